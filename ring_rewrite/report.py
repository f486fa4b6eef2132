"""What the rewrite did, site by site: ``explain()`` and the table it prints, and what a site
costs per rank: FLOPs, bytes sent, memory.

Note [Memory of a site]
~~~~~~~~~~~~~~~~~~~~~~~
What a site holds at once on one rank, as inductor (the default compiler) schedules its forward
and backward bodies. Three facts of the generated code set it:

* The forward's merge is pointwise, so inductor computes it in one kernel at the end, and every
  branch's dilated out and lse wait for it; within a ring the same holds for a head chunk: the
  out of every block of every step waits for its last step. Local branches run in place merge
  into a running out and lse as they attend (Note [Local branches in place]):
  site-sized from the first on, the one partial that the rings' join. The backward's gradients are added
  to the site's sums in place, branch by branch (``ops.undilate_add``, Note [Gradient sums as
  calls]): a branch's dilated dq, dk, dv are gone once added. The sums, in
  ``stat_dtype``, exist from the first branch that adds to them on (a lone rate-1 branch's
  gradients are the sums themselves). A ring's dq and dK/dV are summed block by block
  (``ops.add_rows``: Note [Gradient sums of a ring step] there) and wait, dilated, for the local
  branches: its dq joins their sums, its dK/dV are added once home. The last head chunk's
  dK/dV are on their last hop while the local branches run (and while later rings do): its
  share kept home, the accumulator sent and the one arriving, three copies. Where the ring's
  dq comes in head chunks, inductor concatenates them as the local branches start, beside the
  chunks. Where the local branches'
  backward runs in ``C`` head chunks (Note [Head chunks of local branches] there), the site's
  dq, dk, dv exist from the first chunk on, and each chunk sums into its heads of them in place
  (the rings' dq of those heads too), or, where the sums are wider than the inputs, into
  buffers of its own heads, cast into the site's once done. Where the local branches run in
  place (float32 on CPU, Note [Local branches in place] there), they hold nothing but the
  site's dq, dk, dv, which their blocks write and add to (and forward, no dilated copies).
* Ring branches run first and in order (the token chains their transfers). Local branches need
  no token and come after them (the order is read from the site's program, ``_order``, and a
  ring's blocks from its steps: Note [The site program]); forward, in an order inductor picks for a low peak
  (``memory.py``'s ``reorder_for_peak_memory``), counted here as the order that holds least: the
  largest working set first. A branch runs holding the results of those before it. Backward,
  the sums order them as the plan does.
* aten's kernels return a block's dq, dk, dv in their own layout, and ``kernels.py`` copies
  them contiguous one at a time: the block's gradients plus the largest of them (not for
  float32 CPU blocks without a bias: ``cpu_kernel.py`` writes them contiguous). With
  dropout, query rows go ``DROPOUT_CHUNK`` scores at a time, and two chunks' scores,
  probabilities and masks overlap (``kernels.py``); with a band, documents or a recentred key
  bias, two chunks' masks and one chunk's position differences (``BAND_CHUNK`` pairs) come on
  top, and the row chunks' results beside their concatenation (``ops.py``).

So the backward peak is ``saved`` plus the largest of

* a ring branch running: the earlier rings' gradients, its head chunks done,
  its dilated copies (q, dout, out, lse, K/V at r > 1, gathered once: Note [Rows of a ring
  branch]) and one chunk's buffers: K/V held and arriving, the dK/dV share
  kept home, the accumulator that arrived and the next, the dq sum and its next copy, the
  largest block's kernel gradients and scratch;
* a local branch running: the rings' gradients, the sums so far, its dilated copies (the same,
  K/V in the compute dtype), its kernel's gradients and scratch;
* a branch's gradients being added: the sums (the new ones too) beside them;
* with the local branches in place (Note [Local branches in place] there), in place of the
  local branches: the rings' gradients and the site's dq, dk, dv;
* with local head chunks, in place of the local branches: the rings' gradients, the site's
  dq, dk, dv (dk, dv in ``stat_dtype`` where rings add to them last), a chunk's own sums where
  they are wider than the inputs, and ``1 / C`` of one local branch running;
* the casts at the end, where the sums are wider than the inputs: the sums and the gradients
  cast so far;
* in replicated mode, the gathers: the whole output (which the caller holds through the
  backward), the whole gradients, and the received and stacked shards of the one being gathered.

The forward peak is the same with outs for gradients. Not counted: the block kernel's per-thread
tiles (ours: about 0.5 MiB a thread at 64 dims, backward, and 8 bytes for each query row of a
kv head's group; about 1 MiB for aten's), what the allocator keeps after frees (small tensors in glibc's heap), and the CUDA
kernel's own workspace (the CPU kernel's scratch stands in for it, Note [The CUDA kernels]).
``benchmarks/ring_memory.py`` and ``benchmarks/scale.py`` print the estimate beside the
measured peaks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from tabulate import tabulate

from . import cpu_choice, cpu_kernel
from .site_plan import SitePlan
from .backend import RingDilatedBackend
from .config import RingDilatedConfig
from .kernels import DROPOUT_CHUNK
from .ops import BAND_CHUNK
from .program import Block, build

__all__ = [
    "Report", "explain", "attention_flops", "attention_memory_bytes", "branch_bytes_sent", "branch_flops",
    "bytes_sent",
]  # fmt: skip


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _counted(plan: SitePlan, graph: str):
    """The plan's program folded for counting (``program.build``), so that ``plan()`` can count
    every rank's at any scale."""
    return build(plan, graph, folded=True)


