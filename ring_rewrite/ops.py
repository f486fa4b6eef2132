"""Custom ops in the ``ring_rewrite`` namespace: block attention that returns its log-sum-exp.

``block_attention(q, k, v, bias, scale, is_causal) -> (out, lse)`` is one block of attention:
``q (B, Hq, L, D)``, ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)``, GQA by head groups
(query head j reads kv head ``j // (Hq // Hkv)``), an optional additive key bias broadcast to
``(B, Hq, L, S)``, causal top-left aligned. ``out`` has the input dtype, ``lse`` is float32
``(B, Hq, L)`` in natural log and is ``-inf`` for a row with nothing to attend (the CPU flash
kernel reports 0 there).

``block_attention_backward(dout, q, k, v, out, lse, bias, scale, is_causal)`` is the fused
attention backward. Called with the *merged* ``out`` and ``lse`` of a row (the softmax over every
block the row attends to), it returns this block's exact share of the gradient (FINDINGS.md,
"Kernels"); rows whose ``lse`` is ``+inf`` contribute nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["block_attention", "block_attention_backward"]


def _kernels(device: torch.device):
    if device.type == "cpu":
        return (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        )
    # NOTE: untested here (no GPU): CUDA goes through the memory-efficient kernel, which takes
    # a bias and returns lse; see docs/cuda.md in the README's "not supported yet" list.
    raise NotImplementedError(
        f"ring_rewrite block attention has no kernel for device {device.type!r} yet "
        "(only the CPU flash kernel is wired up)"
    )


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """The CPU flash kernels read the last dim as contiguous (aten's SDPA checks this too)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _pad_head_dims(q, k, v):
    """The CPU flash kernel needs one head size for q, k and v: pad the smaller with zeros."""
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    d, dv = q.shape[-1], v.shape[-1]
    if d < dv:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    elif dv < d:
        v = F.pad(v, (0, d - dv))
    return q, k, v


def _empty_rows(bias: torch.Tensor, lse_shape: torch.Size, is_causal: bool) -> torch.Tensor:
    """Rows of ``lse_shape`` (B, H, L) whose every key is masked by ``bias`` (.., 1 or L, S)."""
    live = bias > float("-inf")
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


@torch.library.custom_op("ring_rewrite::block_attention", mutates_args=())
def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    fwd, _ = _kernels(q.device)
    dv = v.shape[-1]
    qp, kp, vp = _pad_head_dims(q, k, v)
    out, lse = fwd(qp, kp, vp, 0.0, is_causal, attn_mask=bias, scale=scale)
    out = out[..., :dv].contiguous()
    lse = lse.float().contiguous()
    if bias is not None:
        lse = lse.masked_fill(_empty_rows(bias, lse.shape, is_causal), float("-inf"))
    return out, lse


@block_attention.register_fake
def _(q, k, v, bias, scale, is_causal):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, bwd = _kernels(q.device)
    d, dv = q.shape[-1], v.shape[-1]
    qp, kp, vp = _pad_head_dims(q, k, v)
    dout, out = _unit_stride(dout), _unit_stride(out)
    if dv < d:
        dout, out = F.pad(dout, (0, d - dv)), F.pad(out, (0, d - dv))
    # A row with nothing to attend has lse = -inf; +inf makes its probabilities exp(s - lse) zero.
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    grads = list(bwd(dout, qp, kp, vp, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale))
    # The kernel's gradients are laid out (B, L, H, D); make each contiguous and drop the
    # original before the next copy, so at most one gradient is held twice.
    result = []
    for i, channels in enumerate((d, d, dv)):
        grad, grads[i] = grads[i], None
        result.append(grad[..., :channels].contiguous())
        del grad
    return tuple(result)


@block_attention_backward.register_fake
def _(dout, q, k, v, out, lse, bias, scale, is_causal):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, scale, is_causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, out, lse)
    ctx.scale, ctx.is_causal = scale, is_causal


def _backward(ctx, dout, dlse):
    q, k, v, bias, out, lse = ctx.saved_tensors
    dq, dk, dv = block_attention_backward(dout, q, k, v, out, lse, bias, ctx.scale, ctx.is_causal)
    if dlse is not None:
        # d lse / d s = P, so dlse adds P * dlse to dS. The kernel's dS is P * (dP - rowsum(dO*O));
        # with v = 0, dO = 1 and O = -dlse / Dv it is exactly P * dlse.
        ones = torch.ones_like(dout)
        fake_out = (-dlse / dout.shape[-1]).unsqueeze(-1).to(out.dtype).expand_as(out).contiguous()
        dq2, dk2, _ = block_attention_backward(
            ones, q, k, torch.zeros_like(v), fake_out, lse, bias, ctx.scale, ctx.is_causal
        )
        dq, dk = dq + dq2, dk + dk2
    return dq, dk, dv, None, None, None


block_attention.register_autograd(_backward, setup_context=_setup_context)
