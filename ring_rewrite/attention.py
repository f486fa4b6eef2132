"""Dilated ring attention of one SDPA site: forward and its explicit backward.

Both functions run the plan's program (Note [The site program]), step by
step, as plain torch code: ``_Forward`` and ``_Backward`` hold what a call has computed and
have one method per step type. The rewrite pass traces each into an FX body (once per plan,
shared by the sites that have it) and joins the two with ``autograd_function_apply``, so the
graph handed to the inner compiler shows every gather, transfer, block attention call and
merge of the site. With
one rank every branch is local and no transfer appears: the single-device case is the ring's
degenerate case, not a second code path.

Note [Backward from the merged statistics]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The merged output is one softmax over the multiset of connected keys (a key connected by two
branches counts twice, the ``log c`` bias of the dense form). With ``O`` and ``L`` that softmax's
output and log-sum-exp, the fused attention backward run per block with ``(dO, O, L)`` computes
``dS = exp(s - L) * (dO·v - rowsum(dO * O))``: exactly the block's share of the gradient of the
whole function, branch merge weights included. So backward saves only the local ``q, k, v, O, L``
(O(N/P)), re-dilates them per branch and sends K/V around the ring again, with their dK/dV
accumulators travelling one step behind back to their owner. An accumulator starts at the first
rank that holds borrowed K/V; the owner keeps its own share: ``G - 1`` dK/dV messages per ring of
``G`` ranks, where ring-flash-attention and torch's ring send ``G`` (at ``G = 2``, half).

``O`` is saved as the blocks computed it (``compute_dtype``: float32 for 16-bit inputs on CPU),
not as the site returns it. ``rowsum(dO * O)`` must cancel against the blocks' own ``exp(s - L)``
(the row sums of ``dS`` are 0): an ``O`` rounded to bfloat16 leaves each row of ``dS`` a sum of
about 2^-8 of ``dO·O``, which ``dq`` sees multiplied by ``|k|`` (and ``dk`` by ``|q|``) where the
true gradient cancels it. With keys sharing an offset of 100 that is tens of times the error of the
same kernel with ``O`` in float32 (and of SDPA's math kernel); the cost is 2 bytes per output
entry more saved per site.

Note [Local branches in place]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A local branch's rows are a lattice of the site's own: per kernel head, segment after segment,
every ``r``-th row from the head's offset, one stride apart. ``flash_cpu.c`` reads any operand
at such a layout (``BranchLayout.lattice``: segments as batches, each kernel head's first row),
and writes or adds its gradients at one too. So where it runs every local block (float32 on CPU,
no bias, band, documents or dropout, no padding, and no two kernel kv heads on the same rows:
``SitePlan.local_in_place``), a local branch is one call each way, and nothing of it is
gathered. Forward, ``ops.dilated_block_attention`` reads the site's q, k, v where they lie and
merges the branch's out and lse into a running out and lse of the site's size, in place, row by
row as the kernel finishes it (the first branch, at rate 1, writes them; else they start at 0
and ``-inf``): the merge of ``merge.py``, two partials at a time, so no branch's out exists on
its own and no pointwise merge runs after them (rings, where there are, merge with the running
ones there). Backward, ``ops.dilated_block_backward`` reads q, k, v, dout, out and lse where they lie and adds
the branch's dq, dk, dv into the site's, in place; the first branch, at rate 1, writes them
(else they start at zero). No gradient of a branch exists on its own and nothing is summed
afterwards: the backward holds the site's dq, dk, dv and the kernel's per-thread tiles, so it
needs no head chunks, and no buffer of it grows with the branches (gathered chunks, Note [Head
chunks of local branches], fault in fresh pages every step at long N; benchmarks/README.md,
section 1, has the peaks). The graph shows one node per local branch
each way, roles ``attention`` and ``attention_backward``; the rings' dq and dK/dV add into the
same sums after them. Elsewhere (aten's kernel, CUDA, 16-bit, a bias) they are gathered, and the backward runs in
head chunks (the Note above).

Note [Rows of a ring branch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A local branch runs as one batched call over ``(B*nseg, H, m, D)``. A ring branch's blocks read
runs of a rank's parts (both zigzag chunks, or one), so it holds its tensors as ``(B, H,
nseg*m, D)``, per head the parts one after another: every block's rows are then a slice, a view,
and its out, lse and gradients split back into parts by views. With ``r = 1`` that layout is
the rank's sequence itself (no copy). Otherwise the dilation gathers each tensor once per
branch into a buffer of its own (``ops.dilate``, Note [Gathers as calls]), which
every block, head chunk and ring step reads by views: 1/r of the input it comes from.

Note [Gradient sums of a ring step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The blocks of one backward ring step read disjoint key parts of the K/V held (the table of Note
[Ring schedule]), so the step's share of dK/dV is each block's dk, dv put at
its rows; added to the accumulators that arrived, it leaves for the next rank. Those sums, and
the branch's dq over the steps, are ``ops.add_rows`` calls: each adds a block's gradient into a
copy of the running sum at the block's rows (zeros where no sum exists yet). As pointwise ops
they would be a concatenation with zeros, an add and a copy per step, each with the sizes of
its branch baked in: a C++ kernel per ring branch and step kind, about 5 per ring branch, most
of a site's compile (``benchmarks/compile_cost.py --site`` counts them). What the graph shows is the same: a block's gradients, then their sum (role
``merge``), then the transfer. The forward's merges stay pointwise.

Note [Overlap across branches]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Within a ring, each step's transfer overlaps that step's blocks. A branch of a high rate has
few rows per step to hide a transfer behind, but the site's local branches have many: so the
forward starts every ring's first transfer before any branch computes, and the backward runs
its rings first and waits for their last dK/dV hop (the one with nothing after it in its ring)
after the local branches computed. The order of the transfers is the same on every rank.

Note [Recentred key biases]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A key bias that is more than a mask can be large: ALiBi written as a key bias (BLOOM, MPT,
Falcon: ``slope_h * t``, the ``-slope_h * p`` part being constant along a row) reaches 32,768
at ``t = 65,536`` with slope 1/2, where a float32 score keeps 3 decimals. Such a site
(``SitePlan.recentred``) never adds the bias as it is: each block call gets its query rows'
own key bias ``b_p`` (the bias at the row's position, which in self-attention is a key: the
rows of this rank's bias) and adds ``b_t - b_p``, in chunks of query rows as a band is added
(``ops.BAND_CHUNK`` scores each). ``b_p`` is a constant of the row, so the softmax is the same;
every block of a row, in every branch and at every ring step, subtracts the same ``b_p``, so
the lse merges are exact, and the backward gets the lse in the same frame. For ALiBi ``b_t -
b_p`` is ``slope_h * (t - p)``, the dense bias itself, so the site is as accurate as that dense
bias at any length. A row whose own bias masks (a padded position) takes 0 instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .comm.ring import Ring, Rotater
from .comm.tags import DKV
from .dilation import last_dim
from .layout import assemble, layout_of, take_shard
from .merge import merge_partials
from .ops import BAND_OPEN, RELATIONS
from .program import Block, Cast, Chunk, Dilate, Exchange, Gather, Land, Merge, Start, Undilate, Wait, build, chunks
from .roles import role
from .site_plan import SitePlan
from .schedule import Branch, Parts

__all__ = ["site_forward", "site_backward"]

_NEG_INF = float("-inf")


# ---- small pieces ------------------------------------------------------------------------------


def _local(plan: SitePlan, x: torch.Tensor, bias: bool = False) -> torch.Tensor:
    """This rank's shard of ``x`` (``(B, H, N, C)``, or a key ``bias`` ``(B|1, H|1, N)``) in
    replicated mode; of a bucket, its padding zeros (a bias's ``-inf``: ``_bucket_rows``)."""
    if not plan.replicated:
        return x
    dim = x.dim() - (1 if bias else 2)
    if plan.bucketed:
        rows = _bucket_rows(plan, x.size(dim), x.device)
        real = rows < x.size(dim)
        taken = x.index_select(dim, rows.clamp_max(x.size(dim) - 1))
        return torch.where(real if bias else real.unsqueeze(-1), taken, _NEG_INF if bias else 0.0)
    return take_shard(x, dim, plan.n, world=plan.world, rank=plan.rank, layout=plan.layout)


def _bucket_rows(plan: SitePlan, n, device) -> torch.Tensor:
    """Replicated mode, a sequence of ``n`` padded to a bucket: the positions this rank's shard
    holds of it cut into ``P * parts`` chunks of ``ceil(n / (P * parts))``, the last ones past
    ``n`` (padding: keys masked, rows dead, outputs dropped; Note [Padding shards to a bucket])."""
    layout = layout_of(plan.layout)
    pieces = plan.world * layout.parts
    each = (n + pieces - 1) // pieces
    return torch.cat([c * each + torch.arange(each, device=device) for c in layout.chunks(plan.rank, plan.world)])


def _padded(plan: SitePlan, *xs: torch.Tensor) -> list[torch.Tensor]:
    """``xs`` (sequence on dim 2) with the plan's padding after them (Note [Padding the
    sequence])."""
    if not plan.pad:
        return list(xs)
    return [torch.nn.functional.pad(x, (0, 0, 0, plan.pad)) for x in xs]


def _padded_keys(plan: SitePlan, q: torch.Tensor, mask: torch.Tensor | None):
    """The key bias ``(B|1, Hq|1, N)`` with the padded keys at ``-inf``; None where nothing is
    masked (with ``is_causal`` no real query reaches a padded key)."""
    if not plan.pad or (mask is None and plan.is_causal):
        return mask
    if mask is None:
        mask = q.new_zeros(1, 1, plan.n - plan.pad)
    return torch.nn.functional.pad(mask, (0, plan.pad), value=_NEG_INF)


def _dead_padding(plan: SitePlan, lse: torch.Tensor, real: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """This rank's saved ``lse`` with the rows of padding at ``+inf``: the plan's (Note [Padding
    the sequence]), in one process a length bucket's past ``real`` (Note [Padding to a
    bucket]), in replicated mode a bucket's past the positions of the site's ``q``
    (``_bucket_rows``). The backward's blocks take them as dead."""
    if real is not None and not plan.bucketed:  # a bucket's run at the real length has no other rows
        rows = torch.arange(lse.shape[-1], device=lse.device)
        lse = lse.masked_fill(rows >= real, float("inf"))
    if plan.bucketed and plan.replicated:
        n = q.size(2)
        lse = lse.masked_fill(_bucket_rows(plan, n, lse.device) >= n, float("inf"))
    if not plan.pad:
        return lse
    rows = torch.arange(plan.n, device=lse.device)
    held = take_shard(rows, 0, plan.n, world=plan.world, rank=plan.rank, layout=plan.layout) if plan.replicated else rows
    return lse.masked_fill(held >= plan.n - plan.pad, float("inf"))


def _unpadded(plan: SitePlan, x: torch.Tensor, q: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` without the rows of padding: the plan's, or a replicated bucket's past the positions
    of the site's ``q`` (taken, not sliced: a slice's contiguity would guard on the length)."""
    if plan.bucketed and plan.replicated:
        return x.index_select(2, torch.arange(q.size(2), device=x.device))
    return x.narrow(2, 0, plan.n - plan.pad) if plan.pad else x


def _gather(plan: SitePlan, rotater: Rotater, x: torch.Tensor, index: int, same=None):
    stacked = rotater.all_gather(x, plan.world, index, same)
    n_local = x.size(2) if plan.bucketed else plan.n_local  # a replicated bucket's real rows
    return assemble(stacked, 2, n_local, world=plan.world, layout=plan.layout)


def _branch_bias(plan: SitePlan, branch: Branch, q: torch.Tensor, mask: torch.Tensor | None):
    """Additive key bias of one branch in kernel layout ``(B*nseg, Hq, 1, m)`` (a ring branch:
    ``(B, Hq, 1, nseg*m)``), or None."""
    if not plan.needs_bias(branch):
        return None
    layout = branch.layout
    rows = -1 if plan.bucketed else layout.n  # a bucket's: the keys it has, its real ones
    if mask is None:
        mask = q.new_zeros(1, 1, q.size(2) if plan.bucketed else 1)
    keys = mask.to(plan.compute_dtype).unsqueeze(-1).expand(layout.batch, layout.hq, rows, 1)
    (bias,) = _dilated(plan, layout, keys, rows=not branch.is_local, fill=_NEG_INF)
    return bias.transpose(-1, -2)


def _to_rows(x: torch.Tensor, layout) -> torch.Tensor:
    """Dilated ``(B*nseg, H, m[, C])`` as ``(B, H, nseg*m[, C])``: per head its parts one after
    another, the layout of a ring branch (Note [Rows of a ring branch])."""
    return x.unflatten(0, (layout.batch, layout.nseg)).transpose(1, 2).flatten(2, 3)


def _from_rows(x: torch.Tensor, layout) -> torch.Tensor:
    """Inverse of ``_to_rows``."""
    return x.unflatten(2, (layout.nseg, layout.m)).transpose(1, 2).flatten(0, 1)


def _dilated(
    plan: SitePlan, layout, *xs, kv: bool = False, rows: bool = False, fill: float = 0.0,
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """``xs (B, H, n[, C])`` in a branch's kernel layout ``(B*nseg, H', m[, C])`` or, with
    ``rows``, a ring branch's ``(B, H', nseg*m[, C])`` (Note [Rows of a ring branch]): views
    where the rows stay in place, else one ``ops.dilate`` call each (Note [Gathers as calls]).
    In ``dtype``: by default the compute dtype, but for a ring's K/V, which travel in the input
    dtype (upcast per block, ``_kv_rows``)."""
    dtype = dtype or (plan.dtype if kv and rows else plan.compute_dtype)
    views = layout.padded == layout.n and (layout.r == 1 or (kv and layout.shared_kv and not rows))
    if plan.bucketed and layout.r == 1 or rows and views:
        # A bucket's rate-1 branch: the site's real rows as they are (its block calls cut them
        # into segments: ``ops._on_site_rows``); a ring's: a rank's parts one after another
        # are its sequence.
        ys = list(xs)
    elif views and not plan.bucketed:
        ys = [layout.dilate_kv(x) if kv else layout.dilate_q(x, fill) for x in xs]
    else:  # gathered; from a bucket's real rows, the rest of its rows past the sequence
        return [torch.ops.ring_rewrite.dilate(x, _fields(layout), kv, rows, fill, dtype) for x in xs]
    return ys if dtype == plan.dtype else [y.to(dtype) for y in ys]


def _fields(layout) -> list[int]:
    """A ``BranchLayout`` as the ops take it."""
    return [layout.w, layout.r, layout.n, layout.batch, layout.hq, layout.hkv, layout.head0]


def _undilate_add(
    plan: SitePlan, total, y: torch.Tensor, layout, *, kv=False, rows=False, start=0, zero=None, length=None
) -> torch.Tensor:  # fmt: skip
    """``total`` with ``y``, a branch's dilated gradient (``_dilated``'s layout), added at its rows,
    in place (Note [Gradient sums as calls]); where ``total`` is None, a new one of
    ``y``'s heads in ``stat_dtype``, in which contributions add up (docs/semantics.md, Accuracy), or
    ``y`` itself where its rows are the site's (rate 1, no padding, one segment or a ring's rows).
    ``y``'s heads are ``total``'s from ``start`` on; with ``zero`` they are written, not added to.
    A bucket's sums have its real ``length`` of rows (Note [Padding to a bucket])."""
    if zero is None:
        zero = total is None
    heads = layout.hkv if kv else layout.hq
    # A ring's gradients are sums already (``stat_dtype``), a local block's in the compute dtype.
    dtype = plan.stat_dtype if rows else plan.compute_dtype
    site_rows = plan.bucketed and layout.r == 1 and not rows  # a bucket's rate-1 branch (``_dilated``)
    if total is None and dtype == plan.stat_dtype and layout.r == 1 and (layout.padded == layout.n or site_rows):
        if rows or site_rows:
            return y
        if layout.nseg == 1:
            return y.view(layout.batch, heads, layout.n, last_dim(y, layout.batch))
    if total is None:
        n = length if plan.bucketed else layout.n
        total = y.new_empty((layout.batch, heads, n, y.shape[-1]), dtype=plan.stat_dtype)
    torch.ops.ring_rewrite.undilate_add(total, y, _fields(layout), kv, rows, zero, start)
    return total


def _rows(x: torch.Tensor, m, p0: int, p1: int, dim: int = 2) -> torch.Tensor:
    """Parts ``[p0, p1)`` of ``x`` in ``_to_rows`` layout, ``m`` rows each: a slice of ``dim``,
    a view."""
    return x.narrow(dim, p0 * m, (p1 - p0) * m)


def _split_rows(x: torch.Tensor, m, p0: int, p1: int) -> list[torch.Tensor]:
    """Inverse of ``_rows``: ``(B, H, rows[, C])`` back into one ``(B, H, m[, C])`` per part."""
    if p1 - p0 == 1:
        return [x]
    x = x.unflatten(2, (p1 - p0, m))
    return [x.select(2, j) for j in range(p1 - p0)]


def _kv_rows(plan: SitePlan, m, kv: list[torch.Tensor], blk: Parts):
    """K and V rows of a block; K/V travel in the input dtype and are upcast only here."""
    rows = [_rows(x, m, blk.k0, blk.k1) for x in kv]
    if plan.compute_dtype != plan.dtype:
        rows = [x.to(plan.compute_dtype) for x in rows]
    return rows


def _own_bias(plan: SitePlan, bias: torch.Tensor | None, m=None, blk: Parts | None = None) -> dict:
    """A block call's ``qbias``, the key bias of its query rows (Note [Recentred key biases]):
    of a ring branch's rows ``blk.q0 .. blk.q1`` (``bias`` this rank's own), of a local branch
    all of them; nothing where the plan does not recentre."""
    if not plan.recentred or bias is None:
        return {}
    if blk is not None:
        bias = _rows(bias, m, blk.q0, blk.q1, dim=3)
    return {"qbias": bias.squeeze(-2)}


def _kv_and_bias(kv: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The K/V a ring step holds, and their key bias if one travels with them."""
    return kv[:2], (kv[2] if len(kv) > 2 else None)


def _drop(plan: SitePlan, seed: torch.Tensor | None, *block: int) -> tuple:
    """The dropout arguments of one block call, none without dropout: the block is named by this
    rank and its place in the site (Note [Dropout in blocks])."""
    return (plan.dropout, seed, [plan.rank, *block]) if plan.dropout else ()


def _ring(rotater: Rotater, i: int, branch: Branch) -> Ring:
    return rotater.ring(i, branch.send_to, branch.recv_from)


def _probe(plan: SitePlan, q: torch.Tensor) -> torch.Tensor:
    """A few query values spread over the sequence (replicated mode compares them across
    ranks): at most ``Hq * 16`` values, never all of q; taken, not a strided view, whose
    reshape would guard a bucket's graph on its length's parity."""
    rows = torch.arange(0, q.size(2), max(1, plan.n // 16), device=q.device)
    return q[:1, :, :, 0].index_select(-1, rows).reshape(-1)


def _band_args(
    plan: SitePlan, branch: Branch, block: Block, like: torch.Tensor, docs: torch.Tensor | None = None,
    heads: slice = slice(None),
) -> dict:  # fmt: skip
    """The mask arguments of one block call (Note [Bands]), as the program
    decided them
    (``program._block``): none for a full block; for a partial one ``band``, the rows'
    positions ``qpos`` and ``kpos`` and, with documents, ``qdoc`` and ``kdoc`` of the block's
    rows (query heads ``heads``)."""
    if block.kind == "full":
        return {}
    m, r = branch.layout.m, block.stride

    def positions(starts):
        rows = torch.arange(m, device=like.device) * r
        return torch.cat([rows + s for s in starts]) if len(starts) > 1 else rows + starts[0]

    band = [BAND_OPEN if x is None else x for x in block.band]
    args = {"band": band, "qpos": positions(block.q_starts), "kpos": positions(block.k_starts)}
    if block.documents:
        band.append([name for name, _ in RELATIONS].index(block.documents))
        args["qdoc"] = _doc_rows(plan, branch, docs, block, False, heads)
        args["kdoc"] = _doc_rows(plan, branch, docs, block, True, heads)
    return args


def _doc_rows(plan, branch, docs, block: Block, keys: bool, heads: slice) -> torch.Tensor:
    """Document ids of a block's query rows (or ``keys``' rows, those of the K/V held at its
    step), per query head (each head its lattice offset), in the order of the rows; ``docs``
    covers the whole (padded) sequence."""
    step = block.step if keys else None
    p0, p1 = block.parts[2:] if keys else block.parts[:2]
    layout = branch.layout
    if plan.world > 1:
        rank = plan.rank if step is None else branch.ring[(branch.position - step) % len(branch.ring)]
        docs = take_shard(docs, 2, plan.n, world=plan.world, rank=rank, layout=plan.layout)
    ids = layout.dilate_q(docs.expand(layout.batch, layout.hq, -1, 1), fill=-1)[:, heads]
    if branch.is_local:
        return ids.squeeze(-1)
    return _rows(_to_rows(ids, layout), layout.m, p0, p1).squeeze(-1)


# ---- forward -------------------------------------------------------------------------------


def _cat_heads(xs: list[torch.Tensor]) -> torch.Tensor:
    """Head chunks ``(B, h, ...)`` side by side. NOTE: concatenated as 3-D: inductor lays out a
    4-D concatenation channels-last when an input is, and a one-head chunk is both."""
    if len(xs) == 1:
        return xs[0]
    return torch.cat([x.flatten(2) for x in xs], dim=1).unflatten(2, xs[0].shape[2:])


def _merge_rows(merged: dict, m, p0: int, p1: int, out, lse) -> None:
    """A block's ``out`` and ``lse`` over parts ``[p0, p1)`` merged into ``merged``, runs of
    parts and their results so far: a run that is the block's parts merges whole (a rank's
    blocks mostly cover the same parts, so mostly one merge a block); where the block and the
    runs cut each other, both go part by part."""
    if (p0, p1) in merged:
        merged[(p0, p1)] = _merged(merged[(p0, p1)], (out, lse))
        return
    if not any(a < p1 and p0 < b for a, b in merged):
        merged[(p0, p1)] = (out, lse)
        return
    for (a, b), (o, l) in list(merged.items()):
        if a < p1 and p0 < b:
            del merged[(a, b)]
            merged.update(_parts(m, a, b, o, l))
    for run, (o, l) in _parts(m, p0, p1, out, lse).items():
        merged[run] = _merged(merged[run], (o, l)) if run in merged else (o, l)


def _merged(acc: tuple, new: tuple) -> tuple:
    """``acc`` and ``new``, each ``(out, lse)``, merged."""
    return merge_partials([acc[0], new[0]], [acc[1], new[1]])


def _parts(m, p0: int, p1: int, out, lse) -> dict:
    """``out`` and ``lse`` over parts ``[p0, p1)`` as one run per part (views)."""
    pieces = zip(_split_rows(out, m, p0, p1), _split_rows(lse, m, p0, p1))
    return {(part, part + 1): piece for part, piece in zip(range(p0, p1), pieces)}


def _chunk_kv(k_dilated, v_dilated, bias, qh: slice, kh: slice) -> list[torch.Tensor]:
    """The K/V (and key bias) a head chunk sends round its ring."""
    return [k_dilated[:, kh], v_dilated[:, kh]] + ([] if bias is None else [bias[:, qh]])


@dataclasses.dataclass
class _Inputs:
    """A site call's inputs on this rank: padded (Note [Padding the sequence])
    and, in replicated
    mode, this rank's shard of them; ``docs`` whole (padded)."""

    q_padded: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    docs: torch.Tensor | None
    dout: torch.Tensor | None = None
    real: torch.Tensor | None = None
    """The count of real positions, where the sequence is padded to a length bucket in one
    process (``site_forward``): the blocks compute only those rows (Note [Padding to a bucket]),
    and the backward takes the rows past it as dead."""
    rows: Any = None
    """A bucket's shard in sharded mode: the real rows of each part of it, the traced length's
    symbol over the layout's parts, where the plan has the bucket's (Note [Padding shards to a
    bucket]); None elsewhere."""

    @classmethod
    def take(cls, plan: SitePlan, qkv: tuple, mask, docs, dout=None, real=None) -> _Inputs:
        """``qkv`` (q, k, v), ``mask``, ``docs``, the backward's ``dout`` and ``real``, as the
        site's blocks read them."""
        q = qkv[0]
        with role("shard"):
            padded = _padded(plan, *qkv, *([] if dout is None else [dout]))
            mask_padded = _padded_keys(plan, q, mask)
            local = [_local(plan, x) for x in padded]
            mask_local = None if mask_padded is None else _local(plan, mask_padded, bias=True)
            docs_padded = None if docs is None else _padded(plan, docs)[0]
        rows = local[0].size(2) // layout_of(plan.layout).parts if plan.bucketed and plan.world > 1 else None
        return cls(padded[0], *local[:3], mask_local, docs_padded, *(local[3:] or [None]), real, rows)

    def part_rows(self, layout) -> Any:
        """Rows of each part of a ring branch's ``layout``: the plan's, or a bucket's real ones."""
        return layout.m if self.rows is None else self.rows


class _Call:
    """A site call running its program (Note [The site program]), one step at
    a time: each step type has its method (``Start`` runs ``start``); a block runs as a local
    branch in place, a local branch's rows, or a ring's."""

    def run(self, step) -> None:
        getattr(self, type(step).__name__.lower())(step)

    def block(self, step: Block) -> None:
        if step.kind == "skip":
            return
        if step.in_place:
            self._in_place(step)
        elif step.step is None:
            self._local(step)
        else:
            self._ring_block(step)


@dataclasses.dataclass
class _Forward(_Call):
    """A forward call: what its steps hand on to later ones (``site_forward`` runs them)."""

    plan: SitePlan
    rotater: Rotater
    inputs: _Inputs
    seed: torch.Tensor | None
    rows: dict = dataclasses.field(default_factory=dict)
    """Per branch its dilated ``(q, k, v, key bias)`` (Note [Rows of a ring branch])."""
    rings: dict = dataclasses.field(default_factory=dict)
    held: dict = dataclasses.field(default_factory=dict)
    """Per ring head chunk ``(branch, chunk)``: its query heads (a slice), its queries, their
    key bias, and the K/V (with their bias) held now."""
    flights: dict = dataclasses.field(default_factory=dict)
    computed: dict = dataclasses.field(default_factory=dict)
    """Per ``(branch, chunk, step)`` what its blocks computed: the step's transfer waits for it."""
    merged: dict = dataclasses.field(default_factory=dict)
    """Per ring head chunk, runs of parts and their (out, lse) merged so far (``_merge_rows``)."""
    results: dict = dataclasses.field(default_factory=dict)
    """Per branch its dilated (out, lse); a ring's per head chunk."""
    outs: list = dataclasses.field(default_factory=list)
    lses: list = dataclasses.field(default_factory=list)
    """Every branch's (out, lse) at the site's rows, for the merge."""
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    gathered: torch.Tensor | None = None

    def dilate(self, step: Dilate) -> None:
        plan, i = self.plan, step.branch
        branch, x = plan.branches[i], self.inputs
        with role("dilate", branch=i):
            (q,) = _dilated(plan, branch.layout, x.q, rows=not branch.is_local)
            k, v = _dilated(plan, branch.layout, x.k, x.v, kv=True, rows=not branch.is_local)
            bias = _branch_bias(plan, branch, x.q, x.mask)
        self.rows[i] = (q, k, v, bias)
        if not branch.is_local:
            self.rings[i] = _ring(self.rotater, i, branch)

    def start(self, step: Start) -> None:
        tag = step.tag
        key = (tag.branch, tag.chunk)
        with role("p2p", branch=tag.branch, step=tag.step):
            if key in self.held:
                kv = self.held[key][3]
            else:  # started before its chunk begins (Note [Overlap across branches])
                qh, kh = chunks(self.plan, self.plan.branches[tag.branch])[tag.chunk]
                kv = _chunk_kv(*self.rows[tag.branch][1:], qh, kh)
            self.flights[tag] = self.rings[tag.branch].start(kv, tag.kind, tag.step, tag.chunk)

    def chunk(self, step: Chunk) -> None:
        qh, kh = step.slices
        q, k, v, bias = self.rows[step.branch]
        q_heads, kv = q[:, qh], _chunk_kv(k, v, bias, qh, kh)
        self.held[(step.branch, step.chunk)] = (qh, q_heads, _kv_and_bias(kv)[1], kv)
        self.merged[(step.branch, step.chunk)] = {}

    def _ring_block(self, blk: Block) -> None:
        plan, i, key = self.plan, blk.branch, (blk.branch, blk.chunk)
        layout = plan.branches[i].layout
        qh, q, own_bias, kv = self.held[key]
        step_kv, step_bias = _kv_and_bias(kv)
        m = self.inputs.part_rows(layout)
        band = _band_args(plan, plan.branches[i], blk, q, self.inputs.docs, qh)
        with role("attention", branch=i, step=blk.step):
            out, lse = torch.ops.ring_rewrite.block_attention(
                _rows(q, m, blk.q0, blk.q1),
                *_kv_rows(plan, m, step_kv, blk),
                None if step_bias is None else _rows(step_bias, m, blk.k0, blk.k1, dim=3),
                plan.scale,
                blk.causal,
                *_drop(plan, self.seed, i, blk.chunk, blk.step, blk.index),
                **band,
                **_own_bias(plan, own_bias, m, blk),
            )
        self.computed.setdefault((i, blk.chunk, blk.step), []).extend([out, lse])
        with role("merge", branch=i, step=blk.step):
            _merge_rows(self.merged[key], m, blk.q0, blk.q1, out, lse)

    def _local(self, blk: Block) -> None:
        plan, i = self.plan, blk.branch
        q, k, v, bias = self.rows[i]
        with role("attention", branch=i):
            band = _band_args(plan, plan.branches[i], blk, q, self.inputs.docs)
            out, lse = torch.ops.ring_rewrite.block_attention(
                q, k, v, bias, plan.scale, plan.is_causal, *_drop(plan, self.seed, i), **band, **_own_bias(plan, bias),
                **_real_rows(plan, plan.branches[i].layout, self.inputs),
            )  # fmt: skip
        self.results[i] = (out, lse)

    def _in_place(self, blk: Block) -> None:
        """A local branch read where it lies, merged into the running out and lse (Note [Local
        branches in place]); the first allocates them, and at rate 1 writes them."""
        plan, x = self.plan, self.inputs
        first = not self.outs
        write = next(b for b in plan.branches if b.is_local).layout.r == 1  # writes every position
        if first:
            # A bucketed site may take its real rows only (Note [Padding to a bucket]).
            shape = (plan.batch, plan.hq, plan.n_local if x.real is None else x.q.shape[2])
            with role("merge"):
                if write:
                    out, lse = x.q.new_empty((*shape, plan.dv)), x.q.new_empty(shape, dtype=plan.stat_dtype)
                else:
                    out = x.q.new_zeros((*shape, plan.dv))
                    lse = x.q.new_full(shape, _NEG_INF, dtype=plan.stat_dtype)
            self.outs.append(out)
            self.lses.append(lse)
        with role("attention", branch=blk.branch):
            torch.ops.ring_rewrite.dilated_block_attention(
                self.outs[0], self.lses[0], x.q, x.k, x.v, _fields(plan.branches[blk.branch].layout), plan.scale,
                plan.is_causal, write and first, *_real(x),
            )  # fmt: skip

    def wait(self, step: Wait) -> None:
        tag = step.tag
        key = (tag.branch, tag.chunk)
        with role("p2p", branch=tag.branch, step=tag.step):
            kv = self.rings[tag.branch].wait(self.flights.pop(tag), self.computed.pop((*key, tag.step), []))
        self.held[key] = (*self.held[key][:3], kv)

    def merge(self, step: Merge) -> None:
        if step.branch is not None:  # a ring head chunk's runs of parts, whole
            merged = self.merged.pop((step.branch, step.chunk))
            runs = [merged[run] for run in sorted(merged)]
            result = runs[0] if len(runs) == 1 else (torch.cat([o for o, _ in runs], 2), torch.cat([l for _, l in runs], 2))
            self.results.setdefault(step.branch, []).append(result)
            return
        with role("merge"):
            out, self.lse = merge_partials(self.outs, self.lses)
            self.out = out.to(self.plan.dtype)
            # Saved as the blocks computed it (Note [Backward from the merged statistics]).
            same = self.plan.compute_dtype == self.plan.dtype
            self.saved_out = self.out if same else out.to(self.plan.compute_dtype)

    def undilate(self, step: Undilate) -> None:
        i = step.branch
        branch = self.plan.branches[i]
        if branch.is_local:
            out, lse = self.results.pop(i)
            if self.plan.bucketed and branch.layout.r == 1:  # the site's real rows (``_dilated``)
                self.outs.append(out)
                self.lses.append(lse)
                return
        else:  # its head chunks side by side, then as the rows of a local branch
            outs, lses = zip(*self.results.pop(i))
            out, lse = _cat_heads(list(outs)), _cat_heads(list(lses))
            if self.inputs.rows is not None:  # a bucket's ring at rate 1: its rows are the shard's
                self.outs.append(out)
                self.lses.append(lse)
                return
            out, lse = _from_rows(out, branch.layout), _from_rows(lse, branch.layout)
        with role("undilate", branch=i):
            out, lse = branch.layout.undilate_q(out), branch.layout.undilate_q(lse.unsqueeze(-1), _NEG_INF).squeeze(-1)
            if self.plan.bucketed:
                # A bucket's real rows; taken, not sliced: a slice's contiguity (its strides
                # against its length) would guard on the length.
                rows = torch.arange(self.inputs.q.size(2), device=out.device)
                out, lse = out.index_select(2, rows), lse.index_select(2, rows)
            self.outs.append(out)
            self.lses.append(lse)

    def gather(self, step: Gather) -> None:
        with role("shard"):
            # A few query values ride along: the ranks must hold the same sequence.
            gathered = _gather(self.plan, self.rotater, self.out, step.index, _probe(self.plan, self.inputs.q_padded))
            self.gathered = _unpadded(self.plan, gathered, self.inputs.q_padded)


def _real_rows(plan: SitePlan, layout, x: _Inputs) -> dict:
    """A local branch's block call over the real rows only, where the sequence is padded to a
    length bucket (``x.real``, Note [Padding to a bucket]): no real row attends a padded key
    (after it, or masked), so the rows and keys past them are left out (with dropout each call
    draws a stream of its own: ``ops._call_of``)."""
    if x.real is None:
        return {}
    return {"layout": _fields(layout), "real": x.real}


def _real(x: _Inputs) -> list[torch.Tensor]:
    """The in-place ops' optional last argument: a bucketed causal site's count of real
    positions."""
    return [] if x.real is None else [x.real]


def site_forward(plan: SitePlan, q, k, v, mask=None, docs=None, token=None, seed=None, real=None):
    """``(q, k, v[, mask][, token][, seed][, real]) -> (out, saved)``; ``mask`` is an additive
    key bias ``(B|1, Hq|1, N)``, ``token`` (with more than one rank) starts the chain of the
    site's transfers (``comm/calls.py``, ``site_token``), ``seed`` (with dropout) fixes this call's dropout,
    ``real`` (a 0-d int64 tensor) counts the real positions of a sequence padded to a length
    bucket in one process, or the real rows of each part of a sharded one (Note [Padding to a
    bucket]). Runs the plan's forward program (Note [The site
    program])."""
    if plan.exchanged:
        return _exchanged_forward(plan, (q, k, v), mask, docs, token)
    rotater = Rotater(plan.group_name, token)
    run = _Forward(plan, rotater, _Inputs.take(plan, (q, k, v), mask, docs, real=real), seed)
    for step in build(plan, "forward").steps:
        run.run(step)
    out = run.gathered if plan.replicated else run.out
    with role("p2p"):
        rotater.close([out, run.lse])  # the forward's call ends; its token goes to the backward
    saved = [q, k, v, run.saved_out, run.lse, *(x for x in (mask, docs, rotater.token, seed, real) if x is not None)]
    return out, saved


# ---- backward ------------------------------------------------------------------------------


def _add_rows(plan: SitePlan, total, x: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """``total`` (zeros where None) plus ``x`` at rows ``[start, ...)``, in ``stat_dtype`` (Note
    [Gradient sums of a ring step])."""
    return torch.ops.ring_rewrite.add_rows(total, x, start, rows, plan.stat_dtype)


def _after(x: torch.Tensor, *totals) -> torch.Tensor:
    """``x``, once the gradient sums so far are computed (Note [Head chunks of local branches])."""
    deps = [t for t in totals if t is not None]
    if not deps:
        return x
    with role("merge"):
        return torch.ops.ring_rewrite.after(x, deps)


@dataclasses.dataclass
class _RingChunk:
    """One head chunk of a ring branch in the backward: its dilated rows (dout, q, k, v, out,
    lse, key bias), the K/V held now, and its sums: dq, the dK/dV share of this rank's own K/V
    (which never leaves, ``own``), the accumulators held (``dkv``) and, home, ``landed``."""

    rows: list
    kv: list
    dq: torch.Tensor | None = None
    own: list | None = None
    dkv: list | None = None
    landed: list | None = None


@dataclasses.dataclass
class _LocalChunk:
    """One head chunk of the local branches' backward (Note [Head chunks of local branches]):
    its heads, where its sums start in the site's, and the sums so far (``sums``; the site's
    own where it sums in place); ``branch``: the current local branch's dilated rows."""

    index: int
    qh: slice
    kh: slice
    sums: list
    starts: tuple[int, int]
    zero: bool | None
    branch: tuple = ()


@dataclasses.dataclass
class _Backward(_Call):
    """A backward call: what its steps hand on to later ones (``site_backward`` runs them)."""

    plan: SitePlan
    rotater: Rotater
    inputs: _Inputs
    out: torch.Tensor
    lse: torch.Tensor
    seed: torch.Tensor | None
    rows: dict = dataclasses.field(default_factory=dict)
    rings: dict = dataclasses.field(default_factory=dict)
    chunks: dict = dataclasses.field(default_factory=dict)
    """Per ring head chunk ``(branch, chunk)``: its ``_RingChunk``."""
    flights: dict = dataclasses.field(default_factory=dict)
    computed: dict = dataclasses.field(default_factory=dict)
    """Per ``(branch, chunk, step)`` what its blocks computed, and (None) what the local
    branches did: transfers wait for them."""
    shares: dict = dataclasses.field(default_factory=dict)
    rings_dq: list = dataclasses.field(default_factory=list)
    """Each ring's dilated dq, ``(branch, dq)``, added where the local branches' are."""
    local: _LocalChunk | None = None
    totals: list | None = None
    """The site's dq, dk, dv where the local branches write them in place or in head chunks."""
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    grads: list = dataclasses.field(default_factory=list)

    def dilate(self, step: Dilate) -> None:
        plan, i, x = self.plan, step.branch, self.inputs
        branch = plan.branches[i]
        if branch.is_local:
            return self._dilate_local(step)
        layout = branch.layout
        with role("dilate", branch=i):
            q, dout, out = _dilated(plan, layout, x.q, x.dout, self.out, rows=True)
            k, v = _dilated(plan, layout, x.k, x.v, kv=True, rows=True)
            (lse,) = _dilated(plan, layout, self.lse.unsqueeze(-1), rows=True, fill=float("inf"), dtype=plan.stat_dtype)
            lse = lse.squeeze(-1)
            bias = _branch_bias(plan, branch, x.q, x.mask)
        self.rows[i] = (dout, q, k, v, out, lse, bias)
        self.rings[i] = _ring(self.rotater, i, branch)

    def chunk(self, step: Chunk) -> None:
        qh, kh = step.slices
        dout, q, k, v, out, lse, bias = self.rows[step.branch]
        rows = [dout[:, qh], q[:, qh], k[:, kh], v[:, kh], out[:, qh], lse[:, qh], None if bias is None else bias[:, qh]]
        self.chunks[(step.branch, step.chunk)] = _RingChunk(rows, rows[2:4] + ([] if bias is None else rows[6:]))

    def start(self, step: Start) -> None:
        tag = step.tag
        chunk = self.chunks[(tag.branch, tag.chunk)]
        with role("p2p", branch=tag.branch, step=tag.step):
            sent = chunk.dkv if tag.kind == DKV else chunk.kv
            self.flights[tag] = self.rings[tag.branch].start(sent, tag.kind, tag.step, tag.chunk)

    def wait(self, step: Wait) -> None:
        tag, after = step.tag, step.after
        chunk = self.chunks[(tag.branch, tag.chunk)]
        last = tag.step == len(self.plan.branches[tag.branch].ring) - 1
        # A transfer is named by the step it waits at; a last hop home by its own.
        at = tag.step if after is None or (tag.kind == DKV and last) else after[2]
        with role("p2p", branch=tag.branch, step=at):
            got = self.rings[tag.branch].wait(self.flights.pop(tag), self.computed.get(after, []))
        if tag.kind != DKV:
            chunk.kv = got
        elif last:
            chunk.landed = got
        else:
            chunk.dkv = got

    def land(self, step: Land) -> None:
        chunk = self.chunks[(step.branch, step.chunk)]
        layout = self.plan.branches[step.branch].layout
        with role("merge", branch=step.branch):
            rows = layout.nseg * self.inputs.part_rows(layout)
            chunk.landed = [_add_rows(self.plan, a, b, 0, rows) for a, b in zip(chunk.landed, chunk.own)]

    def _ring_block(self, blk: Block) -> None:
        plan, i = self.plan, blk.branch
        layout = plan.branches[i].layout
        chunk = self.chunks[(i, blk.chunk)]
        dout, q, _, _, out, lse, bias = chunk.rows
        step_kv, step_bias = _kv_and_bias(chunk.kv)
        qh = chunks(plan, plan.branches[i])[blk.chunk][0]
        m = self.inputs.part_rows(layout)
        band = _band_args(plan, plan.branches[i], blk, q, self.inputs.docs, qh)
        with role("attention_backward", branch=i, step=blk.step):
            dq, dk, dv = torch.ops.ring_rewrite.block_attention_backward(
                *(_rows(x, m, blk.q0, blk.q1) for x in (dout, q)),
                *_kv_rows(plan, m, step_kv, blk),
                *(_rows(x, m, blk.q0, blk.q1) for x in (out, lse)),
                None if step_bias is None else _rows(step_bias, m, blk.k0, blk.k1, dim=3),
                plan.scale,
                blk.causal,
                *_drop(plan, self.seed, i, blk.chunk, blk.step, blk.index),
                **band,
                **_own_bias(plan, bias, m, blk),
            )
        self.computed.setdefault((i, blk.chunk, blk.step), []).extend([dq, dk, dv])
        self.shares.setdefault((i, blk.chunk, blk.step), []).append((blk.k0 * m, dk, dv))
        with role("merge", branch=i, step=blk.step):
            chunk.dq = _add_rows(plan, chunk.dq, dq, blk.q0 * m, layout.nseg * m)

    def merge(self, step: Merge) -> None:
        if step.branch is None:
            return self._write_chunk(step)
        plan, i = self.plan, step.branch
        if step.step is None:  # a ring's dq: its head chunks side by side
            dqs = [self.chunks[(i, c)].dq for c in range(plan.head_chunks(plan.branches[i]))]
            self.rings_dq.append((i, _cat_heads(dqs)))
            return
        self._sum_step(i, step.chunk, step.step)

    def _sum_step(self, i: int, c: int, step: int) -> None:
        """A ring step's share of dK/dV added to the accumulators that arrived (Note [Gradient
        sums of a ring step]); step 0's is this rank's own share, which stays home."""
        plan, chunk = self.plan, self.chunks[(i, c)]
        layout = plan.branches[i].layout
        rows = layout.nseg * self.inputs.part_rows(layout)
        shares = self.shares.pop((i, c, step), [])
        with role("merge", branch=i, step=step):
            sums = None if step == 0 else chunk.dkv
            if sums is None and not shares and step <= 1:
                # Step 0 keeps a share of its own, step 1 starts the accumulators: touched or not.
                kh = chunks(plan, plan.branches[i])[c][1]
                shape = (layout.batch, kh.stop - kh.start, rows)
                sums = [chunk.rows[2].new_zeros((*shape, ch), dtype=plan.stat_dtype) for ch in (plan.d, plan.dv)]
            for start, dk, dv in shares:
                sums = [_add_rows(plan, a, x, start, rows) for a, x in zip(sums or (None, None), (dk, dv))]
        if step == 0:
            chunk.own = sums
        else:
            chunk.dkv = sums

    def _in_place(self, blk: Block) -> None:
        """A local branch read where it lies, its gradients added into the site's (Note [Local
        branches in place]); the first allocates them and, at rate 1, writes them."""
        plan, x = self.plan, self.inputs
        write = next(b for b in plan.branches if b.is_local).layout.r == 1  # it writes every position
        first = self.totals is None
        if first:
            with role("merge"):
                new = torch.empty_like if write else torch.zeros_like
                self.totals = [new(t, memory_format=torch.contiguous_format) for t in (x.q, x.k, x.v)]
            self.dq, self.dk, self.dv = self.totals
            self.computed[None] = self.totals
        with role("attention_backward", branch=blk.branch):
            torch.ops.ring_rewrite.dilated_block_backward(
                *self.totals, x.dout, x.q, x.k, x.v, self.out, self.lse, _fields(plan.branches[blk.branch].layout),
                plan.scale, plan.is_causal, write and first, *_real(x),
            )  # fmt: skip

    def _begin_local_chunk(self, c: int) -> None:
        """Head chunk ``c`` of the local branches: with several, the site's gradients exist from
        the first on, and a chunk's sums are those heads of them where they are as wide."""
        plan, x = self.plan, self.inputs
        heads = plan.local_chunks()
        qh, kh = heads[c]
        if len(heads) > 1 and self.totals is None:
            # A chunk's sums are final in the input dtype (rounded once), but for dK/dV to which
            # the rings' last hops still add (in stat_dtype).
            kv_dtype = plan.stat_dtype if any(not b.is_local for b in plan.branches) else plan.dtype
            n = x.q.size(2) if plan.bucketed else plan.n_local  # a bucket's: the real length
            with role("merge"):
                self.totals = [
                    x.q.new_empty((plan.batch, plan.hq, n, plan.d)),
                    x.k.new_empty((plan.batch, plan.hkv, n, plan.d), dtype=kv_dtype),
                    x.v.new_empty((plan.batch, plan.hkv, n, plan.dv), dtype=kv_dtype),
                ]
        into = self.totals is not None and plan.dtype == plan.stat_dtype
        sums = list(self.totals) if into else [None, None, None]
        starts = (qh.start, kh.start) if into else (0, 0)
        self.local = _LocalChunk(c, qh, kh, sums, starts, True if into else None)
        self.computed[None] = []

    def _dilate_local(self, step: Dilate) -> None:
        if self.local is None or step.chunk != self.local.index:
            self._begin_local_chunk(step.chunk)
        plan, x, lc, i = self.plan, self.inputs, self.local, step.branch
        whole = lc.qh == slice(0, plan.hq)
        heads = (lambda t, h: t) if whole else (lambda t, h: t[:, h])
        branch = plan.branches[i]
        layout = branch.layout if whole else branch.layout.heads(lc.qh.start, lc.qh.stop)
        chunk = branch if whole else dataclasses.replace(branch, layout=layout)
        q_heads = heads(x.q, lc.qh)
        mask = None if x.mask is None else heads(x.mask.expand(-1, plan.hq, -1), lc.qh)  # (B|1, Hq|1, N)
        with role("dilate", branch=i):
            q, dout, out = _dilated(plan, layout, q_heads, heads(x.dout, lc.qh), heads(self.out, lc.qh))
            k, v = _dilated(plan, layout, heads(x.k, lc.kh), heads(x.v, lc.kh), kv=True)
            (lse,) = _dilated(plan, layout, heads(self.lse, lc.qh).unsqueeze(-1), fill=float("inf"), dtype=plan.stat_dtype)
            lse = lse.squeeze(-1)
            bias = _branch_bias(plan, chunk, q_heads, mask)
        before = self.totals if step.chunk and len(plan.local_chunks()) > 1 else ()
        lse = _after(lse, *before)
        lc.branch = (chunk, layout, dout, q, k, v, out, lse, bias)

    def _local(self, blk: Block) -> None:
        plan, i = self.plan, blk.branch
        chunk, layout, dout, q, k, v, out, lse, bias = self.local.branch
        with role("attention_backward", branch=i):
            band = _band_args(plan, chunk, blk, q, self.inputs.docs)
            dq, dk, dv = torch.ops.ring_rewrite.block_attention_backward(
                dout, q, k, v, out, lse, bias, plan.scale, plan.is_causal, *_drop(plan, self.seed, i), **band,
                **_own_bias(plan, bias), **_real_rows(plan, layout, self.inputs),
            )  # fmt: skip
        self.computed[None] += [dq, dk, dv]
        self.local.branch = (layout, dq, dk, dv)

    def undilate(self, step: Undilate) -> None:
        plan, i = self.plan, step.branch
        branch = plan.branches[i]
        if branch.is_local:
            return self._undilate_local(step)
        if step.tensors == ("dq",):
            return self._add_ring_dq(i)
        landed = [self.chunks[(i, c)].landed for c in range(plan.head_chunks(branch))]
        dk, dv = [_cat_heads(list(g)) for g in zip(*landed)]
        with role("undilate", branch=i):
            self.dk = _undilate_add(plan, self.dk, dk, branch.layout, kv=True, rows=True)
            self.dv = _undilate_add(plan, self.dv, dv, branch.layout, kv=True, rows=True)

    def _undilate_local(self, step: Undilate) -> None:
        plan, lc, i = self.plan, self.local, step.branch
        layout, dq, dk, dv = lc.branch
        with role("undilate", branch=i):
            n = self.inputs.q.size(2)
            lc.sums[0] = _undilate_add(plan, lc.sums[0], dq, layout, start=lc.starts[0], zero=lc.zero, length=n)
            lc.sums[1] = _undilate_add(plan, lc.sums[1], dk, layout, kv=True, start=lc.starts[1], zero=lc.zero, length=n)
            lc.sums[2] = _undilate_add(plan, lc.sums[2], dv, layout, kv=True, start=lc.starts[1], zero=lc.zero, length=n)
        lc.zero = None
        if len(plan.local_chunks()) == 1:
            self.dq, self.dk, self.dv = lc.sums

    def _add_ring_dq(self, i: int) -> None:
        """Ring ``i``'s dq (of the local chunk's query heads) added into the sums (Note [Head
        chunks of local branches])."""
        plan = self.plan
        (dq,) = [dq for branch, dq in self.rings_dq if branch == i]
        qh, start = (self.local.qh, self.local.starts[0]) if self.local else (slice(0, plan.hq), 0)
        layout = plan.branches[i].layout
        with role("undilate", branch=i):
            if qh != slice(0, plan.hq):  # kernel heads of whole kv heads are those of the same query heads
                layout, dq = layout.heads(qh.start, qh.stop), dq[:, qh]
            total = self.dq if self.local is None else self.local.sums[0]
            total = _undilate_add(plan, total, dq, layout, rows=True, start=start)
        if self.local is not None:
            self.local.sums[0] = total
        if self.local is None or len(plan.local_chunks()) == 1:  # several: the site's once written
            self.dq = total

    def _write_chunk(self, step: Merge) -> None:
        """A local head chunk's sums into the site's gradients (nothing to do where it summed
        into them in place); once the last is done, the totals are the site's."""
        plan, lc = self.plan, self.local
        if plan.dtype != plan.stat_dtype:
            with role("merge"):
                for total, x, heads in zip(self.totals, lc.sums, (lc.qh, lc.kh, lc.kh)):
                    torch.ops.ring_rewrite.write_heads(total, x.to(total.dtype), heads.start)
        self.dq, self.dk, self.dv = self.totals
        self.computed[None] = self.totals

    def cast(self, step: Cast) -> None:
        with role("undilate"):
            self.grads = [self.dq.to(self.plan.dtype), self.dk.to(self.plan.dtype), self.dv.to(self.plan.dtype)]

    def gather(self, step: Gather) -> None:
        with role("shard"):
            j = step.index - 1
            gathered = _gather(self.plan, self.rotater, self.grads[j], step.index)
            self.grads[j] = _unpadded(self.plan, gathered, self.inputs.q_padded)


def site_backward(plan: SitePlan, dout, q, k, v, out, lse, mask=None, docs=None, token=None, seed=None, real=None):
    """Gradients of ``site_forward``'s output w.r.t. ``q, k, v`` (and None for the mask, the
    token and the seed): the plan's backward program run (Note [The site program])."""
    if plan.exchanged:
        return _exchanged_backward(plan, dout, (q, k, v, out, lse), mask, docs, token)
    with role("p2p"):
        rotater = Rotater(plan.group_name, token)
        if token is not None:
            rotater = Rotater.resume(plan.group_name, token)  # the backward is a call of its own
    lse = _dead_padding(plan, lse, real, q)
    run = _Backward(plan, rotater, _Inputs.take(plan, (q, k, v), mask, docs, dout, real), out, lse, seed)
    for step in build(plan, "backward").steps:
        run.run(step)
    with role("p2p"):
        rotater.close(run.grads)
    return (*run.grads, *(None for x in (mask, docs, token, seed, real) if x is not None))


# ---- heads across ranks ----------------------------------------------------------------------


@dataclasses.dataclass
class _Exchanged:
    """An exchanging site call (Note [Heads across ranks]): its exchanges (in replicated mode,
    its gathers), and between them the inner plan's steps, run by ``inner`` (its ``_Forward``
    or ``_Backward``), which ``begin`` makes from the inputs for this rank's heads."""

    plan: SitePlan
    rotater: Rotater
    tensors: dict
    """By name: the call's inputs, then what its exchanges made of them and of the results."""
    begin: Any
    inner: Any = None
    probe: torch.Tensor | None = None
    """Replicated mode: a few query values that ride with the output's gather (``_probe``)."""

    def run(self, step) -> None:
        if not isinstance(step, (Exchange, Gather)):
            if self.inner is None:
                self.inner = self.begin(self.tensors)
            self.inner.run(step)
            return
        plan, name = self.plan, step.tensor
        copies = plan.kv_copies if name in ("k", "v", "dk", "dv") else 1
        with role("p2p"):
            if isinstance(step, Exchange) and step.to == "heads":
                x = self.tensors[name]
                x = x.repeat_interleave(copies, 1) if copies > 1 else x
                self.tensors[name] = _to_heads(plan, self.rotater, x, step.index)
                return
            results = {"out": self.inner.out} if isinstance(self.inner, _Forward) else dict(
                zip(("dq", "dk", "dv"), self.inner.grads)
            )
            if isinstance(step, Exchange):
                x = _to_sequence(plan, self.rotater, results[name], step.index)
            else:
                x = _gather_heads(plan, self.rotater, results[name], step.index, self.probe if name == "out" else None)
            b, h, n, d = x.shape  # each head's gradient summed over its copies
            self.tensors[name] = x.view(b, h // copies, copies, n, d).sum(2) if copies > 1 else x


def _own_heads(plan: SitePlan, name: str, x: torch.Tensor) -> torch.Tensor:
    """Replicated mode: what ``_to_heads`` would make of ``x`` (``(B, H, N, D)``, the whole
    sequence, key/value heads before their copies), taken from it where every rank holds it."""
    copies = plan.kv_copies if name in ("k", "v") else 1
    x = x.repeat_interleave(copies, 1) if copies > 1 else x
    heads = x.shape[1] // plan.a2a
    x = x.narrow(1, plan.rank % plan.a2a * heads, heads)
    return take_shard(x, 2, plan.n, world=plan.world // plan.a2a, rank=plan.rank // plan.a2a, layout=plan.layout)


def _gather_heads(plan: SitePlan, rotater: Rotater, x: torch.Tensor, index: int, same=None) -> torch.Tensor:
    """Replicated mode: every rank's ``x`` (its heads' shard of the ring across the all-to-all
    groups) gathered into the whole ``(B, H, N, D)``."""
    world = plan.world // plan.a2a
    ring = rotater.all_gather(x, plan.world, index, same).unflatten(0, (world, plan.a2a))
    heads = [assemble(ring[:, j], 2, x.shape[2], world=world, layout=plan.layout) for j in range(plan.a2a)]
    return torch.cat(heads, 1)


def _to_heads(plan: SitePlan, rotater: Rotater, x: torch.Tensor, index: int) -> torch.Tensor:
    """This rank's shard of the sequence for every head, ``(B, H, N / P, D)``, to its all-to-all
    group's tokens for its ``H / a2a`` heads, ``(B, H / a2a, N a2a / P, D)``: the ``j``-th rank
    of the group gets heads ``[j H / a2a, (j + 1) H / a2a)``, and the group's tokens are its
    shard of the ring across the groups (the whole sequence where one group holds every rank)."""
    b, h, n, d = x.shape
    a2a, group = plan.a2a, plan.rank // plan.a2a
    got = rotater.all_to_all(x.reshape(b, a2a, h // a2a, n, d).transpose(0, 1), a2a, index, group * a2a)
    return layout_of(plan.layout).regroup(got, 2, plan.n_local, plan.world, a2a, group)


def _to_sequence(plan: SitePlan, rotater: Rotater, x: torch.Tensor, index: int) -> torch.Tensor:
    """The inverse of ``_to_heads``: the group's tokens for this rank's heads back to this
    rank's shard of the sequence for every head."""
    a2a, group = plan.a2a, plan.rank // plan.a2a
    pieces = layout_of(plan.layout).split(x, 2, plan.n_local, plan.world, a2a, group)
    got = rotater.all_to_all(torch.stack(pieces), a2a, index, group * a2a)
    _, b, h, n, d = got.shape
    return got.transpose(0, 1).reshape(b, a2a * h, n, d)


def _exchanged_forward(plan: SitePlan, qkv: tuple, mask, docs, token):
    """``site_forward`` of an exchanging site: what it saves are q, k, v (and a given key bias)
    for its heads, as exchanged, and the inner call's out and lse; ``docs`` are every
    position's already."""
    inner = plan.inner
    rotater = Rotater(plan.group_name, token)
    if plan.replicated:
        tensors, docs, probe = _heads_at_hand(plan, qkv, mask, docs)
    else:
        tensors, probe = dict(zip("qkv", qkv)), None
        if mask is not None:  # every query head's key bias, exchanged as a one-wide tensor
            tensors["bias"] = _key_bias_rows(plan, mask, plan.n_local)
    run = _Exchanged(
        plan, rotater, tensors,
        lambda t: _Forward(inner, rotater, _Inputs.take(inner, (t["q"], t["k"], t["v"]), _bias_of(t), docs), None),
        probe=probe,
    )  # fmt: skip
    for step in build(plan, "forward").steps:
        run.run(step)
    out, bias = run.tensors["out"], _bias_of(run.tensors) if mask is not None else None
    with role("p2p"):
        rotater.close([out, run.inner.lse])
    saved = [run.tensors["q"], run.tensors["k"], run.tensors["v"], run.inner.saved_out, run.inner.lse]
    return _unpadded(plan, out), [*saved, *(x for x in (bias, docs) if x is not None), rotater.token]


def _key_bias_rows(plan: SitePlan, mask: torch.Tensor, keys: int) -> torch.Tensor:
    """A key bias ``(B|1, H|1, keys)`` as every query head's one-wide rows ``(B, H, keys, 1)``."""
    return mask.to(plan.dtype).expand(plan.batch, plan.hq, keys).unsqueeze(-1)


def _heads_at_hand(plan: SitePlan, qkv: tuple, mask, docs) -> tuple[dict, torch.Tensor | None, torch.Tensor]:
    """Replicated mode: this rank's heads' shard of q, k, v and of the key bias, taken from the
    whole inputs, padded first as one process would pad them (Note [Padding the sequence]);
    the padded document ids; the probe of query values for the output's gather."""
    tensors = dict(zip("qkv", _padded(plan, *qkv)))
    probe = _probe(plan, tensors["q"])
    mask = _padded_keys(plan, qkv[0], mask)
    if mask is not None:
        tensors["bias"] = _key_bias_rows(plan, mask, plan.n)
    docs = None if docs is None else _padded(plan, docs)[0]
    return {name: _own_heads(plan, name, x) for name, x in tensors.items()}, docs, probe


def _bias_of(tensors: dict) -> torch.Tensor | None:
    """The key bias ``(B, H / a2a, N a2a / P)`` of an exchanging call's heads."""
    return tensors["bias"].squeeze(-1) if "bias" in tensors else None


def _exchanged_backward(plan: SitePlan, dout, saved: tuple, bias, docs, token):
    """``site_backward`` of an exchanging site: ``saved`` (q, k, v, out, lse) and ``bias`` as
    its forward saved them."""
    inner = plan.inner
    q, k, v, out, lse = saved
    with role("p2p"):
        rotater = Rotater.resume(plan.group_name, token)
    heads = bias
    if plan.replicated:
        dout = _own_heads(plan, "dout", _padded(plan, dout)[0])
        if bias is None and inner.has_mask:  # the padded keys' bias alone, made again
            heads = _bias_of({"bias": _own_heads(plan, "bias", _key_bias_rows(plan, _padded_keys(plan, dout, None), plan.n))})
    run = _Exchanged(
        plan, rotater, {"dout": dout},
        lambda t: _Backward(inner, rotater, _Inputs.take(inner, (q, k, v), heads, docs, t["dout"]), out, lse, None),
    )  # fmt: skip
    for step in build(plan, "backward").steps:
        run.run(step)
    grads = [_unpadded(plan, run.tensors[name]) for name in ("dq", "dk", "dv")]
    with role("p2p"):
        rotater.close(grads)
    return (*grads, *(None for x in (bias, docs, token) if x is not None))
