"""A world quorum across a leaf and spine fabric: the local quorum each leaf closes a use at,
and who sends in a fill-in round at each leaf.

A job's quorum Q of the world's W ranks (`Worker(quorum=Q)`, 0 < Q < W; 0 or Q >= W: every
rank) lets a use complete without W - Q of them. In a fabric a use completes at a spine only
with every leaf's partial (a spine's job has no quorum: QUORUM 0, CONFIG.partials), and a
leaf closes its local use at its own QUORUM, which counts its local contributions. So the
hosts deal the world's slack, the W - Q ranks a use may close without, to the leaves, one
rank at a time, each to the leaf with the most ranks still needed (the lowest index among
equals), never a leaf's last rank. Leaf l, with n_l ranks and m_l of the slack, closes its
local uses at q_l = n_l - m_l (its QUORUM register; 0, every rank, when m_l is 0): its
partial carries at least q_l ranks' data, and every result at least
sum(q_l) = W - sum(m_l) >= Q ranks' (`needed`; more than Q only when Q is below one rank per
leaf). With 8 ranks on two leaves: Q = 7 closes leaf0's uses at 3 of its 4 ranks and
leaf1's at all 4; Q = 6 at 3 and 3; Q = 5 at 2 and 3; Q = 2 or 1 at 1 and 1.

What a result holds is the world's check lane's: every contribution carries its world rank's
bit, so a spine's result shows the ranks of every leaf in its bitmap and count, and the
hosts take it, scale it within the loss budget or fill the chunk in, as on one switch
(`host.checklane`). A fill-in round runs in the slot's next use, which must complete at
every leaf: at each leaf, the leaf's missing ranks send their data and, when they are fewer
than q_l (n_l without a quorum), the lowest ranks of the leaf whose data is in send zeros to
make up q_l; the leaf's other ranks wait for the result (and ask for it with zeros after
max(16 RTOs, `rto_max`)). So every leaf's round has at least q_l senders (a leaf that misses
no rank sends q_l zeros: the spine waits for its partial), and every rank decides from the
same result what it sends.

What a leaf does with a contribution that comes after its local use closed is the leaf's rule
(docs/leafspine.md): while the partial waits for the spine (UPSTREAM), the leaf sends it
again, marked `resent` (`resends`), and the spine counts it a duplicate and pulls every leaf
missing from the use (`pulls`; a pulled leaf still collecting its own use counts
`drop_parent`); once the spine's result came back (DONE), the leaf replays the final to the
late rank (`replays`). Its data is in neither: the bitmap shows it missing, and a fill-in
round adds it. A deadline closes a leaf's use short of q_l as well (the same rounds follow).
Credits count end-to-end completions at every leaf, quorum or not.
"""

from __future__ import annotations

import dataclasses

from netagg.host.checklane import CheckLane
from netagg.host.fabric import Placement
from netagg.host.messages import Send


@dataclasses.dataclass(frozen=True)
class FabricQuorum:
    """The world's quorum `quorum` (0: every rank) over leaves of `sizes` ranks, and each
    leaf's QUORUM (`local`, 0: every rank of the leaf)."""

    quorum: int
    sizes: tuple[int, ...]
    local: tuple[int, ...]

    @classmethod
    def of(cls, quorum: int, world: int, leaves: int) -> FabricQuorum:
        sizes = tuple(len(Placement.ranks_of(lf, world, leaves)) for lf in range(leaves))
        slack = world - quorum if 0 < quorum < world else 0
        missing = [0] * leaves
        for _ in range(slack):
            lf = max(range(leaves), key=lambda i: (sizes[i] - missing[i], -i))
            if sizes[lf] - missing[lf] <= 1:
                break                   # one rank left at every leaf
            missing[lf] += 1
        return cls(quorum, sizes, tuple(n - m if m else 0 for n, m in zip(sizes, missing)))

    @property
    def world(self) -> int:
        return sum(self.sizes)

    def closing(self, leaf: int) -> int:
        """The local contributions that close a use at `leaf`."""
        return self.local[leaf] or self.sizes[leaf]

    @property
    def needed(self) -> int:
        """The world's ranks a result holds at least (the world, without a quorum)."""
        return sum(self.closing(lf) for lf in range(len(self.sizes)))

    def fill_in(self, check_lane: CheckLane, members: int, where: Placement) -> Send:
        """What the rank at `where` sends in a fill-in round of a chunk whose sums hold the
        world ranks of `members`: the fill-in rule among its leaf's ranks, with its leaf's
        quorum (`CheckLane.fill_in`)."""
        ranks = Placement.ranks_of(where.leaf, where.world, len(self.sizes))
        return check_lane.fill_in(members, where.rank, self.closing(where.leaf), ranks)
