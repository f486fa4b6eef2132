"""A site's program: every gather, transfer, block and sum of one site call on one rank, in order.

Note [The site program]
~~~~~~~~~~~~~~~~~~~~~~~
``build(plan, "forward")`` and ``build(plan, "backward")`` list, once per plan, what a site
call does on this rank, one typed step at a time, with their sizes; ``site_forward`` and
``site_backward`` (``attention.py``) run them, a method per step type, so the order of the
transfers and blocks is written here alone:

* ``Dilate``: a branch's rows put in its kernel layout (gathered, or views of the inputs);
* ``Start`` / ``Wait``: a ring transfer (its ``Tag``, the tensors sent, their shapes, dtypes
  and peers) and the wait that ends it, after the blocks it overlaps;
* ``Chunk``: a ring branch's head chunk begins (its heads, as views);
* ``Block``: one block attention call (or its backward): the branch, ring step and head chunk,
  its query and key rows, and ``kind``: ``full`` (no pair masked), ``partial`` (a band or
  documents mask some: the call takes the rows' positions, Note [Bands]) or
  ``skip`` (every pair masked: no call, the transfer still goes);
* ``Merge`` / ``Undilate``: results merged (forward) or gradients summed (backward), and a
  branch's results put back at the site's rows; ``Land``: a ring's dK/dV home; ``Cast``: the
  gradients in the input dtype;
* ``Gather``: replicated mode's all-gather of an output or a gradient.

What a band or documents mean for a block is decided here (``_block``) and nowhere else: the
bodies skip the blocks marked ``skip`` and hand a ``partial`` block's positions to its kernel;
how local branches run (in place, gathered, in head chunks) is which steps the program lists.
``print(record.forward_program)`` (a ``SiteRecord``'s) shows a program, one line a step. ``tests/test_program.py``
checks that it lists exactly the transfers, in order, and the block calls that the traced
bodies issue, on every rank.

The report's FLOPs and bytes sum a program's blocks and transfers (``report.py``), and its
memory walks the steps (``memory.py``, Note [Memory of a site]), folded:
``build(plan, graph, folded=True)`` lists each ring's transfers of a kind once and its
equal blocks once, each with how many times it runs (``times``). The counts are the same (head
chunks are equal slices, every hop of a ring sends the same); the steps are about ``1 / (ring
size x head chunks)`` as many, which lets ``ring_rewrite.plan`` build every rank's of a billion
tokens over 512 ranks in seconds.

Note [Bands]
~~~~~~~~~~~~
A mask read from the graph (``passes/masks.py``) may restrict ``t - p`` to a band ``[lo, hi]``
(a sliding window: ``lo = 1 - W`` with ``is_causal``). Within a branch a query and its keys
share a segment and a lattice offset, so ``t - p`` of a block's rows is the difference of their
positions without the offset: ``start of the part + row * r``. The site's program classifies
each block from those numbers (``_block``; Note [The site program]):
all its pairs inside the band (the call is as without one), none (skipped, as causal attention
skips blocks above the diagonal; never the transfer), or some: then the call gets ``band`` and
the rows' positions (``attention._band_args``), and the block op masks the band
in chunks of query rows (``ops.BAND_CHUNK`` scores each), so nothing of size (queries x keys)
is ever held. Memory stays O(N/P); a window shorter than the shards skips most ring blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Union

import torch

from .comm.tags import DKV, GATHER, KV, KV_BACK, Tag
from .layout import layout_of

if TYPE_CHECKING:
    from .schedule import Branch, Parts
    from .site_plan import SitePlan

__all__ = [
    "Block", "Cast", "Chunk", "Dilate", "Exchange", "Gather", "Land", "Merge", "Program", "Start", "Undilate", "Wait",
    "build",
]  # fmt: skip

_DTYPES = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16"}


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


@dataclasses.dataclass(frozen=True)
class Dilate:
    """A branch's ``tensors`` in its kernel layout: one gather each (``copied``), or views; a
    local branch's backward takes the heads of its ``chunk`` (``SitePlan.local_chunks``)."""

    branch: int
    tensors: tuple[str, ...]
    copied: bool
    chunk: int = 0

    def __str__(self) -> str:
        where = f"b{self.branch} c{self.chunk}" if self.chunk else f"b{self.branch}"
        return f"dilate    {where}  {' '.join(self.tensors)} ({'gathered' if self.copied else 'views'})"


