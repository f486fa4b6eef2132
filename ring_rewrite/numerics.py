"""Two numeric rules every layer shares: the dtype statistics are kept in, and which fill masks.

Note [Fills that mask]
~~~~~~~~~~~~~~~~~~~~~~
Models mask a key with ``-inf`` or with ``torch.finfo(dtype).min`` (transformers' float masks,
BERT's ``(1 - mask) * min``). The two give a masked key the same weight, ``exp(min - max) = 0``,
in every row with a key allowed; they differ only in a row whose every key is masked, where the
fill of ``min`` gives the mean of the values and ``-inf`` nothing. Here a value at or below half
its dtype's lowest (``mask_floor``) masks as ``-inf`` does, everywhere a mask is read: the
constants of a mask's construction (``passes/masks.py``, ``passes/hand_written.py``: ``masks``),
key biases computed at run time (``masked_fills``: a key-padding mask given as it is, the key
bias of a dense mask, a decode step's), and a row's own bias (``ops._band_chunks``). So a row, or a
branch's segment of a row, with nothing but masked keys attends to nothing, 0, whichever fill
the model used (docs/semantics.md, Accuracy). Half the lowest, not the lowest: a fill that a
finite bias was added to (ALiBi plus padding) still masks.
"""

from __future__ import annotations

import math

import torch

__all__ = ["mask_floor", "masked_fills", "masks", "stat_dtype"]


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """What log-sum-exps, merges and gradient sums are kept in: float32, or the input's dtype
    where that is wider (float64 inputs get float64 accuracy at every P: docs/semantics.md,
    Accuracy)."""
    return torch.promote_types(dtype, torch.float32)


def mask_floor(dtype: torch.dtype) -> float:
    """The value of ``dtype`` at or below which a bias masks (Note [Fills that mask])."""
    return torch.finfo(dtype).min / 2


def masks(value: float | None, dtype: torch.dtype) -> bool:
    """Whether a constant fill ``value`` of a ``dtype`` mask masks (Note [Fills that mask])."""
    return value is not None and dtype.is_floating_point and (value == -math.inf or value <= mask_floor(dtype))


def masked_fills(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``bias`` (of ``dtype``; a proxy while traced) with every value that masks as ``-inf``
    (Note [Fills that mask])."""
    return bias.masked_fill(bias <= mask_floor(dtype), float("-inf"))
