"""Decode steps: the last rows of dilated attention, for a query shorter than its keys.

With a KV cache, a model calls SDPA with ``q`` the newest ``m`` tokens and ``k, v`` the whole
prefix of ``N`` (cache + new). Those queries are positions ``N - m .. N - 1`` and the
step computes exactly those rows of the site's function, so greedy generation equals
recomputing the whole prefix at every step. Per branch ``(w, r)`` and query head ``j`` (offset
``o = j mod r``) query ``p`` reaches key ``t`` when ``p // w == t // w``, ``p ≡ t ≡ o (mod r)``
(and ``t <= p`` when causal: a prefix has no later key anyway): the ``log c`` bias of the dense
form, for ``m`` rows only. That is O(m N) per head, small for the ``m`` of a decode step, and
written with the cache length as a size, so a symbolic length (dynamo's automatic dynamic shapes,
from the second decode step on) compiles once for every later length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .ops import stat_dtype

__all__ = ["decode_attention"]

# Bias values at or below it mask (half float32's lowest: -inf, transformers' finfo.min fills).
# A constant: the step is traced with proxies, whose dtype is no value.
_FLOOR = torch.finfo(torch.float32).min / 2


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    branches: Sequence[tuple[int, int]],
    scale: float,
    is_causal: bool,
    first_query=None,
    first_key=0,
) -> torch.Tensor:
    """Rows ``N - m .. N - 1`` of dilated attention: ``q (B, Hq, m, D)``, ``k (B, Hkv, N, D)``,
    ``v (B, Hkv, N, Dv)``, ``bias`` an additive key bias broadcast to ``(B, Hq, 1, N)``;
    ``branches`` as ``RingDilatedConfig.branches`` (a segment ``w >= N`` is the whole prefix).
    A cache that holds the last keys only (a sliding window) gives its positions: the queries at
    ``first_query ..`` (default ``N - m``), the keys at ``first_key ..``."""
    hq, m, hkv, n = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    acc = stat_dtype(q.dtype)
    p = torch.arange(m, device=q.device) + (n - m if first_query is None else first_query)
    t = torch.arange(n, device=q.device) + first_key
    heads = torch.arange(hq, device=q.device).view(-1, 1, 1)
    counts = 0
    for w, r in branches:
        same = (p.view(-1, 1) // w) == (t.view(1, -1) // w)
        on = ((p.view(1, -1, 1) - heads) % r == 0) & ((t.view(1, 1, -1) - heads) % r == 0)
        counts = counts + (same & on).to(acc)  # (Hq, m, N)
    if is_causal:
        counts = counts * (t.view(1, 1, -1) <= p.view(1, -1, 1))
    log_c = torch.where(counts > 0, counts.log(), float("-inf"))
    # Query head j reads kv head j // (Hq // Hkv): grouped, K/V never repeated.
    qg = q.to(acc).unflatten(1, (hkv, hq // hkv))
    scores = (qg @ k.to(acc).unsqueeze(2).transpose(-1, -2)).flatten(1, 2) * scale + log_c
    if bias is not None:
        # Less each row's largest value (a constant of the row: the same softmax), a bias that
        # grows with the position (ALiBi's slope_h * t) adds what the dense slope_h * (t - p)
        # adds (Note [Recentred key biases] in attention.py); fills at or below half the lowest
        # value mask and are passed over.
        bias = bias.to(acc)
        floor = _FLOOR
        top = torch.where(bias > floor, bias, float("-inf")).amax(-1, keepdim=True)
        scores = scores + (bias - torch.where(top > floor, top, 0.0))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(top == float("-inf"), 0.0, top)  # a row with nothing to attend: zeros
    probs = torch.exp(scores - top)
    total = probs.sum(-1, keepdim=True)
    out = (probs.unflatten(1, (hkv, hq // hkv)) @ v.to(acc).unsqueeze(2)).flatten(1, 2)
    out = out / torch.where(total > 0, total, 1.0)
    return out.to(q.dtype)
