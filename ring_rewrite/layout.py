"""Sequence layouts across ranks: cut a sequence into this rank's shard and put it back.

``layout="contiguous"``: rank k holds tokens ``[kN/P, (k+1)N/P)``. ``layout="zigzag"``: the sequence
is cut into 2P chunks and rank k holds chunks k and 2P-1-k (balances causal work).
``shard`` / ``unshard`` are inverses; ``take_shard`` / ``assemble`` are their static, traceable
cores (ranks and sizes as ints) used inside rewritten graphs.
"""

from __future__ import annotations

import torch

from .p2p import resolve_group

__all__ = ["shard", "unshard", "take_shard", "assemble", "positions"]

LAYOUTS = ("contiguous", "zigzag")


def _check(n: int, world: int, layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    pieces = world * (2 if layout == "zigzag" else 1)
    if n % pieces:
        raise ValueError(
            f"a sequence of {n} tokens cannot be cut into {pieces} equal "
            f"{'chunks' if layout == 'zigzag' else 'shards'} ({world} ranks, layout={layout!r})"
        )
    return n // pieces


def take_shard(x: torch.Tensor, dim: int, n: int, *, world: int, rank: int, layout: str) -> torch.Tensor:
    """This rank's tokens of ``x`` (``n`` tokens along ``dim``)."""
    size = _check(n, world, layout)
    if layout == "contiguous":
        return x.narrow(dim, rank * size, size)
    return torch.cat([x.narrow(dim, rank * size, size), x.narrow(dim, (2 * world - 1 - rank) * size, size)], dim)


def assemble(gathered: torch.Tensor, dim: int, n_local: int, *, world: int, layout: str) -> torch.Tensor:
    """Inverse of ``take_shard`` over all ranks: ``gathered`` stacks every rank's shard on dim 0."""
    shards = [gathered[i] for i in range(world)]
    if layout == "contiguous":
        return torch.cat(shards, dim)
    half = n_local // 2
    firsts = [x.narrow(dim, 0, half) for x in shards]
    seconds = [x.narrow(dim, half, half) for x in reversed(shards)]
    return torch.cat(firsts + seconds, dim)


def positions(n: int, *, world: int, rank: int, layout: str, device=None) -> torch.Tensor:
    """Global positions of this rank's tokens (for RoPE / position ids in sharded mode)."""
    return take_shard(torch.arange(n, device=device), 0, n, world=world, rank=rank, layout=layout)


def shard(x: torch.Tensor, dim: int, *, group=None, layout: str = "contiguous") -> torch.Tensor:
    """This rank's shard of a full sequence ``x`` along ``dim`` (a view or one copy)."""
    _, world, rank = resolve_group(group)
    return take_shard(x, dim, x.shape[dim], world=world, rank=rank, layout=layout)


def unshard(x: torch.Tensor, dim: int, *, group=None, layout: str = "contiguous") -> torch.Tensor:
    """The full sequence from every rank's shard ``x`` (all-gather; differentiable)."""
    group, world, _ = resolve_group(group)
    if world == 1:
        return x
    from torch.distributed._functional_collectives import all_gather_single_autograd

    stacked = all_gather_single_autograd(x.contiguous().unsqueeze(0), 0, group)
    return assemble(stacked, dim, x.shape[dim], world=world, layout=layout)
