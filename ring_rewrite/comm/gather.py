"""``all_gather_seq`` and ``all_to_all_seq``: every rank's tensor gathered, or every rank's
pieces exchanged, by point-to-point transfers."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import _group, global_rank
from .tags import EXCHANGE, GATHER, Tag, transfer_tag
from .transfers import _finish, _message_tag, _start

__all__ = ["all_gather_seq", "all_to_all_seq"]


@torch.library.custom_op("ring_rewrite::all_gather_seq", mutates_args=())
def all_gather_seq(
    x: torch.Tensor,
    token: torch.Tensor,
    group_name: str,
    world: int,
    tag: int,
    same: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack every rank's ``x`` along a new leading dim (rank order of the group).

    ``tag`` travels in the payload: ranks that gathered different tensors (a schedule gone
    wrong) fail loudly instead of mixing them. ``same`` (a few values)
    travels too and must be bitwise equal on every rank: replicated mode checks with it that the
    ranks really hold the same sequence.
    """
    group = _group(group_name)
    _, tag, _, timeout = _message_tag(token, tag)
    check = _tag_bytes(tag, x.device)
    if same is not None:
        check = torch.cat([check, same.contiguous().view(-1).view(torch.uint8)])
    payload = torch.cat([x.contiguous().view(-1).view(torch.uint8), check])
    # NOTE: point-to-point, one transfer per distance d (to rank + d, from rank - d), not a
    # collective: a gather a failed call left half done is recovered like any transfer (Note
    # [Calls, deadlines and recovery]). One wire tag for every gather of a call: ranks at
    # different gathers then pair up and fail on the tag in the payload, at once.
    me = dist.get_rank(group)
    keys = [
        _start(
            group_name, token, [payload], (me + d) % world, (me - d) % world,
            transfer_tag(0, GATHER, d),
        )  # fmt: skip
        for d in range(1, world)
    ]
    gathered = payload.new_empty((world, payload.numel()))
    gathered[me] = payload
    for d, pending in zip(range(1, world), _finish(keys, timeout)):
        gathered[(me - d) % world] = pending.received[0]
    tail = gathered[:, payload.numel() - check.numel() :]
    tags = tail[:, :8].contiguous().view(torch.int64).view(-1)
    if not bool((tags == tag).all()):
        raise RuntimeError(
            f"ring_rewrite: all_gather_seq mixed transfers: tags {tags.tolist()} (expected {tag} "
            "on every rank); the ranks ran their gathers in different orders"
        )
    differ = [global_rank(group, r) for r in range(world) if not torch.equal(tail[r], tail[0])]
    if differ:
        raise RuntimeError(
            f"ring_rewrite: sharding='replicated' needs the same full sequence on every rank, but "
            f"the attention inputs of rank(s) {differ} differ from rank {global_rank(group, 0)}'s "
            "(data-parallel inputs? use sharding='sharded' with shard(), or a group= of the ranks "
            "that share a sequence)"
        )
    out = gathered[:, : x.numel() * x.element_size()].contiguous().view(x.dtype)
    return out.view(world, *x.shape), token.clone()


def _tag_bytes(tag: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([tag], dtype=torch.int64, device=device).view(torch.uint8)


@all_gather_seq.register_fake
def _(x, token, group_name, world, tag, same=None):
    return x.new_empty((world, *x.shape)), token.new_empty(token.shape)


torch.fx.node.has_side_effect(torch.ops.ring_rewrite.all_gather_seq.default)


@torch.library.custom_op("ring_rewrite::all_to_all_seq", mutates_args=())
def all_to_all_seq(
    x: torch.Tensor, token: torch.Tensor, group_name: str, world: int, tag: int, first: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's pieces exchanged among the ``world`` ranks ``first, first + 1, ...`` of the
    group: ``x[j]`` goes to rank ``first + j``, and the result's ``[j]`` is what that rank sent
    this one (its ``x[me]``); ``x`` is ``(world, ...)``.

    Point-to-point like ``all_gather_seq`` (one transfer per distance), ``tag`` in every
    payload: ranks that exchanged different tensors fail loudly. Unlike a gather's, each message
    has a tag of its own in the call (the exchange's index, ``Tag.chunk``, and the distance):
    a call's exchanges all go to every rank, and recovery (``recovery._recover``) tells a
    peer's unfinished message from one this rank finished by its tag alone.
    """
    index = Tag.decode(tag).chunk
    _, tag, _, timeout = _message_tag(token, tag)
    check = _tag_bytes(tag, x.device)
    me = dist.get_rank(_group(group_name)) - first
    pieces = x.contiguous().view(world, -1).view(torch.uint8)
    keys = [
        _start(
            group_name, token, [torch.cat([pieces[(me + d) % world], check])], first + (me + d) % world,
            first + (me - d) % world, transfer_tag(EXCHANGE, GATHER, d, index),
        )  # fmt: skip
        for d in range(1, world)
    ]
    out = torch.empty_like(pieces)
    out[me] = pieces[me]
    for d, pending in zip(range(1, world), _finish(keys, timeout)):
        got = pending.received[0]
        if int(got[-check.numel() :].view(torch.int64)) != tag:
            raise RuntimeError(
                f"ring_rewrite: all_to_all_seq mixed transfers: rank {first + (me - d) % world} sent tag "
                f"{int(got[-check.numel() :].view(torch.int64))} (expected {tag}); the ranks ran "
                "their all-to-alls in different orders"
            )
        out[(me - d) % world] = got[: -check.numel()]
    return out.view(x.dtype).view(x.shape), token.clone()


@all_to_all_seq.register_fake
def _(x, token, group_name, world, tag, first=0):
    return x.new_empty(x.shape), token.new_empty(token.shape)


torch.fx.node.has_side_effect(torch.ops.ring_rewrite.all_to_all_seq.default)
