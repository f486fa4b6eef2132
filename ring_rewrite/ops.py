"""Custom ops in the ``ring_rewrite`` namespace: block attention that returns its log-sum-exp.

``block_attention(q, k, v, bias, scale, is_causal) -> (out, lse)`` is one block of attention:
``q (B, Hq, L, D)``, ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)``, GQA by head groups
(query head j reads kv head ``j // (Hq // Hkv)``), an optional additive key bias broadcast to
``(B, Hq, L, S)``, causal top-left aligned. ``out`` has the input dtype, ``lse`` is float32
(float64 for float64 inputs: ``stat_dtype``)
``(B, Hq, L)`` in natural log and is ``-inf`` for a row with nothing to attend (the CPU flash
kernel reports 0 there). Each device's kernel comes from ``kernels.py``. With ``dropout_p > 0``
the block's probabilities drop, each with that probability, by a mask that the int64 ``seed``
and the block's identifier ``block`` fix (Note [Dropout in blocks]).

``block_attention_backward(dout, q, k, v, out, lse, bias, scale, is_causal[, dropout_p, seed,
block])`` is the fused
attention backward. Called with the *merged* ``out`` and ``lse`` of a row (the softmax over every
block the row attends to), it returns this block's exact share of the gradient
(Note [Backward from the merged statistics]); rows whose ``lse`` is
``+inf`` contribute nothing.

``dilated_block_attention(out, lse, q, k, v, layout, scale, is_causal, write[, real])`` is
``block_attention`` of a local branch's blocks, reading its rows where they lie in the site's
tensors and merging (with ``write``: writing) its results into the site's ``out`` and ``lse``,
and ``dilated_block_backward(dq, dk, dv, dout, q, k, v, out, lse, layout, scale, is_causal,
write[, real])`` their backward, adding (with ``write``: writing) the gradients into the site's,
in place (Note [Local branches in place]); with ``real``, a causal site's
count of real positions in a sequence padded to a length bucket, only the blocks' real rows.
``block_attention`` and its backward take ``real`` too, with the ``layout`` of a local branch
whose rows they hold: they compute its real rows and keys only (``_on_real_rows``).

``dilate(x, layout, kv, rows, fill, dtype)`` gathers a branch's rows (Note [Gathers as calls])
and ``undilate_add(total, y, layout, kv, rows, zero, start)`` adds them back, in place (Note
[Gradient sums as calls]). ``after(x, deps)`` and ``write_heads(total, x, start)`` order the
local branches' gradient sums (Note [Head chunks of local branches]);
``add_rows(total, x, start, rows, dtype)`` sums a ring step's gradients (Note [Gradient sums of a
ring step]).

With ``qbias (B|1, H|1, L)``, the key bias at each query row's own position, both ops add the
key bias less the row's own, in chunks of query rows, and the lse is relative to it (Note
[Recentred key biases]).

With ``band = [lo, hi]`` (``BAND_OPEN`` for an open end) and the rows' positions ``qpos (L,)``,
``kpos (S,)``, both ops let key ``t`` reach query ``p`` only if ``lo <= kpos[t] - qpos[p] <= hi``
(and ``t <= p`` when causal): the mask is built per chunk of query rows, at most ``BAND_CHUNK``
scores at a time (Note [Bands]).

Note [Gathers as calls]
~~~~~~~~~~~~~~~~~~~~~~~
Where a branch's rows do not stay in place (``r > 1``, or padding), the gather is one call of
``ops.dilate``: per kernel head, one strided copy of that head's lattice rows, whose head and
offset are Python ints of the call. Written as indexing, each gather would be a C++ kernel of
inductor's with the branch's sizes, heads and lattice offsets baked in (per ring branch one for
q, k, v in the forward and two in the backward, one more per head chunk of the local branches'
backward), each its own compile (``benchmarks/compile_cost.py --site`` counts a site's
kernels). A gather is a copy whatever compiles it (a block op reads a buffer, never a fused
input), so nothing is lost at run time; the graph still shows one node per gather, role
``dilate``. The way back is a call too in the backward (Note [Gradient sums as calls]); the
forward's undilation stays a torch op, fused with the merge it feeds.

Note [Gradient sums as calls]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A branch's dq, dk, dv go back to the site's rows by ``ops.undilate_add``: per kernel head one
strided add into a running total, in place, the adjoint of the gather. The first branch to reach
a total allocates it in ``stat_dtype`` and zeroes it (or writes it, at rate 1 without padding,
where every position gets one row); later ones add. A ring's dq waits, dilated (``1 / r`` of
q), and is added to the local branches' sums of each head chunk.
As torch ops (an undilation with zeros off the lattice, an ``index_add`` for kv heads not
shared), inductor would fuse the sum of every branch into kernels per head chunk of the local
branches, with the chunk's lattice offsets baked in, and hold every branch's gradients until
they ran (Note [Memory of a site]). As calls the backward compiles no kernel
per chunk, and a branch's gradients are freed once added. The forward's merge
stays pointwise (docs/semantics.md, The rewritten graph): it weighs each branch's out by every
branch's lse.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from . import cpu_kernel
from .dilation import BranchLayout
from .kernels import block_kernel, dropout_backward, dropout_forward
from .merge import merge_partials
from .numerics import mask_floor, stat_dtype

__all__ = [
    "add_rows", "after", "block_attention", "block_attention_backward", "dilate", "dilated_block_attention",
    "dilated_block_backward", "documents", "kernel_calls", "kernel_pairs", "real_calls", "undilate_add", "write_heads",
]  # fmt: skip


def _empty_rows(bias: torch.Tensor, lse_shape: torch.Size, is_causal: bool) -> torch.Tensor:
    """Rows of ``lse_shape`` (B, H, L) whose every key is masked by ``bias`` (.., 1 or L, S)."""
    live = bias != float("-inf")  # a NaN is no mask: it makes the rows that see it NaN
    if not is_causal:
        return ~live.any(-1).expand(lse_shape)
    # Causal, top-left: row i sees keys 0..i, so it is empty when no live key lies at or before i.
    seen = live.cumsum(-1) > 0
    rows = torch.arange(lse_shape[-1], device=bias.device).clamp_max(seen.shape[-1] - 1)
    if seen.shape[-2] == 1:
        any_live = seen[..., 0, :].index_select(-1, rows)
    else:
        any_live = seen.gather(-1, rows.view(-1, 1).expand(*seen.shape[:-1], 1)).squeeze(-1)
    return ~any_live.expand(lse_shape)


def _attend(q, k, v, bias, scale, is_causal, dropout_p, seed, block):
    if dropout_p:
        out, lse = dropout_forward(q, k, v, bias, scale, is_causal, dropout_p, seed, block)
    else:
        out, lse = block_kernel(q.device).forward(q, k, v, bias, scale, is_causal)
    out = out.contiguous()
    lse = lse.to(stat_dtype(q.dtype)).contiguous()
    if bias is not None:
        lse = lse.masked_fill(_empty_rows(bias, lse.shape, is_causal), float("-inf"))
    return out, lse


BAND_CHUNK = 1 << 22
"""Scores per chunk of query rows when a band or a row's own bias is applied (Note [Bands],
Note [Recentred key biases])."""


def _band_chunks(q, k, bias, is_causal, band, qpos, kpos, qdoc, kdoc, qbias):
    """Query rows ``[r0, r1)`` of each chunk and the chunk's additive bias ``(B|1, H|1, rows,
    S)``: the key bias (less each row's own, ``qbias``, where given) plus ``-inf`` outside the
    band (and above the diagonal when causal), and between different documents.

    A row's own bias that masks (``-inf``, transformers' ``finfo.min`` fill: a padded position;
    Note [Fills that mask]) is taken as 0; any constant of a row gives the
    same softmax."""
    lo, hi, relation = _band(band) if band is not None else (None, None, None)
    if is_causal:
        hi = 0 if hi is None else min(hi, 0)
    if qpos is None:  # top-left aligned positions of the block's rows
        qpos, kpos = torch.arange(q.shape[2], device=q.device), torch.arange(k.shape[2], device=q.device)
    rows = max(1, BAND_CHUNK // max(1, q.shape[0] * q.shape[1] * k.shape[2]))
    dtype = q.dtype if bias is None else bias.dtype
    own = None
    if qbias is not None:
        own = torch.where(qbias > mask_floor(qbias.dtype), qbias, 0.0).to(dtype).unsqueeze(-1)
    for r0 in range(0, q.shape[2], rows):
        r1 = min(r0 + rows, q.shape[2])
        chunk = bias
        if lo is not None or hi is not None or qdoc is not None:
            d = kpos.view(1, -1) - qpos[r0:r1].view(-1, 1)
            allowed = torch.ones_like(d, dtype=torch.bool)
            if lo is not None:
                allowed &= d >= lo
            if hi is not None:
                allowed &= d <= hi
            allowed = allowed.view(1, 1, r1 - r0, -1)
            if qdoc is not None:
                allowed = allowed & relation(kdoc[:, :, None, :], qdoc[:, :, r0:r1, None])
            # where, not a sum: a NaN in the key bias must not reach pairs outside the band
            # (Note [Non-finite values] in cpu_kernel.py).
            outside = torch.tensor(float("-inf"), dtype=dtype, device=q.device)
            chunk = torch.where(allowed, outside.new_zeros(()) if chunk is None else chunk, outside)
        if own is not None:
            chunk = chunk - own[:, :, r0:r1]
        yield r0, r1, chunk


@torch.library.custom_op("ring_rewrite::block_attention", mutates_args=())
def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
    block: list[int] | None = None,
    band: list[int] | None = None,
    qpos: torch.Tensor | None = None,
    kpos: torch.Tensor | None = None,
    qdoc: torch.Tensor | None = None,
    kdoc: torch.Tensor | None = None,
    qbias: torch.Tensor | None = None,
    layout: list[int] | None = None,
    real: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if real is not None:
        results = lambda: [  # noqa: E731
            q.new_zeros((*q.shape[:-1], v.shape[-1])), q.new_full(q.shape[:-1], float("-inf"), dtype=stat_dtype(q.dtype))
        ]
        args = dict(q=q, k=k, v=v, bias=bias, qpos=qpos, kpos=kpos, qdoc=qdoc, kdoc=kdoc, qbias=qbias)
        rest = dict(scale=scale, is_causal=is_causal, dropout_p=dropout_p, seed=seed, block=block, band=band)
        return tuple(_on_real_rows(_block_forward, BranchLayout(*layout), int(real), args, rest, results))
    return _block_forward(q, k, v, bias, scale, is_causal, dropout_p, seed, block, band, qpos, kpos, qdoc, kdoc, qbias)


def _block_forward(q, k, v, bias, scale, is_causal, dropout_p, seed, block, band, qpos, kpos, qdoc, kdoc, qbias):
    if band is None and qbias is None:
        return _attend(q, k, v, bias, scale, is_causal, dropout_p, seed, block)
    chunks = _band_chunks(q, k, bias, is_causal, band, qpos, kpos, qdoc, kdoc, qbias)
    outs, lses = [], []
    for c, (r0, r1, chunk_bias) in enumerate(chunks):
        chunk_block = None if block is None else [*block, c]
        out, lse = _attend(q[:, :, r0:r1], k, v, chunk_bias, scale, False, dropout_p, seed, chunk_block)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _band(band: list[int]) -> tuple:
    """The op's ``band`` argument ``[lo, hi[, relation]]`` (``BAND_OPEN`` for an open end; the
    index in ``RELATIONS`` of how a key's document id compares to its query's) as ``(lo, hi,
    comparison)``."""
    lo, hi = (None if x == BAND_OPEN else x for x in band[:2])
    return lo, hi, RELATIONS[band[2] if len(band) > 2 else 0][1]


RELATIONS = (("eq", operator.eq), ("le", operator.le), ("lt", operator.lt), ("ge", operator.ge), ("gt", operator.gt))
"""Document relations by their code in ``band``: key id <relation> query id."""


BAND_OPEN = -(1 << 62)
"""An open end of a band in the ops' ``band`` argument (a list of ints has no None)."""


