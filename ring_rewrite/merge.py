"""Exact log-sum-exp merges of partial attention results (plain pointwise ops: inductor fuses them)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .numerics import stat_dtype

__all__ = ["merge_partials"]


def merge_partials(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention results over disjoint (multi)sets of keys into the softmax over their union.

    ``outs[i] (..., L, Dv)`` and ``lses[i] (..., L)`` may hold ``-inf`` rows (no key). The merge
    is ``L = logsumexp_i lse_i`` and ``O = sum_i exp(lse_i - L) * O_i`` (docs/semantics.md, The
    function; the identity ring-flash-attention's ``_update_out_and_lse`` applies pairwise),
    computed in float32 (or float64, if an input is) as
    ``O = sum_i w_i O_i / sum_i w_i`` with ``w_i = exp(lse_i - max_i lse_i)``: the weights then
    sum to 1 exactly even where ``|L|`` is large and its float32 rounding is not. Rows where
    every ``lse_i`` is ``-inf`` give ``O = 0`` and ``L = -inf``.
    """
    if len(outs) == 1:
        return outs[0], lses[0]
    acc = stat_dtype(lses[0].dtype)
    lses = [x.to(acc) for x in lses]
    top = lses[0]
    for x in lses[1:]:
        top = torch.maximum(top, x)
    # NOTE: the max is -inf only where every lse_i is -inf; shifting by 0 there makes w_i = 0.
    top = torch.where(top == float("-inf"), 0.0, top)
    weights = [torch.exp(x - top) for x in lses]
    total = weights[0]
    out = weights[0].unsqueeze(-1) * outs[0].to(acc)
    for w, o in zip(weights[1:], outs[1:]):
        total = total + w
        out = out + w.unsqueeze(-1) * o.to(acc)
    # NOTE: total >= 1 wherever some lse_i is finite (the max contributes exp(0)).
    out = out / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    return out, top + torch.log(total)
