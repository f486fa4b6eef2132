"""Collectives of the ring as ``ring_rewrite`` custom ops that survive compilation.

Note [Ordering the ring's messages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Seen on torch 2.13 (FINDINGS.md): a P2P op whose result one rank does not use is dead-code
eliminated on that rank only; inductor may order independent P2P calls differently on different
ranks, and equal-shaped messages then pair up wrong without an error. So every op here

* is marked side-effectful (``torch.fx.node.has_side_effect``, which inductor honours too):
  never eliminated, even where a rank does not use what it received,
* takes the previous transfer's ``token`` and returns the next one: all transfers of a site form
  one data-dependency chain, so every rank runs them in the same order (a ring step is two ops,
  ``ring_shift_start`` before the compute it overlaps and ``ring_shift_wait`` after it, both in
  the chain). The backward's transfers all sit in the site's backward body, one
  ``invoke_subgraph`` call that takes ``dout``: AOT's partitioner cannot hoist one into the
  forward (where it would save every rotated K/V block),
* waits after the compute it overlaps, by data: ``ring_shift_wait`` takes that compute's results
  (``after``) and ignores them. The chain orders transfers, not the compute between them, and
  inductor's peak-memory reordering moved every dK/dV wait of the backward ahead of the block it
  overlaps (a wait frees the buffers it sent), leaving each of those transfers bare,
* sends each message under its own tag: the transfer's place in its site (branch, direction,
  head chunk, step) plus the site, which the token carries as its value (``site_token``). A
  schedule that still went wrong fails loudly (a timeout naming the op) instead of pairing the
  wrong buffers.

Why not ``EffectType.ORDERED``: a rewritten site is one ``invoke_subgraph`` body shared by every
layer with the same plan (Note [One body per plan] in ``passes/rewrite_sdpa.py``), and on torch
2.13 an effectful op inside ``invoke_subgraph`` drops the gradients of the whole call (its
output no longer requires grad), or fails AOT with a missing ``tangents_token`` when the call
sits in a backward graph. The site index cannot be a constant of a shared body, hence the token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

__all__ = [
    "ring_shift_start", "ring_shift_wait", "all_gather_seq", "site_token",
    "resolve_group", "check_agreement",
]  # fmt: skip


def _group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


@torch.library.custom_op("ring_rewrite::site_token", mutates_args=())
def site_token(site: int) -> torch.Tensor:
    """The first token of a site's chain. Tokens order the transfers (each op takes one and
    returns the next) and carry the site index as their value, for the tags.

    An op, not ``torch.full``: inductor would build one kernel per site index.
    """
    return torch.full((1,), float(site))


@site_token.register_fake
def _(site):
    return torch.empty((1,))


_SITE_BITS = 24  # a transfer's tag within its site is below 2**24 (SitePlan.tag)


def _message_tag(token: torch.Tensor, tag: int) -> tuple[int, str]:
    """The site's transfer ``tag`` made unique across sites (within gloo's int: sites 16 apart
    share tags), and how errors name it."""
    site = int(token.item())
    return ((site << _SITE_BITS) + tag) % 2**28, f"transfer {tag} of site {site}"


# Transfers started and not yet waited for, by tag: (works, received, sent). Holding ``sent``
# keeps the send buffers alive until the transfer is done.
_PENDING: dict[int, tuple[list, list[torch.Tensor], list[torch.Tensor]]] = {}


@torch.library.custom_op("ring_rewrite::ring_shift_start", mutates_args=())
def ring_shift_start(
    xs: list[torch.Tensor],
    token: torch.Tensor,
    group_name: str,
    send_to: int,
    recv_from: int,
    tag: int,
) -> torch.Tensor:
    """Start sending ``xs`` to global rank ``send_to`` and receiving tensors like them from
    ``recv_from``; returns the next token at once. ``ring_shift_wait`` under the same ``tag``
    returns what arrived: the compute between the two overlaps the transfer.

    Message ``i`` goes under tag ``4 * tag + i`` (so at most 4 tensors per call).
    """
    assert len(xs) <= 4, "ring_shift_start sends at most 4 tensors per call"
    tag, name = _message_tag(token, tag)
    if tag in _PENDING:
        raise RuntimeError(f"ring_rewrite: {name} started twice without a wait")
    group = _group(group_name)
    xs = [x.contiguous() for x in xs]
    received = [torch.empty_like(x) for x in xs]
    ops = [dist.P2POp(dist.isend, x, send_to, group, 4 * tag + i) for i, x in enumerate(xs)]
    ops += [dist.P2POp(dist.irecv, r, recv_from, group, 4 * tag + i) for i, r in enumerate(received)]
    _PENDING[tag] = (dist.batch_isend_irecv(ops), received, xs)
    counters["ring_rewrite"]["bytes_sent"] += sum(x.numel() * x.element_size() for x in xs)
    return token.clone()


@ring_shift_start.register_fake
def _(xs, token, group_name, send_to, recv_from, tag):
    return token.new_empty(token.shape)


@torch.library.custom_op("ring_rewrite::ring_shift_wait", mutates_args=())
def ring_shift_wait(
    xs: list[torch.Tensor], token: torch.Tensor, tag: int, after: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Finish the transfer ``ring_shift_start`` began under ``tag``: the received tensors, then
    the next token. ``xs`` are the tensors it sent (their shapes for the fake kernel; taking them
    keeps them alive in the graph until the transfer is done). ``after`` is the compute the
    transfer overlaps, unread: it orders the wait after that compute."""
    tag, name = _message_tag(token, tag)
    if tag not in _PENDING:
        raise RuntimeError(
            f"ring_rewrite: no {name} is pending (waited before its start, or twice)"
        )
    works, received, _ = _PENDING.pop(tag)
    for work in works:
        work.wait()
    return [*received, token.clone()]


