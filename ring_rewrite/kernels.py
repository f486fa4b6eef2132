"""Block attention kernels by device: the one table that says what runs a block, and where.

``ring_rewrite::block_attention`` and its backward (``ops.py``) call the entry of their inputs'
device; the finder (``passes/find_sdpa.py``) asks ``kernel_unsupported_reason`` whether a site's
inputs can run at all; a site's plan asks ``compute_dtype`` what its blocks compute in. A new
device is one ``BlockKernel`` in ``KERNELS``.

An entry's ``forward`` returns ``(out, lse)`` with ``lse`` in natural log, shape ``(B, Hq, L)``,
any float dtype; what it reports for a row with nothing to attend does not matter (the op sets
``-inf`` there). Its ``backward`` gets the *merged* ``out`` and ``lse`` of each row, with ``+inf``
for a row with nothing to attend, and returns this block's exact share of ``dq, dk, dv``,
contiguous, in the inputs' dtypes (Note [Backward from the merged statistics]).

Note [Dropout in blocks]
~~~~~~~~~~~~~~~~~~~~~~~~
With ``dropout_p > 0`` no fused kernel serves: each draws its own random mask, and ours must be
drawn again, the same, by the backward. So every device runs the same torch code
(``dropout_forward`` / ``dropout_backward``), query rows in chunks of at most ``DROPOUT_CHUNK``
scores. A chunk's keep-mask comes from a generator seeded with a hash of the site call's
``seed`` and the block's identifier (``block``: rank, branch, head chunk, ring step, block, then
the row chunk): forward and backward draw it alike, and no two blocks of a call share a stream.
A block's ``lse`` is that of its undropped scores, so merging by it drops probabilities of the
merged softmax (docs/semantics.md, Dropout): ``O = sum_t Z_t exp(s_t - L) v_t`` with
``Z_t = keep_t / (1 - p)``, whose expectation is the undropped ``O``. With ``P = exp(s - L)``
and ``O`` the merged (dropped) output, the backward is
``dS = P * (Z * dO·v - rowsum(dO * O))``, ``dV = (P * Z)^T dO``.

Note [The CUDA kernels]
~~~~~~~~~~~~~~~~~~~~~~~
The CUDA entry runs each block on one of torch's fused attention kernels that return the
log-sum-exp and take the merged statistics in their backward (``CUDA_CANDIDATES``): FlashAttention
(``aten._scaled_dot_product_flash_attention``: half inputs, no bias, head sizes to 256, GQA
without repeating K/V), cuDNN's (half inputs, no bias, head sizes to 128, GQA without
repeating) and the memory-efficient kernel (every dtype, a bias, K/V heads repeated for GQA; it
serves every block). Flash and cuDNN align a causal mask bottom-right where ours is top-left, so
they serve a causal block only when it is square (every causal block of a site is). A block
runs on the first candidate of ``CUDA_ORDER`` that serves it, the memory-efficient kernel last;
the choice is made at run time, per block, so a compiled graph does not depend on it.
``benchmarks/gpu_kernels.py`` checks each candidate against float64 and times it, per case
(dtype, causal or not, GQA, head size), and ``CUDA_ORDER`` is to follow what it measures. Until a
GPU has run it, ``CUDA_ORDER`` holds the memory-efficient kernel alone, the one that has run.

FlexAttention is timed beside them, not a candidate: its backward starts from its own output
and log-sum-exp, so a block given the merged ones would run its forward again first (the
gradient of the merged output through the block's ``(out, lse)``), and on CPU it has no backward
at all to develop against. ``gpu_kernels.py``'s flex rows say whether it could still pay.

Tests: ``tests/test_cuda.py`` (skipped without a CUDA device) runs each candidate in bf16 and
fp16 under inductor, outputs and gradients, against float64 and against SDPA in the same dtype;
float32 and masks through the memory-efficient kernel; a transfer over NCCL (what has run on a
GPU, and when: README.md, Support). The CPU CI skips that file; ``tests/test_kernels.py`` checks
every candidate's shapes on meta tensors there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import cpu_choice, cpu_kernel

__all__ = [
    "BlockKernel", "KERNELS", "block_kernel", "kernel_unsupported_reason", "dropout_forward", "dropout_backward",
    "CudaCandidate", "CUDA_CANDIDATES", "CUDA_ORDER", "cuda_candidates", "use_cuda_kernel",
]  # fmt: skip

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class BlockKernel:
    """One device's block attention kernel and what it can do."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """``(q, k, v, bias, scale, is_causal) -> (out, lse)``."""
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """``(dout, q, k, v, out, lse, bias, scale, is_causal) -> (dq, dk, dv)``."""
    dtypes: tuple[torch.dtype, ...]
    """Input dtypes a site may have."""
    compute_dtype: Callable[[torch.dtype], torch.dtype]
    """The dtype blocks compute in, for a site's input dtype."""
    tested: bool
    """Whether a test suite has run it (Note [The CUDA kernels])."""


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """The fused kernels read the last dim as contiguous (aten's SDPA checks this too)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


# ---- CPU: ours or aten's flash kernel for float32 blocks without a bias, whichever is faster on
# ---- this CPU (Note [Choosing the CPU block kernel] in cpu_choice.py), aten's for the rest ------


def _cpu_forward(q, k, v, bias, scale, is_causal):
    # A NaN or inf: the careful path, forward and backward alike (``_cpu_backward``).
    finite = not (q.shape[2] and k.shape[2]) or _finite(q, k, v, bias=bias)
    if finite and cpu_kernel.serves(q, k, v, bias=bias):
        name = cpu_kernel.choose(_cpu_class(q, k, v, is_causal), _ATEN).forward
        if name != "aten":
            return cpu_kernel.forward(q, k, v, scale, is_causal, variant=name)
    return _aten_forward(q, k, v, bias, scale, is_causal)


def _cpu_backward(dout, q, k, v, out, lse, bias, scale, is_causal):
    # A block whose forward took the careful path (a NaN or inf in q, k, v or the bias) takes it
    # backward too: it recomputes the probabilities as the forward computed them, in float64
    # (Note [Non-finite values]).
    finite = not (q.shape[2] and k.shape[2]) or _finite(q, k, v, bias=bias)
    if finite and cpu_kernel.serves(dout, q, k, v, out, lse, bias=bias):
        name = cpu_kernel.choose(_cpu_class(q, k, v, is_causal), _ATEN).backward
        if name != "aten":
            return cpu_kernel.backward(dout, q, k, v, out, lse, scale, is_causal, variant=name)
    return _aten_backward(dout, q, k, v, out, lse, bias, scale, is_causal)


def _cpu_class(q, k, v, is_causal) -> cpu_choice.BlockClass:
    return cpu_choice.BlockClass.of(q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3], is_causal)


def _causal_as_bias(q, k, bias, scale, is_causal):
    """``(bias, is_causal)`` for aten's kernel. NOTE: with ``is_causal`` and a scale of 0 or
    below, torch 2.13's CPU flash forward returns NaN rows (its causal ``-inf`` times the scale):
    the diagonal then goes into the bias, for the backward too, so both recompute the same
    weights."""
    if not (is_causal and scale <= 0):
        return bias, is_causal
    above = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
    zero = torch.zeros((), dtype=q.dtype if bias is None else bias.dtype, device=q.device)
    return torch.where(above, float("-inf"), zero if bias is None else bias), False


def _aten_forward(q, k, v, bias, scale, is_causal):
    bias, is_causal = _causal_as_bias(q, k, bias, scale, is_causal)
    # A NaN or inf: aten's products would take it to pairs that do not attend (Note [Non-finite
    # values] in cpu_kernel.py).
    if q.shape[2] and k.shape[2] and not _finite(q, k, v, bias=bias):
        return nonfinite_forward(q, k, v, bias, scale, is_causal)
    # NOTE: aten's CPU flash kernel needs one head size for q, k and v: the smaller gets zeros.
    dv, size = v.shape[-1], max(q.shape[-1], v.shape[-1])
    q, k, v = (_pad_last(_unit_stride(x), size) for x in (q, k, v))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale
    )
    return out[..., :dv], lse


def _aten_backward(dout, q, k, v, out, lse, bias, scale, is_causal):
    bias, is_causal = _causal_as_bias(q, k, bias, scale, is_causal)
    # out too: its NaN rows may come from another block (Note [Non-finite values] in cpu_kernel.py).
    if q.shape[2] and k.shape[2] and not _finite(dout, q, k, v, out, bias=bias, lse=lse):
        return nonfinite_backward(dout, q, k, v, out, lse, bias, scale, is_causal)
    channels = (q.shape[-1], k.shape[-1], v.shape[-1])
    size = max(q.shape[-1], v.shape[-1])
    q, k, v, dout, out = (_pad_last(_unit_stride(x), size) for x in (q, k, v, dout, out))
    grads = list(
        aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale
        )
    )
    # The kernel's gradients are laid out (B, L, H, D); make each contiguous and drop the
    # original before the next copy, so at most one gradient is held twice.
    result = []
    for i, c in enumerate(channels):
        grad, grads[i] = grads[i], None
        result.append(grad[..., :c].contiguous())
        del grad
    return tuple(result)


_ATEN = {
    "aten": cpu_choice.Candidate(
        lambda q, k, v, scale, causal: _aten_forward(q, k, v, None, scale, causal),
        lambda dout, q, k, v, out, lse, scale, causal: _aten_backward(dout, q, k, v, out, lse, None, scale, causal),
    )
}
"""aten's flash kernel as a candidate for float32 blocks without a bias (``cpu_kernel.choose``)."""


