"""Transfers of the ring: ``ring_rewrite`` custom ops that survive compilation, and the
``Rotater`` through which the attention code uses them.

Note [Ordering the ring's messages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The attention code (``ring_rewrite/attention.py``) sees one ``Rotater`` per site call and,
from it, one ``Ring`` per branch (``rotater.ring(branch, send_to, recv_from)``). It says what
moves and when: ``flight = ring.start(xs, KV, step, chunk)`` before the compute a transfer
overlaps, ``ring.wait(flight, after=that compute)`` after it, and ``rotater.all_gather(x, world,
index)``. Tags, tokens, the order of the messages and the lifetime of their buffers are the
rotater's business, below, never the call sites'.

Seen on torch 2.13 (FINDINGS.md): a P2P op whose result one rank does not use is dead-code
eliminated on that rank only; inductor may order independent P2P calls differently on different
ranks, and equal-shaped messages then pair up wrong without an error. So every op here

* is marked side-effectful (``torch.fx.node.has_side_effect``, which inductor honours too):
  never eliminated, even where a rank does not use what it received,
* takes the previous transfer's ``token`` and returns the next one: all transfers of a site form
  one data-dependency chain, so every rank runs them in the same order. The backward's transfers
  all sit in the site's backward body, one ``invoke_subgraph`` call that takes ``dout``: AOT's
  partitioner cannot hoist one into the forward (where it would save every rotated K/V block),
* waits after the compute it overlaps, by data: ``ring_shift_wait`` takes that compute's results
  (``after``) and ignores them. The chain orders transfers, not the compute between them, and
  inductor's peak-memory reordering moved every dK/dV wait of the backward ahead of the block it
  overlaps (a wait frees the buffers it sent), leaving each of those transfers bare,
* sends each message under its own tag: the transfer's place in its site (``transfer_tag``:
  branch, kind, head chunk, step) plus the site, which the token carries as its value
  (``site_token``). A schedule that still went wrong fails loudly (a timeout naming the
  transfer) instead of pairing the wrong buffers.

Why not ``EffectType.ORDERED``: a rewritten site is one ``invoke_subgraph`` body shared by every
layer with the same plan (Note [One body per plan] in ``passes/rewrite_sdpa.py``), and on torch
2.13 an effectful op inside ``invoke_subgraph`` drops the gradients of the whole call (its
output no longer requires grad), or fails AOT with a missing ``tangents_token`` when the call
sits in a backward graph. The site index cannot be a constant of a shared body, hence the token.

Note [Buffers in flight]
~~~~~~~~~~~~~~~~~~~~~~~~
Between ``ring_shift_start`` and ``ring_shift_wait`` gloo reads the sent tensors and writes the
received ones on its own threads. To a compiler our ops are plain function calls: inductor's
memory planner hands an input's storage to the next kernel as soon as the input's last reader
returns (``buf7 = buf4; del buf4  # reuse``), and when a view feeds two custom ops it may
materialise it once per op. Both happened: the K/V sent at step 0 were reused for the next
block's gathers while still in flight, and the wait was given a second copy; at P = 2 and 4,
ring branches (exact attention too) came out wrong under inductor only. So, by construction:

* **received** tensors are allocated inside ``ring_shift_start`` and reach the graph only as
  ``ring_shift_wait``'s outputs: no compiled code can see them, let alone reuse them, in flight;
* **sent** tensors are read again by ``ring_shift_wait`` (its ``xs``), so the planner keeps them
  alive and unwritten until the wait, provided both ops get one buffer. Under inductor that is
  made so, not hoped for: ``inductor_lowering`` lowers the wait onto the very buffers its start
  was lowered onto (by tag), whatever its own ``xs`` argument lowered to, and schedules what is
  lowered between the two after the start (so the overlap survives the peak-memory reordering).
  No copy is added: what the start sends is what inductor would have materialised for it
  anyway. (A ``clone`` in the graph did not do it: inductor dropped the clone of a contiguous
  tensor and still materialised the gather once per consumer.) Eager and ``aot_eager`` pass the
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
after the compute it should overlap (FINDINGS.md saw it placed before). Our ops keep all three
and get the lifetimes from the rules above, checked at run time and in ``tests/``, which
read inductor's generated code.

A site call that raised between a start and its wait leaves the transfer pending; the next
``site_token`` of that site waits it out and drops it (``_drain``), so it cannot break the next
call.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

__all__ = [
    "Rotater", "Ring", "InFlight", "KV", "KV_BACK", "DKV", "transfer_tag", "checking_transfers",
    "inductor_lowering", "ring_shift_start", "ring_shift_wait", "all_gather_seq", "site_token",
    "resolve_group", "check_agreement",
]  # fmt: skip

log = logging.getLogger(__name__)

_CHECK = os.environ.get("RING_REWRITE_CHECK_TRANSFERS", "0") not in ("", "0")

# Transfer kinds, the second field of a tag.
KV, KV_BACK, DKV, GATHER = range(4)
_KINDS = ("K/V", "K/V (backward)", "dK/dV", "gather")
_SITE_BITS = 24  # a transfer's tag within its site is below 2**24 (transfer_tag)


def checking_transfers() -> bool:
    """Whether ``RING_REWRITE_CHECK_TRANSFERS`` fingerprints every message (read at import)."""
    return _CHECK


def transfer_tag(branch: int, kind: int, step: int, chunk: int = 0) -> int:
    """A transfer's tag within its site: which branch, kind, head chunk and ring step."""
    assert 0 <= kind < 4 and 0 <= chunk < 64 and 0 <= step < 1024 and 0 <= branch < 64
    return ((branch * 4 + kind) * 64 + chunk) * 1024 + step


