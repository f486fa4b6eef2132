"""Exact log-sum-exp merges of partial attention results (plain pointwise ops: inductor fuses them)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["merge_partials"]


def merge_partials(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention results over disjoint (multi)sets of keys into the softmax over their union.

    ``outs[i] (..., L, Dv)`` and ``lses[i] (..., L)`` may hold ``-inf`` rows (no key); the merge
    is ``L = logsumexp_i lse_i`` and ``O = sum_i exp(lse_i - L) * O_i`` (SPEC §2; the same
    identity ring-flash-attention's ``_update_out_and_lse`` applies pairwise). It runs in float32;
    rows where every ``lse_i`` is ``-inf`` give ``O = 0`` and ``L = -inf``.
    """
    if len(outs) == 1:
        return outs[0], lses[0]
    lses = [l.float() for l in lses]
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    # NOTE: L = -inf only where every lse_i is -inf; shifting by 0 there makes every weight 0.
    shift = torch.where(lse == float("-inf"), 0.0, lse)
    out = None
    for o, l in zip(outs, lses):
        part = torch.exp(l - shift).unsqueeze(-1) * o.float()
        out = part if out is None else out + part
    return out, lse
