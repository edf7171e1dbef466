"""The fast switch's compiled core and socket loop (`netagg/sim/cpp/fast.cpp`, `fast_switch.h`,
`fast_io.h`): their interface, built and loaded.

The interface is declared here once: `State`, the ctypes structure a call fills (the
switch's parameters, the addresses of the numpy arrays that hold its job table, slot copies
and counters, where the run of frames to take begins and the buffers for what it sends; the
run's headers and datagrams are the call's two other arguments, bytes), `Stop`, why a
call returned, `Io` and `Served`, the socket loop's buffers, tables and counts and why it
returned, and the wire's layout as the C++ reads it (offsets, opcodes, ImmDt fields,
counter positions, the layout of a job's and a worker's row), all taken from `netagg.contract.wire`.
`abi_header` writes them as the C++ header ``fast_abi.h`` the source includes, so the C++
declares no field or constant of its own.

`library()` compiles the source with the machine's C++ compiler at first use, into the
build cache (`netagg.cache.cache_dir()`, ``sim/fast-<hash>.so``, the hash of the source,
the header, the compiler's version and flags and the machine), under the cache's lock
(`netagg.cache.locked`), and loads it with ctypes, which releases the GIL for each call. It is
None (and `unavailable()` says why) when the environment sets NETAGG_COMPILED=0, or when
there is no compiler or the build fails.
"""

from __future__ import annotations

import ctypes
import enum
from pathlib import Path

from netagg.contract import headers as H
from netagg.contract import regmap as R
from netagg.contract import wire as W
from netagg.host import udp_offload
from netagg.host.cpp_build import CRC_SLICED, FLAGS, CompiledLibrary
from netagg.sim import udp

SOURCE = Path(__file__).resolve().parent / "cpp" / "fast.cpp"
INCLUDES = [SOURCE.with_name("fast_switch.h"), SOURCE.with_name("fast_io.h"), CRC_SLICED]


class Stop(enum.IntEnum):
    """Why `fast_run` returned."""

    DONE = 0            # every row of the run taken
    GOLDEN = 1          # row `taken` is not the compiled core's: the golden model's `receive`
    FULL = 2            # the buffer for what it sends cannot hold row `taken`'s results


class Served(enum.IntEnum):
    """Why `fast_serve` returned."""

    IDLE = 0            # nothing came for `Io.wait_us`
    BUDGET = 1          # `Io.wait_us` passed: the clock's and the control path's turn
    HANDBACK = 2        # packet `hand_packet` of the batch, from row `hand_row`, is Python's


# A job's row in the job table (`State.job`), and a worker's (`State.worker`).
JOB_WORDS = ("enable", "workers", "slot_base", "slot_count", "credits", "needed", "key",
             "deadline", "completed")
WORKER_WORDS = ("port", "ip", "va", "rkey")
# Bytes of a result's template (`State.templates`): Ethernet, IPv4, UDP and the BTH up to
# its PSN, as `sim.codec.ResultTemplate` makes them for a payload of 0 bytes.
TEMPLATE_BYTES = W.BTH_OFFSET + 8

_I = ctypes.c_int64
# (name): every field an int64; addresses of arrays are integers; "out" fields are results.
STATE_FIELDS = [
    # the switch
    "ports", "jobs", "max_workers", "slots", "max_payload", "queue_capacity", "lanes",
    "now", "crc32",
    # its arrays (numpy, C-contiguous, int64 unless said)
    "thresholds",               # [8] drop thresholds by priority class
    "job",                      # [jobs][JOB_WORDS]
    "worker",                   # [jobs][max_workers][WORKER_WORDS]
    "templates",                # uint8 [jobs][max_workers][TEMPLATE_BYTES]
    "bitmap", "count", "data", "length", "msn16", "exponent", "overflow", "begun",
    "sums",                     # [slots * 2][lanes]: saturated int32 sums
    "port_counters",            # [ports][PORT_COUNTERS]
    "job_counters",             # [jobs][JOB_COUNTERS]
    # a call: rows `first` .. `rows` - 1 of a run of frames of one length in at one port
    # (their headers and datagrams are the call's arguments)
    "port", "rows", "size", "first",
    "out", "out_rows",          # uint8 [out_rows][BTH_OFFSET + size]: the frames sent
    "sent",                     # [out_rows][2]: each frame's port and destination
    # out
    "taken", "results", "stop",
]


class State(ctypes.Structure):
    _fields_ = [(name, _I) for name in STATE_FIELDS]


# A row of the senders' table (`Io.senders`): a UDP sender's IPv4 address and port (as
# integers), the switch port its frames enter and the MAC standing for it.
SENDER_WORDS = ("ip", "udp_port", "port", "mac")
# A destination's route (`Io.routes`, by job * max_workers + rank): the socket that sends
# from its results' source (-1: none), and the address and port they go to.
ROUTE_WORDS = ("fd", "ip", "udp_port")
RX_BATCH = 64                   # packets one recvmmsg takes at most
IO_FIELDS = [
    # the sockets and tables (addresses of numpy arrays, int64 unless said)
    "raw_fd", "gso",
    "rx", "rx_bytes", "rx_count",   # uint8 [rx_count][rx_bytes]: a batch of packets
    "rx_lengths",                   # [rx_count]
    "senders", "senders_count",     # [senders_count][SENDER_WORDS]
    "routes",                       # [jobs * max_workers][ROUTE_WORDS]
    "arena", "arena_bytes",         # uint8: the results until they are sent
    "records", "records_rows",      # [records_rows][3]: a result's offset, bytes, dest.
    "sent",                         # [records_rows][2]: `State.sent` for a run
    "batch", "resume_at", "wait_us",
    # out (counts add up over calls)
    "served", "hand_packet", "hand_row", "error",
    "datagrams_in", "datagrams_out", "dropped", "undeliverable", "compiled",
]


