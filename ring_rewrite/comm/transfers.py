"""A ring transfer's custom ops: ``ring_shift_start`` and ``ring_shift_wait``.

Note [Buffers in flight]
~~~~~~~~~~~~~~~~~~~~~~~~
Between ``ring_shift_start`` and ``ring_shift_wait`` gloo reads the sent tensors and writes the
received ones on its own threads. To a compiler our ops are plain function calls: inductor's
memory planner hands an input's storage to the next kernel as soon as the input's last reader
returns (``buf7 = buf4; del buf4  # reuse``), and when a view feeds two custom ops it may
materialise it once per op. Either would send memory that the next block's gathers overwrite
in flight, or wait on a second copy, and ring branches (exact attention too) would come out
wrong under inductor only. So, by construction:

* **received** tensors are allocated inside ``ring_shift_start`` and reach the graph only as
  ``ring_shift_wait``'s outputs: no compiled code can see them, let alone reuse them, in flight;
* **sent** tensors are read again by ``ring_shift_wait`` (its ``xs``), so the planner keeps them
  alive and unwritten until the wait, provided both ops get one buffer. Under inductor that is
  made so, not hoped for: ``inductor_lowering`` lowers the wait onto the very buffers its start
  was lowered onto (by tag), whatever its own ``xs`` argument lowered to, and schedules what is
  lowered between the two after the start (so the overlap survives the peak-memory reordering).
  No copy is added: what the start sends is what inductor would have materialised for it
  anyway. (A ``clone`` in the graph would not do it: inductor drops the clone of a contiguous
  tensor and may still materialise the gather once per consumer.) Eager and ``aot_eager`` pass the
  very tensors the start sent;
* ``ring_shift_wait`` checks that it got the very buffer its start sent (a pointer compare, on
  always), and raises otherwise, naming the transfer, instead of sending overwritten memory;
* ``RING_REWRITE_CHECK_TRANSFERS=1`` (every rank) also fingerprints each message at its start,
  sends the fingerprint along, and at the wait checks the sent buffers and the received ones
  against it: any write to a buffer in flight, or a mis-paired message, raises naming the site,
  branch, step and tag. Off, it costs one module-level bool test per transfer.

Why not torch's functional P2P (``_c10d_functional.batch_p2p_ops`` + ``wait_tensor``), whose wait
inductor knows keeps the sent buffer alive: its tags are graph constants (a shared body cannot
name its site, a call cannot name itself), it carries no token, so the order of independent
rings rests on inductor's own comm ordering, and its wait takes one tensor, so nothing pins it
after the compute it should overlap (inductor may place it before). Our ops keep all three
and get the lifetimes from the rules above, checked at run time and in ``tests/``, which
read inductor's generated code.

Note [The CUDA transport]
~~~~~~~~~~~~~~~~~~~~~~~~~
On a process group of NCCL the ring's own group (``ring_group``) is ``cpu:gloo,cuda:nccl``:
what the ring exchanges on the CPU (headers, a compile's agreement, recovery's lists) goes over
gloo with its deadlines (Note [Calls, deadlines and recovery]),
the K/V, dK/dV and gathered tensors, on the GPU, over NCCL. The transfers keep torch's stream
contract (``ProcessGroupNCCL``; its functional collectives' ``wait_tensor`` does the same):

* ``ring_group`` makes the NCCL communicator when the group is made (``device_id``: every rank of
  the group makes it, at its first compile), not at the first transfer: a ring of a branch may
  span fewer ranks than the group, and a communicator made lazily needs all of them at once.
* ``ring_shift_start`` launches the P2P ops (``batch_isend_irecv``) on the group's NCCL stream,
  which first waits for the current stream: what the compute before the start wrote is what is
  sent. The host does not wait.
* ``ring_shift_wait`` calls each work's ``wait()`` on the calling thread: it makes the *current*
  stream wait for the NCCL stream and returns at once. Kernels launched after it read the
  received tensors; those launched between start and wait overlap the transfer. No thread of
  ours waits on a CUDA work (``_Waiter`` serves gloo only): on another thread ``wait()`` would
  order that thread's current stream, not the caller's.
* Every tensor NCCL reads or writes, sent and received, is held by ``_Pending`` from the start
  until the wait, so the caching allocator cannot hand its memory out while the transfer may
  still use it; after the wait the current stream is ordered after the transfer, so memory
  freed then and reused on that stream is reused after it (no ``record_stream`` is needed: the
  allocator reuses a block on the stream that allocated it, the current one, and ``received``
  is allocated there). Inductor's planner is held off as on the CPU (Note [Buffers in flight]).
* The host never waits for a CUDA transfer, so ``RingDilatedConfig.timeout`` does not bound
  one: the NCCL process group's own timeout (its watchdog) does. Headers keep their deadlines
  over gloo, and a transfer left pending (an error between its start and its wait) is recovered
  at the next header as on the CPU, its messages posted on the GPU.

Tests: the transport's calls are checked on CPU against a fake process group
(``tests/test_ring.py``); ``tests/test_cuda.py`` sends to its own rank over NCCL on one GPU
(NCCL runs no ring of several processes on one GPU). What has run on GPUs: README.md, Support.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from .calls import _announce
from .errors import TransferTimeout
from .groups import _group, _p2p, global_rank
from .state import _GROUP_CALL, _Started, _state
from .tags import _describe, _wire
from .waiter import _ABANDONED, _PENDING, _Pending, _Work, _on_stream, _wait

__all__ = ["checking_transfers", "ring_shift_start", "ring_shift_wait"]

_CHECK = os.environ.get("RING_REWRITE_CHECK_TRANSFERS", "0") not in ("", "0")
_MAX_TENSORS = 4


def checking_transfers() -> bool:
    """Whether ``RING_REWRITE_CHECK_TRANSFERS`` fingerprints every message (read at import)."""
    return _CHECK


def _message_tag(token: torch.Tensor, tag: int) -> tuple[tuple[int, int], int, str, float]:
    """The transfer's key in ``_PENDING``, its wire tag, how errors name it, and its deadline."""
    site, call_id, call, timeout_ms, _ = token.tolist()
    return (call_id, tag), _wire(call, tag), _describe(site, call, tag), timeout_ms / 1000