@dataclasses.dataclass(frozen=True)
class Start:
    """A ring transfer started: ``tensors`` (their ``shapes`` and ``dtypes``, ``bytes`` in all)
    to group rank ``send_to``, their like received from ``recv_from``; ``times``: how many
    transfers of the ring this one stands for in a folded program (``build``)."""

    tag: Tag
    tensors: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    bytes: int
    send_to: int
    recv_from: int
    times: int = 1

    def __str__(self) -> str:
        sent = ",".join(f"{n} {_shape(s)} {_DTYPES.get(d, d)}" for n, s, d in zip(self.tensors, self.shapes, self.dtypes))
        times = f" ({self.times} times)" if self.times > 1 else ""
        return f"start     {_where(self.tag)}  {sent} to {self.send_to} from {self.recv_from}{times}"


@dataclasses.dataclass(frozen=True)
class Wait:
    """The transfer ``tag`` waited for, after the blocks it overlaps: those of ``after``, a
    ``(branch, head chunk, ring step)``, or (None) the local branches' (Note [Overlap across
    branches])."""

    tag: Tag
    after: tuple[int, int, int] | None

    def __str__(self) -> str:
        tag, after = self.tag, self.after
        if after is None:
            return f"wait      {_where(tag)}  after the local branches"
        if after != (tag.branch, tag.chunk, tag.step):
            return f"wait      {_where(tag)}  after s{after[2]} c{after[1]}"
        return f"wait      {_where(tag)}"


def _where(tag: Tag) -> str:
    kinds = {KV: "K/V", KV_BACK: "K/V", DKV: "dK/dV"}
    return f"b{tag.branch} s{tag.step} c{tag.chunk}  {kinds[tag.kind]}"


@dataclasses.dataclass(frozen=True)
class Block:
    """One block attention call (``backward``: its gradients) of ``branch`` at ring ``step``
    (None: a local branch) and head ``chunk``: query parts ``[q0, q1)`` against key parts
    ``[k0, k1)`` of the K/V held, ``rows`` query rows and ``keys`` key rows per head and batch
    element, over ``batch`` batch elements (a local branch's segments count as batch) and ``heads``
    query heads. ``index``: its place in the step (dropout names a block by it).

    ``kind``: ``"full"``, ``"partial"`` or ``"skip"`` (Note [The site program]). A partial
    block's ``band`` is ``(lo, hi)`` of ``t - p`` (None: open), ``documents`` the relation of the
    rows' document ids; ``q_starts`` / ``k_starts`` are the positions of each part's first row,
    ``stride`` the distance between rows (the rate). ``in_place``: a local branch that reads its
    rows where they lie (Note [Local branches in place]). ``times``: how
    many head chunks' blocks it stands for in a folded program (``build``)."""

    branch: int
    step: int | None
    chunk: int
    index: int
    q0: int
    q1: int
    k0: int
    k1: int
    batch: int
    heads: int
    rows: int
    keys: int
    causal: bool
    kind: str = "full"
    band: tuple[int | None, int | None] | None = None
    documents: str | None = None
    q_starts: tuple[int, ...] = ()
    k_starts: tuple[int, ...] = ()
    stride: int = 1
    in_place: bool = False
    backward: bool = False
    times: int = 1

    @property
    def parts(self) -> tuple[int, int, int, int]:
        return self.q0, self.q1, self.k0, self.k1

    @property
    def pairs(self) -> int:
        """Query-key pairs the call computes per head and batch element (the causal diagonal
        halves); none for a skipped block."""
        if self.kind == "skip":
            return 0
        return self.rows * (self.rows + 1) // 2 if self.causal else self.rows * self.keys

    def __str__(self) -> str:
        where = f"b{self.branch}" if self.step is None else f"b{self.branch} s{self.step} c{self.chunk}"
        q0, q1, k0, k1 = self.parts
        parts = "" if self.step is None else f" q{q0}:{q1} k{k0}:{k1}"
        mask = ""
        if self.kind == "partial":
            mask = " band " + ",".join("open" if x is None else str(x) for x in (self.band or (None, None)))
            mask += f" documents {self.documents}" if self.documents else ""
        return (
            f"block{'_bw' if self.backward else '   '}  {where}{parts}  {self.batch}x{self.heads} "
            f"{self.rows}x{self.keys}{' causal' if self.causal else ''} {self.kind}{mask}"
            f"{', in place' if self.in_place else ''}{f' ({self.times} times)' if self.times > 1 else ''}"
        )


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Head chunk ``chunk`` of a ring branch begins: its query heads ``[q0, q1)`` and dilated
    kv heads ``[k0, k1)`` taken, as views, from the branch's rows (Note [Head chunks])."""

    branch: int
    chunk: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]

    @property
    def slices(self) -> tuple[slice, slice]:
        return slice(*self.heads), slice(*self.kv_heads)

    def __str__(self) -> str:
        (q0, q1), (k0, k1) = self.heads, self.kv_heads
        return f"chunk     b{self.branch} c{self.chunk}  heads {q0}:{q1}, kv heads {k0}:{k1}"


