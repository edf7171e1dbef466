"""The switch's register map, declared once: the gateware (`hw.control`) decodes it and
software addresses it through `netagg.contract.wire`. Plain Python, no Amaranth.

Registers are 32 bits at word addresses, reached through control requests (see
netagg.contract.wire): a record (address, value) with WRITE set in the address writes, and every
record returns the register's value after it was applied. Unknown addresses read 0 and ignore
writes.

Who may write (reads are open to anyone): the switch's manager (REG_MANAGER, an IPv4
address; 0, the reset value, means none, and then the first request that writes it sets it)
alone writes the switch's own writable registers once it is set, REG_MANAGER included. An
enabled job belongs to its owner (JOB_OWNER, the source address of the request whose CONFIG
write enabled it): a write to any address of its block (JOB_BASE + JOB_STRIDE j ..., its
worker entries included) from neither its owner nor the manager is refused and counted
(`control_denied`, on the request's port), but for a worker entry's own: the address the
entry holds (WORKER_IP) may write it, and anyone may while it holds none (0), so that each
rank writes its own entry into the job its rank 0 enabled. A rank's heartbeat (BEAT) takes a
write from the address its entry holds, or the manager's, and no other (refused and counted
as `control_denied`), so that no process keeps a dead rank's beat moving. A refused record's
answer carries
the register's value, unchanged. A CONFIG write that enables a job whose slot range runs
past the switch's slots or overlaps another enabled job's, and a write of an enabled job's
slot range, are refused and counted (`config_refused`, the job's): an enabled job's range is
fixed, and no two enabled jobs share a slot.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Fields:
    """The bit fields of a register, (name, lsb, width) most significant first: `pack` and
    `unpack` for software, `bits(name)` (lsb, width) for the gateware, `text()` for the
    register table."""

    fields: tuple[tuple[str, int, int], ...]

    def bits(self, name: str) -> tuple[int, int]:
        for n, lsb, width in self.fields:
            if n == name:
                return lsb, width
        raise KeyError(name)

    def pack(self, **values: int) -> int:
        """The register value of `values` (fields not given are 0); ValueError for one that
        does not fit its field or is not one."""
        word = 0
        for name, value in values.items():
            lsb, width = self.bits(name)
            if not 0 <= value < 1 << width:
                raise ValueError(f"{name}={value} does not fit in {width} bits")
            word |= value << lsb
        return word

    def unpack(self, word: int) -> dict[str, int]:
        return {name: (word >> lsb) & ((1 << width) - 1) for name, lsb, width in self.fields}

    def text(self) -> str:
        return ", ".join(f"{name} ({lsb + width - 1}-{lsb})" if width > 1 else
                         f"{name} ({lsb})" for name, lsb, width in self.fields)


MAGIC = 0x4E414747          # "NAGG"
REG_MAGIC = 0x0000          # ro
REG_PARAMS = 0x0001         # ro: PARAMS
PARAMS = Fields((("ports", 24, 8), ("jobs", 16, 8), ("max_workers", 8, 8),
                 ("width64", 0, 8)))
REG_SLOTS = 0x0002          # ro: slots per version
REG_MAX_PAYLOAD = 0x0003    # ro: bytes
REG_MAC_HI = 0x0004         # rw: switch MAC bits 47:32 (source of results)
REG_MAC_LO = 0x0005         # rw: switch MAC bits 31:0
REG_IP = 0x0006             # rw: switch IPv4 address (source of results)
REG_UDP_SPORT = 0x0007      # rw: UDP source port of results (reset 0xC000)
UDP_SPORT_RESET = 0xC000    # REG_UDP_SPORT's reset value
REG_PORT = 0x0008           # ro: the switch port this control request came in by
REG_MANAGER = 0x0009        # rw: the manager's IPv4 address (0: none; then anyone sets it)
# Leaf and spine (docs/leafspine.md). A switch built with uplinks (a leaf; the golden model's
# parameter `uplinks`, 0..MAX_UPLINKS) sends its jobs' partial sums up to spines: uplink i
# leaves by the switch port UPLINK_PORT and goes to the spine at UPLINK_MAC/IP/UDP_PORT (the
# partial's source: REG_MAC, REG_IP, REG_UDP_SPORT). A switch without uplinks (every board,
# the RTL) reads these registers as 0 and ignores writes to them, as any unknown address.
REG_UPLINKS = 0x000A        # ro: uplinks the switch was built with
REG_UPLINK_DOWN = 0x000B    # rw: bit i, uplink i is marked down (its slots go to the next
#                             one up)
REG_UPLINK_LOST = 0x000C    # ro: bit i, uplink i's port reports its link lost (down as well)
UPLINK_BASE, UPLINK_STRIDE = 0x0100, 8      # UPLINK_BASE + UPLINK_STRIDE i + field
UPLINK_PORT = 0             # rw: [3:0] the switch port the uplink leaves by
UPLINK_MAC_HI = 1           # rw: the spine's MAC bits 47:32
UPLINK_MAC_LO = 2           # rw: bits 31:0
UPLINK_IP = 3               # rw: the spine's IPv4 address
UPLINK_UDP_PORT = 4         # rw: [15:0] the spine's UDP port (ROCEV2_PORT)
UPLINK_FIELDS = 5
UPLINK_PORT_BITS = 4        # UPLINK_PORT's width
UPLINK_UDP_PORT_BITS = 16   # UPLINK_UDP_PORT's width
# Priority drop: a droppable contribution of priority class c (IPv4 DSCP >> 3) is dropped to a
# null contribution (header kept, payload discarded) when the bytes its ingress queue holds
# ahead of it are at least REG_DROP_THRESHOLD + c. 16 bits, reset NEVER_DROP.
REG_DROP_THRESHOLD = 0x0010     # rw, 8 registers, classes 0..7
PRIORITY_CLASSES = 8
NEVER_DROP = 0xFFFF

JOB_BASE, JOB_STRIDE = 0x1000, 0x200
JOB_CONFIG = 0x00           # rw: CONFIG; a write clears COMPLETED, and the slots if enabled
CONFIG = Fields((("enable", 31, 1), ("partials", 30, 1), ("workers", 0, 6)))
# CONFIG.partials (a spine's job): the job's contributions are leaves' partials (their BTH.psn
# is hw.headers.PARTIAL) and its results' RETH.va is the use's CONTRIBUTION_VA. A switch that
# cannot be a spine (every board, the RTL) ignores the bit and reads it 0.
JOB_SLOT_BASE = 0x01        # rw: first slot of the job
JOB_SLOT_COUNT = 0x02       # rw: slots of the job (slot numbers 0..count-1 in packets)
JOB_CREDITS = 0x03          # rw: [15:0] uses a worker may have open beyond COMPLETED; 0: no limit
JOB_QUORUM = 0x04           # rw: [5:0] contributions that complete a use; 0 or >= workers: all
JOB_COMPLETED = 0x05        # ro: uses completed since CONFIG was last written (32 bits, wraps)
JOB_EPOCH = 0x06            # rw: the configuration's epoch, fresh each time rank 0 configures
JOB_KEY = 0x07              # wo (reads 0): the R_Key every contribution of the job carries
JOB_OWNER = 0x08            # ro: IPv4 source of the request that enabled the job; 0: disabled
JOB_DEADLINE = 0x09         # rw: [7:0] ticks a use may wait for its missing contributions; 0: none
# A leaf's job (docs/leafspine.md): a switch without uplinks reads these 0 and ignores writes
# (as any unknown address of a job's block: an enabled job's owner or the manager may write).
JOB_PARENT = 0x0A           # rw: PARENT; enable: the job's uses complete at a spine
PARENT = Fields((("enable", 31, 1), ("rank", 0, 5)))    # rank: the leaf's in the spines' job
JOB_PARENT_KEY = 0x0B       # wo (reads 0): the RETH.rkey of the job's partials, the spines' KEY
JOB_SPRAY = 0x0C            # rw: SPRAY_ENTRIES entries of SPRAY_BITS: slot s goes up
SPRAY_ENTRIES, SPRAY_BITS = 16, 2   # uplink entry (s % 16), bits 2e+1..2e
MAX_UPLINKS = 1 << SPRAY_BITS       # 4
WORKER_BASE, WORKER_STRIDE = 0x20, 8
WORKER_PORT = 0             # rw: WORKER_ENDPOINT
WORKER_ENDPOINT = Fields((("switch_port", 16, 4), ("udp_port", 0, 16)))
WORKER_MAC_HI = 1           # rw: bits 47:32
WORKER_MAC_LO = 2
WORKER_IP = 3
WORKER_QPN = 4              # rw: 24 bits
WORKER_RKEY = 5
WORKER_VA_HI = 6
WORKER_VA_LO = 7

# Deadlines: the switch counts ticks of TICK_SECONDS (8 bits, wrapping; a board divides its
# core clock, a simulated switch ticks by the wall clock). A use notes the tick it began at; a
# retransmission (a contribution of a rank already in the use) that finds the use at least
# JOB_DEADLINE ticks old closes it with the contributions it has, as a quorum would: its
# result, whose count and check lane say who is in it, goes to every worker of the job, and
# the workers complete, fill in or redo the chunk by their loss budget. Ages are taken modulo
# 256 ticks (2 s): a use is late while its age modulo 256 is at least the deadline, a window of
# 256 - DEADLINE ticks each 2 s, which retransmissions at least every second (the workers'
# rto_max) hit only if it is at least a second long: the hosts set at most MAX_DEADLINE.
TICK_SECONDS = 2 ** -7
DEADLINE_BITS = 8
MAX_DEADLINE = (1 << DEADLINE_BITS) // 2        # ticks: 1 s

# Heartbeats: one register per (job, rank), rw, 32 bits, reset 0, which a rank's worker
# writes with a running count while it is open (from the address its entry holds, or the
# manager: see the module); every rank of the job reads them all to tell a rank whose
# process is gone (its count stops) from one that is only slow.
BEAT_BASE, BEAT_STRIDE = 0x3000, 0x20      # BEAT_BASE + job * BEAT_STRIDE + rank

PORT_COUNTERS_BASE, PORT_COUNTERS_STRIDE = 0x4000, 0x20
JOB_COUNTERS_BASE, JOB_COUNTERS_STRIDE = 0x6000, 0x20
# Counters are read-only, 32 bits, wrapping. Per port: good frames the aggregator took, frames
# sent,
# frames dropped by the parser's verdict (hw.headers.Verdict order, OK excluded), and drops
# after the parser. Per job: what the aggregator did with the job's packets.
PORT_COUNTERS = (
    "rx", "tx",
    "drop_not_roce", "drop_truncated", "drop_bad_length", "drop_bad_ip_checksum",
    "drop_bad_opcode", "drop_bad_icrc", "drop_oversize",
    "drop_priority",       # droppable contributions whose payload was dropped (null)
    "drop_unhandled",      # good RoCEv2, but neither a contribution nor a control request
    "drop_bad_job",        # a contribution for a job that does not exist or is disabled
    "drop_bad_payload",    # contribution/control payload length not allowed
    "control",             # control requests served
    "control_denied",      # write records refused: from neither the owner nor the manager
)
JOB_COUNTERS = (
    "contributions",       # contributions added to a slot
    "completed",           # slots completed
    "duplicates",          # contributions already counted, use not complete: dropped
    "replays",             # contributions to a completed use: result sent again, to the sender
    "drop_stale",          # a message (MSN) other than the slot's current use
    "overflows",           # slots completed with a saturated lane
    "drop_bad_slot",       # slot number outside the job's range
    "drop_bad_worker",     # rank outside the job, or source IP not the rank's
    "drop_bad_length",     # payload length differs from the slot's other contributions
    "drop_credit",         # a message beyond the job's credit limit
    "results",             # result packets sent
    "drop_bad_key",        # a contribution whose RETH.rkey is not the job's KEY
    "closed_late",         # uses closed short at their deadline (also counted `completed`)
    "config_refused",      # CONFIG enabling an overlapping or too long slot range, or a
                           # slot range written while enabled: refused
)

# A leaf's and a spine's job counters (docs/leafspine.md), after JOB_COUNTERS in the job's
# block, at FABRIC_COUNTERS_OFFSET + i: a switch without uplinks that cannot be a spine (every
# board, the RTL) reads them 0.
FABRIC_COUNTERS_OFFSET = 0x10
FABRIC_COUNTERS = (
    "upstream",            # leaf: partials sent up (first sends, re-sends, answers to pulls)
    "parent_results",      # leaf: a spine's results taken (the use is DONE)
    "drop_parent",         # leaf: frames at UPLINK_QPN from an uplink's spine refused (no
                           # such use, late, a result for a DONE use, by another port)
    "resends",             # leaf: partials re-sent for a local retransmission (in upstream)
    "no_uplink",           # leaf: partials not sent, every uplink down (they wait)
    "pulled",              # leaf: pulls answered (with the partial or the final)
    "pulls",               # spine: pulls sent to the leaves missing from a use
    "finals",              # spine: uses completed by a leaf's final
    "abandoned",           # spine: a use in progress given up for a later use of its copy
)
assert len(JOB_COUNTERS) <= FABRIC_COUNTERS_OFFSET
assert FABRIC_COUNTERS_OFFSET + len(FABRIC_COUNTERS) <= JOB_COUNTERS_STRIDE

WRITE = 1 << 31             # in a control record's address: write the value


def job_reg(job: int, offset: int) -> int:
    return JOB_BASE + job * JOB_STRIDE + offset


def worker_reg(job: int, rank: int, offset: int) -> int:
    return job_reg(job, WORKER_BASE + rank * WORKER_STRIDE + offset)


def uplink_reg(uplink: int, field: int) -> int:
    return UPLINK_BASE + uplink * UPLINK_STRIDE + field


def spray_entry(spray: int, slot: int) -> int:
    """The uplink a JOB_SPRAY word names for slot number `slot` (before the down ones are
    skipped)."""
    return spray >> (SPRAY_BITS * (slot % SPRAY_ENTRIES)) & ((1 << SPRAY_BITS) - 1)


def spray_word(uplinks: list[int]) -> int:
    """The JOB_SPRAY word of SPRAY_ENTRIES uplink numbers (entry e: slots s with s % 16 == e)."""
    if len(uplinks) != SPRAY_ENTRIES or not all(0 <= u < MAX_UPLINKS for u in uplinks):
        raise ValueError(f"a spray is {SPRAY_ENTRIES} uplinks of 0..{MAX_UPLINKS - 1}")
    return sum(u << (SPRAY_BITS * e) for e, u in enumerate(uplinks))


def beat_reg(job: int, rank: int) -> int:
    return BEAT_BASE + job * BEAT_STRIDE + rank


def drop_threshold(priority_class: int) -> int:
    return REG_DROP_THRESHOLD + priority_class


def port_counter(port: int, name: str) -> int:
    return PORT_COUNTERS_BASE + port * PORT_COUNTERS_STRIDE + PORT_COUNTERS.index(name)


def job_counter(job: int, name: str) -> int:
    """The address of job counter `name`, one of JOB_COUNTERS or FABRIC_COUNTERS."""
    index = (JOB_COUNTERS.index(name) if name in JOB_COUNTERS
             else FABRIC_COUNTERS_OFFSET + FABRIC_COUNTERS.index(name))
    return JOB_COUNTERS_BASE + job * JOB_COUNTERS_STRIDE + index


def rows() -> list[tuple[str, str]]:
    """The register map as (address, what it holds) rows: the table of docs/switch.md
    (`python -m netagg.contract.regmap` prints it; a test checks the document against it)."""
    job, worker = f"{JOB_STRIDE:#x} j", f"{JOB_STRIDE:#x} j + {WORKER_STRIDE} r"
    return [
        (f"{REG_MAGIC:#06x}", f'magic {MAGIC:#x} ("NAGG")'),
        (f"{REG_PARAMS:#06x}", f"PARAMS (read only): {PARAMS.text()}"),
        (f"{REG_SLOTS:#06x} / {REG_MAX_PAYLOAD:#06x}",
         "slots per version / largest payload in bytes (read only)"),
        (f"{REG_MAC_HI:#06x} / {REG_MAC_LO:#06x}",
         "switch MAC bits 47-32 / 31-0 (source of results)"),
        (f"{REG_IP:#06x} / {REG_UDP_SPORT:#06x}",
         "switch IPv4 address / UDP source port of results (reset 0xC000)"),
        (f"{REG_PORT:#06x}", "the switch port this control request came in by (read only)"),
        (f"{REG_MANAGER:#06x}", "the manager's IPv4 address (0: none, the first write sets "
         "it; then only the manager writes it and the switch's other writable registers)"),
        (f"{REG_UPLINKS:#06x} / {REG_UPLINK_DOWN:#06x} / {REG_UPLINK_LOST:#06x}",
         f"uplinks the switch has (read only, 0..{MAX_UPLINKS}; 0: no uplink, these and the "
         "leaf's registers read 0) / uplink i is marked down (bit i) / uplink i's port "
         "reports its link lost (bit i, read only; the uplink is down too)"),
        (f"{REG_DROP_THRESHOLD:#06x} + c",
         f"priority-drop threshold of class c (0..{PRIORITY_CLASSES - 1}): bytes queued "
         f"ahead ({NEVER_DROP:#x}: never)"),
        (f"{UPLINK_BASE:#06x} + {UPLINK_STRIDE} i + 0..{UPLINK_FIELDS - 1}",
         "uplink i (a leaf's): switch port (3-0); spine's MAC 47-32; MAC 31-0; IPv4 address; "
         "UDP port (15-0)"),
        (f"{JOB_BASE + JOB_CONFIG:#06x} + {job}",
         f"job j CONFIG: {CONFIG.text()}; a write clears COMPLETED and, when it leaves the "
         "job enabled, the job's slots"),
        (f"{JOB_BASE + JOB_SLOT_BASE:#06x} / {JOB_BASE + JOB_SLOT_COUNT:#06x} + {job}",
         "job j first slot / number of slots"),
        (f"{JOB_BASE + JOB_CREDITS:#06x} / {JOB_BASE + JOB_QUORUM:#06x} / "
         f"{JOB_BASE + JOB_COMPLETED:#06x} + {job}",
         "job j CREDITS (15-0; 0: no limit) / QUORUM (5-0; 0: all workers) / COMPLETED "
         "(read only)"),
        (f"{JOB_BASE + JOB_EPOCH:#06x} / {JOB_BASE + JOB_KEY:#06x} + {job}",
         "job j EPOCH (the configuration's, written with CONFIG) / KEY (write only, reads 0: "
         "the R_Key of the job's contributions)"),
        (f"{JOB_BASE + JOB_OWNER:#06x} + {job}",
         "job j OWNER (read only): IPv4 source of the request whose CONFIG write enabled it "
         "(0: disabled); only it and the manager write the job's block while it is enabled "
         "(and a worker entry, the address it holds, or anyone while it holds 0)"),
        (f"{JOB_BASE + JOB_DEADLINE:#06x} + {job}",
         f"job j DEADLINE ({DEADLINE_BITS - 1}-0; 0: none): ticks of {TICK_SECONDS * 1e3:g} ms "
         "after which a retransmission closes a use with the contributions it has"),
        (f"{JOB_BASE + JOB_PARENT:#06x} + {job}",
         f"job j PARENT (a leaf's): {PARENT.text()}, the leaf's rank in the spines' job"),
        (f"{JOB_BASE + JOB_PARENT_KEY:#06x} / {JOB_BASE + JOB_SPRAY:#06x} + {job}",
         "job j PARENT_KEY (write only, reads 0: the R_Key of its partials, the spines' KEY) / "
         f"SPRAY ({SPRAY_ENTRIES} entries of {SPRAY_BITS} bits: slot s goes up the uplink of "
         f"entry s % {SPRAY_ENTRIES}, or the next one up)"),
        (f"{JOB_BASE + WORKER_BASE:#06x} + {worker} + 0..{WORKER_STRIDE - 1}",
         f"worker r of job j: {WORKER_ENDPOINT.text()}; MAC 47-32; MAC 31-0; IPv4 address; "
         f"QPN; R_Key; base address 63-32; 31-0"),
        (f"{BEAT_BASE:#06x} + {BEAT_STRIDE:#x} j + r",
         "heartbeat of rank r of job j: a running count its worker writes (reset 0)"),
        (f"{PORT_COUNTERS_BASE:#06x} + {PORT_COUNTERS_STRIDE:#x} p + i",
         "counter i of port p: " + ", ".join(PORT_COUNTERS)),
        (f"{JOB_COUNTERS_BASE:#06x} + {JOB_COUNTERS_STRIDE:#x} j + i",
         "counter i of job j: " + ", ".join(JOB_COUNTERS)),
        (f"{JOB_COUNTERS_BASE + FABRIC_COUNTERS_OFFSET:#06x} + {JOB_COUNTERS_STRIDE:#x} j + i",
         "leaf and spine counter i of job j (0 on a switch that is neither, as the RTL): "
         + ", ".join(FABRIC_COUNTERS)),
    ]


def markdown_table() -> str:
    lines = ["| address | register |", "| --- | --- |"]
    return "\n".join(lines + [f"| {a} | {what} |" for a, what in rows()]) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