def attention_flops(plan: SitePlan) -> int:
    """Useful forward FLOPs of the site on this rank (2 per multiply-add in QK^T and PV): the
    blocks of its forward program (a block that a band skips computes none)."""
    return _counted(plan, "forward").flops()


def branch_flops(plan: SitePlan, branch) -> int:
    """Useful forward FLOPs of one branch on this rank."""
    return _counted(plan, "forward").flops(plan.branches.index(branch))


def dense_flops(plan: SitePlan) -> int:
    """FLOPs of dense SDPA over the whole sequence, split evenly over the ranks."""
    n = plan.n
    pairs = n * (n + 1) // 2 if plan.is_causal else n * n
    return 2 * plan.batch * plan.hq * pairs * (plan.d + plan.dv) // plan.world


def bytes_sent(plan: SitePlan) -> dict[str, int]:
    """Bytes this rank sends per forward and per backward (what the P2P ops count): the
    programs' transfers and gathers."""
    return {graph: _counted(plan, graph).bytes_sent() for graph in ("forward", "backward")}


def branch_bytes_sent(plan: SitePlan, branch) -> dict[str, int]:
    """Bytes one branch's ring sends from this rank per forward and per backward, and its
    largest message (one head chunk's K/V, or dK/dV in ``stat_dtype``, with the keys' bias)."""
    i = plan.branches.index(branch)
    fwd, bwd = _counted(plan, "forward"), _counted(plan, "backward")
    message = max(fwd.largest_message(i), bwd.largest_message(i))
    return {"forward": fwd.bytes_sent(i), "backward": bwd.bytes_sent(i), "message": message}


def attention_memory_bytes(plan: SitePlan) -> dict[str, int]:
    """Estimated activation memory of the site on this rank, in bytes (Note [Memory of a site]).

    ``saved``: what forward keeps for backward (merged out in the blocks' dtype, lse in float32 or
    float64; q, k, v are the inputs'). ``peak``: the most the site holds at once beyond its inputs, forward or backward: the
    saved tensors, each branch's results until one kernel merges or sums them, a ring's buffers, a
    branch's dilated copies and the block kernel's scratch.
    """
    out, lse = _site_out(plan)
    return {"saved": out + lse, "peak": max(_forward_peak(plan), _backward_peak(plan))}


def _itemsizes(plan: SitePlan) -> tuple[int, int, int]:
    """Bytes per element of the inputs, of what blocks compute in, and of the statistics."""
    return _itemsize(plan.dtype), _itemsize(plan.compute_dtype), _itemsize(plan.stat_dtype)


def _site_out(plan: SitePlan) -> tuple[int, int]:
    """Bytes of the site's merged out (as the blocks computed it: what the backward reads) and
    lse on this rank."""
    rows = plan.batch * plan.hq * plan.n_local
    return rows * plan.dv * _itemsize(plan.compute_dtype), rows * _itemsize(plan.stat_dtype)