@dataclasses.dataclass(frozen=True)
class Merge:
    """Results merged (forward: out and lse, by their lse) or gradients summed (backward) of
    ``branch`` (None: the site's, every branch's), of head ``chunk`` (a ring's, or backward
    the local branches') and ring ``step``; backward ``dq`` of a ring: its head chunks' side by
    side."""

    branch: int | None = None
    what: str = "out, lse"
    chunk: int = 0
    step: int | None = None

    def __str__(self) -> str:
        where = "site" if self.branch is None else f"b{self.branch}"
        where += "" if self.step is None else f" s{self.step}"
        return f"merge     {where} c{self.chunk}  {self.what}"


@dataclasses.dataclass(frozen=True)
class Land:
    """A ring head chunk's dK/dV home: the accumulator that came back on its last hop plus the
    share of the owner's own K/V, which never left (Note [Backward from the merged statistics])."""

    branch: int
    chunk: int

    def __str__(self) -> str:
        return f"land      b{self.branch} c{self.chunk}  dk, dv"


@dataclasses.dataclass(frozen=True)
class Cast:
    """The site's sums (``stat_dtype``) in the input dtype."""

    tensors: tuple[str, ...]

    def __str__(self) -> str:
        return f"cast      {' '.join(self.tensors)}"


@dataclasses.dataclass(frozen=True)
class Undilate:
    """A branch's results (forward) or gradients (backward, added in place) at the site's rows;
    backward, those of the local branches' head ``chunk`` (a ring's dq: its heads of that chunk)."""

    branch: int
    tensors: tuple[str, ...]
    chunk: int = 0

    def __str__(self) -> str:
        where = f"b{self.branch} c{self.chunk}" if self.chunk else f"b{self.branch}"
        return f"undilate  {where}  {' '.join(self.tensors)}"


@dataclasses.dataclass(frozen=True)
class Gather:
    """Replicated mode: every rank's ``tensor`` (``shape``, ``dtype``) gathered, the site's
    ``index``-th gather; ``bytes`` this rank sends (its shard to every other rank, with the
    message's tag and, for the output, the probe of the query values)."""

    index: int
    tensor: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int
    times: int = 1

    @property
    def tag(self) -> Tag:
        return Tag(0, GATHER, self.index)

    def __str__(self) -> str:
        return f"gather    {self.index}  {self.tensor} {_shape(self.shape)} {_DTYPES.get(self.dtype, self.dtype)}"


@dataclasses.dataclass(frozen=True)
class Exchange:
    """An exchanging site's ``index``-th all-to-all (Note [Heads across ranks]): ``tensor``
    (``shape`` on this rank as its shard of the sequence, ``dtype``) turned ``to`` ``"heads"``
    (this rank's shard of the sequence for every head -> its all-to-all group's tokens for its
    heads) or back ``to`` ``"sequence"``; ``bytes`` this rank sends (every other rank of its
    group its piece, each with the message's tag)."""

    index: int
    tensor: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    to: str
    bytes: int
    message: int
    """One message: a piece and its tag."""
    peers: tuple[int, ...]
    """The group ranks of the all-to-all group, this rank among them."""
    times: int = 1

    def __str__(self) -> str:
        among = f"{self.peers[0]}-{self.peers[-1]}"
        return f"exchange  {self.index}  {self.tensor} {_shape(self.shape)} {_DTYPES.get(self.dtype, self.dtype)} to {self.to} among {among}"