def _on_real_rows(fn, lay: BranchLayout, real: int, rows: dict, rest: dict, make) -> list:
    """``fn(**rows, **rest)`` over the real rows of a local branch of a sequence padded to a
    length bucket (Note [Padding to a bucket]), its results written into those ``make()`` makes (the
    kernel layout's rows, left as they are made elsewhere): the segments all of whose rows are
    real in one call, the next one's first rows (the most real rows of any head) in another, no
    later segment. ``rows`` are the tensors of the kernel layout, cut along their rows (keys
    for ``bias``, the only dim of ``qpos`` and ``kpos``); a bucket's rate-1 branch gives the
    site's real rows instead (``_on_site_rows``)."""
    if _site_rows(lay, rows["q"]):
        return _on_site_rows(fn, lay, rows, rest)
    calls = real_calls(lay, real)
    if calls == [KernelCall(0, lay.nseg, lay.m)]:  # every row real: no copy
        return list(fn(**rows, **rest))
    results = make()
    for j, call in enumerate(calls):
        first, segments, count = call.first, call.segments, call.rows
        cut = {name: _segment_rows(x, lay, first, segments, count, _ROW_DIM.get(name, 2)) for name, x in rows.items()}
        for total, part in zip(results, fn(**cut, **_call_of(rest, j))):
            where = total.unflatten(0, (lay.batch, lay.nseg)).narrow(1, first, segments).narrow(3, 0, count)
            where.copy_(part.unflatten(0, (lay.batch, segments)))
    return results