@ring_shift_wait.register_fake
def _(xs, token, tag, after):
    return [*(x.new_empty(x.shape) for x in xs), token.new_empty(token.shape)]


torch.fx.node.has_side_effect(torch.ops.ring_rewrite.ring_shift_start.default)
torch.fx.node.has_side_effect(torch.ops.ring_rewrite.ring_shift_wait.default)


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

    Collectives carry no tag, so ``tag`` travels in the payload: ranks that gathered different
    tensors (a schedule gone wrong) fail loudly instead of mixing them. ``same`` (a few values)
    travels too and must be bitwise equal on every rank: replicated mode checks with it that the
    ranks really hold the same sequence.
    """
    group = _group(group_name)
    tag, _ = _message_tag(token, tag)
    check = _tag_bytes(tag, x.device)
    if same is not None:
        check = torch.cat([check, same.contiguous().view(-1).view(torch.uint8)])
    payload = torch.cat([x.contiguous().view(-1).view(torch.uint8), check])
    gathered = payload.new_empty((world, payload.numel()))
    dist.all_gather(list(gathered.unbind(0)), payload, group=group)
    tail = gathered[:, payload.numel() - check.numel() :]
    tags = tail[:, :8].contiguous().view(torch.int64).view(-1)
    if not bool((tags == tag).all()):
        raise RuntimeError(
            f"ring_rewrite: all_gather_seq mixed transfers: tags {tags.tolist()} (expected {tag} "
            "on every rank); the ranks ran their collectives in different orders"
        )
    differ = [r for r in range(world) if not torch.equal(tail[r], tail[0])]
    if differ:
        raise RuntimeError(
            f"ring_dilated: sharding='replicated' needs the same full sequence on every rank, but "
            f"the attention inputs of rank(s) {differ} differ from rank 0's (data-parallel inputs? "
            "use sharding='sharded' with shard(), or a group= of the ranks that share a sequence)"
        )
    out = gathered[:, : x.numel() * x.element_size()].contiguous().view(x.dtype)
    counters["ring_rewrite"]["bytes_sent"] += payload.numel() * (world - 1)
    return out.view(world, *x.shape), token.clone()


def _tag_bytes(tag: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([tag], dtype=torch.int64, device=device).view(torch.uint8)


@all_gather_seq.register_fake
def _(x, token, group_name, world, tag, same=None):
    return x.new_empty((world, *x.shape)), token.new_empty(token.shape)


torch.fx.node.has_side_effect(torch.ops.ring_rewrite.all_gather_seq.default)


def resolve_group(group) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(process group, world size, rank)``; ``(None, 1, 0)`` without torch.distributed."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1, 0
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        group = group.get_group()  # a 1-D DeviceMesh
    return group, dist.get_world_size(group), dist.get_rank(group)


def check_agreement(group: dist.ProcessGroup, sites: list[dict]) -> None:
    """Raise on every rank, naming the difference, unless all ranks planned the same ``sites``.

    Ranks that disagree (another sequence length, another config) would otherwise exchange
    mismatched messages and hang until the group timeout.
    """
    world = dist.get_world_size(group)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, sites, group=group)
    mine = everyone[0]
    for rank, theirs in enumerate(everyone):
        if len(theirs) != len(mine):
            raise RuntimeError(
                f"ring_dilated: ranks disagree on the rewrite: {len(mine)} attention sites on "
                f"rank 0 but {len(theirs)} on rank {rank}"
            )
        for a, b in zip(mine, theirs):
            if ("reason" in a) != ("reason" in b):
                raise RuntimeError(
                    f"ring_dilated: ranks disagree on the rewrite of attention site "
                    f"{a.get('site')}: " + " but ".join(
                        f"left alone on rank {r} ({x['reason']})" if "reason" in x
                        else f"rewritten on rank {r}"
                        for r, x in ((0, a), (rank, b))
                    )
                )
            for key in [*a, *(k for k in b if k not in a)]:
                if a.get(key) != b.get(key):
                    raise RuntimeError(
                        f"ring_dilated: ranks disagree on the rewrite of attention site "
                        f"{a.get('site')}: {key}={a.get(key)!r} on rank 0 but "
                        f"{key}={b.get(key)!r} on rank {rank}"
                    )