Step = Union[Dilate, Start, Wait, Chunk, Block, Merge, Land, Undilate, Cast, Gather, Exchange]


@dataclasses.dataclass(frozen=True)
class Program:
    """The steps of one site call (``graph``: ``"forward"`` or ``"backward"``) on one rank, in
    the order the body runs them (Note [The site program]; a folded one is for counting only,
    ``build``), and the site's head dims ``d`` and ``dv`` for its FLOPs. ``str`` prints one line
    a step."""

    graph: str
    title: str
    steps: tuple[Step, ...]
    d: int
    dv: int

    def blocks(self, branch: int | None = None) -> list[Block]:
        return [s for s in self.steps if isinstance(s, Block) and branch in (None, s.branch)]

    def transfers(self, branch: int | None = None) -> list[Start | Gather | Exchange]:
        """Ring transfers (``Start``), gathers and all-to-alls, in issue order (``branch``: its
        ring's only)."""
        if branch is None:
            return [s for s in self.steps if isinstance(s, (Start, Gather, Exchange))]
        return [s for s in self.steps if isinstance(s, Start) and s.tag.branch == branch]

    def flops(self, branch: int | None = None) -> int:
        """Useful FLOPs of the blocks (of ``branch``), 2 per multiply-add in QK^T and PV (a
        skipped block has none, ``Block.pairs``)."""
        return self._counts(branch)[0]

    def bytes_sent(self, branch: int | None = None) -> int:
        """Bytes this rank sends: its transfers (of ``branch``'s ring) and gathers."""
        return self._counts(branch)[1]

    def largest_message(self, branch: int | None = None) -> int:
        """The largest transfer (of ``branch``'s ring) or gather, in bytes."""
        return self._counts(branch)[2]

    def _counts(self, branch: int | None) -> tuple[int, int, int]:
        counts = self._by_branch
        if branch is not None:
            return counts.get(branch, (0, 0, 0))
        return sum(c[0] for c in counts.values()), sum(c[1] for c in counts.values()), max(
            (c[2] for c in counts.values()), default=0
        )

    @functools.cached_property
    def _by_branch(self) -> dict[int | None, tuple[int, int, int]]:
        """``(FLOPs, bytes sent, largest message)`` per branch (None: the gathers), one pass."""
        counts: dict = {}
        for s in self.steps:
            if isinstance(s, Block):
                key, flops, sent, message = s.branch, 2 * s.batch * s.heads * s.pairs * (self.d + self.dv) * s.times, 0, 0
            elif isinstance(s, (Start, Gather, Exchange)):
                key = s.tag.branch if isinstance(s, Start) else None
                flops, sent, message = 0, s.bytes * s.times, s.message if isinstance(s, Exchange) else s.bytes
            else:
                continue
            f, b, m = counts.get(key, (0, 0, 0))
            counts[key] = (f + flops, b + sent, max(m, message))
        return counts

    def block(self, branch: int, chunk: int, step: int | None, index: int) -> Block:
        """The block ``index`` of ``branch``'s ring ``step`` in head ``chunk``."""
        return self._places[(branch, chunk, step, index)]

    @functools.cached_property
    def _places(self) -> dict:
        return {(b.branch, b.chunk, b.step, b.index): b for b in self.blocks()}

    def __str__(self) -> str:
        return "\n".join([self.title, *(f"  {s}" for s in self.steps)])


def build(plan: SitePlan, graph: str, *, folded: bool = False) -> Program:
    """The ``"forward"`` or ``"backward"`` program of ``plan``: what ``site_forward`` or
    ``site_backward`` does on this rank, step by step; built once per plan.

    ``folded``: each ring's transfers of a kind listed once, and its blocks for the first head
    chunk, each with how many times it runs (``times``): the same counts (FLOPs, bytes, the
    largest message) in about ``1 / (ring size x head chunks)`` of the steps, the branches and
    sums in the body's order. The report counts these, so ``ring_rewrite.plan`` builds every
    rank's at any scale.
    """
    programs = plan.__dict__.setdefault("_programs", {})  # not a field: equal plans stay equal
    if (graph, folded) not in programs:
        programs[(graph, folded)] = _build(plan, graph, folded)
    return programs[(graph, folded)]