def _dilated_rows(plan: SitePlan, branch) -> tuple[int, int]:
    """Query rows and key rows of a branch on this rank, over every head (its dilated kv heads
    for the keys) and the batch."""
    layout = branch.layout
    per_head = plan.batch * layout.padded // layout.r
    return per_head * plan.hq, per_head * layout.kv_heads


def _gathered(branch) -> bool:
    """Whether a branch's dilated rows are copies (a gather at r > 1, or padding), not views."""
    return branch.layout.r > 1 or branch.layout.padded != branch.layout.n


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
    are done (``Land`` in the backward program): that chunk's share kept home, the accumulator sent and the one
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


def _copies_gradients(plan: SitePlan, branch) -> bool:
    """Whether a block of ``branch`` runs a kernel whose gradients are copied contiguous: all
    but ``cpu_kernel``'s float32 blocks without a bias (and the dropout path's own)."""
    biased = plan.needs_bias(branch) or plan.band is not None or plan.documents
    ours = plan.device == "cpu" and plan.compute_dtype == torch.float32 and not biased
    return plan.dropout or not ours


def _block_extra(
    plan: SitePlan, branch, rows: tuple[int, int], lengths: tuple[int, int], backward: bool
) -> int:
    """Scratch of one block call of ``branch`` beyond its results: ``rows`` query and key rows
    over every head and batch, ``lengths`` per head and batch."""
    _, compute, stat = _itemsizes(plan)
    d, dv = plan.d, plan.dv
    (q_rows, kv_rows), (length, keys) = rows, lengths
    # aten's kernels return the gradients in a layout of their own: one beside its contiguous
    # copy. Ours writes them contiguous (Note [The CPU block kernel] in cpu_kernel.py).
    copied = backward and _copies_gradients(plan, branch)
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
    blocks = _counted(plan, "forward").blocks(plan.branches.index(branch))
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
    if _gathered(branch):
        copies += q_rows * ((d + 2 * dv) * compute + stat if backward else d * compute)
        copies += kv_rows * (d + dv) * (compute if branch.is_local else item)
    return copies


def _local_work(plan: SitePlan, branch, backward: bool) -> int:
    """What a local branch needs while it runs beyond its results: its dilated copies and its
    block call's scratch."""
    m = branch.layout.m
    scratch = _block_extra(plan, branch, _dilated_rows(plan, branch), (m, m), backward)
    return _copies(plan, branch, backward) + scratch


def _order(plan: SitePlan) -> tuple[list, list]:
    """The ring branches and the local branches in the order the backward program runs them
    (rings first, their last hops home after the local branches: Note [Overlap across branches])."""
    program = _counted(plan, "backward")
    order = [s.branch for s in program.steps if isinstance(s, Block)]
    branches = [plan.branches[i] for i in dict.fromkeys(order)]
    return [b for b in branches if not b.is_local], [b for b in branches if b.is_local]


def _rings_peak(plan: SitePlan, results, backward: bool) -> tuple[int, int]:
    """The most held while a ring branch runs, with the ``results`` of the rings before it, and
    the results of every ring (Note [Memory of a site])."""
    held, peak = 0, 0
    for branch in _order(plan)[0]:
        chunks = plan.head_chunks(branch)
        done = results(plan, branch) * (chunks - 1) // chunks
        work = _copies(plan, branch, backward) + _ring_chunk(plan, branch, backward) // chunks
        peak = max(peak, held + done + work)
        held += results(plan, branch)
    return peak, held


def _branches_peak(plan: SitePlan, results, backward: bool) -> tuple[int, int]:
    """The most held while a branch runs, with the ``results`` of the branches before it, and the
    results of every branch (Note [Memory of a site])."""
    peak, held = _rings_peak(plan, results, backward)
    local, done = _locals_peak(plan, results, backward)
    return max(peak, held + local), held + done


