"""What the ring exchanges in collectives, each with a deadline, and the recovery of the
transfers a failed call left (Note [Calls, deadlines and recovery])."""

from __future__ import annotations

import logging
import pickle
import threading

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from .errors import TransferTimeout
from .groups import _p2p
from .tags import _wire
from .state import _GroupState
from .waiter import _ABANDONED, _PENDING, _Work, _on_stream, _wait

log = logging.getLogger(__name__)


def _all_gather(group, x: torch.Tensor, timeout: float, what: str, state: _GroupState):
    """Every rank's ``x`` stacked, or ``TransferTimeout`` past ``timeout`` (the group is then
    broken: its collectives would no longer pair up)."""
    world = dist.get_world_size(group)
    out = [torch.empty_like(x) for _ in range(world)]
    try:
        work = dist.all_gather(out, x, group=group, async_op=True)
        _wait_collective(work, timeout)
    except TransferTimeout:
        state.broken = f"{what} did not finish within {timeout:g} s"
        raise TransferTimeout(
            f"ring_rewrite: {what} did not finish within {timeout:g} s: a rank did not reach it "
            "(it died, hangs, or runs other code). The ring cannot be used in this process "
            "group any more."
        ) from None
    except Exception as error:
        state.broken = f"{what} failed: {error}"
        raise RuntimeError(f"ring_rewrite: {what} failed: {error}") from error
    return torch.stack(out)


def _gather_objects(group, obj, timeout: float, what: str, state: _GroupState) -> list:
    """Every rank's picklable ``obj``, with a deadline (``_all_gather``). Only where every rank
    knows that every rank calls it: after a header all of them read the same way."""
    mine = pickle.dumps(obj)
    size = _all_gather(group, torch.tensor([len(mine)]), timeout, what, state)
    payload = torch.zeros(int(size.max()), dtype=torch.uint8)
    payload[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    everyone = _all_gather(group, payload, timeout, what, state)
    return [pickle.loads(everyone[r, : int(size[r])].numpy().tobytes()) for r in range(len(size))]


def _wait_collective(work, timeout: float) -> None:
    try:
        future = work.get_future()
    except RuntimeError:  # a backend without futures (the fake process group): no deadline
        work.wait()
        return
    done = threading.Event()
    future.then(lambda _: done.set())
    if not done.wait(timeout):
        raise TransferTimeout()
    future.value()  # raises the collective's own error, if any


def _recover(group, group_name, state, previous: dict, leftover: list, timeout: float) -> None:
    """Complete what a failed call left half done, on every rank (Note [Calls, deadlines and
    recovery]): ``previous`` is what this rank started in that call."""
    me = dist.get_rank(group)
    everyone = _gather_objects(group, list(previous.values()), timeout, "recovery", state)
    ops = []
    for peer, started in enumerate(everyone):
        if peer == me:
            continue
        for t in started:
            if (t.call, t.tag) in previous:
                continue  # this rank did its half
            wire = _wire(t.call, t.tag)
            if t.send_to == me:  # sent to us, never received: receive it and drop it
                ops += [
                    _p2p(dist.irecv, torch.empty(shape, dtype=dtype, device=t.device), group, peer, 8 * wire + i)
                    for i, shape, dtype in t.sends
                ]
            if t.recv_from == me:  # waits for us, never sent: send zeros
                ops += [
                    _p2p(dist.isend, torch.zeros(shape, dtype=dtype, device=t.device), group, peer, 8 * wire + i)
                    for i, shape, dtype in t.recvs
                ]
    on_stream = bool(ops) and _on_stream(ops[0].tensor)
    works = [_Work(w, on_stream) for w in dist.batch_isend_irecv(ops)] if ops else []
    for pending in leftover:
        works += pending.works
    try:
        _wait(works, timeout)
    except BaseException as error:
        state.broken = f"recovering the transfers of a failed call failed: {error}"
        raise
    for key in [k for k, p in _PENDING.items() if p.group_name == group_name]:
        del _PENDING[key]
    _ABANDONED[:] = [p for p in _ABANDONED if p.group_name != group_name]
    counters["ring_rewrite"]["recovered_transfers"] += len(leftover)
    log.warning(
        "ring_rewrite: recovered %d transfer(s) left over by a failed call (%d message(s) "
        "completed for peers)", len(leftover), len(ops),
    )  # fmt: skip