def _build(plan: SitePlan, graph: str, folded: bool) -> Program:
    if plan.exchanged:
        steps = _exchanged(plan, graph, folded)
    else:
        steps = _forward(plan, folded) if graph == "forward" else _backward(plan, folded)
    title = f"site {plan.site} {graph}"
    if plan.world > 1:
        title += f", rank {plan.rank} of {plan.world} ({plan.sharding}, {plan.layout})"
    if folded:
        title += ", folded"
    return Program(graph, title, tuple(steps), plan.d, plan.dv)


def chunks(plan: SitePlan, branch: Branch) -> list[tuple[slice, slice]]:
    """Query-head and kv-head slices of each head chunk of a ring branch (dilated layout: query
    head ``j`` reads kv head ``j // (hq / kv_heads)``, so contiguous slices pair up)."""
    g = plan.head_chunks(branch)
    qc, kc = plan.hq // g, branch.layout.kv_heads // g
    return [(slice(c * qc, (c + 1) * qc), slice(c * kc, (c + 1) * kc)) for c in range(g)]


# ---- the forward ----------------------------------------------------------------------------


def _forward(plan: SitePlan, folded: bool) -> list[Step]:
    steps: list[Step] = []
    for i, branch in _rings(plan):
        steps.append(Dilate(i, ("q", "k", "v", *_bias(plan, branch)), branch.layout.gathered))
        times = _hops(plan, branch) if folded else 1
        steps.append(_start(_sent(plan, branch), i, branch, KV, 0, 0, times))
    if plan.local_in_place:
        steps += [_block(plan, i, b, b.steps[0][0], None, 0, 0, plan.hq, in_place=True) for i, b in _locals(plan)]
    for i, branch in enumerate(plan.branches):
        if branch.is_local and plan.local_in_place:
            continue
        if branch.is_local:
            steps.append(Dilate(i, ("q", "k", "v", *_bias(plan, branch)), branch.layout.gathered))
            steps.append(_block(plan, i, branch, branch.steps[0][0], None, 0, 0, plan.hq))
        else:
            steps += _ring_forward(plan, i, branch, folded)
        steps.append(Undilate(i, ("out", "lse")))
    steps.append(Merge())
    if plan.replicated:
        steps.append(_gather(plan, 0, "out", plan.dv))
    return steps


def _ring_forward(plan: SitePlan, i: int, branch: Branch, folded: bool) -> list[Step]:
    """One ring branch's forward, head chunk by head chunk: K/V travel while each step computes
    (folded: the first chunk's blocks, no transfer: ``_forward`` listed it)."""
    steps: list[Step] = []
    last = len(branch.ring) - 1
    sent, chunks = _sent(plan, branch), plan.head_chunks(branch)
    heads = plan.hq // chunks
    for c in range(1 if folded else chunks):
        steps += [] if folded else [_chunk(plan, i, branch, c)]
        for step, blocks in enumerate(branch.steps):
            moves = step < last and not folded
            if moves and (step, c) != (0, 0):  # the first chunk's first one started early
                steps.append(_start(sent, i, branch, KV, step, c))
            if not folded:
                steps += [_block(plan, i, branch, blk, step, c, j, heads) for j, blk in enumerate(blocks)]
            if moves:
                steps.append(Wait(Tag(i, KV, step, c), (i, c, step)))
        steps += _folded_blocks(plan, i, branch, heads, backward=False) if folded else []
        steps.append(Merge(i, chunk=c))
    return steps


# ---- heads across ranks ---------------------------------------------------------------------