def _locals_peak(plan: SitePlan, results, backward: bool) -> tuple[int, int]:
    """The most the local branches hold while one runs, in the order that holds least (the
    largest working set first), and the results of them all."""
    peak, held = 0, 0
    local = [(_local_work(plan, b, backward), results(plan, b)) for b in _order(plan)[1]]
    for work, result in sorted(local, reverse=True):
        peak = max(peak, held + result + work)
        held += result
    return peak, held


def _forward_peak(plan: SitePlan) -> int:
    out, lse = _site_out(plan)
    if plan.local_in_place:
        # The local branches' running out and lse, site-sized, from the first on; the rings run
        # beside them, and their outs merge with them into the site's.
        peak, held = _rings_peak(plan, _branch_outs, backward=False)
        peak = out + lse + max(peak, held + (out + lse if held else 0))
    else:
        peak, held = _branches_peak(plan, _branch_outs, backward=False)
        peak = max(peak, held + (0 if _in_place(plan) else out + lse))
    if plan.replicated:  # every rank's out received, then stacked (and assembled)
        peak = max(peak, out + lse + 2 * plan.world * out)
    return peak


def _sums_are_views(plan: SitePlan, branch) -> bool:
    """Whether ``branch``'s gradients become the site's sums as they are, where it is the first
    to reach them (``_undilate_add`` in ``attention.py``: rate 1, no padding, one segment or a
    ring's rows, already in ``stat_dtype``)."""
    layout = branch.layout
    dtype = plan.stat_dtype if not branch.is_local else plan.compute_dtype
    one_piece = not branch.is_local or layout.nseg == 1
    return layout.r == 1 and layout.padded == layout.n and one_piece and dtype == plan.stat_dtype