def real_calls(lay: BranchLayout, real: int) -> list[KernelCall]:
    """The block calls of a gathered local branch over the first ``real`` positions
    (``_on_real_rows``): the segments all of whose rows are real, then the next one's first
    rows, the most real rows of any head there, every head."""
    whole, parts = lay.real_rows(real)
    last = max(parts.values(), default=0)
    return [KernelCall(0, whole, lay.m)] * bool(whole) + [KernelCall(whole, 1, last)] * bool(last)


_ROW_DIM = {"bias": 3, "qpos": 0, "kpos": 0}
"""Where the rows (keys) lie in a block op's tensors that are not dim 2."""


def _segment_rows(x: torch.Tensor | None, lay: BranchLayout, first: int, segments: int, count: int, dim: int):
    """Segments ``[first, first + segments)`` of ``x`` in a local branch's kernel layout
    ``(B * nseg, ...)`` (where it is one per segment, not broadcast), their first ``count`` rows
    along ``dim``."""
    if x is None:
        return None
    if x.dim() > 1 and x.shape[0] == lay.batch * lay.nseg:
        x = x.unflatten(0, (lay.batch, lay.nseg)).narrow(1, first, segments).flatten(0, 1)
    return x.narrow(dim, 0, count)


@block_attention.register_fake
def _(q, k, v, bias, scale, is_causal, dropout_p=0.0, seed=None, block=None, band=None, qpos=None, kpos=None,
      qdoc=None, kdoc=None, qbias=None, layout=None, real=None):  # fmt: skip
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(q.shape[:-1], dtype=stat_dtype(q.dtype))
    return out, lse