def _exchanged(plan: SitePlan, graph: str, folded: bool) -> list[Step]:
    """An exchanging site: its inputs to heads, the inner plan's program (a hybrid's: its
    ring across the groups), its results back to the sequence, one all-to-all a tensor (Note
    [Heads across ranks])."""
    forward = ("q", "k", "v", *(("bias",) if plan.has_mask else ()))  # the key bias: its forward's only
    inputs, results = (forward, ("out",)) if graph == "forward" else (("dout",), ("dq", "dk", "dv"))
    steps = build(plan.inner, graph, folded=folded).steps
    if plan.replicated:  # every rank holds its heads' shard already; the results are gathered
        width = {"out": plan.dv, "dq": plan.d, "dk": plan.d, "dv": plan.dv}
        return [*steps, *(_gather(plan, j + (graph == "backward"), name, width[name]) for j, name in enumerate(results))]
    first = [_exchange(plan, j, name, "heads") for j, name in enumerate(inputs)]
    last = [_exchange(plan, len(inputs) + j, name, "sequence") for j, name in enumerate(results)]
    return [*first, *steps, *last]


def _exchange(plan: SitePlan, index: int, name: str, to: str) -> Exchange:
    """``name`` exchanged ``to`` heads or the sequence: ``(B, H, N / P, D)`` on this rank before
    (to heads) or after (to the sequence), key/value heads in their copies (``kv_copies``), the
    key bias one wide; this rank sends every other rank of its all-to-all group its piece,
    ``1 / a2a`` of it, and the message's tag."""
    heads = plan.hkv * plan.kv_copies if name in ("k", "v", "dk", "dv") else plan.hq
    width = {"q": plan.d, "k": plan.d, "dq": plan.d, "dk": plan.d, "bias": 1}.get(name, plan.dv)
    shape = (plan.batch, heads, plan.n_local, width)
    piece = math.prod(shape) * plan.dtype.itemsize // plan.a2a
    first = plan.rank // plan.a2a * plan.a2a
    peers = tuple(range(first, first + plan.a2a))
    return Exchange(index, name, shape, plan.dtype, to, (plan.a2a - 1) * (piece + 8), piece + 8, peers)


# ---- the backward ---------------------------------------------------------------------------


_ROWS_BACKWARD = ("q", "dout", "out", "k", "v", "lse")


def _backward(plan: SitePlan, folded: bool) -> list[Step]:
    steps: list[Step] = []
    last_hops = []  # each ring's last chunk's dK/dV on their way home
    for i, branch in _rings(plan):
        steps.append(Dilate(i, (*_ROWS_BACKWARD, *_bias(plan, branch)), branch.layout.gathered))
        steps += _ring_backward(plan, i, branch, folded)
        last_hops.append(Tag(i, DKV, len(branch.ring) - 1, plan.head_chunks(branch) - 1))
    steps += _locals_backward(plan)
    for tag in last_hops:
        steps += [Wait(tag, None), Land(tag.branch, tag.chunk), Undilate(tag.branch, ("dk", "dv"))]
    steps.append(Cast(("dq", "dk", "dv")))
    if plan.replicated:
        steps += [_gather(plan, 1, "dq", plan.d), _gather(plan, 2, "dk", plan.d), _gather(plan, 3, "dv", plan.dv)]
    return steps


def _locals_backward(plan: SitePlan) -> list[Step]:
    """The local branches' backward, in place or one head chunk after another (Note [Head
    chunks of local branches]), each chunk's sums with the rings' dq of its
    heads; with several chunks each chunk's sums then go into the site's gradients."""
    local, rings = _locals(plan), _rings(plan)
    if plan.local_in_place:
        steps: list[Step] = [
            _block(plan, i, b, b.steps[0][0], None, 0, 0, plan.hq, in_place=True, backward=True) for i, b in local
        ]
        return steps + [Undilate(i, ("dq",)) for i, _ in rings]
    if not local:
        return [Undilate(i, ("dq",)) for i, _ in rings]
    steps = []
    chunks = plan.local_chunks()
    for c, (qh, _) in enumerate(chunks):
        for i, branch in local:
            steps.append(Dilate(i, (*_ROWS_BACKWARD, *_bias(plan, branch)), branch.layout.gathered, c))
            steps.append(_block(plan, i, branch, branch.steps[0][0], None, c, 0, qh.stop - qh.start, backward=True))
            steps.append(Undilate(i, ("dq", "dk", "dv"), c))
        steps += [Undilate(i, ("dq",), c) for i, _ in rings]
        if len(chunks) > 1:
            steps.append(Merge(None, "dq, dk, dv", c))
    return steps