def _backward_peak(plan: SitePlan) -> int:
    item, _, stat = _itemsizes(plan)
    out, lse = _site_out(plan)
    rows, kv_rows = plan.batch * plan.hq * plan.n_local, plan.batch * plan.hkv * plan.n_local
    grads = [rows * plan.d * item, kv_rows * plan.d * item, kv_rows * plan.dv * item]
    sums = [g * stat // item for g in grads]
    rings, local = _order(plan)
    peak = held = 0  # held: the rings' gradients, waiting for the local branches
    have = [0, 0, 0]  # the site's dq, dk, dv sums so far

    def add(result: int, parts: list[int], view: bool) -> None:
        """A branch's gradients (``result``) added into the sums of ``parts``; a sum that does
        not exist yet is new, or with ``view`` the branch's gradient itself."""
        nonlocal peak
        fresh = 0 if view else sum(sums[j] for j in parts if not have[j])
        peak = max(peak, held + sum(have) + result + fresh)
        for j in parts:
            have[j] = sums[j]

    for branch in rings:
        chunks = plan.head_chunks(branch)
        result = _branch_grads(plan, branch)
        work = _copies(plan, branch, True) + _ring_chunk(plan, branch, True) // chunks
        peak = max(peak, held + result * (chunks - 1) // chunks + work)
        held += result
    chunks = len(plan.local_chunks()) if local else 1
    held += _rings_dq_cat(plan)
    if plan.local_in_place:
        # The site's dq, dk, dv, which the local blocks write and add to where they lie; the
        # rings' dq and, once home, dK/dV add to them in place.
        peak = max(peak, held + sum(grads))
    elif chunks == 1:
        for branch in local:
            result = _branch_grads(plan, branch)
            peak = max(peak, held + sum(have) + result + _local_work(plan, branch, True))
            add(result, [0, 1, 2], _sums_are_views(plan, branch))
        if rings:  # their dq, then once home their dK/dV
            add(0, [0], _sums_are_views(plan, rings[0]))
            add(0, [1, 2], _sums_are_views(plan, rings[0]))
        if stat != item:  # the casts, one after another
            peak = max(peak, *(sum(sums[j:]) + sum(grads[: j + 1]) for j in range(3)))
    else:
        # The site's gradients from the first chunk on (dK/dV in stat_dtype while the rings'
        # last hops are to come); one local branch's share of the chunk and, where the sums are
        # wider than the inputs, the chunk's sums, cast to the site's dtype one at a time (else
        # the chunk sums into the site's gradients in place).
        dkv = grads[1] + grads[2]
        totals = grads[0] + (dkv * stat // item if rings else dkv)
        chunk = sum(sums) if stat != item else 0
        work = max(_branch_grads(plan, b) + _local_work(plan, b, True) for b in local)
        cast = max(grads) if stat != item else 0
        peak = max(peak, held + totals + (chunk + max(work, cast)) // chunks)
        peak = max(peak, held + totals + (dkv if rings and stat != item else 0))
    if plan.replicated:  # the whole out (the caller's) and gradients; received and stacked shards
        peak = max(peak, plan.world * (out + sum(grads)) + 2 * plan.world * max(grads))
    return out + lse + peak


def _branch_summary(plan: SitePlan, branch) -> str:
    where = "local" if branch.is_local else f"ring {_ranks(plan.ranks[r] for r in branch.ring)}"
    return f"({branch.w},{branch.r}) {where}"


def _ranks(ranks) -> str:
    """Global ranks, runs of consecutive ranks shortened: ``0-3``, ``1,3``, ``0-1,4-5``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)


def _causal(plan: SitePlan) -> str:
    """``is_causal`` and the band a mask read from the graph adds (Note [Bands])."""
    if plan.band is None:
        return str(plan.is_causal)
    lo, hi = plan.band
    if plan.is_causal and hi is None:
        return f"True, window {1 - lo}"
    return f"{plan.is_causal}, {'-inf' if lo is None else lo} <= t - p <= {'inf' if hi is None else hi}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _shape(s: Any) -> str:
    return "x".join(map(str, s)) if s else "-"


@dataclasses.dataclass
class Report:
    """What the ``ring_dilated`` rewrite did with each attention site it saw.

    One row per site record: the site id, where it is (module path and ``file:line``), its
    kind, the normalising passes that touched it, the q / k / v shapes, and whether it was
    rewritten or left alone and why. A rewritten site's row adds its branches (``local``, or
    ``ring`` and the ranks of its ring), ``P / mode / layout`` (and the padded length), this
    process's rank and its group's ranks (with more than one rank), ``is_causal`` and any band
    read from a mask, and its cost on this rank: useful forward GFLOP (dense in brackets), MiB
    sent forward / backward, MiB saved for backward / peak (estimates: Note [Memory of a site]).
    Ranks are global. ``str(report)`` is a ``tabulate`` table under a one-line summary
    (``ring_rewrite: no attention site found`` when there are no records) and, where a site runs
    on CPU, a line saying which block kernel runs its blocks and why (Note [Choosing the CPU block
    kernel]).

    Args:
        records (list[SiteRecord]): the site records, as a backend's ``.records`` or
            ``ring_rewrite.testing.Capture.records`` hold them.

    Attributes:
        rewritten (list[SiteRecord]): the records of sites rewritten (a plan, or a decode step).
        skipped (list[SiteRecord]): the records of sites left alone.
        rows() (list[dict[str, Any]]): the table's rows, column name to cell text.

    Example::

        be = ring_rewrite.backend(segment_lengths=[64, 256], dilation_rates=[1, 4])
        torch.compile(model, backend=be)(x)
        report = ring_rewrite.Report(be.records)
        assert not report.skipped, report
        print(report)
    """

    records: list[Any]

    @property
    def rewritten(self) -> list[Any]:
        return [r for r in self.records if r.rewritten]

    @property
    def skipped(self) -> list[Any]:
        return [r for r in self.records if not r.rewritten]

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for r in self.records:
            row = {
                "site": r.site,
                "where": r.location,
                "kind": r.kind,
                "passes": ", ".join(r.passes) or "-",
                "q / k / v": " ".join(_shape(r.shapes.get(n)) for n in ("query", "key", "value")),
            }
            if r.decode:
                row.update({"branches (w, r)": "-", "status": f"rewritten, {r.reason}"})
            elif r.plan is None:
                row.update({"branches (w, r)": "-", "status": f"left alone: {r.reason}"})
            else:
                plan = r.plan
                mem, sent = attention_memory_bytes(plan), bytes_sent(plan)
                row.update(
                    {
                        "branches (w, r)": " ".join(_branch_summary(plan, b) for b in plan.branches),
                        "P / mode / layout": f"{plan.world} / {plan.sharding} / {plan.layout}"
                        + (f" (N padded to {plan.n})" if plan.pad else "")
                        if plan.world > 1
                        else "1",
                        **({"rank (group)": f"{plan.ranks[plan.rank]} ({_ranks(plan.ranks)})"}
                           if plan.world > 1 else {}),
                        "causal": _causal(plan),
                        "status": "rewritten" if r.reason is None else f"rewritten, {r.reason}",
                        "GFLOP fwd (dense)": f"{attention_flops(plan) / 1e9:.3g} "
                        f"({dense_flops(plan) / 1e9:.3g})",
                        "MiB sent fwd / bwd": f"{_mib(sent['forward'])} / {_mib(sent['backward'])}",
                        "MiB saved / peak": f"{_mib(mem['saved'])} / {_mib(mem['peak'])}",
                    }
                )
            rows.append(row)
        return rows

    def __str__(self) -> str:
        if not self.records:
            return "ring_rewrite: no attention site found"
        head = f"ring_rewrite: {len(self.rewritten)} of {len(self.records)} attention sites rewritten"
        head += " (per rank)" if any(r.plan is not None and r.plan.world > 1 for r in self.records) else ""
        kernel = _kernel_line([r.plan for r in self.rewritten if r.plan is not None])
        head += f"\n{kernel}" if kernel else ""
        return head + "\n" + tabulate(self.rows(), headers="keys", tablefmt="simple")


def _kernel_line(plans: list[SitePlan]) -> str | None:
    """Which kernel runs the CPU blocks of ``plans`` and why (Note [Choosing the CPU block kernel]);
    None without a CPU plan."""
    plans = [p for p in plans if p.device == "cpu"]
    if not plans:
        return None
    if all(_copies_gradients(p, b) for p in plans for b in p.branches):  # no block that ours could run
        return "CPU block kernel: aten's flash kernel, the only candidate (float64, a bias, a band or dropout)"
    if not cpu_kernel.available():
        return "CPU block kernel: aten's flash kernel, the only candidate (csrc/flash_cpu.c is not built)"
    return f"CPU block kernel: {cpu_choice.describe()}"


def explain(model_or_fn: Callable[..., Any], *example_args: Any, dynamic: bool | None = None, **config: Any) -> Report:
    """Run ``model_or_fn(*example_args)`` once through the rewrite and report every site.

    Compiles ``model_or_fn`` with ``torch.compile`` and a new ``ring_dilated`` backend built
    from ``config``, calls it once on ``example_args`` (its output is dropped), and returns the
    report of every attention site of every graph compiled during that call. The rewritten
    graph runs eagerly (``compiler="eager"``) unless ``config`` names another compiler. The
    model itself is not modified. For keyword arguments of the model pass
    ``functools.partial(model, **kwargs)``. Under an initialised process group the call runs
    the ring, so every rank of the group must make it. With ``dynamic=True`` the sequence
    length is a symbol, as after a second length in training, so a site is padded to its
    length bucket and the report says what the bucket computes at the example's length.

    Args:
        model_or_fn (Callable): an ``nn.Module`` or a function.
        *example_args: its positional arguments.
        dynamic (bool, optional): ``torch.compile``'s ``dynamic``. Default: ``None``.
        **config: ``RingDilatedConfig`` fields; ``compiler`` defaults to ``"eager"``.

    Returns:
        Report: one row per attention site; ``print`` it for the table.

    Raises:
        TypeError, ValueError: a bad config field.
        torch._dynamo.exc.BackendCompilerFailed: the rewrite raised while compiling (with
            ``strict=True`` or in sharded mode, a site that cannot be rewritten).

    Example::

        print(ring_rewrite.explain(model, x, segment_lengths=[64, 256], dilation_rates=[1, 4]))
        # ring_rewrite: 2 of 2 attention sites rewritten
        #   site  where  ...  branches (w, r)  ...  status  ...
    """
    config.setdefault("compiler", "eager")
    be = RingDilatedBackend(RingDilatedConfig(**config))
    torch.compile(model_or_fn, backend=be, dynamic=dynamic)(*example_args)
    return Report(list(be.records))