def _start(
    group_name: str, token: torch.Tensor, xs: list[torch.Tensor], send_to: int, recv_from: int,
    tag: int,
) -> tuple[int, int]:  # fmt: skip
    """Send ``xs`` to ``send_to`` and receive their like from ``recv_from`` (ranks of the group)
    under ``tag`` of the token's call; returns the transfer's key in ``_PENDING``."""
    key, wire, name, _ = _message_tag(token, tag)
    if key in _PENDING:
        raise RuntimeError(f"ring_rewrite: transfer {name} started twice without a wait")
    group = _group(group_name)
    sent = [x.contiguous() for x in xs]
    given = [x.data_ptr() if s is x else None for x, s in zip(xs, sent)]
    received = [torch.empty_like(x) for x in sent]
    if dist.get_backend(group) == "fake":
        # The fake process group (testing.capture_ranks) moves nothing; its collectives hand
        # every rank its own input, and so does a transfer.
        received = [x.clone() for x in sent]
    sends, recvs = list(enumerate(sent)), list(enumerate(received))
    prints = None
    if _CHECK:
        ours = torch.stack([_fingerprint(x) for x in sent])
        theirs = torch.empty_like(ours)
        sends.append((_MAX_TENSORS, ours))
        recvs.append((_MAX_TENSORS, theirs))
        prints = (ours, theirs)
    ops = [_p2p(dist.isend, x, group, send_to, 8 * wire + i) for i, x in sends]
    ops += [_p2p(dist.irecv, r, group, recv_from, 8 * wire + i) for i, r in recvs]
    on_stream = _on_stream(sent[0])
    works = [_Work(w, on_stream) for w in dist.batch_isend_irecv(ops)]
    peers = (global_rank(group, send_to), global_rank(group, recv_from))
    _PENDING[key] = _Pending(
        group_name, f"transfer {name}", peers, works, received, sent, given, prints
    )
    call = int(token[_GROUP_CALL])
    _state(group_name).started[call, tag] = _Started(
        call, tag, send_to, recv_from,
        tuple((i, tuple(x.shape), x.dtype) for i, x in sends),
        tuple((i, tuple(x.shape), x.dtype) for i, x in recvs), sent[0].device,
    )  # fmt: skip
    counters["ring_rewrite"]["bytes_sent"] += sum(x.numel() * x.element_size() for x in sent)
    return key


def _finish(keys: list[tuple[int, int]], timeout: float) -> list[_Pending]:
    """Wait for the transfers ``keys`` (``_start``); past ``timeout`` raise ``TransferTimeout``
    naming the first unfinished one and its peers, and leave them pending (recovery)."""
    pendings = [_PENDING[key] for key in keys]
    try:
        _wait([w for p in pendings for w in p.works], timeout)
    except TransferTimeout:
        late = next(p for p in pendings if not all(w.done for w in p.works))
        send_to, recv_from = late.peers
        _announce(late.group_name)
        raise TransferTimeout(
            f"ring_rewrite: {late.name} did not finish within the {timeout:g} s timeout "
            f"(sending to rank {send_to}, receiving from rank {recv_from}): a peer failed, "
            "stopped, or is out of step (or is still compiling: raise RingDilatedConfig.timeout). "
            "The next call of a ring site recovers what this one left."
        ) from None
    except Exception as error:
        for key, pending in zip(keys, pendings):
            del _PENDING[key]
            _ABANDONED.append(pending)
        send_to, recv_from = pendings[0].peers
        raise RuntimeError(
            f"ring_rewrite: {pendings[0].name} failed (sending to rank {send_to}, receiving from "
            f"rank {recv_from}): {error}"
        ) from error
    for key in keys:
        del _PENDING[key]
    return pendings


