"""What a site holds at once on one rank: its programs walked step by step.

Note [Memory of a site]
~~~~~~~~~~~~~~~~~~~~~~~
``site_memory`` walks a site's forward and backward programs (Note [The site program]), folded,
in the order inductor (the default compiler) runs them. Each kind of step creates buffers, frees
them, or needs scratch while it runs (``_Forward`` and ``_Backward`` below, a method per step
type); the peak is the most held at any step, beyond the site's inputs. Reordering the steps in
``program.py`` moves the buffers with them. What the generated code does, and the walk counts:

* The forward's merge is pointwise, so inductor computes it in one kernel at the end: every
  branch's dilated out and lse wait for it, and within a ring every block's out waits for the
  head chunk's last step (``Merge`` of the chunk). Ring branches run first and in order (their
  token chains their transfers); local branches need no token and run after them, in the order
  that holds least (inductor's ``reorder_for_peak_memory``): the largest working set first
  (``_inductor_order``). Local branches run in place (Note [Local branches in place]) merge
  into a running out and lse as they attend: site-sized from the first on.
* A ring head chunk's working set (``_ring_chunk``): K/V held and the next arriving (the keys'
  bias too), its blocks' outs, or backward the dq sum and its next copy (``ops.add_rows``, Note
  [Gradient sums of a ring step]) and the dK/dV share kept home, the accumulator that arrived
  and the next; the largest block's kernel gradients and scratch. The earlier head chunks'
  results are held beside it. A ring branch's dilated copies live from its ``Dilate`` to its
  last merge.
* Backward, the rings' gradients wait for the local branches: their dq joins the local
  branches' sums (where it comes in head chunks, inductor concatenates the chunks as the local
  branches start, beside them: ``_rings_dq_cat``), their dK/dV land after them (``Land``: the
  last head chunk's share kept home, the accumulator sent and the one arriving). A branch's
  gradients are added to the site's sums (``stat_dtype``) in place (``ops.undilate_add``, Note
  [Gradient sums as calls]) and freed; a sum that does not exist yet is created by its first
  branch, or is that branch's gradient itself (a rate-1 branch without padding, already in
  ``stat_dtype``). Where the sums are wider than the inputs, ``Cast`` casts them one at a time.
  Local branches in place hold nothing but the site's dq, dk, dv, which their blocks write and
  add to. Local branches in ``C`` head chunks (Note [Head chunks of local branches]) hold the
  site's dq, dk, dv from the first chunk on (dk, dv in ``stat_dtype`` while the rings' dK/dV are
  to land), and one chunk holds ``1 / C`` of a branch running and, where the sums are wider
  than the inputs, its own sums, cast into the site's once done (the chunk's ``Merge``).
* aten's kernels return a block's dq, dk, dv in their own layout, and ``kernels.py`` copies
  them contiguous one at a time: the block's gradients plus the largest of them (not for
  float32 CPU blocks without a bias: ``cpu_kernel.py`` writes them contiguous). With dropout,
  query rows go ``DROPOUT_CHUNK`` scores at a time, and two chunks' scores, probabilities and
  masks overlap (``kernels.py``); with a band, documents or a recentred key bias, two chunks'
  masks and one chunk's position differences (``BAND_CHUNK`` pairs) come on top, and the row
  chunks' results beside their concatenation (``ops.py``): ``_block_extra``.
* Replicated mode's gathers: forward, every rank's out received, then stacked; backward, the
  whole out (which the caller holds through the backward) and the whole gradients, and the
  received and stacked shards of the largest.
* An all-to-all site (Note [Heads across ranks]) walks its inner plan's steps with that plan's
  sizes, beside what its exchanges hold: each exchange needs three of the tensor's size beside
  it (``_Walk.on_Exchange``), then holds the result; the exchanged q, k, v are saved for the
  backward, and each gradient exchanged back frees its heads' layout.
  ``benchmarks/comm_options.py`` prints the estimate beside the allocator's peak.

Not counted: the block kernel's per-thread tiles (ours: about 0.5 MiB a thread at 64 dims,
backward, and 8 bytes for each query row of a kv head's group; about 1 MiB for aten's), what
the allocator keeps after frees (small tensors in glibc's heap), and the CUDA kernel's own
workspace (the CPU kernel's scratch stands in for it, Note [The CUDA kernels]).
``benchmarks/ring_memory.py`` and ``benchmarks/scale.py`` print the estimate beside the
measured peaks.
"""

