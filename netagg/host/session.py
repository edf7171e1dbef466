"""A session's hold on its switch job: the epoch, the key and the tag.

Every worker of a run passes the same session string, the run's secret. Rank 0 configures
the job afresh for each run: it draws an EPOCH (`fresh_epoch`: 32 random bits from
`secrets`, never 0, the register's reset value) and writes it, in the request that writes
the job's CONFIG, with the job's KEY and, in every rank's job-table entry, the R_Key that
results carry (the TAG). Both are keyed hashes of the job and the epoch (BLAKE2b keyed with
the session, `JobKeys.derive`), each with its own purpose, so one cannot be had from the
other:

- the KEY goes in RETH.rkey of every contribution; the switch drops a contribution with
  another (`drop_bad_key`) before it touches a slot or the credit check. No control read
  gives it (register JOB_KEY reads 0): a process that does not know the session cannot
  contribute to the job, however it learns the rank's address and the message numbers;
- the TAG is public (any control read of a worker entry shows it). A rank other than 0 reads
  the EPOCH and the R_Key of its own entry until the R_Key is the TAG of the session and that
  epoch, which only rank 0 of this session can have written; it then derives the KEY.

The workers of an earlier run keep the key of their own epoch: once rank 0 of a new run has
configured the job, the switch drops their retransmissions as `drop_bad_key`, even when the
two runs pass the same session string (the epochs differ), and they time out on their own.
Two runs of one session string cannot be told apart before the second's rank 0 has
configured the job: a rank other than 0 that reads the job before then takes the earlier
run's epoch, and its contributions are dropped once the job is configured again (it times
out). A session string drawn afresh for each run (as `netagg demo` and the torch backend
draw theirs) leaves no such window. The key guards the job against a process that does not
know the session only as far as the session cannot be guessed from the epoch and the tag
it may read: a random string (`secrets.token_hex`) and not a name like "run-42"; and, as
an RDMA R_Key, only against a process that cannot read the job's packets (contributions
carry the key in the clear).
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import struct

_KEY_BYTES = 64                 # BLAKE2b's longest key


def fresh_epoch() -> int:
    """A new epoch: 32 random bits, never 0 (a job never configured reads EPOCH 0)."""
    return 1 + secrets.randbelow((1 << 32) - 1)


def _secret(session) -> bytes:
    """The BLAKE2b key of a session: its string's bytes, or their digest when longer than a
    key may be."""
    raw = str(session).encode()
    return raw if len(raw) <= _KEY_BYTES else hashlib.blake2b(raw).digest()


def keyed_hash(session, job: int, epoch: int, purpose: str) -> int:
    """32 bits of BLAKE2b keyed with the session, of (job, epoch, purpose); never 0 (an
    unset register's value)."""
    data = struct.pack(">II", job, epoch & 0xFFFFFFFF) + purpose.encode()
    value = int.from_bytes(
        hashlib.blake2b(data, digest_size=4, key=_secret(session)).digest(), "big")
    return value or 1


@dataclasses.dataclass(frozen=True)
class JobKeys:
    """What a session holds of a job configured in `epoch`: the `tag` (the R_Key of its
    results, in every rank's job-table entry) and the `key` (the R_Key of its
    contributions, in the job's KEY register)."""

    epoch: int
    tag: int
    key: int

    @classmethod
    def derive(cls, session, job: int, epoch: int) -> JobKeys:
        return cls(epoch, keyed_hash(session, job, epoch, "tag"),
                   keyed_hash(session, job, epoch, "key"))
