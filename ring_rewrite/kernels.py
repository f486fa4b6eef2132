"""Block attention kernels by device: the one table that says what runs a block, and where.

``ring_rewrite::block_attention`` and its backward (``ops.py``) call the entry of their inputs'
device; the finder (``passes/find_sdpa.py``) asks ``unsupported_reason`` whether a site's inputs
can run at all; a site's plan asks ``compute_dtype`` what its blocks compute in. A new device is
one ``BlockKernel`` in ``KERNELS``.

An entry's ``forward`` returns ``(out, lse)`` with ``lse`` in natural log, shape ``(B, Hq, L)``,
any float dtype; what it reports for a row with nothing to attend does not matter (the op sets
``-inf`` there). Its ``backward`` gets the *merged* ``out`` and ``lse`` of each row, with ``+inf``
for a row with nothing to attend, and returns this block's exact share of ``dq, dk, dv``,
contiguous, in the inputs' dtypes (Note [Backward from the merged statistics] in
``attention.py``).

Note [The CUDA entry is untested]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
No GPU has run it. It is written against torch's memory-efficient attention, the CUDA kernel that
takes an additive bias and returns the log-sum-exp; ``tests/test_kernels.py`` checks only its
shapes, on meta tensors. Until a GPU run of the numerics suite checks it, the README lists CUDA
as untested.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["BlockKernel", "KERNELS", "block_kernel", "unsupported_reason"]

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
    """Whether the test suite runs it (Note [The CUDA entry is untested])."""


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """The flash kernels read the last dim as contiguous (aten's SDPA checks this too)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


# ---- CPU: the flash kernel -----------------------------------------------------------------


def _cpu_forward(q, k, v, bias, scale, is_causal):
    # NOTE: the CPU flash kernel needs one head size for q, k and v: the smaller gets zeros.
    dv, size = v.shape[-1], max(q.shape[-1], v.shape[-1])
    q, k, v = (_pad_last(_unit_stride(x), size) for x in (q, k, v))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale
    )
    return out[..., :dv], lse


def _cpu_backward(dout, q, k, v, out, lse, bias, scale, is_causal):
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


def _cpu_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Blocks run in float32 for half inputs: on CPU the half kernels are no faster, and each
    branch's result would otherwise be rounded before the merge (SPEC §5)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ---- CUDA: the memory-efficient kernel (Note [The CUDA entry is untested]) ------------------

_CUDA_ALIGN = 8  # head sizes are padded to a multiple of this, as SDPA's front end does
_CUDA_LSE_ROWS = 32  # the kernel's lse rows come padded to a multiple of this


def _cuda_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    """K or V with one head per query head (GQA spelled out: the kernel wants equal heads)."""
    return x if x.shape[1] == hq else x.repeat_interleave(hq // x.shape[1], dim=1)


def _cuda_bias(bias, q, k):
    """The key bias broadcast to ``(B, Hq, L, S)``, its rows aligned as SDPA's front end aligns
    a mask (padded to a multiple of 16 keys, then viewed back)."""
    if bias is None:
        return None
    s = k.shape[-2]
    padded = F.pad(bias, (0, -s % 16)) if s % 16 else bias
    return padded[..., :s].expand(q.shape[0], q.shape[1], q.shape[2], s)


def _cuda_pad(q, k, v):
    d, dv = q.shape[-1], v.shape[-1]
    qk = d + -d % _CUDA_ALIGN
    return _pad_last(q, qk), _pad_last(k, qk), _pad_last(v, dv + -dv % _CUDA_ALIGN)


def _cuda_forward(q, k, v, bias, scale, is_causal):
    length, dv = q.shape[-2], v.shape[-1]
    k, v = _cuda_heads(k, q.shape[1]), _cuda_heads(v, q.shape[1])
    qp, kp, vp = _cuda_pad(q, k, v)
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
        qp, kp, vp, _cuda_bias(bias, q, k), True, 0.0, is_causal, scale=scale
    )
    lse = lse[..., :length]
    # A row with nothing to attend (its lse not finite, whichever way): zeros, as on CPU.
    out = out[..., :dv].masked_fill(~torch.isfinite(lse).unsqueeze(-1), 0.0)
    return out, lse


def _cuda_backward(dout, q, k, v, out, lse, bias, scale, is_causal):
    hkv, d, dv = k.shape[1], q.shape[-1], v.shape[-1]
    k, v = _cuda_heads(k, q.shape[1]), _cuda_heads(v, q.shape[1])
    qp, kp, vp = _cuda_pad(q, k, v)
    dout, out = _pad_last(dout, vp.shape[-1]), _pad_last(out, vp.shape[-1])
    lse = F.pad(lse.float(), (0, -lse.shape[-1] % _CUDA_LSE_ROWS))
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout
    dq, dk, dvv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, qp, kp, vp, _cuda_bias(bias, q, k), out, lse, seed, offset, 0.0,
        [True, True, True, False], is_causal, scale=scale,
    )  # fmt: skip

    def per_kv_head(g, channels):
        g = g[..., :channels]
        if g.shape[1] != hkv:
            g = g.unflatten(1, (hkv, -1)).sum(2)
        return g.contiguous()

    return dq[..., :d].contiguous(), per_kv_head(dk, d), per_kv_head(dvv, dv)


KERNELS: dict[str, BlockKernel] = {
    "cpu": BlockKernel(
        _cpu_forward, _cpu_backward,
        (torch.float16, torch.bfloat16, torch.float32, torch.float64), _cpu_compute_dtype, True,
    ),
    # NOTE: half inputs compute in their own dtype here: the kernel accumulates in float32, and
    # each block's output is rounded once before the float32 merge.
    "cuda": BlockKernel(
        _cuda_forward, _cuda_backward,
        (torch.float16, torch.bfloat16, torch.float32), lambda dtype: dtype, False,
    ),
}  # fmt: skip


def block_kernel(device: torch.device | str) -> BlockKernel:
    """The block kernel of ``device``'s type; raises naming the devices that have one."""
    kind = torch.device(device).type
    if kind not in KERNELS:
        raise NotImplementedError(
            f"ring_rewrite block attention has no kernel for device {kind!r} "
            f"(ring_rewrite/kernels.py has {', '.join(KERNELS)})"
        )
    return KERNELS[kind]


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why blocks of these (example) inputs cannot run, or None."""
    kind = q.device.type
    if kind not in KERNELS:
        return f"device {kind!r}: no block kernel (ring_rewrite/kernels.py has {', '.join(KERNELS)})"
    dtypes = KERNELS[kind].dtypes
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        names = ", ".join(str(t).removeprefix("torch.") for t in dtypes)
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (need one of {names})"
    return None
