"""Dense float64 reference of SPEC §2 (the log-count bias form). Slow and O(N^2): tests only."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["reference_attention", "connection_counts"]


def connection_counts(
    n: int, heads: int, branches: Sequence[tuple[int, int]], *, is_causal: bool, device=None
) -> torch.Tensor:
    """``c[j, p, t]``: how many branches connect query ``p`` to key ``t`` for head ``j``."""
    pos = torch.arange(n, device=device)
    p, t = pos.view(-1, 1), pos.view(1, -1)
    counts = torch.zeros(heads, n, n, dtype=torch.float64, device=device)
    for w, r in branches:
        same_segment = (p // w) == (t // w)
        for j in range(heads):
            o = j % r
            counts[j] += (same_segment & (p % r == o) & (t % r == o)).double()
    if is_causal:
        counts = counts * (t <= p)
    return counts


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    segment_lengths: Sequence[int] | None = None,
    dilation_rates: Sequence[int] | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dilated attention of SPEC §2 in float64, differentiable; returns float64.

    ``q (B, Hq, N, D)``, ``k (B, Hkv, N, D)``, ``v (B, Hkv, N, Dv)``; ``key_bias`` is an
    additive bias (or a bool keep-mask) broadcast to ``(B, Hq, 1, N)``. With no segment lengths
    this is exact softmax attention.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    scale = d**-0.5 if scale is None else scale
    if segment_lengths is None:
        branches = [(n, 1)]
    else:
        branches = list(zip(segment_lengths, dilation_rates))
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    counts = connection_counts(n, hq, branches, is_causal=is_causal, device=q.device)
    scores = scale * q @ k.transpose(-1, -2) + counts.log()
    if key_bias is not None:
        if key_bias.dtype == torch.bool:
            key_bias = torch.zeros(key_bias.shape, dtype=torch.float64).masked_fill(
                ~key_bias, float("-inf")
            )
        scores = scores + key_bias.double()
    live = scores.amax(-1, keepdim=True) > float("-inf")
    probs = torch.softmax(torch.where(live, scores, 0.0), dim=-1) * live
    return probs @ v