@torch.library.custom_op("ring_rewrite::block_attention_backward", mutates_args=())
def block_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
    block: list[int] | None = None,
    band: list[int] | None = None,
    qpos: torch.Tensor | None = None,
    kpos: torch.Tensor | None = None,
    qdoc: torch.Tensor | None = None,
    kdoc: torch.Tensor | None = None,
    qbias: torch.Tensor | None = None,
    layout: list[int] | None = None,
    real: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if real is not None:
        args = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, bias=bias, qpos=qpos, kpos=kpos, qdoc=qdoc, kdoc=kdoc, qbias=qbias)
        rest = dict(scale=scale, is_causal=is_causal, dropout_p=dropout_p, seed=seed, block=block, band=band)
        grads = lambda: [torch.zeros_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)]  # noqa: E731
        return tuple(_on_real_rows(_block_backward, BranchLayout(*layout), int(real), args, rest, grads))
    return _block_backward(dout, q, k, v, out, lse, bias, scale, is_causal, dropout_p, seed, block, band, qpos, kpos, qdoc, kdoc, qbias)


def _block_backward(dout, q, k, v, out, lse, bias, scale, is_causal, dropout_p, seed, block, band, qpos, kpos, qdoc, kdoc, qbias):
    # A row with nothing to attend has lse = -inf; +inf makes its probabilities exp(s - lse) zero.
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    if band is None and qbias is None:
        return _attend_backward(dout, q, k, v, out, lse, bias, scale, is_causal, dropout_p, seed, block)
    dqs, dk, dv = [], None, None
    acc = stat_dtype(q.dtype)
    chunks = _band_chunks(q, k, bias, is_causal, band, qpos, kpos, qdoc, kdoc, qbias)
    for c, (r0, r1, chunk_bias) in enumerate(chunks):
        rows = slice(r0, r1)
        chunk_block = None if block is None else [*block, c]
        dq_c, dk_c, dv_c = _attend_backward(
            dout[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows], chunk_bias,
            scale, False, dropout_p, seed, chunk_block,
        )  # fmt: skip
        dqs.append(dq_c)
        dk = dk_c.to(acc) if dk is None else dk + dk_c
        dv = dv_c.to(acc) if dv is None else dv + dv_c
    return torch.cat(dqs, 2), dk.to(k.dtype), dv.to(v.dtype)


def _attend_backward(dout, q, k, v, out, lse, bias, scale, is_causal, dropout_p, seed, block):
    if dropout_p:
        return dropout_backward(dout, q, k, v, out, lse, bias, scale, is_causal, dropout_p, seed, block)
    return block_kernel(q.device).backward(dout, q, k, v, out, lse, bias, scale, is_causal)


@block_attention_backward.register_fake
def _(dout, q, k, v, out, lse, bias, scale, is_causal, dropout_p=0.0, seed=None, block=None, band=None, qpos=None,
      kpos=None, qdoc=None, kdoc=None, qbias=None, layout=None, real=None):  # fmt: skip
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.custom_op("ring_rewrite::after", mutates_args=())
def after(x: torch.Tensor, deps: list[torch.Tensor]) -> torch.Tensor:
    """A copy of ``x`` that exists only once ``deps`` do: whatever reads it runs after the
    compute of ``deps``, where nothing else would order a compiler's schedule (Note [Head chunks
    of local branches]). ``x`` should be small: an op's output may not alias
    its input, so it is copied."""
    return x.clone(memory_format=torch.contiguous_format)


@after.register_fake
def _(x, deps):
    return x.new_empty(x.shape)