def _cpu_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Blocks run in float32 for half inputs: on CPU the half kernels are no faster, and each
    branch's result would otherwise be rounded before the merge (docs/semantics.md, Accuracy)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ---- Non-finite values on aten's path (Note [Non-finite values] in cpu_kernel.py) ------------


def _finite(*xs: torch.Tensor, bias: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> bool:
    """Whether ``xs`` hold only finite values, ``bias`` no NaN or ``+inf`` (``-inf`` masks) and
    ``lse`` no NaN (``-inf`` and ``+inf`` mark empty rows). A sum per tensor: finite values that
    overflow it only send a block down the careful path, which computes the same."""
    if not all(math.isfinite(float(x.sum())) for x in xs):
        return False
    if bias is not None and bias.numel() and not float(bias.max()) < math.inf:
        return False
    return lse is None or not bool(lse.isnan().any())


NONFINITE_CHUNK = 1 << 22
"""Scores, or terms of a non-finite row's products, per chunk on the careful path (32 MiB of
float64)."""


def _pairs(bias, is_causal: bool, r0: int, r1: int, keys: int, device) -> torch.Tensor | None:
    """Which (query, key) pairs of rows ``[r0, r1)`` attend (None: all): on or before the
    diagonal when causal, and where ``bias`` is not ``-inf`` (a mask ANDs with the
    connectivity: docs/semantics.md, Masks)."""
    keep = None
    if bias is not None:
        keep = (bias if bias.shape[-2] == 1 else bias[..., r0:r1, :]) != float("-inf")
    if is_causal:
        rows = torch.arange(r0, r1, device=device).unsqueeze(-1)
        seen = torch.arange(keys, device=device) <= rows
        keep = seen if keep is None else keep & seen
    return keep


def _pairs_product(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``a @ b`` over the pairs ``keep`` of ``a``'s last two dims only (None: all): a pair off
    them adds nothing, also where a row of ``b`` holds a NaN or inf (a plain product adds
    ``0 * inf``, NaN, to every row of ``a``). Those rows of ``b`` are added term by term."""
    if keep is None:
        return a @ b
    a = a.masked_fill(~keep, 0.0)
    good = torch.isfinite(b).all(-1, keepdim=True)
    if bool(good.all()):
        return a @ b
    clean = b.masked_fill(~good, 0.0)
    out = a @ clean
    bad = (~good).flatten(0, -3).any(0).squeeze(-1).nonzero().squeeze(-1)  # in some (batch, head)
    terms = max(1, a[..., :1].numel() * b.shape[-1])
    for part in bad.split(max(1, NONFINITE_CHUNK // terms)):
        ap = a.index_select(-1, part).unsqueeze(-1)  # (.., L, n, 1)
        bp = (b.index_select(-2, part) - clean.index_select(-2, part)).unsqueeze(-3)  # (.., 1, n, C)
        kp = keep.index_select(-1, part).unsqueeze(-1)
        out = out + (ap * bp).masked_fill(~kp, 0.0).sum(-2)
    return out


def _per_query_head(x: torch.Tensor, hq: int, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).repeat_interleave(hq // x.shape[1], dim=1)


def _careful_rows(q, keys: int) -> list[tuple[int, int]]:
    rows = max(1, NONFINITE_CHUNK // max(1, q.shape[0] * q.shape[1] * keys))
    return [(r0, min(r0 + rows, q.shape[2])) for r0 in range(0, q.shape[2], rows)]


def _careful_scores(q, k, bias, scale, keep, r0, r1, dtype):
    """Scores of rows ``[r0, r1)``, ``-inf`` off ``keep`` whatever q, k or the bias hold there."""
    s = q[:, :, r0:r1].to(dtype) @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s + (bias if bias.shape[-2] == 1 else bias[..., r0:r1, :]).to(dtype)
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def nonfinite_forward(q, k, v, bias, scale, is_causal):
    """``(out, lse)`` of a block whose inputs hold a NaN or inf, each reaching what it reaches in
    the float64 function, and nothing else (Note [Non-finite values] in cpu_kernel.py): a row is
    NaN (its lse too) where a score is NaN or ``+inf``, and a value row's NaN or inf reaches only
    the rows that attend to it."""
    dtype = torch.float64
    kx, vx = _per_query_head(k, q.shape[1], dtype), _per_query_head(v, q.shape[1], dtype)
    outs, lses = [], []
    for r0, r1 in _careful_rows(q, k.shape[2]):
        keep = _pairs(bias, is_causal, r0, r1, k.shape[2], q.device)
        s = _careful_scores(q, kx, bias, scale, keep, r0, r1, dtype)
        top = s.amax(-1, keepdim=True)  # NaN if a score is; +inf makes the sum below NaN
        top = top.masked_fill(top == float("-inf"), 0.0)  # a row that attends to nothing
        lse = top + torch.log(torch.exp(s - top).sum(-1, keepdim=True))
        prob = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0))
        outs.append(_pairs_product(prob, vx, keep))
        lses.append(lse.squeeze(-1))
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)


def nonfinite_backward(dout, q, k, v, out, lse, bias, scale, is_causal):
    """``dq, dk, dv`` of a block as its kernel's backward gives them (the merged ``out`` and
    ``lse``, ``+inf`` where a row has nothing to attend), where some input holds a NaN or inf:
    a row whose lse is NaN has P = NaN on every key it attends to, and no product multiplies a
    NaN or inf by the 0 of a pair that does not attend (a dead row's included)."""
    dtype = torch.float64
    hq, hkv, keys = q.shape[1], k.shape[1], k.shape[2]
    kx, vx = _per_query_head(k, hq, dtype), _per_query_head(v, hq, dtype)
    dqs = []
    dk = torch.zeros(kx.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(vx.shape, dtype=dtype, device=v.device)
    for r0, r1 in _careful_rows(q, keys):
        l = lse[:, :, r0:r1].to(dtype).unsqueeze(-1)
        keep = _pairs(bias, is_causal, r0, r1, keys, q.device)
        live = ~l.isinf()  # (B, Hq, rows, 1): a dead row attends to nothing
        keep = live.expand(*live.shape[:-1], keys) if keep is None else keep & live
        s = _careful_scores(q, kx, bias, scale, keep, r0, r1, dtype)
        prob = torch.exp(s - l).masked_fill(~keep, 0.0)
        do, qc = dout[:, :, r0:r1].to(dtype), q[:, :, r0:r1].to(dtype)
        delta = (do * out[:, :, r0:r1].to(dtype)).sum(-1, keepdim=True)
        ds = (prob * (do @ vx.transpose(-1, -2) - delta)).masked_fill(~keep, 0.0)
        keep_t = keep.transpose(-1, -2)
        dqs.append(_pairs_product(ds, kx, keep) * scale)
        dk += _pairs_product(ds.transpose(-1, -2), qc, keep_t) * scale
        dv += _pairs_product(prob.transpose(-1, -2), do, keep_t)
    dq = torch.cat(dqs, 2)
    return dq.to(q.dtype), _per_kv_head(dk, hkv).to(k.dtype), _per_kv_head(dv, hkv).to(v.dtype)


# ---- CUDA: torch's fused kernels, one chosen per case (Note [The CUDA kernels]) -------------

_CUDA_ALIGN = 8  # head sizes are padded to a multiple of this, as SDPA's front end does
_CUDA_LSE_ROWS = 32  # the memory-efficient kernel's lse rows come padded to a multiple of this
_HALF = (torch.float16, torch.bfloat16)


def _cuda_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    """K or V with one head per query head (GQA spelled out, for a kernel that wants equal heads)."""
    return x if x.shape[1] == hq else x.repeat_interleave(hq // x.shape[1], dim=1)


def _cuda_bias(bias, q, k):
    """The key bias broadcast to ``(B, Hq, L, S)``, its rows aligned as SDPA's front end aligns
    a mask (padded to a multiple of 16 keys, then viewed back): the kernel reads it in aligned
    vectors, and checks every stride but the last."""
    if bias is None:
        return None
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[-2])
    s = shape[-1]
    if s % 16:
        bias = F.pad(bias, (0, -s % 16))[..., :s]
    view = bias.expand(shape)
    if view.stride(-1) != 1 or any(x % 16 for x, n in zip(view.stride()[:-1], shape[:-1]) if n > 1):
        view = bias.contiguous().expand(shape)  # s is a multiple of 16 here
    return view


def _aligned(size: int) -> int:
    return size + -size % _CUDA_ALIGN


def _cuda_inputs(q, k, v, *, same_size: bool = False, repeat_heads: bool = True):
    """q, k, v as a fused kernel takes them: unit stride, head sizes padded with zeros (to one
    size for all three with ``same_size``), and one K/V head per query head with
    ``repeat_heads``."""
    hq = q.shape[1]
    q, k, v = (_unit_stride(x) for x in (q, k, v))
    if repeat_heads:
        k, v = _cuda_heads(k, hq), _cuda_heads(v, hq)
    qk, dv = _aligned(q.shape[-1]), _aligned(v.shape[-1])
    if same_size:
        qk = dv = max(qk, dv)
    return _pad_last(q, qk), _pad_last(k, qk), _pad_last(v, dv)


def _sdpa_layout(x: torch.Tensor) -> torch.Tensor:
    """``x (B, H, L, C)`` laid out as ``(B, L, H, C)``, as SDPA's forward returns its output.
    NOTE: the half kernels' backward computes ``rowsum(dO * O)`` reading ``out`` so laid out,
    whatever its strides say (xformers' ``o_strideM() = H * Dv``)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _zero_empty_rows(out: torch.Tensor, lse: torch.Tensor, dv: int) -> torch.Tensor:
    """A row with nothing to attend (its lse infinite, whichever way) outputs zeros, as on CPU.
    A NaN row (a NaN it attends to) keeps its NaN out and lse (Note [Non-finite values] in
    cpu_kernel.py)."""
    return out[..., :dv].masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0)


def _cut_grads(grads, q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused kernel's ``dq, dk, dv`` as the entry returns them: head sizes cut back from their
    padding, dk / dv summed per K/V head where the kernel saw them repeated, contiguous."""
    result = []
    for g, x in zip(grads, (q, k, v)):
        g = g[..., : x.shape[-1]]
        result.append((g if g.shape[1] == x.shape[1] else _per_kv_head(g, x.shape[1])).contiguous())
    return tuple(result)


def _no_rng(q: torch.Tensor, shape=()) -> torch.Tensor:
    """A seed or offset for a backward without dropout (the kernels read it only with dropout)."""
    return torch.zeros(shape, dtype=torch.int64, device=q.device)


def _efficient_forward(q, k, v, bias, scale, is_causal):
    length, dv = q.shape[-2], v.shape[-1]
    qp, kp, vp = _cuda_inputs(q, k, v)
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
        qp, kp, vp, _cuda_bias(bias, qp, kp), True, 0.0, is_causal, scale=scale
    )
    lse = lse[..., :length]
    return _zero_empty_rows(out, lse, dv), lse


def _efficient_backward(dout, q, k, v, out, lse, bias, scale, is_causal):
    qp, kp, vp = _cuda_inputs(q, k, v)
    dout, out = (_sdpa_layout(_pad_last(x, vp.shape[-1])) for x in (dout, out))
    lse = F.pad(lse.float(), (0, -lse.shape[-1] % _CUDA_LSE_ROWS))
    seed = offset = _no_rng(q)
    dq, dk, dvv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, qp, kp, vp, _cuda_bias(bias, qp, kp), out, lse, seed, offset, 0.0,
        [True, True, True, False], is_causal, scale=scale,
    )  # fmt: skip
    return _cut_grads((dq, dk, dvv), q, k, v)


def _flash_forward(q, k, v, bias, scale, is_causal):
    dv = v.shape[-1]
    qp, kp, vp = _cuda_inputs(q, k, v, same_size=True, repeat_heads=False)
    out, lse, *_ = aten._scaled_dot_product_flash_attention(qp, kp, vp, 0.0, is_causal, scale=scale)
    return _zero_empty_rows(out, lse, dv), lse


def _flash_backward(dout, q, k, v, out, lse, bias, scale, is_causal):
    qp, kp, vp = _cuda_inputs(q, k, v, same_size=True, repeat_heads=False)
    dout, out = (_pad_last(_unit_stride(x), vp.shape[-1]) for x in (dout, out))
    length, keys = q.shape[2], k.shape[2]
    dq, dk, dvv = aten._scaled_dot_product_flash_attention_backward(
        dout, qp, kp, vp, out, lse.float().contiguous(), None, None, length, keys, 0.0, is_causal,
        _no_rng(q, (2,)), _no_rng(q), scale=scale,
    )  # fmt: skip
    return _cut_grads((dq, dk, dvv), q, k, v)


def _cudnn_forward(q, k, v, bias, scale, is_causal):
    dv = v.shape[-1]
    qp, kp, vp = _cuda_inputs(q, k, v, repeat_heads=False)
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(
        qp, kp, vp, None, True, 0.0, is_causal, False, scale=scale
    )
    lse = lse.reshape(lse.shape[:3])  # (B, H, L, 1) from cuDNN
    return _zero_empty_rows(out, lse, dv), lse


def _cudnn_backward(dout, q, k, v, out, lse, bias, scale, is_causal):
    qp, kp, vp = _cuda_inputs(q, k, v, repeat_heads=False)
    dout, out = (_pad_last(_unit_stride(x), vp.shape[-1]).contiguous() for x in (dout, out))
    length, keys = q.shape[2], k.shape[2]
    dq, dk, dvv = aten._scaled_dot_product_cudnn_attention_backward(
        dout, qp, kp, vp, out, lse.float().unsqueeze(-1).contiguous(), _no_rng(q), _no_rng(q),
        None, None, None, length, keys, 0.0, is_causal, scale=scale,
    )  # fmt: skip
    return _cut_grads((dq, dk, dvv), q, k, v)


def _fused_half_serves(q, k, v, bias, is_causal, max_head: int) -> bool:
    """What flash and cuDNN share: half inputs, no bias, a causal block square (their causal
    masks align differently from ours when L != S), rows and keys, head sizes within
    ``max_head``."""
    square = not is_causal or q.shape[2] == k.shape[2]
    sizes = _aligned(q.shape[-1]) <= max_head and _aligned(v.shape[-1]) <= max_head
    return q.dtype in _HALF and bias is None and square and q.shape[2] > 0 and k.shape[2] > 0 and sizes


@dataclasses.dataclass(frozen=True)
class CudaCandidate:
    """One of torch's CUDA attention kernels that return the log-sum-exp, and when it serves."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    serves: Callable[..., bool]
    """``(q, k, v, bias, is_causal) -> bool``."""


CUDA_CANDIDATES: dict[str, CudaCandidate] = {
    "flash": CudaCandidate(
        _flash_forward, _flash_backward, lambda q, k, v, bias, c: _fused_half_serves(q, k, v, bias, c, 256)
    ),
    "cudnn": CudaCandidate(
        _cudnn_forward, _cudnn_backward, lambda q, k, v, bias, c: _fused_half_serves(q, k, v, bias, c, 128)
    ),
    "efficient": CudaCandidate(_efficient_forward, _efficient_backward, lambda q, k, v, bias, c: True),
}  # fmt: skip

CUDA_ORDER: tuple[str, ...] = ("efficient",)
"""The candidates in the order the CUDA entry tries them: the first that serves a block runs it
(Note [The CUDA kernels])."""

_cuda_forced: list[str] = []


@contextlib.contextmanager
def use_cuda_kernel(name: str):
    """Within the block, CUDA blocks run candidate ``name`` wherever it serves them (the others
    as ``CUDA_ORDER`` says): how ``benchmarks/gpu.py`` times each candidate. The choice is made
    at run time, so one compiled function serves every candidate."""
    if name not in CUDA_CANDIDATES:
        raise ValueError(f"no CUDA block kernel {name!r} (have {', '.join(CUDA_CANDIDATES)})")
    _cuda_forced.append(name)
    try:
        yield
    finally:
        _cuda_forced.pop()


def cuda_candidates(dtype: torch.dtype) -> tuple[str, ...]:
    """The candidates that can serve blocks of ``dtype`` (some blocks of theirs, at least)."""
    return tuple(name for name in CUDA_CANDIDATES if name == "efficient" or dtype in _HALF)


def _cuda_pick(q, k, v, bias, is_causal) -> CudaCandidate:
    for name in [*_cuda_forced[-1:], *CUDA_ORDER, "efficient"]:
        candidate = CUDA_CANDIDATES[name]
        if candidate.serves(q, k, v, bias, is_causal):
            return candidate
    raise AssertionError("the memory-efficient kernel serves every block")


def _cuda_forward(q, k, v, bias, scale, is_causal):
    return _cuda_pick(q, k, v, bias, is_causal).forward(q, k, v, bias, scale, is_causal)


def _cuda_backward(dout, q, k, v, out, lse, bias, scale, is_causal):
    candidate = _cuda_pick(q, k, v, bias, is_causal)
    return candidate.backward(dout, q, k, v, out, lse, bias, scale, is_causal)


KERNELS: dict[str, BlockKernel] = {
    "cpu": BlockKernel(
        _cpu_forward, _cpu_backward,
        (torch.float16, torch.bfloat16, torch.float32, torch.float64), _cpu_compute_dtype, True,
    ),
    # NOTE: half inputs compute in their own dtype here: the kernel accumulates in float32, and
    # each block's output is rounded once before the float32 merge.
    "cuda": BlockKernel(
        _cuda_forward, _cuda_backward,
        (torch.float16, torch.bfloat16, torch.float32), lambda dtype: dtype, True,
    ),
}  # fmt: skip


# ---- Dropout: the same torch code on every device (Note [Dropout in blocks]) -----------------

DROPOUT_CHUNK = 1 << 22
"""Scores per chunk of query rows on the dropout path (16 MiB of float32)."""

_MASK64 = (1 << 64) - 1


def _splitmix(x: int) -> int:
    """SplitMix64's finaliser (Steele, Lea and Flood, 2014): a well-mixed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _keep(shape, p: float, seed: torch.Tensor, block: list[int], device) -> torch.Tensor:
    """The keep-mask of one chunk of one block: True with probability ``1 - p``."""
    stream = _splitmix(int(seed) & _MASK64)
    for part in block:
        stream = _splitmix(stream ^ part)
    generator = torch.Generator(device=device)
    generator.manual_seed(stream)
    return torch.rand(shape, generator=generator, device=device) >= p


def _grouped(a: torch.Tensor, b: torch.Tensor, heads: int) -> torch.Tensor:
    """``a (B, Hq, L, X) @ b (B, Hkv, X, Y)``, query head j reading kv head ``j // (Hq // Hkv)``:
    ``(B, Hq, L, Y)``."""
    out = a.unflatten(1, (heads, a.shape[1] // heads)) @ b.unsqueeze(2)
    return out.flatten(1, 2)


def _per_kv_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, Hq, ...)`` summed over each kv head's query heads: ``(B, Hkv, ...)``."""
    return x.unflatten(1, (heads, x.shape[1] // heads)).sum(2)


def _chunk_scores(q, k, bias, scale, is_causal, r0, r1, dtype):
    """Scores of query rows ``[r0, r1)`` of a block, ``(B, Hq, r1 - r0, S)`` in ``dtype``."""
    s = _grouped(q[:, :, r0:r1].to(dtype), k.to(dtype).transpose(-1, -2), k.shape[1]) * scale
    if bias is not None:
        s = s + (bias if bias.shape[-2] == 1 else bias[..., r0:r1, :]).to(dtype)
    if is_causal:  # top-left: row i sees keys 0..i
        rows = torch.arange(r0, r1, device=q.device).unsqueeze(-1)
        s = s.masked_fill(torch.arange(k.shape[2], device=q.device) > rows, float("-inf"))
    return s


def _dropout_rows(q: torch.Tensor, keys: int) -> list[tuple[int, int]]:
    """Query rows ``[r0, r1)`` of each chunk: at most ``DROPOUT_CHUNK`` scores each."""
    rows = max(1, DROPOUT_CHUNK // max(1, q.shape[0] * q.shape[1] * keys))
    return [(r0, min(r0 + rows, q.shape[2])) for r0 in range(0, q.shape[2], rows)]


def _dropped(s, lse, p, seed, block, device):
    """``P = exp(s - lse)``, and ``P`` with dropped entries 0 and kept ones scaled by ``1 / (1 - p)``."""
    prob = torch.exp(s - lse.unsqueeze(-1))
    kept = prob.masked_fill(~_keep(s.shape, p, seed, block, device), 0.0)
    return prob, kept * (1 / (1 - p) if p < 1 else 0.0)


def dropout_forward(q, k, v, bias, scale, is_causal, p, seed, block):
    """``(out, lse)`` of a block whose probabilities drop with probability ``p`` (Note [Dropout
    in blocks]); ``lse`` is that of the undropped scores."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    heads = k.shape[1]
    outs, lses = [], []
    for c, (r0, r1) in enumerate(_dropout_rows(q, k.shape[2])):
        s = _chunk_scores(q, k, bias, scale, is_causal, r0, r1, dtype)
        lse = torch.logsumexp(s, -1)
        finite = lse.masked_fill(lse == float("-inf"), 0.0)  # an empty row: all of s is -inf
        _, dropped = _dropped(s, finite, p, seed, [*block, c], q.device)
        outs.append(_grouped(dropped, v.to(dtype), heads))
        lses.append(lse)
    return _cat_rows(outs, q, v.shape[-1]).to(q.dtype), _cat_rows(lses, q)


def dropout_backward(dout, q, k, v, out, lse, bias, scale, is_causal, p, seed, block):
    """This block's share of ``dq, dk, dv`` given the merged ``out`` and ``lse`` (``+inf`` for
    an empty row), the forward's keep-mask drawn again (Note [Dropout in blocks])."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    heads = k.shape[1]
    kd, vd = k.to(dtype), v.to(dtype)
    dqs = []
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    for c, (r0, r1) in enumerate(_dropout_rows(q, k.shape[2])):
        s = _chunk_scores(q, k, bias, scale, is_causal, r0, r1, dtype)
        prob, dropped = _dropped(s, lse[:, :, r0:r1].to(dtype), p, seed, [*block, c], q.device)
        do, qc = dout[:, :, r0:r1].to(dtype), q[:, :, r0:r1].to(dtype)
        delta = (do * out[:, :, r0:r1].to(dtype)).sum(-1, keepdim=True)
        ds = dropped * _grouped(do, vd.transpose(-1, -2), heads) - prob * delta
        dqs.append(_grouped(ds, kd, heads) * scale)
        dk += _per_kv_head(ds.transpose(-1, -2) @ qc, heads) * scale
        dv += _per_kv_head(dropped.transpose(-1, -2) @ do, heads)
    return _cat_rows(dqs, q, q.shape[-1]).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _cat_rows(chunks: list[torch.Tensor], q: torch.Tensor, *channels: int) -> torch.Tensor:
    """Row chunks side by side; an empty block (no rows) gives an empty result."""
    if not chunks:
        return q.new_zeros((*q.shape[:3], *channels), dtype=torch.promote_types(q.dtype, torch.float32))
    return torch.cat(chunks, 2)


def block_kernel(device: torch.device | str) -> BlockKernel:
    """The block kernel of ``device``'s type; raises naming the devices that have one."""
    kind = torch.device(device).type
    if kind not in KERNELS:
        raise NotImplementedError(
            f"ring_rewrite block attention has no kernel for device {kind!r} "
            f"(ring_rewrite/kernels.py has {', '.join(KERNELS)})"
        )
    return KERNELS[kind]


def kernel_unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why no block kernel runs blocks of these (example) inputs (their device or dtypes), or
    None."""
    kind = q.device.type
    if kind not in KERNELS:
        return f"device {kind!r}: no block kernel (ring_rewrite/kernels.py has {', '.join(KERNELS)})"
    dtypes = KERNELS[kind].dtypes
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        names = ", ".join(str(t).removeprefix("torch.") for t in dtypes)
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (need one of {names})"
    return None
