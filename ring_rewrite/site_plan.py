"""Everything static about one rewritten site on one rank (``SitePlan``), and how it runs its
heads in chunks.

The rewrite (``passes/rewrite_sdpa.py``) builds a plan per site; the site's program
(``program.build``, Note [The site program]) is built from it, and the interpreter
(``attention.py``) runs that program.

Note [Heads across ranks]
~~~~~~~~~~~~~~~~~~~~~~~~~
With ``comm="all_to_all"`` (more than one rank) a site moves its inputs, not K/V.
An all-to-all turns this rank's shard of the sequence for every head into the whole sequence for
``H / P`` of the heads (rank ``j`` takes heads ``[j H / P, (j + 1) H / P)``, query and key/value
heads alike, so GQA's groups stay whole); the rank attends them as one process would
(``SitePlan.inner``: the same branches over the whole sequence, all local, no ring); a second
all-to-all turns the output back. The backward exchanges ``dout`` to heads and ``dq, dk, dv``
back: the forward saves the exchanged q, k, v and its out and lse in the heads' layout. Each
all-to-all is point-to-point (``all_to_all_seq``: one transfer per distance, on the site's token
chain, with the headers, deadlines and named errors of the ring's transfers) and sends ``(P - 1)
/ P`` of a tensor per rank whatever ``P``, where a ring passes every K/V by every rank; a rank's
blocks then run the whole sequence. The program lists the all-to-alls (``program.Exchange``) around
the inner plan's steps. A dilated branch gives head ``j`` the lattice offset ``j % r``: a rank's
branches number their heads from its first (``BranchLayout.head0``), so each keeps its offset
whatever ``H / P`` and the rates. Query heads must split evenly; key/value heads are copied the fewest times that lets them split
(``kv_copies``, the report says how many; their gradients are summed over the copies on the way
back). A key bias (a padding mask, ALiBi) is exchanged as a one-wide tensor of every query
head, its rank's heads then reading their whole row of keys; document ids are every position's
already (the rewrite gathers them) and a band is a rule on positions, so the inner plan keeps
both. Dropout is not carried. A site that cannot run so is an error naming ``comm="ring"`` (``_check_exchange``).

``comm="hybrid"`` runs the all-to-alls within groups of ``a2a`` consecutive ranks (``SitePlan.a2a``;
``"all_to_all"`` is one group of every rank) and a ring across the groups: after the exchange,
group ``g`` holds its ranks' tokens for ``H / a2a`` heads, and those tokens are exactly shard
``g`` of the same layout over ``P / a2a`` ranks (contiguous: the group's shards side by side;
zigzag: its ranks' first chunks in order, then their second chunks in reverse,
``Layout.regroup``). So the inner plan is an ordinary ring plan of ``P / a2a`` ranks over those
shards, whose ring runs between the ranks in the same place of every group (``Branch.peers``:
rank ``j`` of the ring is group rank ``j a2a + rank % a2a``), on the site's own group and token
chain: one header per call, the same deadlines, errors and recovery for the exchanges and the
ring's transfers. A rank sends ``(a2a - 1) / a2a`` of each tensor it exchanges, and its K/V
shard (``N a2a / P`` tokens of ``H / a2a`` heads: as large as a flat ring's) goes round a ring of
``P / a2a`` ranks instead of ``P``.

In replicated mode every rank holds the whole sequence, so nothing is exchanged on the way in:
a rank takes its heads' shard where it lies (``attention._own_heads``, after padding the whole
inputs as the ring's replicated mode pads them; the padded keys then come to the inner plan as a
key bias), and the results (the output; dq, dk, dv) are gathered from every rank
(``program.Gather``, the replicated ring's gathers, with the probe that the ranks hold the same
sequence).

Note [Head chunks]
~~~~~~~~~~~~~~~~~~
Heads never interact, so a ring branch may run its whole ring for a slice of the heads, then
again for the next slice. The bytes sent do not change; what does is every buffer the ring
holds at once: K/V arriving while the held ones compute, dK/dV held and arriving, the block's
gradients. Over all heads those are some eight local-K-sized tensors on top of the four the
single-device backward also needs (out, dq, dk, dv), which would keep the per-rank peak far above
1/P of the single-device one; in ``g`` chunks they shrink to ``1/g``. Chunks cost one more
transfer and kernel call each, so ``SitePlan.head_chunks`` takes as many as divide the dilated kv
heads while each K/V message stays at least ``RING_CHUNK_BYTES`` (small rings stay whole). In the
backward a chunk's dK/dV make their last hop home while the next chunk's first step computes, so
only the last chunk's last hop has nothing to overlap with.

Note [Head chunks of local branches]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Where the local branches cannot run in place (Note [Local branches in place]), a local
branch's backward holds its dilated copies (q, dout, out, K/V at ``r > 1``), its
kernel's gradients with their contiguous copy, and the sums they are added to (while inductor
summed pointwise, every branch's gradients too: 9.6 ``q``-sized tensors at the peak in
``benchmarks/single_device.py``'s LongNet config). So the local branches' backward runs one
head chunk (of whole kv heads) at a time: every local branch computes its share of the chunk's
heads, and the shares are summed (with the rings' dq of those heads, Note [Gradient sums as
calls]) straight into those heads of the site's dq, dk, dv, in place (``undilate_add``'s
``start``; a concatenation would hold every chunk's sums beside its result). Where the sums are
wider than the inputs (``stat_dtype``: float32 for 16-bit inputs) a chunk sums into buffers of
its own instead, cast once into the site's (``ops.write_heads``). The next chunk's blocks wait
for those writes (``ops.after`` on their lse: nothing else stops a compiler from running every
chunk's blocks first and holding their results). At once are held the site's gradients (and a
chunk's own sums, where wider) and one branch's copies, gradients and scratch for that chunk.
Summing in place saves three chunk-sized buffers a chunk and a copy of dq, dk, dv a step (at
256k tokens a one-head chunk is 64 MiB, over glibc's ``mmap`` threshold: fresh pages every
time). ``SitePlan.local_chunks`` takes the fewest chunks whose share fits in
``max(LOCAL_CHUNK_BYTES, q)``: small sites stay whole, as does a site with dropout (a block's
keep-mask is drawn over all of its heads). The forward holds each branch's out and lse, ``1 / r``
of q each (in place, the Note below, one running pair), and needs no chunks.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from . import cpu_kernel
from .kernels import block_kernel
from .numerics import stat_dtype
from .comm.groups import global_ranks
from .layout import layout_of
from .schedule import Branch, schedule_branch

__all__ = ["ExchangeRefused", "LOCAL_CHUNK_BYTES", "RING_CHUNK_BYTES", "SitePlan", "comm_options", "option_name"]

# A ring branch runs its heads in chunks whose K/V message is at least this large (Note [Head
# chunks]).
RING_CHUNK_BYTES = 1 << 20
# The local branches' backward runs in head chunks whose working set is at most this, or q
# (Note [Head chunks of local branches]).
LOCAL_CHUNK_BYTES = 1 << 26


@dataclasses.dataclass(frozen=True)
class SitePlan:
    """Everything static about one rewritten site on one rank."""

    site: int
    batch: int
    hq: int
    hkv: int
    n: int
    """Global sequence length."""
    d: int
    dv: int
    dtype: torch.dtype
    device: str
    """Device type of the inputs: which block kernel runs (``kernels.py``)."""
    scale: float
    is_causal: bool
    has_mask: bool
    world: int
    rank: int
    group_name: str
    sharding: str
    layout: str
    branches: tuple[Branch, ...]
    pad: int = 0
    """Tokens of padding after the sequence (replicated mode, Note [Padding the sequence]):
    ``n`` counts them; the site's inputs and outputs have ``n - pad`` tokens."""
    dropout: float = 0.0
    """Probability that an attention probability drops (Note [Dropout in blocks]);
    the site's calls then take a ``seed``."""
    ranks: tuple[int, ...] = (0,)
    """The global rank of each rank of the group (``ranks[rank]`` is this process): what the
    report names. Rings and transfers speak group ranks (Note [Group ranks])."""
    band: tuple[int | None, int | None] | None = None
    """``(lo, hi)``: key ``t`` reaches query ``p`` only if ``lo <= t - p <= hi`` (None: open), on
    top of ``is_causal`` (a mask read from the graph, ``passes/masks.py``; Note [Bands])."""
    documents: str | None = None
    """Key ``t`` reaches query ``p`` only if ``doc[t] <documents> doc[p]`` (``eq``: the same
    document; ``le``: block-causal; ``ops.RELATIONS``): the site's calls take ``docs (B|1, 1, N,
    1)``, the id of every position (replicated mode or one rank: every rank holds them all; Note
    [Bands])."""
    recentred: bool = False
    """Whether the key bias holds more than a mask (a bias such as ALiBi's, which grows with the
    position): block calls then recentre it (Note [Recentred key biases])."""
    comm: str = "ring"
    """``"all_to_all"`` or ``"hybrid"`` (with more than one rank): the site exchanges sequence
    shards for head shards within groups of ``a2a`` ranks, attends its heads (``inner``: the
    whole sequence, or a ring across the groups) and exchanges back (Note [Heads across
    ranks]); its branches are ``inner``'s."""
    a2a: int = 1
    """Ranks in each all-to-all group, consecutive ranks of the group: 1 for a ring, ``world``
    for ``"all_to_all"``, in between for ``"hybrid"``."""
    bucketed: bool = False
    """Whether the plan is a length bucket's and the site runs at the real length: on each
    rank's unpadded shard in sharded mode (Note [Padding shards to a bucket]), more than half
    of each part's planned rows, reading, sending and computing only those; in one process on
    the unpadded sequence, a rate-1 branch on its rows, a dilated one gathered from them (Note
    [Padding to a bucket])."""

    @classmethod
    def build(
        cls, *, site=0, batch, hq, hkv, n, d, dv, dtype, device="cpu", scale, is_causal, has_mask,
        branches, world=1, rank=0, group_name="", sharding="replicated", layout="contiguous",
        pad=0, dropout=0.0, band=None, documents=None, recentred=False, comm="ring", a2a=None, ranks=None,
        bucketed=False,
    ):  # fmt: skip
        a2a = _a2a_ranks(comm, world, a2a)
        if a2a > 1:  # first: no padding of the sequence helps here
            _check_exchange(comm, hq, a2a, dropout)
        if world > 1:
            layout_of(layout).chunk_size(n, world)  # raises where n does not cut evenly
        copies = _kv_copies(hkv, a2a)
        # The branches run over the ring across the all-to-all groups: rank ``rank // a2a`` of
        # ``world // a2a``, whose process-group ranks are those of this rank's place in its group.
        peers = tuple(_ring_members(rank, world, a2a)) if 1 < a2a < world else ()
        plans = tuple(
            schedule_branch(
                w, r, n_global=n, world=world // a2a, rank=rank // a2a, layout=layout, is_causal=is_causal,
                batch=batch, hq=hq // a2a, hkv=hkv * copies // a2a, peers=peers, head0=rank % a2a * (hq // a2a),
            )  # fmt: skip
            for w, r in branches
        )
        if ranks is None:
            ranks = global_ranks(group_name) if group_name else tuple(range(world))
        comm = "ring" if a2a == 1 else "all_to_all" if a2a == world else "hybrid"
        return cls(
            site, batch, hq, hkv, n, d, dv, dtype, device, scale, is_causal, has_mask,
            world, rank, group_name, sharding, layout, plans, pad, dropout, ranks, band, documents,
            recentred and has_mask, comm, a2a, bucketed,
        )  # fmt: skip

    def with_comm(self, comm: str, a2a: int | None = None) -> SitePlan:
        """This site as ``comm`` (with ``a2a`` ranks per all-to-all group for ``"hybrid"``) would
        run it on this rank: what ``explain()`` and ``plan()`` compare. Raises ``ValueError``
        (``ExchangeRefused``) where the site cannot run so."""
        return SitePlan.build(
            site=self.site, batch=self.batch, hq=self.hq, hkv=self.hkv, n=self.n, d=self.d, dv=self.dv,
            dtype=self.dtype, device=self.device, scale=self.scale, is_causal=self.is_causal, has_mask=self.has_mask,
            branches=[(b.w, b.r) for b in self.branches], world=self.world, rank=self.rank,
            group_name=self.group_name, sharding=self.sharding, layout=self.layout, pad=self.pad,
            dropout=self.dropout, band=self.band, documents=self.documents, recentred=self.recentred, comm=comm,
            a2a=a2a, ranks=self.ranks,  # the group's ranks as they were (the group may be gone)
        )  # fmt: skip

    def alternatives(self) -> list[tuple[str, SitePlan | str]]:
        """This site under every other ``comm`` its group can be asked for (``comm_options``),
        named as ``option`` names them: its plan on this rank, or why the site cannot run so."""
        others = []
        for comm, a2a in comm_options(self.world) if self.world > 1 else ():
            name = option_name(comm, a2a)
            if name == self.option:
                continue
            try:
                others.append((name, self.with_comm(comm, a2a)))
            except ValueError as error:
                others.append((name, str(error)))
        return others

    @property
    def option(self) -> str:
        """How the site shares its work: ``comm='ring'``, ``comm='hybrid', a2a_ranks=2``, ..."""
        return option_name(self.comm, self.a2a)

    @property
    def exchanged(self) -> bool:
        """Whether the site exchanges its inputs for heads (Note [Heads across ranks])."""
        return self.a2a > 1

    @property
    def kv_copies(self) -> int:
        """How many copies of each key/value head an exchanging site sends: the fewest that let
        an all-to-all group split them (1 where the kv heads divide by ``a2a``)."""
        return _kv_copies(self.hkv, self.a2a)

    @functools.cached_property
    def inner(self) -> SitePlan:
        """An exchanging site's attention on this rank: its ``H / a2a`` query heads and their
        key/value heads with the same branches, over the whole sequence (``"all_to_all"``) or
        as rank ``rank // a2a`` of the ring across the groups (``"hybrid"``)."""
        world, a2a = self.world // self.a2a, self.a2a
        # Replicated mode pads the whole inputs before it takes their shards: the padded keys
        # then come as a key bias (Note [Padding the sequence]).
        masked = self.has_mask or bool(self.pad and not self.is_causal)
        return dataclasses.replace(
            self, hq=self.hq // a2a, hkv=self.hkv * self.kv_copies // a2a, world=world, rank=self.rank // a2a,
            group_name=self.group_name if world > 1 else "", ranks=tuple(self.ranks[m] for m in _ring_members(self.rank, self.world, a2a)),
            comm="ring", a2a=1, sharding="sharded", pad=0, has_mask=masked,
        )  # fmt: skip

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the blocks compute in: the device's block kernel says (``kernels.py``)."""
        return block_kernel(self.device).compute_dtype(self.dtype)

    @property
    def stat_dtype(self) -> torch.dtype:
        """What lse, merges and gradient sums are kept in (``numerics.stat_dtype``)."""
        return stat_dtype(self.dtype)

    @property
    def n_local(self) -> int:
        return self.n // self.world

    @property
    def replicated(self) -> bool:
        """Replicated mode across ranks: every rank holds the whole sequence, so the site takes
        its rank's shard of the inputs and gathers its outputs (and gradients) whole again."""
        return self.world > 1 and self.sharding == "replicated"

    def head_chunks(self, branch: Branch) -> int:
        """How many head chunks a ring branch runs in, one after another (Note [Head chunks]):
        the most that divide its dilated kv heads and keep each K/V message >= 1 MiB (of real
        rows: half the rows of a bucketed plan's, the fewest it computes)."""
        layout = branch.layout
        if branch.is_local:
            return 1
        message = layout.batch * layout.nseg * layout.kv_heads * layout.m * (self.d + self.dv)
        message = message * self.dtype.itemsize // (2 if self.bucketed else 1)
        fits = [g for g in range(1, layout.kv_heads + 1) if layout.kv_heads % g == 0]
        return max(g for g in fits if g == 1 or message // g >= RING_CHUNK_BYTES)

    def local_chunks(self) -> list[tuple[slice, slice]]:
        """Query-head and kv-head slices of the head chunks the local branches' backward runs in
        (Note [Head chunks of local branches]): the fewest, of whole kv heads, whose working set
        fits in ``max(LOCAL_CHUNK_BYTES, q)``; one chunk with dropout (a block's keep-mask is
        drawn over all its heads)."""
        local = [b.layout for b in self.branches if b.is_local]
        if not local or self.dropout or self.local_in_place:
            return [(slice(0, self.hq), slice(0, self.hkv))]
        item = self.compute_dtype.itemsize
        budget = max(LOCAL_CHUNK_BYTES, self.batch * self.hq * self.n_local * self.d * item)
        grads, work = 0, 0  # per query head: every branch's gradients; the largest branch's work
        for layout in local:
            rows = self.batch * layout.padded // layout.r
            kv = rows * layout.kv_heads // self.hq
            grads += rows * self.d + kv * (self.d + self.dv)
            copies = rows * (self.d + 2 * self.dv) + kv * (self.d + self.dv) if layout.gathered else 0
            work = max(work, copies + max(rows * self.d, kv * max(self.d, self.dv)))
        g = self.hq // self.hkv
        sizes = [c for c in range(self.hkv, 0, -1) if self.hkv % c == 0]  # kv heads a chunk
        kc = next((c for c in sizes if (grads + work) * c * g * item <= budget), sizes[-1])
        return [
            (slice(j * kc * g, (j + 1) * kc * g), slice(j * kc, (j + 1) * kc)) for j in range(self.hkv // kc)
        ]

    @property
    def local_in_place(self) -> bool:
        """Whether the local branches read their rows where they lie, forward and backward, and
        add their gradients straight into the site's (Note [Local branches in place]): float32
        on CPU with ``flash_cpu.c`` built, no bias, band, documents or dropout, no padding; not
        a bucket's run at the real length (``bucketed``: its blocks take the real rows)."""
        local = [b for b in self.branches if b.is_local]
        if not local or self.dtype != torch.float32 or self.device != "cpu" or self.dropout or self.bucketed:
            return False
        if self.band is not None or self.documents or self.pad:
            return False
        if any(self.needs_bias(b) or not b.layout.in_place for b in local):
            return False
        return cpu_kernel.available()

    def needs_bias(self, branch: Branch) -> bool:
        # Padded keys sit after every real query, so causal attention never sees them. A
        # bucket's rate-1 branch reads the real rows only; its gathered ones read past them.
        layout = branch.layout
        padded = layout.r > 1 if self.bucketed else self.pad or layout.padded != layout.n
        return self.has_mask or (padded and not self.is_causal)


def _a2a_ranks(comm: str, world: int, a2a: int | None) -> int:
    """Ranks in each all-to-all group of a site on ``world`` ranks (``SitePlan.a2a``)."""
    if world == 1 or comm == "ring":
        return 1
    if comm == "all_to_all":
        return world
    if not a2a or world % a2a:
        raise ValueError(
            f"comm='hybrid' runs all-to-alls in groups of a2a_ranks consecutive ranks and a ring "
            f"across the groups, so a2a_ranks must divide the {world} ranks, got {a2a}"
        )
    return a2a


class ExchangeRefused(ValueError):
    """An exchanging ``comm`` cannot carry the site (no padding of the sequence would help)."""


def _check_exchange(comm: str, hq: int, a2a: int, dropout: float) -> None:
    """Raise ``ExchangeRefused`` where an all-to-all of ``a2a`` ranks cannot carry the site
    (Note [Heads across ranks])."""
    fix = "use comm='ring'"
    if hq % a2a:
        raise ExchangeRefused(
            f"comm={comm!r} splits the heads over {a2a} ranks, but {hq} query heads are "
            f"not a multiple of {a2a}; {fix}"
        )
    if dropout:
        raise ExchangeRefused(f"comm={comm!r} does not carry dropout; {fix}")



def comm_options(world: int) -> list[tuple[str, int | None]]:
    """Every ``(comm, a2a_ranks)`` a group of ``world`` ranks can be asked for."""
    return [("ring", None), ("all_to_all", None)] + [("hybrid", a) for a in range(2, world) if world % a == 0]


def option_name(comm: str, a2a: int | None) -> str:
    return f"comm={comm!r}" + (f", a2a_ranks={a2a}" if comm == "hybrid" else "")


def _ring_members(rank: int, world: int, a2a: int) -> range:
    """The ranks (of the site's group) of the ring across all-to-all groups of ``a2a`` that
    ``rank`` runs in: those in its place of every group."""
    return range(rank % a2a, world, a2a)


def _kv_copies(hkv: int, world: int) -> int:
    """The fewest copies of each of ``hkv`` key/value heads that ``world`` ranks can split
    evenly, every rank's query heads then reading its own (Note [Heads across ranks])."""
    return world // math.gcd(hkv, world)