@torch.library.custom_op("ring_rewrite::write_heads", mutates_args=("total",))
def write_heads(total: torch.Tensor, x: torch.Tensor, start: int) -> None:
    """``x`` copied into heads ``[start, start + x.shape[1])`` (dim 1) of ``total``, in place:
    a chunk's result lands in the site's result without a concatenation that would hold every
    chunk's (Note [Head chunks of local branches])."""
    total.narrow(1, start, x.shape[1]).copy_(x)


@torch.library.custom_op("ring_rewrite::add_rows", mutates_args=())
def add_rows(total: torch.Tensor | None, x: torch.Tensor, start: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """``total (B, H, rows, C)`` (zeros where None) plus ``x (B, H, L, C)`` at rows ``[start,
    start + L)``, in ``dtype``: a ring step's gradient sums (Note [Gradient sums of a ring step])."""
    if total is None:
        out = x.new_zeros((*x.shape[:2], rows, x.shape[3]), dtype=dtype)
    else:
        out = total.to(dtype, copy=True)
    out.narrow(2, start, x.shape[2]).add_(x)
    return out


@add_rows.register_fake
def _(total, x, start, rows, dtype):
    return x.new_empty((*x.shape[:2], rows, x.shape[3]), dtype=dtype)


def _call_of(rest: dict, index: int) -> dict:
    """``rest`` of one of the calls a block is cut into: with dropout, the block's identifier and
    the call's, so that no two calls draw the same stream (Note [Dropout in blocks])."""
    if rest.get("block") is None:
        return rest
    return {**rest, "block": [*rest["block"], index]}


def _site_rows(lay: BranchLayout, x: torch.Tensor) -> bool:
    """Whether ``x`` of a rate-1 local branch holds the site's rows ``(B, H, n', C)`` (a length
    bucket's real ones, ``n' <= n``), not the kernel layout's ``(B * nseg, H, m, C)``: a bucket's
    rate-1 branch is never gathered (Note [Padding to a bucket]). Where both are one segment of
    every row, they are the same tensor."""
    return lay.r == 1 and (x.shape[0], x.shape[2]) != (lay.batch * lay.nseg, lay.m)


_POSITIONS = ("qpos", "kpos")


def _segment_positions(name: str, x, count: int):
    """A band's positions (``qpos``, ``kpos``: a segment's, the same in every segment) of a
    call over a segment's first ``count`` rows; any other tensor as it is."""
    return x.narrow(0, 0, count) if name in _POSITIONS and x is not None else x


def _on_site_rows(fn, lay: BranchLayout, rows: dict, rest: dict) -> list:
    """``fn(**rows, **rest)`` of a rate-1 local branch over the site's real rows ``(B, H, n',
    ...)`` (``_site_rows``), its results in that layout: the whole segments in one call, their
    views as the kernel layout's batch, the last one's rows in another. No row is copied in
    (with a batch of one) and none past ``n'`` exists. Each result is allocated as its first
    part lands and the part dropped once copied, so that at most one of them is held twice."""
    n = rows["q"].shape[2]
    if n <= lay.seg:  # one segment: the kernel layout is the site's
        return list(fn(**{name: _segment_positions(name, x, n) for name, x in rows.items()}, **rest))
    whole, tail = divmod(n, lay.seg)
    results: list = []
    for first, segments, count in ((0, whole, lay.seg), (whole, 1, tail)):
        if not segments or not count:
            continue

        def cut(x, dim):
            if x is None:
                return None
            x = x.narrow(dim, first * lay.seg, segments * count).unflatten(dim, (segments, count)).movedim(dim, 1)
            return x.expand(lay.batch, *x.shape[1:]).flatten(0, 1)

        def cut_rows(name, x):
            return _segment_positions(name, x, count) if name in _POSITIONS else cut(x, _ROW_DIM.get(name, 2))

        parts = list(fn(**{name: cut_rows(name, x) for name, x in rows.items()}, **_call_of(rest, first)))
        for j in range(len(parts)):
            part, parts[j] = parts[j], None
            if len(results) == j:
                results.append(part.new_empty((lay.batch, part.shape[1], n, *part.shape[3:])))
            where = results[j].narrow(2, first * lay.seg, segments * count).unflatten(2, (segments, count))
            where.movedim(2, 1).copy_(part.unflatten(0, (lay.batch, segments)))
            del part
    return results


@torch.library.custom_op("ring_rewrite::dilate", mutates_args=())
def dilate(
    x: torch.Tensor, layout: list[int], kv: bool, rows: bool, fill: float, dtype: torch.dtype
) -> torch.Tensor:
    """``x (B, H, n, C)`` dilated by the branch ``layout`` (``BranchLayout``'s fields ``w, r, n,
    batch, hq, hkv, head0``) into a buffer of its own, in ``dtype``: the kv rows (``kv``) or the
    query rows (off the sequence: ``fill``), in kernel layout or, with ``rows``, a ring branch's
    (``BranchLayout.gather``; Note [Gathers as calls])."""
    return BranchLayout(*layout).gather(x, kv=kv, rows=rows, fill=fill, dtype=dtype)


@dilate.register_fake
def _(x, layout, kv, rows, fill, dtype):
    shape = BranchLayout(*layout).gathered_shape(x.shape[0], x.shape[-1], kv=kv, rows=rows)
    return x.new_empty(shape, dtype=dtype)


@torch.library.custom_op("ring_rewrite::undilate_add", mutates_args=("total",))
def undilate_add(
    total: torch.Tensor, y: torch.Tensor, layout: list[int], kv: bool, rows: bool, zero: bool, start: int
) -> None:  # fmt: skip
    """``y``, a branch's dilated rows in ``dilate``'s layout (``kv``, ``rows`` as there), added in
    place at their positions of heads ``[start, start + H)`` (dim 1) of ``total (B, H', n, C)``,
    ``H`` the layout's kv or query heads; with ``zero``, those heads are zeroed first
    (``BranchLayout.scatter_add``; Note [Gradient sums as calls]). ``y`` of a bucket's rate-1
    branch holds the site's rows (``_site_rows``), ``total``'s real ones."""
    lay = BranchLayout(*layout)
    heads = total.narrow(1, start, lay.hkv if kv else lay.hq)
    if not rows and _site_rows(lay, y):  # a bucket's rate-1 branch: the site's rows already
        heads.copy_(y) if zero else heads.add_(y)
        return
    lay.scatter_add(heads, y, kv=kv, rows=rows, zero=zero)


def _in_place(layout: BranchLayout, *operands: torch.Tensor) -> bool:
    """Whether ``flash_cpu.c`` reads and writes ``operands`` at ``layout``'s lattice."""
    ours = cpu_kernel.serves(*operands, bias=None) and all(x.stride(-1) == 1 for x in operands)
    return ours and layout.in_place


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One kernel call of a local branch in place: ``segments`` from segment ``first`` on, their
    first ``rows`` rows (and keys), the kernel heads at lattice ``offsets`` (None: all)."""

    first: int
    segments: int
    rows: int
    offsets: tuple[int, ...] | None = None

    def layouts(self, lay: BranchLayout, tensors, kinds) -> tuple[list, list[list[int]]]:
        """The call's views of ``tensors`` (from its first segment) and their lattices (of its
        heads), ``kinds`` saying which hold kv rows."""
        views = [x.narrow(2, self.first * lay.seg, x.shape[2] - self.first * lay.seg) for x in tensors]
        lattices = []
        for x, kv in zip(views, kinds):
            lattice = lay.lattice(x, kv=kv)
            if self.offsets is not None:
                lattice = lattice[:3] + [lattice[3 + a] for a in lay.kernel_heads(self.offsets, kv=kv)]
            lattices.append(lattice)
        return views, lattices

    def sizes(self, lay: BranchLayout, q: torch.Tensor, v: torch.Tensor) -> list[int]:
        """``cpu_kernel``'s sizes of the call (``_sizes`` of its kernel layout)."""
        hq, hkv = lay.hq, lay.kv_heads
        if self.offsets is not None:
            hq, hkv = (len(lay.kernel_heads(self.offsets, kv=kv)) for kv in (False, True))
        return [lay.batch * self.segments, hq, hkv, self.rows, self.rows, q.shape[-1], v.shape[-1]]