@torch.library.custom_op("ring_rewrite::ring_shift_start", mutates_args=())
def ring_shift_start(
    xs: list[torch.Tensor],
    token: torch.Tensor,
    group_name: str,
    send_to: int,
    recv_from: int,
    tag: int,
) -> torch.Tensor:
    """Start sending ``xs`` to ``send_to`` and receiving tensors like them from ``recv_from``
    (ranks of the group, Note [Group ranks]); returns the next token at once.
    ``ring_shift_wait`` under the same ``tag``, given the same ``xs``, returns what arrived: the
    compute between the two overlaps the transfer. Use it through ``Rotater`` (Note [Buffers in
    flight]).

    Message ``i`` goes under wire tag ``8 * wire + i`` (``_wire``: the tag and the call);
    with fingerprints, they go under ``8 * wire + 4``.
    """
    assert len(xs) <= _MAX_TENSORS, "ring_shift_start sends at most 4 tensors per call"
    _start(group_name, token, xs, send_to, recv_from, tag)
    return token.clone()


@ring_shift_start.register_fake
def _(xs, token, group_name, send_to, recv_from, tag):
    return token.new_empty(token.shape)


@torch.library.custom_op("ring_rewrite::ring_shift_wait", mutates_args=())
def ring_shift_wait(
    xs: list[torch.Tensor], token: torch.Tensor, tag: int, after: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Finish the transfer ``ring_shift_start`` began under ``tag``: the received tensors, then
    the next token. ``xs`` are the tensors it sent: reading them here keeps them alive and
    unwritten until the transfer is done (Note [Buffers in flight]). ``after`` is the compute
    the transfer overlaps, unread: it orders the wait after that compute.

    Past the call's deadline it raises ``TransferTimeout`` naming the transfer and its peers,
    and the transfer stays pending for the next header to recover.
    """
    key, _, name, timeout = _message_tag(token, tag)
    if key not in _PENDING:
        raise RuntimeError(
            f"ring_rewrite: transfer {name} is not pending (waited before its start, or twice)"
        )
    (pending,) = _finish([key], timeout)
    for i, (x, address) in enumerate(zip(xs, pending.given)):
        if address is not None and x.data_ptr() != address:
            raise RuntimeError(
                f"ring_rewrite: transfer {name}: tensor {i} reached the wait in another buffer "
                "than the one its start sent, so the compiled code does not keep the sent "
                "buffer alive in flight and may have overwritten it (Note [Buffers in flight] "
                "in ring_rewrite/comm/transfers.py)"
            )
    if pending.fingerprints is not None:
        _check_fingerprints(pending)
    return [*pending.received, token.clone()]


@ring_shift_wait.register_fake
def _(xs, token, tag, after):
    return [*(x.new_empty(x.shape) for x in xs), token.new_empty(token.shape)]


torch.fx.node.has_side_effect(torch.ops.ring_rewrite.ring_shift_start.default)
torch.fx.node.has_side_effect(torch.ops.ring_rewrite.ring_shift_wait.default)


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the bytes of ``x`` (plain and position-weighted): equal bytes give
    equal fingerprints on every rank; a changed or moved word changes them."""
    raw = x.detach().reshape(-1).view(torch.uint8)
    raw = torch.nn.functional.pad(raw, (0, -raw.numel() % 4))
    words = raw.view(torch.int32).to(torch.int64)
    weights = torch.arange(words.numel(), dtype=torch.int64, device=x.device) * 2 + 1
    return torch.stack([words.sum(), (words * weights).sum()])


def _check_fingerprints(pending: _Pending) -> None:
    ours, theirs = pending.fingerprints
    send_to, recv_from = pending.peers
    for i, x in enumerate(pending.sent):
        if not torch.equal(_fingerprint(x), ours[i]):
            raise RuntimeError(
                f"ring_rewrite: transfer {pending.name}: tensor {i} sent to rank {send_to} was "
                "written while in flight (RING_REWRITE_CHECK_TRANSFERS)"
            )
    for i, x in enumerate(pending.received):
        if not torch.equal(_fingerprint(x), theirs[i]):
            raise RuntimeError(
                f"ring_rewrite: transfer {pending.name}: tensor {i} received from rank "
                f"{recv_from} differs from what that rank sent: its buffer was written in "
                "flight, or the ranks paired different messages (RING_REWRITE_CHECK_TRANSFERS)"
            )