from __future__ import annotations

import math

import torch

from .kernels import DROPOUT_CHUNK
from .ops import BAND_CHUNK
from .program import Block, Cast, Dilate, Exchange, Gather, Land, Merge, Program, Step, Undilate, build
from .site_plan import SitePlan

__all__ = ["site_memory", "copies_gradients"]


def site_memory(plan: SitePlan) -> dict[str, int]:
    """Estimated activation memory of the site on this rank, in bytes (Note [Memory of a site]).

    ``saved``: what forward keeps for backward (merged out in the blocks' dtype, lse in
    ``stat_dtype``; q, k, v are the inputs'). ``peak``: the most the site holds at once beyond
    its inputs, forward or backward.
    """
    sizes = plan.inner if plan.exchanged else plan  # an exchanging site's blocks are its inner plan's
    out, lse = _site_out(sizes)
    # An exchanging site saves its q, k, v for its heads (Note [Heads across ranks]).
    steps = build(plan, "forward", folded=True).steps
    heads = sum(_size(s) for s in steps if isinstance(s, Exchange) and s.to == "heads")
    if plan.exchanged and plan.replicated:  # taken from the whole inputs, not exchanged
        heads = sizes.batch * sizes.n_local * (sizes.hq * sizes.d + sizes.hkv * (sizes.d + sizes.dv))
        heads *= sizes.dtype.itemsize
    forward = _Forward(sizes, plan.world).walk(_inductor_order(sizes, build(plan, "forward", folded=True)))
    backward = _Backward(sizes, heads, plan.world).walk(build(plan, "backward", folded=True).steps)
    return {"saved": out + lse + heads, "peak": max(forward, backward)}


def _size(step: Exchange) -> int:
    return math.prod(step.shape) * step.dtype.itemsize


def copies_gradients(plan: SitePlan, branch) -> bool:
    """Whether a block of ``branch`` runs a kernel whose gradients are copied contiguous: all
    but ``cpu_kernel``'s float32 blocks without a bias (and the dropout path's own)."""
    biased = plan.needs_bias(branch) or plan.band is not None or plan.documents
    ours = plan.device == "cpu" and plan.compute_dtype == torch.float32 and not biased
    return plan.dropout or not ours


# ---- the walk -------------------------------------------------------------------------------


