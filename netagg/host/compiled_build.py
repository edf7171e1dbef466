"""The compiled step's library (`netagg/host/cpp/step.cpp`): its interface, built and loaded.

The interface is declared here once: `Run`, the ctypes structure a call fills (every
number and array of the plain window the C++ reads or updates: integers, times, and the
addresses of numpy arrays), `Status`, why a call returned, and `Fmt`, the number formats
it carries. `abi_header` writes them as the C++ header ``step_abi.h`` the source includes,
so the C++ never declares a field of its own.

`library()` compiles the source with the machine's C++ compiler at first use, into the
build cache (`netagg.cache.cache_dir()`, ``host/step-<hash>.so``, the hash of the source,
the header, the compiler's version and flags and the machine), under the cache's lock
(`netagg.cache.locked`), and loads it with ctypes, which releases the GIL for each call. It is
None (and `unavailable()` says why) when the environment sets NETAGG_COMPILED=0, or when
there is no compiler or the build fails: the window then runs in Python alone.
"""

from __future__ import annotations

import ctypes
import enum
from pathlib import Path

from netagg.contract import wire as W
from netagg.host.cpp_build import CRC_SLICED, CompiledLibrary

SOURCE = Path(__file__).resolve().parent / "cpp" / "step.cpp"


class Status(enum.IntEnum):
    """Why `step_run` returned."""

    RUNNING = 0         # (never returned)
    IDLE = 1            # nothing in flight and nothing may start
    UNTIL = 2           # the time it was given is up (a heartbeat, a control deadline)
    DUE = 3             # a message in flight is due for retransmission
    HANDED = 4          # a datagram it does not take: `Run.rx` from `rx_from` (in run
                        # `rx_run` of `rx_runs`) and the runs after it, for Python
    BOUNDARY = 5        # a slot's next message is outside the span it was given
    PYTHON = 6          # a slot's next message is an exponent message
    NONFINITE = 7       # a chunk about to start is in a block agreed non-finite
    TAGS = 8            # a slot ran past its tag table


class Fmt(enum.IntEnum):
    """The number formats the compiled step carries (`host.numerics`)."""

    INT32 = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3


_I, _D = ctypes.c_int64, ctypes.c_double
# (name, type): addresses of arrays are integers; "# out" fields are the call's results.
RUN_FIELDS = [
    # the socket and the switch
    ("fd", _I), ("dst_ip", _I), ("dst_port", _I), ("result_ip", _I), ("result_port", _I),
    ("gso", _I), ("renumber", _I), ("per_run", _I), ("deltas", _I), ("sol_udp", _I),
    ("udp_segment", _I), ("udp_gro", _I), ("crc32", _I),
    # a contribution's layout (`host.wire_arrays.write_imm_dtype`) and fields
    ("size", _I), ("lanes", _I), ("off_psn", _I), ("off_va", _I), ("off_rkey", _I),
    ("off_dma", _I), ("off_imm", _I), ("off_lanes", _I), ("off_icrc", _I), ("tx_head", _I),
    ("tx_state", _I), ("imm_base", _I), ("sh_version", _I), ("sh_slot", _I),
    ("sh_exponent", _I), ("exp_mask", _I), ("va_msn_shift", _I), ("va_offset_mask", _I),
    ("msn_mask", _I), ("psn_mask", _I), ("key", _I),
    # a result's (`host.wire_arrays.read_results`)
    ("rx_head", _I), ("rx_state", _I), ("rkey", _I), ("job", _I), ("nslots", _I),
    ("workers", _I), ("rs_job", _I), ("rm_job", _I), ("rs_count", _I), ("rm_count", _I),
    ("rs_version", _I), ("rm_version", _I), ("rs_slot", _I), ("rm_slot", _I),
    ("rs_exponent", _I), ("rm_exponent", _I), ("exp_sign", _I), ("rs_overflow", _I),
    ("rm_overflow", _I),
    # numbers (`host.numerics`)
    ("int32_max", _I), ("exp_none", _I), ("exp_nonfinite", _I), ("bf16_nan", _I),
    # the window (`host.window.PlainWindow`'s arrays) and its check-lane tags
    ("total", _I), ("dealt", _I), ("credits", _I), ("limit", _I), ("next", _I), ("cur", _I),
    ("use", _I), ("cur_use", _I), ("tag", _I), ("whole", _I), ("last_psn", _I),
    ("sent_at", _I), ("deadline", _I), ("rtos", _I), ("attempts", _I), ("rto", _D),
    ("tag_base", _I), ("tag_cols", _I), ("tag_table", _I), ("seal_table", _I),
    ("whole_table", _I), ("started", _I),
    # the span (`host.window._Span`) and its work
    ("first", _I), ("count", _I), ("leading", _I), ("chunk", _I), ("needs", _I),
    ("carries", _I), ("field", _I), ("offset", _I), ("known", _I), ("shared", _I),
    ("fmt", _I), ("nsources", _I), ("sources", _I), ("out", _I), ("n", _I), ("frac", _I),
    ("mean", _I), ("world_size", _I),
    # buffers
    ("packets", _I), ("rx", _I), ("rx_cap", _I), ("rx_runs", _I), ("samples", _I),
    ("samples_cap", _I),
    # in and out
    ("psn", _I), ("until", _D), ("wanted", _I), ("reorder", _D), ("pto", _D), ("newest", _D),
    ("heard", _D), ("probed", _I),
    # out
    ("status", _I), ("packets_sent", _I), ("packets_received", _I), ("credit_waits", _I),
    ("max_inflight", _I), ("tensor_bytes", _I), ("chunks_done", _I), ("progress_at", _D),
    ("nsamples", _I), ("rx_nruns", _I), ("rx_run", _I), ("rx_from", _I), ("gso_failed", _I),
    ("gso_runs", _I),
]


RX_RUNS = 4             # the runs (GRO buffers) one receive takes, `recvmmsg`


class Run(ctypes.Structure):
    _fields_ = RUN_FIELDS


def abi_header() -> str:
    """`Run`, `Status`, `Fmt` and the wire's MAX_SLOTS as C++ (``step_abi.h``)."""
    c = {_I: "int64_t", _D: "double"}
    lines = ["// Generated by host/compiled_build.py: do not edit.", "#pragma once",
             "#include <cstdint>", "struct Run {"]
    lines += [f"    {c[kind]} {name};" for name, kind in RUN_FIELDS]
    lines.append("};")
    lines.append("enum Status {" + ", ".join(f"ST_{s.name} = {s.value}" for s in Status)
                 + "};")
    lines.append("enum Fmt {" + ", ".join(f"FMT_{f.name} = {f.value}" for f in Fmt) + "};")
    lines.append(f"constexpr int64_t MAX_SLOTS = {W.MAX_SLOTS};   // a job's most slots")
    lines.append(f"constexpr int RX_RUNS = {RX_RUNS};   // the runs one receive takes")
    return "\n".join(lines) + "\n"


def _bind(lib: ctypes.CDLL):
    lib.step_run.argtypes = [ctypes.POINTER(Run)]
    lib.step_run.restype = ctypes.c_int
    lib.step_float16.restype = ctypes.c_int
    lib.step_block_top.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p]
    lib.step_block_top.restype = None


LIBRARY = CompiledLibrary(SOURCE, "step_abi.h", abi_header, "host", _bind,
                          includes=[CRC_SLICED])
library, unavailable = LIBRARY.get, LIBRARY.unavailable
