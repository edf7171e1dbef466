"""The switch's register map, declared once: the gateware (`hw.control`) decodes it and the
host (`host.wire`) addresses it. Plain Python, no Amaranth.

Registers are 32 bits at word addresses, reached through control requests (see host.wire):
a record (address, value) with WRITE set in the address writes, and every record returns the
register's value after it was applied. Unknown addresses read 0 and ignore writes.
"""

MAGIC = 0x4E414747          # "NAGG"
REG_MAGIC = 0x0000          # ro
REG_PARAMS = 0x0001         # ro: ports [31:24], jobs [23:16], max workers [15:8], width/64 [7:0]
REG_SLOTS = 0x0002          # ro: slots per version
REG_MAX_PAYLOAD = 0x0003    # ro: bytes
REG_MAC_HI = 0x0004         # rw: switch MAC bits 47:32 (source of results)
REG_MAC_LO = 0x0005         # rw: switch MAC bits 31:0
REG_IP = 0x0006             # rw: switch IPv4 address (source of results)
REG_UDP_SPORT = 0x0007      # rw: UDP source port of results (reset 0xC000)
REG_PORT = 0x0008           # ro: the switch port this control request came in by
# Priority drop: a droppable contribution of priority class c (IPv4 DSCP >> 3) is dropped to a
# null contribution (header kept, payload discarded) when the bytes its ingress queue holds
# ahead of it are at least REG_DROP_THRESHOLD + c. 16 bits, reset NEVER_DROP.
REG_DROP_THRESHOLD = 0x0010     # rw, 8 registers, classes 0..7
PRIORITY_CLASSES = 8
NEVER_DROP = 0xFFFF

JOB_BASE, JOB_STRIDE = 0x1000, 0x200
JOB_CONFIG = 0x00           # rw: enable [31], workers [5:0]; a write clears the job's slots
                            # and COMPLETED
JOB_SLOT_BASE = 0x01        # rw: first slot of the job
JOB_SLOT_COUNT = 0x02       # rw: slots of the job (slot numbers 0..count-1 in packets)
JOB_CREDITS = 0x03          # rw: [15:0] uses a worker may have open beyond COMPLETED; 0: no limit
JOB_QUORUM = 0x04           # rw: [5:0] contributions that complete a use; 0 or >= workers: all
JOB_COMPLETED = 0x05        # ro: uses completed since CONFIG was last written (32 bits, wraps)
WORKER_BASE, WORKER_STRIDE = 0x20, 8
WORKER_PORT = 0             # rw: switch port [19:16], UDP port [15:0]
WORKER_MAC_HI = 1           # rw: bits 47:32
WORKER_MAC_LO = 2
WORKER_IP = 3
WORKER_QPN = 4              # rw: 24 bits
WORKER_RKEY = 5
WORKER_VA_HI = 6
WORKER_VA_LO = 7

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
)
JOB_COUNTERS = (
    "contributions",       # contributions added to a slot
    "completed",           # slots completed
    "duplicates",          # contributions already counted, use not complete: dropped
    "replays",             # contributions to a completed use: result sent again, to the sender
    "drop_stale",          # a message (RETH.rkey) other than the slot's current use
    "overflows",           # slots completed with a saturated lane
    "drop_bad_slot",       # slot number outside the job's range
    "drop_bad_worker",     # rank outside the job, or source IP not the rank's
    "drop_bad_length",     # payload length differs from the slot's other contributions
    "drop_credit",         # a message beyond the job's credit limit
    "results",             # result packets sent
)

WRITE = 1 << 31             # in a control record's address: write the value


def job_reg(job: int, offset: int) -> int:
    return JOB_BASE + job * JOB_STRIDE + offset


def worker_reg(job: int, rank: int, offset: int) -> int:
    return job_reg(job, WORKER_BASE + rank * WORKER_STRIDE + offset)


def drop_threshold(priority_class: int) -> int:
    return REG_DROP_THRESHOLD + priority_class


def port_counter(port: int, name: str) -> int:
    return PORT_COUNTERS_BASE + port * PORT_COUNTERS_STRIDE + PORT_COUNTERS.index(name)


def job_counter(job: int, name: str) -> int:
    return JOB_COUNTERS_BASE + job * JOB_COUNTERS_STRIDE + JOB_COUNTERS.index(name)


