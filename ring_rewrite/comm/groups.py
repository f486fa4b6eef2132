"""The ring's process groups and their ranks.

Note [Group ranks]
~~~~~~~~~~~~~~~~~~
A ring runs in one process group (``RingDilatedConfig.group``): WORLD, a ``new_group``, or one
dimension of a DeviceMesh, such as ``cp`` of a ``(dp, cp)`` mesh. Its traffic (headers, agreement,
recovery, data) runs on a group of its own, ``ring_group``: the same ranks, made once per user
group at the first compile (``new_group`` among its members), so that nothing of the ring can pair
with a collective of the user's on their group, even after a fault left one of ours half done.
Everything in ``ring_rewrite/comm/`` speaks that group's ranks: the plans (``SitePlan.rank``,
``Branch.send_to`` / ``recv_from``), ``ring_shift_start``'s ``send_to`` / ``recv_from``, the
gathers, the all-to-alls and recovery. torch's ``P2POp`` takes a global rank, and ``global_rank`` is the one translation: where
a ``P2POp`` is built (``_p2p``), and where an error or the report names a rank. A tag needs no
group in it: gloo keeps one context per process group, and a message matches only a receive posted
in its own group (two groups over the same two ranks, the same tag, received in the other order:
each got its own message). So two ``cp`` groups never cross, nor a rank's ring its ``dp``
collectives (FSDP, DDP).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["global_rank", "global_ranks", "resolve_group", "ring_group"]


def resolve_group(group) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(process group, world size, rank)``; ``(None, 1, 0)`` without torch.distributed."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1, 0
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        # A 1-D DeviceMesh, or a hybrid's (ring, a2a) mesh: all its ranks, row after row.
        group = (group if group.ndim == 1 else group._flatten()).get_group()
    return group, dist.get_world_size(group), dist.get_rank(group)


_RING_GROUPS: dict[str, dist.ProcessGroup] = {}


def ring_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group the ring's traffic runs on for the user's ``group``: the same ranks in the
    same order, made once per group (Note [Group ranks]). Every rank of ``group`` calls this at
    its first compile of a ring on it."""
    from torch.distributed.distributed_c10d import _world

    if dist.get_backend(group) == "fake":  # moves nothing: nothing of the ring to keep apart
        return group
    ours = _RING_GROUPS.get(group.group_name)
    if ours is not None and ours in _world.pg_map:
        return ours
    ranks = dist.get_process_group_ranks(group)
    if ranks != sorted(ranks):
        raise ValueError(
            f"ring_rewrite: the ring's group has its ranks out of order (global ranks {ranks}); "
            "pass a group whose ranks ascend, as dist.new_group or a DeviceMesh dimension makes"
        )
    backend = group._get_backend(torch.device("cpu")) if dist.get_backend(group) == "gloo" else None
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    ours = dist.new_group(
        ranks, use_local_synchronization=True, group_desc=f"ring_rewrite:{group.group_name}",
        **_ring_backend(group), **({"timeout": timeout} if timeout else {}),
    )  # fmt: skip
    _RING_GROUPS[group.group_name] = ours
    return ours


def _ring_backend(group: dist.ProcessGroup) -> dict:
    """The ring group's backend: the user's, with gloo beside NCCL for what the ring exchanges
    on the CPU (headers, agreement), and NCCL's communicator made now, on this rank's current
    GPU (Note [The CUDA transport])."""
    backend = dist.get_backend(group)
    if "nccl" not in backend:
        return {"backend": backend}
    return {"backend": "cpu:gloo,cuda:nccl", "device_id": torch.device("cuda", torch.cuda.current_device())}


def _group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def global_rank(group: dist.ProcessGroup, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (Note [Group ranks])."""
    return dist.get_global_rank(group, rank)


def global_ranks(group_name: str) -> tuple[int, ...]:
    """The global rank of each rank of the group named ``group_name``, in group rank order."""
    group = _group(group_name)
    return tuple(global_rank(group, r) for r in range(dist.get_world_size(group)))


def _p2p(op, x: torch.Tensor, group: dist.ProcessGroup, peer: int, tag: int) -> dist.P2POp:
    """``op`` (``dist.isend`` or ``dist.irecv``) of ``x`` with ``group``'s rank ``peer``: every
    message of the ring is built here (Note [Group ranks])."""
    return dist.P2POp(op, x, global_rank(group, peer), group, tag)