def _ring_backward(plan: SitePlan, i: int, branch: Branch, folded: bool) -> list[Step]:
    """One ring branch's backward, head chunk by head chunk (Note [Head chunks]):
    K/V go round again; dK/dV follow one step behind, from the first rank
    that holds them, and a chunk's last hop home lands during the next chunk's first step.
    Folded: each kind of transfer once, then the first chunk's blocks."""
    last = len(branch.ring) - 1
    sent, chunks = _sent(plan, branch), plan.head_chunks(branch)
    heads = plan.hq // chunks
    if folded:
        times = _hops(plan, branch)
        steps: list[Step] = [_start(sent, i, branch, kind, s, 0, times) for kind, s in ((KV_BACK, 0), (DKV, 1))]
        return steps + _folded_blocks(plan, i, branch, heads, backward=True) + [Merge(i, "dq")]
    steps = []
    for c in range(chunks):
        steps.append(_chunk(plan, i, branch, c))
        for step, blocks in enumerate(branch.steps):
            if step < last:
                steps.append(_start(sent, i, branch, KV_BACK, step, c))
            for j, blk in enumerate(blocks):
                steps.append(_block(plan, i, branch, blk, step, c, j, heads, backward=True))
            if step == 0 and c > 0:
                steps += [Wait(Tag(i, DKV, last, c - 1), (i, c, 0)), Land(i, c - 1)]
            if step > 1:
                steps.append(Wait(Tag(i, DKV, step - 1, c), (i, c, step)))
            steps.append(Merge(i, "dk, dv", c, step))
            if step > 0:
                steps.append(_start(sent, i, branch, DKV, step, c))
            if step < last:
                steps.append(Wait(Tag(i, KV_BACK, step, c), (i, c, step)))
    return steps + [Merge(i, "dq")]


# ---- the pieces -----------------------------------------------------------------------------


def _rings(plan: SitePlan) -> list[tuple[int, Branch]]:
    return [(i, b) for i, b in enumerate(plan.branches) if not b.is_local]


def _locals(plan: SitePlan) -> list[tuple[int, Branch]]:
    return [(i, b) for i, b in enumerate(plan.branches) if b.is_local]


def _bias(plan: SitePlan, branch: Branch) -> tuple[str, ...]:
    return ("bias",) if plan.needs_bias(branch) else ()


def _folded_blocks(plan: SitePlan, i: int, branch: Branch, heads: int, backward: bool) -> list[Block]:
    """A ring branch's blocks, each once with how many times it runs over the steps and head
    chunks: without a band or documents a block is what its parts are, so equal parts fold into
    one; with them, one a step (the band makes each step's its own)."""
    chunks = plan.head_chunks(branch)
    places = [(step, j, blk) for step, blocks in enumerate(branch.steps) for j, blk in enumerate(blocks)]
    if plan.band is not None or plan.documents:
        return [_block(plan, i, branch, blk, step, 0, j, heads, backward=backward, times=chunks) for step, j, blk in places]
    folded: dict[tuple, list] = {}  # the block's parts -> [step, index, block, times]
    for step, j, blk in places:
        place = folded.setdefault((blk.q0, blk.q1, blk.k0, blk.k1, blk.causal), [step, j, blk, 0])
        place[3] += chunks
    return [_block(plan, i, branch, blk, step, 0, j, heads, backward=backward, times=n) for step, j, blk, n in folded.values()]


def _chunk(plan: SitePlan, i: int, branch: Branch, c: int) -> Chunk:
    qh, kh = chunks(plan, branch)[c]
    return Chunk(i, c, (qh.start, qh.stop), (kh.start, kh.stop))


def _hops(plan: SitePlan, branch: Branch) -> int:
    """Transfers of one kind a ring branch makes per call: one a step but the last, per head chunk."""
    return (len(branch.ring) - 1) * plan.head_chunks(branch)