def _describe(site: int, tag: int) -> str:
    step, chunk = tag % 1024, tag // 1024 % 64
    kind, branch = tag // (1024 * 64) % 4, tag // (1024 * 64 * 4)
    return (
        f"site {site}, branch {branch}, step {step}, {_KINDS[kind]}, head chunk {chunk} "
        f"(tag {tag})"
    )


def _group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


@torch.library.custom_op("ring_rewrite::site_token", mutates_args=())
def site_token(site: int) -> torch.Tensor:
    """The first token of a site's chain. Tokens order the transfers (each op takes one and
    returns the next) and carry the site index as their value, for the tags. A new call of the
    site first drops what a call that raised left pending (Note [Buffers in flight]).

    An op, not ``torch.full``: inductor would build one kernel per site index.
    """
    _drain(site)
    return torch.full((1,), float(site))


@site_token.register_fake
def _(site):
    return torch.empty((1,))


def _message_tag(token: torch.Tensor, tag: int) -> tuple[int, int, str]:
    """The site, the transfer's ``tag`` made unique across sites (within gloo's int: sites 16
    apart share tags; each message adds 8 * this + its index), and how errors name it."""
    site = int(token.item())
    return site, ((site << _SITE_BITS) + tag) % 2**28, _describe(site, tag)


@dataclasses.dataclass
class _Pending:
    """A transfer started and not yet waited for."""

    site: int
    name: str
    peers: tuple[int, int]
    works: list
    received: list[torch.Tensor]
    sent: list[torch.Tensor]
    """What gloo reads: the tensors given, or start's own copy of a non-contiguous one. Held
    here too, so that the memory is never freed in flight."""
    given: list[int | None]
    """Address of each tensor given, where gloo reads it in place (None: start's own copy)."""
    fingerprints: tuple[torch.Tensor, torch.Tensor] | None
    """(ours at the start, the sender's as received), with RING_REWRITE_CHECK_TRANSFERS."""