class _Walk:
    """Buffers held by name, and the most held at once: a method per step type (``on_`` and
    the step's class name) creates, frees or needs scratch."""

    def __init__(self, plan: SitePlan, world: int):
        self.plan = plan
        self.world = world
        """The ranks a gather receives from: the site's (``plan`` may be an inner plan)."""
        self.held: dict[str, int] = {}
        self.peak = 0
        self.started: set[int] = set()  # ring branches whose blocks ran

    def hold(self, name: str, size: int) -> None:
        self.held[name] = self.held.get(name, 0) + size
        self.peak = max(self.peak, sum(self.held.values()))

    def scratch(self, size: int) -> None:
        """``size`` more bytes while the step runs, none after."""
        self.peak = max(self.peak, sum(self.held.values()) + size)

    def free(self, *names: str) -> None:
        for name in names:
            self.held.pop(name, None)

    def walk(self, steps) -> int:
        for step in steps:
            getattr(self, f"on_{type(step).__name__}", _nothing)(step)
        return self.peak

    def branch(self, i: int):
        return self.plan.branches[i]

    def on_Exchange(self, step: Exchange) -> None:
        """An all-to-all (Note [Heads across ranks]): while it runs, three of the tensor's size
        beside it (its pieces made contiguous, the messages sent with their tags and those
        received, the result before its layout is restored), then the exchanged tensor."""
        size = _size(step)
        self.scratch(3 * size)
        self.hold(f"exchanged {step.tensor}", size)

    def ring_blocks(self, step: Block, backward: bool, results: int) -> None:
        """A ring branch's blocks (folded: its first head chunk's, each once): the working set of
        its busiest head chunk beside the earlier chunks' ``results``."""
        if step.branch in self.started:
            return
        self.started.add(step.branch)
        branch, chunks = self.branch(step.branch), self.plan.head_chunks(self.branch(step.branch))
        self.scratch(results * (chunks - 1) // chunks + _ring_chunk(self.plan, branch, backward) // chunks)


def _nothing(step: Step) -> None:
    """Steps that hold nothing of their own: a transfer's start and wait (their buffers are the
    ring's working set, ``_ring_chunk``) and a head chunk's views."""


class _Forward(_Walk):
    def on_Dilate(self, step: Dilate) -> None:
        self.hold(f"copies {step.branch}", _copies(self.plan, self.branch(step.branch), False))

    def on_Block(self, step: Block) -> None:
        plan, branch = self.plan, self.branch(step.branch)
        if step.in_place:  # the running out and lse, the site's from the first on
            if "out" not in self.held:
                self.hold("out", sum(_site_out(plan)))
        elif branch.is_local:
            m = branch.layout.m
            self.hold(f"out {step.branch}", _branch_outs(plan, branch))
            self.scratch(_block_extra(plan, branch, _dilated_rows(plan, branch), (m, m), False))
        else:
            self.ring_blocks(step, False, _branch_outs(plan, branch))

    def on_Merge(self, step: Merge) -> None:
        plan = self.plan
        if step.branch is not None:  # a ring's head chunks (folded: all of them)
            self.hold(f"out {step.branch}", _branch_outs(plan, self.branch(step.branch)))
            return
        outs = [name for name in self.held if name.startswith("out ")]
        if _in_place(plan):
            return  # the lone branch's out is the site's
        if plan.local_in_place and not outs:
            return  # the running out is the site's
        self.hold("merged", sum(_site_out(plan)))
        self.free("out", *outs)

    def on_Undilate(self, step: Undilate) -> None:
        self.free(f"copies {step.branch}")

    def on_Gather(self, step: Gather) -> None:
        """Every rank's out received, then stacked."""
        self.scratch(2 * self.world * _site_out(self.plan)[0])


def _inductor_order(plan: SitePlan, program: Program) -> list[Step]:
    """The forward's steps as inductor runs them: the local branches (not in place) after the
    rings, before the site's merge, the largest working set first."""
    local = {i for i, b in enumerate(plan.branches) if b.is_local and not plan.local_in_place}
    groups: dict[int, list[Step]] = {}
    steps: list[Step] = []
    for step in program.steps:
        i = getattr(step, "branch", None)
        if i in local:
            groups.setdefault(i, []).append(step)
        elif isinstance(step, Merge) and step.branch is None:
            work = {i: (_local_work(plan, plan.branches[i], False), _branch_outs(plan, plan.branches[i])) for i in groups}
            for i in sorted(groups, key=work.__getitem__, reverse=True):
                steps += groups[i]
            steps.append(step)
        else:
            steps.append(step)
    return steps


class _Backward(_Walk):
    def __init__(self, plan: SitePlan, saved: int, world: int):
        super().__init__(plan, world)
        item, _, stat = _itemsizes(plan)
        rows, kv_rows = plan.batch * plan.hq * plan.n_local, plan.batch * plan.hkv * plan.n_local
        self.grads = [rows * plan.d * item, kv_rows * plan.d * item, kv_rows * plan.dv * item]
        self.sums = [g * stat // item for g in self.grads]
        self.wide = stat != item
        local = [b for b in plan.branches if b.is_local]
        self.chunks = len(plan.local_chunks()) if local else 1
        self.rings = [i for i, b in enumerate(plan.branches) if not b.is_local]
        self.locals_begun = False
        self.hold("saved", sum(_site_out(plan)) + saved)

    def begin_locals(self) -> None:
        """The first step after the rings' blocks: their dq concatenated, and the site's
        gradients where local branches write into them from their first block on."""
        if self.locals_begun:
            return
        self.locals_begun = True
        plan = self.plan
        self.hold("rings' dq", _rings_dq_cat(plan))
        if plan.local_in_place:
            self.hold("site grads", sum(self.grads))
        elif self.chunks > 1:
            item, _, stat = _itemsizes(plan)
            dkv = self.grads[1] + self.grads[2]
            self.hold("site grads", self.grads[0] + (dkv * stat // item if self.rings else dkv))

    def add(self, parts: tuple[int, ...], view: bool) -> None:
        """Gradients added into the site's sums of ``parts``: a sum that does not exist yet is
        created beside them, or (``view``) is the gradient itself."""
        if self.plan.local_in_place or self.chunks > 1:
            return  # the site's gradients exist already
        self.scratch(0)  # the gradients beside the sums so far
        for j in parts:
            if f"sum {j}" not in self.held and not view:
                self.hold(f"sum {j}", self.sums[j])
        for j in parts:
            self.held.setdefault(f"sum {j}", self.sums[j])

    def on_Dilate(self, step: Dilate) -> None:
        branch = self.branch(step.branch)
        if branch.is_local:
            self.begin_locals()
            if self.chunks > 1:
                return  # counted in the chunk's share of the branch (``on_Block``)
        self.hold(f"copies {step.branch}", _copies(self.plan, branch, True))

    def on_Block(self, step: Block) -> None:
        plan, branch = self.plan, self.branch(step.branch)
        if not branch.is_local:
            self.ring_blocks(step, True, _branch_grads(plan, branch))
            return
        self.begin_locals()
        if step.in_place:
            return  # writes into the site's gradients
        m = branch.layout.m
        extra = _block_extra(plan, branch, _dilated_rows(plan, branch), (m, m), True)
        if self.chunks > 1:  # a chunk's sums where they are wider, and its share of the branch
            chunk = sum(self.sums) if self.wide else 0
            self.scratch((chunk + _branch_grads(plan, branch) + _copies(plan, branch, True) + extra) // self.chunks)
            return
        self.hold(f"grads {step.branch}", _branch_grads(plan, branch))
        self.scratch(extra)
        self.free(f"copies {step.branch}")

    def on_Merge(self, step: Merge) -> None:
        if step.branch is not None:  # a ring's dq: its blocks are done
            self.free(f"copies {step.branch}")
            self.hold(f"grads {step.branch}", _branch_grads(self.plan, self.branch(step.branch)))
        elif self.wide:  # a local head chunk's sums cast into the site's, one at a time
            self.scratch((sum(self.sums) + max(self.grads)) // self.chunks)

    def on_Undilate(self, step: Undilate) -> None:
        self.begin_locals()
        branch = self.branch(step.branch)
        if branch.is_local:
            self.add((0, 1, 2), _sums_are_views(self.plan, branch))
            self.free(f"grads {step.branch}")
        elif step.tensors == ("dq",):
            self.add((0,), _sums_are_views(self.plan, branch))
        else:  # its dK/dV home: the ring's gradients are in the sums
            self.add((1, 2), _sums_are_views(self.plan, branch))
            self.free(f"grads {step.branch}")
            if not any(name.startswith("grads ") for name in self.held):
                self.free("rings' dq")

    def on_Exchange(self, step: Exchange) -> None:
        """``dout`` to heads as any exchange; the gradients back to the sequence one at a time,
        each freeing its heads' layout (the inner call's gradients, all that it holds then)."""
        if step.to == "heads":
            super().on_Exchange(step)
            return
        if "inner grads" not in self.held:
            self.free(*[name for name in self.held if name != "saved"])
            self.hold("inner grads", sum(self.grads))
        super().on_Exchange(step)
        self.held["inner grads"] -= self.grads[("dq", "dk", "dv").index(step.tensor)]

    def on_Land(self, step: Land) -> None:
        """Counted with the ring's gradients (``_branch_grads``) until they are added."""

    def on_Cast(self, step: Cast) -> None:
        if not self.wide or self.plan.local_in_place:
            return
        if self.chunks > 1:
            if self.rings:  # dk, dv were kept in stat_dtype for the rings
                self.scratch(self.grads[1] + self.grads[2])
            return
        for j in range(3):  # one at a time: the gradient beside the sums still to cast
            self.hold(f"grad {j}", self.grads[j])
            self.free(f"sum {j}")

    def on_Gather(self, step: Gather) -> None:
        """The whole out (the caller's) and the whole gradients, and the received and stacked
        shards of the largest gradient."""
        if step.index != 1:
            return
        plan = self.plan
        out = _site_out(plan)[0]
        for name in [n for n in self.held if n != "saved"]:
            self.free(name)
        self.hold("whole", self.world * (out + sum(self.grads)))
        self.scratch(2 * self.world * max(self.grads))


# ---- sizes ----------------------------------------------------------------------------------


def _itemsizes(plan: SitePlan) -> tuple[int, int, int]:
    """Bytes per element of the inputs, of what blocks compute in, and of the statistics."""
    return plan.dtype.itemsize, plan.compute_dtype.itemsize, plan.stat_dtype.itemsize


def _site_out(plan: SitePlan) -> tuple[int, int]:
    """Bytes of the site's merged out (as the blocks computed it: what the backward reads) and
    lse on this rank."""
    rows = plan.batch * plan.hq * plan.n_local
    return rows * plan.dv * plan.compute_dtype.itemsize, rows * plan.stat_dtype.itemsize


def _dilated_rows(plan: SitePlan, branch) -> tuple[int, int]:
    """Query rows and key rows of a branch on this rank, over every head (its dilated kv heads
    for the keys) and the batch."""
    layout = branch.layout
    per_head = plan.batch * layout.padded // layout.r
    return per_head * plan.hq, per_head * layout.kv_heads


def _in_place(plan: SitePlan) -> bool:
    """Whether the site's out and gradients are its lone branch's own, with nothing to merge or
    sum: rate 1, one segment, no cast, and a ring's head chunks concatenated into one buffer each."""
    if len(plan.branches) > 1:
        return False
    (branch,) = plan.branches
    item, compute, stat = _itemsizes(plan)
    return (
        branch.layout.r == 1 and branch.layout.nseg == 1 and not plan.pad and item == compute == stat
        and (branch.is_local or plan.head_chunks(branch) > 1)
    )  # fmt: skip


def _branch_outs(plan: SitePlan, branch) -> int:
    """What a branch's forward leaves for the merge: its dilated out and lse."""
    _, compute, stat = _itemsizes(plan)
    return _dilated_rows(plan, branch)[0] * (plan.dv * compute + stat)


def _branch_grads(plan: SitePlan, branch) -> int:
    """What a branch's backward leaves for the sum: its dilated dq, dk, dv; a ring's dK/dV are
    home but for its last head chunk's, whose last hop is in flight until the local branches
    are done (``Land``): that chunk's share kept home, the accumulator sent and the one
    arriving (``ring_shift_start`` allocates it)."""
    _, compute, stat = _itemsizes(plan)
    q_rows, kv_rows = _dilated_rows(plan, branch)
    dkv = kv_rows * (plan.d + plan.dv)
    if branch.is_local:
        return (q_rows * plan.d + dkv) * compute
    return (q_rows * plan.d + dkv + 2 * dkv // plan.head_chunks(branch)) * stat


def _rings_dq_cat(plan: SitePlan) -> int:
    """The rings' dq where it comes in head chunks: their concatenation, which inductor
    computes as the local branches start, beside the chunks (``_cat_heads``)."""
    _, _, stat = _itemsizes(plan)
    rings = [b for b in plan.branches if not b.is_local and plan.head_chunks(b) > 1]
    return sum(_dilated_rows(plan, b)[0] * plan.d * stat for b in rings)


def _block_extra(
    plan: SitePlan, branch, rows: tuple[int, int], lengths: tuple[int, int], backward: bool
) -> int:
    """Scratch of one block call of ``branch`` beyond its results: ``rows`` query and key rows
    over every head and batch, ``lengths`` per head and batch."""
    _, compute, stat = _itemsizes(plan)
    d, dv = plan.d, plan.dv
    (q_rows, kv_rows), (length, keys) = rows, lengths
    # aten's kernels return the gradients in a layout of their own: one beside its contiguous
    # copy. Ours writes them contiguous (Note [The CPU block kernel]).
    copied = backward and copies_gradients(plan, branch)
    extra = max(q_rows * d, kv_rows * d, kv_rows * dv) * compute if copied else 0
    scores = q_rows // length * keys  # of one query row, over every head and batch
    if plan.band is not None or plan.documents or plan.recentred:
        chunk = min(length, max(1, BAND_CHUNK // scores))
        pairs = chunk * (scores if plan.documents or plan.needs_bias(branch) else keys)
        several = chunk < length
        # A chunk's mask (zeros, then masked), its position differences (int64) and two bool
        # masks; with several chunks the previous chunk's mask is still held, and the chunks'
        # results wait for their concatenation (forward, once the masks are gone) or, backward,
        # a chunk's dk, dv sit beside the running sums.
        masks = pairs * ((3 if several else 2) * compute + 8 + 2)
        if not several:
            extra += masks
        elif backward:
            extra += masks + q_rows * d * compute + kv_rows * (d + dv) * stat
        else:
            extra += max(masks, q_rows * dv * compute)
    if plan.dropout:
        chunk = min(length, max(1, DROPOUT_CHUNK // scores))
        several = chunk < length  # then two chunks' scores, probabilities and masks overlap
        tensors = (7 if several else 6) if backward else (6 if several else 4)
        extra += tensors * chunk * scores * stat
    return extra


def _ring_chunk(plan: SitePlan, branch, backward: bool) -> int:
    """What a ring branch needs at its busiest step beyond its results, over all heads (one head
    chunk needs ``1 / head_chunks`` of it): K/V held and arriving; the blocks' out and lse until
    the last step merges them, or the dq sum and its next copy; the largest block's kernel
    gradients and scratch; backward, the dK/dV share kept home, the accumulator that arrived and
    the next."""
    item, compute, stat = _itemsizes(plan)
    d, dv = plan.d, plan.dv
    layout = branch.layout
    q_rows, kv_rows = _dilated_rows(plan, branch)
    kv = kv_rows * (d + dv)
    message = kv * item + (q_rows * compute if plan.needs_bias(branch) else 0)  # the keys' bias too
    # Received K/V held and the next arriving (at step 0 the own K/V are the inputs or the
    # dilated copies); a ring of two receives once.
    total = (2 if len(branch.ring) > 2 else 1) * message
    if backward:
        total += 3 * kv * stat
    # Every block of every step, each as many times as it runs in one head chunk (the blocks
    # that a band skips too: their out would be the same size).
    chunks = plan.head_chunks(branch)
    blocks = build(plan, "forward", folded=True).blocks(plan.branches.index(branch))
    part = plan.batch * plan.hq * layout.m  # query rows of one part
    if backward:
        total += 2 * q_rows * d * stat  # the dq sum so far and its next copy (``ops.add_rows``)
    else:
        total += sum((blk.q1 - blk.q0) * (blk.times // chunks) for blk in blocks) * part * (dv * compute + stat)
    blk = max(blocks, key=lambda b: (b.q1 - b.q0, b.k1 - b.k0))
    lengths = ((blk.q1 - blk.q0) * layout.m, (blk.k1 - blk.k0) * layout.m)
    bq, bk = (blk.q1 - blk.q0) * part, (blk.k1 - blk.k0) * plan.batch * layout.kv_heads * layout.m
    if compute != item:  # a block's K/V rows upcast
        total += bk * (d + dv) * compute
    if backward:
        total += (bq * d + bk * (d + dv)) * compute  # the kernel's gradients, in its layout
    return total + _block_extra(plan, branch, (bq, bk), lengths, backward)


def _copies(plan: SitePlan, branch, backward: bool) -> int:
    """A branch's dilated copies, held while it runs: q (and backward dout, out) in the compute
    dtype, K/V (a ring's in the input dtype: they travel), backward lse; the keys' bias. None at
    rate 1 without padding: the rows are views of the inputs (Note [Rows of a ring branch]), nor
    for a local branch run in place."""
    if branch.is_local and plan.local_in_place:
        return 0  # its rows read where they lie (Note [Local branches in place])
    item, compute, stat = _itemsizes(plan)
    d, dv = plan.d, plan.dv
    q_rows, kv_rows = _dilated_rows(plan, branch)
    copies = q_rows * compute if plan.needs_bias(branch) else 0
    if branch.layout.gathered:
        copies += q_rows * ((d + 2 * dv) * compute + stat if backward else d * compute)
        copies += kv_rows * (d + dv) * (compute if branch.is_local else item)
    return copies


def _local_work(plan: SitePlan, branch, backward: bool) -> int:
    """What a local branch needs while it runs beyond its results: its dilated copies and its
    block call's scratch."""
    m = branch.layout.m
    scratch = _block_extra(plan, branch, _dilated_rows(plan, branch), (m, m), backward)
    return _copies(plan, branch, backward) + scratch


def _sums_are_views(plan: SitePlan, branch) -> bool:
    """Whether ``branch``'s gradients become the site's sums as they are, where it is the first
    to reach them (``_undilate_add`` in ``attention.py``: rate 1, no padding, one segment or a
    ring's rows, already in ``stat_dtype``)."""
    layout = branch.layout
    dtype = plan.stat_dtype if not branch.is_local else plan.compute_dtype
    one_piece = not branch.is_local or layout.nseg == 1
    return layout.r == 1 and layout.padded == layout.n and one_piece and dtype == plan.stat_dtype