def _sent(plan: SitePlan, branch: Branch) -> dict[bool, tuple]:
    """What one head chunk of a ring branch sends, ``(names, shapes, dtypes, bytes)``: K/V in the
    input dtype (and their keys' bias, in the compute dtype), or (``True``) dK/dV in
    ``stat_dtype``."""
    layout = branch.layout
    g = plan.head_chunks(branch)
    rows = (layout.batch, layout.kv_heads // g, layout.nseg * layout.m)
    kv = [("k", (*rows, plan.d), plan.dtype), ("v", (*rows, plan.dv), plan.dtype)]
    if plan.needs_bias(branch):
        kv.append(("bias", (layout.batch, plan.hq // g, 1, rows[2]), plan.compute_dtype))
    dkv = [("dk", (*rows, plan.d), plan.stat_dtype), ("dv", (*rows, plan.dv), plan.stat_dtype)]
    sent = {}
    for key, tensors in ((False, kv), (True, dkv)):
        names, shapes, dtypes = zip(*tensors)
        sent[key] = (names, shapes, dtypes, sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes)))
    return sent


def _start(sent: dict, i: int, branch: Branch, kind: int, step: int, c: int, times: int = 1) -> Start:
    """Head chunk ``c``'s transfer of ``kind`` at ``step`` (``sent``: ``_sent``'s)."""
    names, shapes, dtypes, size = sent[kind == DKV]
    return Start(Tag(i, kind, step, c), names, shapes, dtypes, size, branch.send_to, branch.recv_from, times)


def _gather(plan: SitePlan, index: int, name: str, width: int) -> Gather:
    sizes = plan.inner if plan.exchanged else plan  # an exchanging site gathers its heads' shards
    heads = sizes.hq if name in ("out", "dq") else sizes.hkv
    shape = (plan.batch, heads, sizes.n_local, width)
    item = plan.dtype.itemsize
    sent = math.prod(shape) * item + 8  # the shard and the message's tag
    if index == 0 and plan.batch:  # the probe of query values (``attention._probe``)
        sent += plan.hq * len(range(0, plan.n, max(1, plan.n // 16))) * item
    return Gather(index, name, shape, plan.dtype, (plan.world - 1) * sent)


def _starts(plan: SitePlan, branch: Branch, step: int | None) -> tuple[int, ...]:
    """Position of the first row of each part a block of ``branch`` reads: this rank's parts
    (``step`` None) or those of the K/V held at ``step``. Global for a ring; for a local branch
    within the segment (only differences of positions matter, Note [Bands])."""
    if branch.is_local:
        return (0,)
    rank = plan.rank if step is None else branch.ring[(branch.position - step) % len(branch.ring)]
    return layout_of(plan.layout).starts(plan.n, plan.world, rank)


def _block(
    plan: SitePlan, i: int, branch: Branch, blk: Parts, step: int | None, c: int, j: int, heads: int, *,
    in_place: bool = False, backward: bool = False, times: int = 1,
) -> Block:  # fmt: skip
    """The block ``blk`` of ``branch`` at ring ``step`` (None: local) in head chunk ``c`` of
    ``heads`` query heads, and
    what a band or documents make of it (Note [Bands]): ``full`` when no pair
    is masked, ``skip`` when every pair is (only where the band holds the diagonal: then every
    part keeps the block of its own diagonal and has rows to merge), else ``partial``."""
    layout = branch.layout
    m, r = layout.m, layout.r
    batch = layout.batch * layout.nseg if branch.is_local else layout.batch
    block = Block(
        i, step, c, j, blk.q0, blk.q1, blk.k0, blk.k1, batch, heads, (blk.q1 - blk.q0) * m,
        (blk.k1 - blk.k0) * m, blk.causal, in_place=in_place, backward=backward, times=times,
    )  # fmt: skip
    if plan.band is None and not plan.documents:
        return block
    lo, hi = plan.band or (None, None)
    qs = _starts(plan, branch, None)[blk.q0 : blk.q1]
    ks = _starts(plan, branch, 0 if step is None else step)[blk.k0 : blk.k1]
    d_min = min(ks) - max(qs) - (m - 1) * r
    d_max = max(ks) + (m - 1) * r - min(qs)
    if (lo is None or d_min >= lo) and (hi is None or d_max <= hi) and not plan.documents:
        return block
    skip = (lo is not None and d_max < lo) or (hi is not None and d_min > hi)
    kind = "skip" if skip and (lo is None or lo <= 0) and (hi is None or hi >= 0) else "partial"
    return dataclasses.replace(
        block, kind=kind, band=(lo, hi), documents=plan.documents, q_starts=qs, k_starts=ks, stride=r
    )
