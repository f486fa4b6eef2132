"""Which ranks exchange what, step by step: the ring schedule of one branch on one rank.

Note [Ring schedule]
~~~~~~~~~~~~~~~~~~~~
Each rank holds ``n = N / P`` tokens in ``parts``: one part (``layout="contiguous"``: rank k holds
``[kn, (k+1)n)``) or two (``layout="zigzag"``: rank k holds chunks k and 2P-1-k of 2P chunks of
``n/2``). A branch ``(w, r)`` is

* **local** when its segments lie inside a part (``part % w == 0``): single-device dilated
  attention on the local tokens, no communication;
* a **ring** over the ``G`` ranks that share its segments otherwise: ``G = P`` when ``w >= N``;
  ``G = w / part`` consecutive ranks when ``w`` is a multiple of the part (a "sub-ring"; with
  zigzag both chunks of a rank fall in segments shared with the same ``G`` ranks).

On a ring, the dilated K/V rows of every rank visit every rank of the group, one step at a time
(step s: rank ``i`` of the group holds the K/V of rank ``i - s``). Each step computes a few blocks
``(query parts, key parts, causal)``; with ``is_causal`` the blocks fully above the diagonal are
skipped, never the transfer. Causal blocks per step for query rank k and key rank j
(the zigzag table follows torch's context parallel / ring-flash-attention's zigzag variant):

    layout       ring       j == k                   j < k               j > k
    contiguous   any        q0 k0 causal             q0 k0               -
    zigzag       full       q01 k01 causal           q01 k0              q1 k01
    zigzag       sub-ring   q0 k0 causal, q1 k1 c.   q0 k0               q1 k1

(``q01`` = both query parts as one block of rows; without ``is_causal`` every pair of parts in
the same segment is one non-causal block.) Per step the compute of the two zigzag halves is
balanced: that is the point of zigzag.
"""

from __future__ import annotations

import dataclasses

from .dilation import BranchLayout
from .layout import layout_of

__all__ = ["Parts", "Branch", "schedule_branch"]


@dataclasses.dataclass(frozen=True)
class Parts:
    """Attention of query parts ``[q0, q1)`` to key parts ``[k0, k1)``."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


@dataclasses.dataclass(frozen=True)
class Branch:
    """One branch on one rank: its local dilated layout and, for a ring, the steps."""

    w: int
    r: int
    layout: BranchLayout
    ring: tuple[int, ...]
    """Ranks of the (sub-)ring in ring order, as ranks of the plan's ``world`` (whose shards
    the layout names); one rank for a local branch."""
    position: int
    """This rank's index in ``ring``."""
    steps: tuple[tuple[Parts, ...], ...]
    """Blocks computed at each step (step s holds the K/V of ``ring[position - s]``)."""
    peers: tuple[int, ...] = ()
    """The rank in the site's process group of each rank of the plan's world (Note [Group
    ranks]), where they differ: a hybrid's ring runs across its all-to-all groups (Note [Heads
    across ranks]). Empty: the same."""

    @property
    def is_local(self) -> bool:
        return len(self.ring) == 1

    @property
    def send_to(self) -> int:
        """The group rank this rank sends to."""
        return self.group_rank(self.ring[(self.position + 1) % len(self.ring)])

    @property
    def recv_from(self) -> int:
        """The group rank this rank receives from."""
        return self.group_rank(self.ring[(self.position - 1) % len(self.ring)])

    def group_rank(self, rank: int) -> int:
        return self.peers[rank] if self.peers else rank


def schedule_branch(
    w: int,
    r: int,
    *,
    n_global: int,
    world: int,
    rank: int,
    layout: str,
    is_causal: bool,
    batch: int,
    hq: int,
    hkv: int,
    peers: tuple[int, ...] = (),
    head0: int = 0,
) -> Branch:
    """The branch on ``rank`` of a group of ``world`` ranks (``peers``: their ranks in the
    process group, where they differ) for the site's query heads ``[head0, head0 + hq)``;
    raises ValueError when the shards cannot carry it."""
    n_local = n_global // world
    if world == 1:
        geometry = BranchLayout(w, r, n_local, batch, hq, hkv, head0)
        return Branch(w, r, geometry, (rank,), 0, ((Parts(0, 1, 0, 1, is_causal),),))
    parts = layout_of(layout).parts
    part = n_local // parts
    if part % w == 0:
        geometry = BranchLayout(w, r, n_local, batch, hq, hkv, head0)
        return Branch(w, r, geometry, (rank,), 0, ((Parts(0, 1, 0, 1, is_causal),),))
    if part % r:
        raise ValueError(
            f"branch (w={w}, r={r}): each rank's part of {part} tokens is not a multiple of the "
            f"dilation rate {r}, so ranks would start on different lattice offsets"
        )
    if w >= n_global:
        size, full = world, True
    elif w % part == 0:
        size, full = w // part, False
        if parts > 1 and world % size:
            raise ValueError(
                f"branch (w={w}, r={r}) spans {size} zigzag chunks of {part} tokens; with zigzag "
                f"that must divide the {world} ranks"
            )
    else:
        raise ValueError(
            f"branch (w={w}, r={r}): the segment length must divide each rank's part of {part} "
            f"tokens or be a multiple of it (N={n_global}, {world} ranks, layout={layout!r})"
        )
    first = rank // size * size
    ring = tuple(range(first, min(first + size, world)))
    position = rank - first
    geometry = BranchLayout(part, r, n_local, batch, hq, hkv, head0)  # one "segment" per part
    steps = tuple(
        _blocks(rank, ring[(position - s) % len(ring)], parts, full, is_causal)
        for s in range(len(ring))
    )
    return Branch(w, r, geometry, ring, position, steps, peers)


def _blocks(k: int, j: int, parts: int, full: bool, causal: bool) -> tuple[Parts, ...]:
    """Blocks of query rank ``k`` against the K/V of rank ``j`` (Note [Ring schedule])."""
    if parts == 1:
        if not causal:
            return (Parts(0, 1, 0, 1, False),)
        if j == k:
            return (Parts(0, 1, 0, 1, True),)
        return (Parts(0, 1, 0, 1, False),) if j < k else ()
    if full:
        if not causal:
            return (Parts(0, 2, 0, 2, False),)
        if j == k:
            return (Parts(0, 2, 0, 2, True),)
        return (Parts(0, 2, 0, 1, False),) if j < k else (Parts(1, 2, 0, 2, False),)
    if not causal:
        return (Parts(0, 1, 0, 1, False), Parts(1, 2, 1, 2, False))
    if j == k:
        return (Parts(0, 1, 0, 1, True), Parts(1, 2, 1, 2, True))
    return (Parts(0, 1, 0, 1, False),) if j < k else (Parts(1, 2, 1, 2, False),)