class Io(ctypes.Structure):
    _fields_ = [(name, _I) for name in IO_FIELDS]


def _fields(layout, prefix: str) -> list[str]:
    return [f"constexpr int {prefix}_{name.upper()}_SHIFT = {shift}, "
            f"{prefix}_{name.upper()}_BITS = {width};" for name, shift, width in layout]


def constants() -> dict[str, int]:
    """The wire's numbers the C++ reads, by name."""
    reth_at = W.BTH_OFFSET + W.BTH_LEN
    return {
        "IP_OFFSET": W.IP_OFFSET, "UDP_OFFSET": W.UDP_OFFSET, "BTH_OFFSET": W.BTH_OFFSET,
        "RETH_OFFSET": reth_at, "IMM_OFFSET": reth_at + W.RETH_LEN,
        "PAYLOAD_OFFSET": reth_at + W.RETH_LEN + W.IMM_LEN, "IP_LEN": W.IP_LEN,
        "UDP_LEN": W.UDP_LEN, "BTH_LEN": W.BTH_LEN, "RETH_LEN": W.RETH_LEN,
        "IMM_LEN": W.IMM_LEN, "ICRC_LEN": W.ICRC_LEN, "ICRC_HEADERS": W.ICRC_HEADERS,
        "ETHERTYPE_IPV4": H.ETHERTYPE_IPV4, "IPV4_FIRST_BYTE": W.IPV4_FIRST_BYTE,
        "IP_PROTO_UDP": H.IP_PROTO_UDP, "ROCEV2_PORT": W.ROCEV2_PORT,
        "ARRIVAL_HEAD": udp.ARRIVAL_HEAD, "VNET_GSO_NONE": udp.VNET_GSO_NONE,
        "OP_CONTRIBUTION": W.OP_CONTRIBUTION, "OP_RESULT": W.OP_RESULT,
        "EXT_CONTRIBUTION": H.EXT_LENGTH[H.OPCODE_CLASSES[W.OP_CONTRIBUTION]],
        "VA_MSN_SHIFT": W.VA_MSN_SHIFT, "DEADLINE_BITS": R.DEADLINE_BITS,
        "PRIORITY_CLASSES": R.PRIORITY_CLASSES, "TEMPLATE_BYTES": TEMPLATE_BYTES,
        "N_PORT_COUNTERS": len(R.PORT_COUNTERS), "N_JOB_COUNTERS": len(R.JOB_COUNTERS),
        "JOB_WORDS": len(JOB_WORDS), "WORKER_WORDS": len(WORKER_WORDS),
        "ETH_LEN": W.ETH_LEN, "WRITE_IMM_HEAD_LEN": W.WRITE_IMM_HEAD_LEN,
        "MAX_SEGMENTS": udp_offload.MAX_SEGMENTS, "MAX_RUN_BYTES": udp_offload.MAX_RUN_BYTES,
        "UDP_SEGMENT_OPTION": udp_offload.UDP_SEGMENT,
        "RX_BATCH": RX_BATCH, "SENDER_WORDS": len(SENDER_WORDS),
        "ROUTE_WORDS": len(ROUTE_WORDS),
    }


def abi_header() -> str:
    """`State`, `Stop` and the wire's layout as C++ (``fast_abi.h``)."""
    lines = ["// Generated by sim/fast_build.py: do not edit.", "#pragma once",
             "#include <cstdint>", "struct State {"]
    lines += [f"    int64_t {name};" for name in STATE_FIELDS]
    lines.append("};")
    lines += ["struct Io {", *(f"    int64_t {name};" for name in IO_FIELDS), "};"]
    lines.append("enum Stop {" + ", ".join(f"STOP_{s.name} = {s.value}" for s in Stop) + "};")
    lines.append("enum Served {" + ", ".join(f"SERVED_{s.name} = {s.value}" for s in Served)
                 + "};")
    lines += [f"constexpr int64_t {name} = {value};" for name, value in constants().items()]
    lines += _fields(W.REQUEST_IMM, "REQ") + _fields(W.RESULT_IMM, "RES")
    masked = sorted(b - W.IP_OFFSET for b in H.ICRC_MASKED_BYTES)
    lines.append("// bytes of the ICRC's headers (from the IPv4 header) masked to ones")
    lines.append("constexpr int ICRC_MASKED[] = {" + ", ".join(map(str, masked)) + "};")
    for prefix, names in (("PC", R.PORT_COUNTERS), ("JC", R.JOB_COUNTERS), ("J", JOB_WORDS),
                          ("WK", WORKER_WORDS), ("SD", SENDER_WORDS), ("RT", ROUTE_WORDS)):
        lines.append("enum {" + ", ".join(f"{prefix}_{n.upper()} = {i}"
                                          for i, n in enumerate(names)) + "};")
    return "\n".join(lines) + "\n"


def _bind(lib: ctypes.CDLL):
    lib.fast_run.argtypes = [ctypes.POINTER(State), ctypes.c_char_p, ctypes.c_char_p]
    lib.fast_run.restype = ctypes.c_int
    lib.fast_serve.argtypes = [ctypes.POINTER(State), ctypes.POINTER(Io)]
    lib.fast_serve.restype = ctypes.c_int


LIBRARY = CompiledLibrary(SOURCE, "fast_abi.h", abi_header, "sim", _bind, FLAGS,
                          INCLUDES)
library, unavailable = LIBRARY.get, LIBRARY.unavailable
