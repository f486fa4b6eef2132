"""Dilated attention of one SDPA site: forward and its explicit backward.

Both functions are plain torch code over a frozen ``SitePlan``; the rewrite pass traces each
into an FX graph and joins them with ``autograd_function_apply``, so the graph handed to the
inner compiler shows every gather, block attention call and merge of the site.

Note [Backward from the merged statistics]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The merged output is one softmax over the multiset of connected keys (a key connected by two
branches counts twice, the ``log c`` bias of SPEC §2). With ``O`` and ``L`` that softmax's output
and log-sum-exp, the fused attention backward run per block with ``(dO, O, L)`` computes
``dS = exp(s - L) * (dO·v - rowsum(dO * O))``: exactly the block's share of the gradient of the
whole function, branch merge weights included. So backward saves only ``q, k, v, O, L`` (O(N))
and re-dilates them per branch; no per-block result is kept.
"""

from __future__ import annotations

import dataclasses

import torch

from ._roles import role
from .dilation import BranchLayout
from .merge import merge_partials

__all__ = ["SitePlan", "site_forward", "site_backward"]

_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class SitePlan:
    """Everything static about one rewritten site."""

    batch: int
    hq: int
    hkv: int
    n: int
    d: int
    dv: int
    dtype: torch.dtype
    scale: float
    is_causal: bool
    has_mask: bool
    branches: tuple[BranchLayout, ...]

    @classmethod
    def build(cls, *, batch, hq, hkv, n, d, dv, dtype, scale, is_causal, has_mask, branches):
        layouts = tuple(BranchLayout(w, r, n, batch, hq, hkv) for w, r in branches)
        return cls(batch, hq, hkv, n, d, dv, dtype, scale, is_causal, has_mask, layouts)

    def needs_bias(self, layout: BranchLayout) -> bool:
        # Padded keys sit after every real query, so causal attention never sees them.
        return self.has_mask or (layout.padded != self.n and not self.is_causal)


def _branch_bias(plan: SitePlan, layout: BranchLayout, q: torch.Tensor, mask: torch.Tensor | None):
    """Additive key bias of one branch in kernel layout ``(B*nseg, Hq, 1, m)``, or None."""
    if not plan.needs_bias(layout):
        return None
    if mask is None:
        mask = q.new_zeros(1, 1, 1)
    keys = mask.to(q.dtype).unsqueeze(-1).expand(plan.batch, plan.hq, plan.n, 1)
    return layout.dilate_q(keys, fill=_NEG_INF).transpose(-1, -2)


def site_forward(plan: SitePlan, q, k, v, mask=None):
    """``(q, k, v[, mask]) -> (out, saved)``; ``mask`` is an additive key bias ``(B|1, Hq|1, N)``."""
    outs, lses = [], []
    for i, layout in enumerate(plan.branches):
        with role("dilate", branch=i):
            qd, kd, vd = layout.dilate_q(q), layout.dilate_kv(k), layout.dilate_kv(v)
            bias = _branch_bias(plan, layout, q, mask)
        with role("attention", branch=i):
            od, lsed = torch.ops.ring_rewrite.block_attention(
                qd, kd, vd, bias, plan.scale, plan.is_causal
            )
        with role("undilate", branch=i):
            outs.append(layout.undilate_q(od))
            lses.append(layout.undilate_q(lsed.unsqueeze(-1), _NEG_INF).squeeze(-1))
    with role("merge"):
        out, lse = merge_partials(outs, lses)
        out = out.to(plan.dtype)
    saved = [q, k, v, out, lse] if mask is None else [q, k, v, out, lse, mask]
    return out, saved


def site_backward(plan: SitePlan, dout, q, k, v, out, lse, mask=None):
    """Gradients of ``site_forward``'s output w.r.t. ``q, k, v`` (and None for the mask)."""
    dq = dk = dv = None
    for i, layout in enumerate(plan.branches):
        with role("dilate", branch=i):
            qd, kd, vd = layout.dilate_q(q), layout.dilate_kv(k), layout.dilate_kv(v)
            bias = _branch_bias(plan, layout, q, mask)
            dod, od = layout.dilate_q(dout), layout.dilate_q(out)
            lsed = layout.dilate_q(lse.unsqueeze(-1), fill=float("inf")).squeeze(-1)
        with role("attention_backward", branch=i):
            dqd, dkd, dvd = torch.ops.ring_rewrite.block_attention_backward(
                dod, qd, kd, vd, od, lsed, bias, plan.scale, plan.is_causal
            )
        with role("undilate", branch=i):
            dq = _acc(dq, layout.undilate_q(dqd))
            dk = _acc(dk, layout.accumulate_kv(dkd, plan.d))
            dv = _acc(dv, layout.accumulate_kv(dvd, plan.dv))
    grads = (dq.to(plan.dtype), dk.to(plan.dtype), dv.to(plan.dtype))
    return grads if mask is None else (*grads, None)


def _acc(total, x):
    # Branch contributions add up in float32 (SPEC §5).
    return x if total is None else total.float() + x.float()