# Transfers started and not yet waited for, by wire tag.
_PENDING: dict[int, _Pending] = {}
# Transfers a failed call left that would not finish: their buffers are never freed, since gloo
# may still write into them.
_ABANDONED: list[_Pending] = []
_MAX_TENSORS = 4


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
    ``recv_from``; returns the next token at once. ``ring_shift_wait`` under the same ``tag``,
    given the same ``xs``, returns what arrived: the compute between the two overlaps the
    transfer. Use it through ``Rotater`` (Note [Buffers in flight]).

    Message ``i`` goes under wire tag ``8 * tag + i``; with fingerprints, they go under
    ``8 * tag + 4``.
    """
    assert len(xs) <= _MAX_TENSORS, "ring_shift_start sends at most 4 tensors per call"
    site, wire, name = _message_tag(token, tag)
    if wire in _PENDING:
        raise RuntimeError(f"ring_rewrite: transfer {name} started twice without a wait")
    group = _group(group_name)
    sent = [x.contiguous() for x in xs]
    given = [x.data_ptr() if s is x else None for x, s in zip(xs, sent)]
    received = [torch.empty_like(x) for x in sent]
    ops = [dist.P2POp(dist.isend, x, send_to, group, 8 * wire + i) for i, x in enumerate(sent)]
    ops += [
        dist.P2POp(dist.irecv, r, recv_from, group, 8 * wire + i) for i, r in enumerate(received)
    ]
    prints = None
    if _CHECK:
        ours = torch.stack([_fingerprint(x) for x in sent])
        theirs = torch.empty_like(ours)
        ops += [
            dist.P2POp(dist.isend, ours, send_to, group, 8 * wire + _MAX_TENSORS),
            dist.P2POp(dist.irecv, theirs, recv_from, group, 8 * wire + _MAX_TENSORS),
        ]
        prints = (ours, theirs)
    works = dist.batch_isend_irecv(ops)
    _PENDING[wire] = _Pending(
        site, name, (send_to, recv_from), works, received, sent, given, prints
    )
    counters["ring_rewrite"]["bytes_sent"] += sum(x.numel() * x.element_size() for x in sent)
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
    the transfer overlaps, unread: it orders the wait after that compute."""
    site, wire, name = _message_tag(token, tag)
    pending = _PENDING.pop(wire, None)
    if pending is None:
        raise RuntimeError(
            f"ring_rewrite: transfer {name} is not pending (waited before its start, or twice)"
        )
    _finish(pending)
    for i, (x, address) in enumerate(zip(xs, pending.given)):
        if address is not None and x.data_ptr() != address:
            raise RuntimeError(
                f"ring_rewrite: transfer {name}: tensor {i} reached the wait in another buffer "
                "than the one its start sent, so the compiled code does not keep the sent "
                "buffer alive in flight and may have overwritten it (Note [Buffers in flight] "
                "in ring_rewrite/p2p.py)"
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
    weights = torch.arange(1, 2 * words.numel(), 2, dtype=torch.int64, device=x.device)
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


def _drain(site: int) -> None:
    """Finish and drop what an earlier call of ``site`` started and never waited for (it raised
    in between). A transfer that cannot finish keeps its buffers for good: gloo may still write
    into them."""
    for wire in [w for w, p in _PENDING.items() if p.site == site]:
        pending = _PENDING.pop(wire)
        log.warning(
            "ring_rewrite: dropping transfer %s, left pending by an earlier call that failed",
            pending.name,
        )
        try:
            _finish(pending)
        except Exception:  # noqa: BLE001  (the peer is gone; the next transfer will say so)
            pass


def _finish(pending: _Pending) -> None:
    """Wait for ``pending``'s messages. If that fails, its buffers are kept for good: gloo may
    still write into them."""
    try:
        for work in pending.works:
            work.wait()
    except BaseException:
        _ABANDONED.append(pending)
        raise


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A started transfer: what it sends (its wait reads them again) and its tag."""

    sent: list
    tag: int


class Rotater:
    """The transfers of one site call, in the order they are made (Note [Ordering the ring's
    messages]). ``token`` is the chain's current token: a site's calls pass the last one on
    (the forward's to the backward).

    Traced by the rewrite with FX proxies for tensors; it also runs on real tensors.
    """

    def __init__(self, group_name: str, token) -> None:
        self.group_name = group_name
        self.token = token

    def ring(self, branch: int, send_to: int, recv_from: int) -> Ring:
        """Branch ``branch``'s ring, in which this rank sends to ``send_to`` and receives from
        ``recv_from`` (global ranks)."""
        return Ring(self, branch, send_to, recv_from)

    def wait(self, flight: InFlight, after: list = ()) -> list:
        """What arrived for ``flight``, once ``after`` (the compute it overlaps) is done."""
        got = torch.ops.ring_rewrite.ring_shift_wait(
            flight.sent, self.token, flight.tag, list(after)
        )
        received = [got[j] for j in range(len(flight.sent))]
        self.token = got[len(flight.sent)]
        return received

    def all_gather(self, x, world: int, index: int, same=None):
        """Every rank's ``x`` stacked on a new leading dim (``all_gather_seq``): the site's
        ``index``-th gather."""
        stacked, self.token = torch.ops.ring_rewrite.all_gather_seq(
            x, self.token, self.group_name, world, transfer_tag(0, GATHER, index), same
        )
        return stacked


@dataclasses.dataclass(frozen=True)
class Ring:
    """One branch's ring within a site call: ``start`` sends one step along it."""

    rotater: Rotater
    branch: int
    send_to: int
    recv_from: int

    def start(self, xs: list, kind: int, step: int, chunk: int = 0) -> InFlight:
        """Start sending ``xs`` (``kind``: ``KV``, ``KV_BACK`` or ``DKV``) one step along the
        ring, and receiving their like; ``self.wait`` after the compute it overlaps."""
        tag = transfer_tag(self.branch, kind, step, chunk)
        r = self.rotater
        r.token = torch.ops.ring_rewrite.ring_shift_start(
            xs, r.token, r.group_name, self.send_to, self.recv_from, tag
        )
        return InFlight(list(xs), tag)

    def wait(self, flight: InFlight, after: list = ()) -> list:
        return self.rotater.wait(flight, after)


@functools.cache
def inductor_lowering() -> dict:
    """Teach inductor that a transfer reads its sent buffers until its wait (Note [Buffers in
    flight]); returns the config patch our compiles run under. Idempotent.

    ``ring_shift_start`` lowers as the plain fallback kernel it would be, on its inputs made
    contiguous buffers; ``ring_shift_wait`` lowers as one whose ``xs`` are *those very buffers*
    (found by tag in the graph being lowered), whatever its own ``xs`` argument lowered to. So the
    wait reads what the start sent, and the memory planner cannot reuse or overwrite it before.
    And every operation lowered between the two is scheduled after the start.
    """
    import weakref

    from torch._inductor import ir
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
    from torch._inductor.lowering import fallback_handler, register_lowering
    from torch._inductor.virtualized import V

    start_op = torch.ops.ring_rewrite.ring_shift_start.default
    wait_op = torch.ops.ring_rewrite.ring_shift_wait.default
    start_kernel = fallback_handler(start_op, add_to_fallback_set=False)
    wait_kernel = fallback_handler(wait_op, add_to_fallback_set=False)
    in_flight: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {tag: sent}

    @register_lowering(start_op, type_promotion_kind=None)
    def _(xs, token, group_name, send_to, recv_from, tag):
        sent = [ir.ExternKernel.require_contiguous(x) for x in xs]
        started = start_kernel(sent, token, group_name, send_to, recv_from, tag)
        pending = in_flight.setdefault(V.graph, {})
        if tag in pending:  # two sites' transfers interleaved in one graph: not ours to pair
            raise RuntimeError(f"ring_rewrite: transfer tag {tag} started twice in one graph")
        pending[tag] = (sent, started.get_name(), len(V.graph.operations))
        return started

    @register_lowering(wait_op, type_promotion_kind=None)
    def _(xs, token, tag, after):
        flight = in_flight.get(V.graph, {}).pop(tag, None)
        if flight is None:
            raise RuntimeError(f"ring_rewrite: ring_shift_wait (tag {tag}) has no start before it")
        sent, started, mark = flight
        # NOTE: what the graph computes between the start and the wait runs after the start:
        # the peak-memory reordering otherwise hoists a step's blocks (which need no token)
        # above the start they should overlap.
        for op in V.graph.operations[mark:]:
            V.graph.additional_buffer_deps[op.operation_name].add(started)
        return wait_kernel(sent, token, tag, after)

    class _Key(CustomGraphPass):
        """Changes nothing. Its uuid keys inductor's FX graph cache to this file, which holds the
        lowering above: code compiled under another lowering of the ring is never reused."""

        def __call__(self, graph) -> None:
            pass

        def uuid(self) -> bytes:
            return get_hash_for_files((__file__,))

    return {"post_grad_custom_post_pass": _Key()}


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
    _, tag, _ = _message_tag(token, tag)
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