def kernel_calls(lay: BranchLayout, real: torch.Tensor | int | None, is_causal: bool) -> list[KernelCall]:
    """The kernel calls of a local branch in place: every segment whole, or with ``real`` (the
    count of real positions of a causal sequence padded to a length bucket: Note [Padding to a
    bucket]) the segments that hold real rows, the last cut to
    each head's real rows (and keys: causal rows attend no later key), heads of the same count
    in one call. A row past them is padding and is neither read nor written."""
    if real is None or not is_causal:
        return [KernelCall(0, lay.nseg, lay.m)]
    whole, parts = lay.real_rows(int(real))
    calls = [KernelCall(0, whole, lay.m)] if whole else []
    for rows in sorted(set(parts.values())):
        if rows:
            offsets = tuple(o for o, r in parts.items() if r == rows)
            calls.append(KernelCall(whole, 1, rows, None if len(offsets) == len(parts) else offsets))
    return calls


def kernel_pairs(lay: BranchLayout, real: int | None, is_causal: bool, *, in_place: bool = True) -> int:
    """Query-key pairs per batch element that a local branch's calls compute: ``kernel_calls``
    in place, else ``real_calls`` (a causal row attends itself and the rows before it; a call
    cut to its real rows cuts its keys too)."""
    total = 0
    if in_place:
        calls = kernel_calls(lay, real, is_causal)
    else:
        calls = [KernelCall(0, lay.nseg, lay.m)] if real is None else real_calls(lay, real)
    for call in calls:
        heads = lay.hq if call.offsets is None else len(lay.kernel_heads(call.offsets, kv=False))
        pairs = call.rows * (call.rows + 1) // 2 if is_causal else call.rows * call.rows
        total += call.segments * heads * pairs
    return total


def _past_real(lay: BranchLayout, calls: list[KernelCall]) -> int:
    """The first position no call computes, at rate 1 (where ``write`` is allowed)."""
    return max(((c.first + c.segments - 1) * lay.seg + c.rows for c in calls), default=0)


@torch.library.custom_op("ring_rewrite::dilated_block_attention", mutates_args=("out", "lse"))
def dilated_block_attention(
    out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: list[int],
    scale: float, is_causal: bool, write: bool, real: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """``block_attention`` of a local branch (``layout``, one block per segment, no bias) over the
    site's ``q, k, v (B, H, n, C)``, its rows' results merged into the site's ``out (B, Hq, n,
    Dv)`` and ``lse (B, Hq, n)`` in place: the softmax over the keys of both (``merge_partials``;
    a row of lse ``-inf`` holds none), or with ``write`` written, every position of the layout's
    heads, which then must be all of them (rate 1). ``flash_cpu.c`` reads and writes the rows
    where they lie (``BranchLayout.lattice``), with ``real`` only the real ones (``kernel_calls``;
    written rows past them are 0 and ``-inf``); elsewhere they are gathered, attended (the real
    rows only: ``real_calls``) and merged, and written back."""
    lay = BranchLayout(*layout)
    if _in_place(lay, q, k, v, out, lse):
        calls = kernel_calls(lay, real, is_causal)
        for call in calls:
            views, layouts = call.layouts(lay, (q, k, v, out, lse), (False, True, True, False, False))
            sizes = call.sizes(lay, q, v)
            cpu_kernel.forward_in_place(views[3:], views[:3], layouts, sizes, call.segments, scale, is_causal, not write)
        if write and real is not None:
            end = _past_real(lay, calls)
            out.narrow(2, end, out.shape[2] - end).zero_()
            lse.narrow(2, end, lse.shape[2] - end).fill_(float("-inf"))
        return

    q_dilated, k_dilated, v_dilated = lay.gather(q), lay.gather(k, kv=True), lay.gather(v, kv=True)
    cut = {"layout": layout, "real": real} if real is not None and is_causal else {}
    out_dilated, lse_dilated = block_attention(q_dilated, k_dilated, v_dilated, None, scale, is_causal, **cut)
    if not write:
        running_out, running_lse = lay.gather(out), lay.gather(lse.unsqueeze(-1)).squeeze(-1)
        running_out = torch.where(running_lse.isneginf().unsqueeze(-1), 0.0, running_out)  # holds nothing
        out_dilated, lse_dilated = merge_partials([running_out, out_dilated], [running_lse, lse_dilated])
    lay.scatter(out, out_dilated.to(out.dtype))
    lay.scatter(lse.unsqueeze(-1), lse_dilated.unsqueeze(-1))


@dilated_block_attention.register_fake
def _(out, lse, q, k, v, layout, scale, is_causal, write, real=None) -> None:
    return None


@torch.library.custom_op("ring_rewrite::dilated_block_backward", mutates_args=("dq", "dk", "dv"))
def dilated_block_backward(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, layout: list[int], scale: float, is_causal: bool,
    write: bool, real: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """The backward of a local branch (``layout``, one block per segment, no bias) over the
    site's ``q, k, v (B, H, n, C)``, ``dout``, merged ``out`` and ``lse (B, Hq, n)``: its
    ``dq, dk, dv`` added into the site's (with ``write``: written, every position of the
    layout's heads, which then must be all of them: rate 1), in place. ``flash_cpu.c`` reads and
    writes the rows where they lie (``BranchLayout.lattice``), with ``real`` only the real ones
    (``kernel_calls``; written gradients past them are 0); elsewhere the rows are gathered, run
    through the block kernel (the real rows only: ``real_calls``) and added back."""
    lay = BranchLayout(*layout)
    operands = (dout, q, k, v, out, lse, dq, dk, dv)
    if _in_place(lay, *operands):
        kinds = (False, False, True, True, False, False, False, True, True)  # kv rows?
        calls = kernel_calls(lay, real, is_causal)
        for call in calls:
            views, layouts = call.layouts(lay, operands, kinds)
            sizes = call.sizes(lay, q, v)
            cpu_kernel.backward_in_place(views[6:], views[:6], layouts, sizes, call.segments, scale, is_causal, not write)
        if write and real is not None:
            end = _past_real(lay, calls)
            for grad in (dq, dk, dv):
                grad.narrow(2, end, grad.shape[2] - end).zero_()
        return
    q_dilated, dout_dilated, out_dilated = (lay.gather(x) for x in (q, dout, out))
    k_dilated, v_dilated = (lay.gather(x, kv=True) for x in (k, v))
    lse_dilated = lay.gather(lse.unsqueeze(-1), fill=float("inf")).squeeze(-1)
    cut = {"layout": layout, "real": real} if real is not None and is_causal else {}
    grads = block_attention_backward(
        dout_dilated, q_dilated, k_dilated, v_dilated, out_dilated, lse_dilated, None, scale, is_causal, **cut
    )
    for total, g, kv in zip((dq, dk, dv), grads, (False, True, True)):
        lay.scatter_add(total, g, kv=kv, zero=write)


@torch.library.custom_op("ring_rewrite::documents", mutates_args=())
def documents(docs: torch.Tensor, shift: torch.Tensor | None, where: str) -> torch.Tensor:
    """``docs (B|1, N)``, the document id of each key, after checking that ``shift`` (positions
    a mask compares, minus the keys' own) is constant within each document, so that comparing
    those positions is comparing the keys' (``passes/masks.py``, ``MaskStructure.positions``).
    Raises naming ``where`` otherwise: never a different function."""
    if shift is not None:
        b = max(docs.shape[0], shift.shape[0])
        d, s = docs.expand(b, -1), shift.expand(b, -1)
        order = d.argsort(dim=-1, stable=True)
        d, s = d.gather(-1, order), s.gather(-1, order)
        if bool(((d[:, 1:] == d[:, :-1]) & (s[:, 1:] != s[:, :-1])).any()):
            raise ValueError(
                f"ring_rewrite: the mask of the site at {where} compares position values that do "
                "not step by one within a document (position_ids of a packed sequence must count "
                "up by one inside each sequence); its structure does not hold for these inputs. A "
                "mask that compares other per-token values so is read as a band over positions: "
                "pass it to the compiled function as a tensor, where it is left alone"
            )
    return docs.clone()


@documents.register_fake
def _(docs, shift, where):
    return docs.new_empty(docs.shape)


@torch.library.custom_op("ring_rewrite::block_ends", mutates_args=())
def block_ends(groups: torch.Tensor, where: str) -> torch.Tensor:
    """``groups (B|1, N)``, each key's block id (``>= 0``; none below 0), as the ids of a
    block-causal relation: the last position of the key's block, or its own position outside
    every block (``passes/masks.py``, ``MaskStructure.blocks``). Raises naming ``where`` if an
    id's positions are not one run: then no such ids exist, never a different function."""
    n = groups.shape[-1]
    changes = groups[:, 1:] != groups[:, :-1]
    first = torch.cat([torch.ones_like(groups[:, :1], dtype=torch.bool), changes], dim=-1)
    for row, starts in zip(groups, first):
        ids = row[starts & (row >= 0)]
        if ids.unique().numel() != ids.numel():
            raise ValueError(
                f"ring_rewrite: the mask of the site at {where} makes blocks bidirectional "
                "(g[t] == g[p] and g[p] >= 0), and a block id appears in more than one run of "
                "positions; its structure does not hold for these inputs"
            )
    position = torch.arange(n, device=groups.device).expand(groups.shape)
    last = torch.cat([changes, torch.ones_like(groups[:, :1], dtype=torch.bool)], dim=-1)
    ends = torch.where(last, position, n).flip(-1).cummin(-1).values.flip(-1)
    return torch.where(groups >= 0, ends, position)


@block_ends.register_fake
def _(groups, where):
    return groups.new_empty(groups.shape, dtype=torch.int64)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, scale, is_causal, *drop = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, out, lse)
    ctx.scale, ctx.is_causal, ctx.drop = scale, is_causal, drop


def _backward(ctx, dout, dlse):
    q, k, v, bias, out, lse = ctx.saved_tensors
    args = (ctx.scale, ctx.is_causal, *ctx.drop)
    dq, dk, dv = block_attention_backward(dout, q, k, v, out, lse, bias, *args)
    if dlse is not None:
        # d lse / d s = P, so dlse adds P * dlse to dS. The kernel's dS is P * (dP - rowsum(dO*O));
        # with v = 0, dO = 1 and O = -dlse / Dv it is exactly P * dlse.
        ones = torch.ones_like(dout)
        fake_out = (-dlse / dout.shape[-1]).unsqueeze(-1).to(out.dtype).expand_as(out).contiguous()
        dq2, dk2, _ = block_attention_backward(ones, q, k, torch.zeros_like(v), fake_out, lse, bias, *args)
        dq, dk = dq + dq2, dk + dk2
    return dq, dk, dv, *(None for _ in range(3 + len(ctx.drop)))


block_attention.register_autograd(_backward, setup_context=_setup_context)
