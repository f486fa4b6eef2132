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

On torch 2.13 a P2P op whose result one rank does not use is dead-code eliminated on that rank
only; inductor may order independent P2P calls differently on different ranks, and equal-shaped
messages then pair up wrong without an error. So every op here

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
* sends each message under its own tag: the transfer's place in its site (``Tag``: branch,
  kind, head chunk, step) plus the call's number, which the token carries with the
  site (``site_token``). A schedule that still went wrong fails loudly (a timeout naming the
  transfer) instead of pairing the wrong buffers.

Why not ``EffectType.ORDERED``: a rewritten site is one ``invoke_subgraph`` body shared by every
layer with the same plan (Note [One body per plan] in ``passes/rewrite_sdpa.py``), and on torch
2.13 an effectful op inside ``invoke_subgraph`` drops the gradients of the whole call (its
output no longer requires grad), or fails AOT with a missing ``tangents_token`` when the call
sits in a backward graph. The site index cannot be a constant of a shared body, nor the call
number a constant of any graph: hence the token.

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

Note [Calls, deadlines and recovery]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The promise: after any fault, every rank runs the same step, or every rank raises; never a call
that pairs one rank's step with another's.

*Headers.* Every call of a site, forward and backward, opens with a header: one all-gather over
the ring's group of eight int64 (``site_token``; ``resume_token`` at the start of the backward):
the call's number in the group, its site, forward or backward, the graph's identity
(``variant_hash``: a hash of the compiled graph's ops, where its sites are in the code, and
their plans, so two different compiled functions never share one), the transfers this rank has
left over and whether its last call closed. A compile's
agreement on its plans (``check_agreement``) sends a header of the same size and layout, of
another kind. So any two things the ring exchanges between calls pair up in gloo, and each rank
reads what every other is doing: a rank that recompiled alone (grad mode, dtype,
``requires_grad``, a length) is named by its peers, and names them, instead of a collective of
another size aborting the process inside gloo.

*Ranks out of step.* Headers that differ raise ``RingOutOfStep`` before any transfer of the
call, naming each rank's call (its site, where it is in the code, its graph), except on the
ranks that left the step the others are in. Each rank learns, from the calls every rank opened
together and closed (``close_call``, the last op of a call; so every rank learns the same),
which calls open a step (the first one, and every forward right after a backward), which close
one (a backward right before an opening call; any call right before one in a group that never
ran a backward), which call follows which, and which calls the step in progress has opened. Some
ranks left the step and began the next one (they raised between two calls, in a kernel, or
skipped a backward) when all of this holds: every round since the ranks last opened a step
together showed one call on every rank; the last call opened together does not close the step;
those ranks' headers all open one call, one that opens a step and has never followed that last
one; and every other rank goes on with the step: it announced a failed call, or opens a call
that has followed that last one, or one the step has not opened yet. Then the others raise, and
those ranks exchange headers again, waiting for the others to leave the step too. Otherwise
every rank raises. A rank that opens again a call its step has opened runs the functions in an
order of its own (A then B on one rank, B then A on another): no rank left the step, and a rank
that waited would pair its step with the next step of a rank that raised and went on. So ranks
whose orders differ all raise at every call whose headers differ, for as long as the orders
differ, and a call whose headers agree is the same step on every rank. A rank whose transfer
missed its deadline says so at once (``_announce``): a header of its own kind, posted and not
waited for, which its peers read at their next header and raise there (they finished that call,
or gave up on it too), instead of waiting for it in vain; it reads the round at its own next
header. Either way each rank's loop that catches the error and goes on runs the same next step
on every rank. A call that completed on some ranks and failed on others stays completed there:
their results are right (every transfer they made completed). When that call closes a step it is
not announced: the ranks that completed it go on to the next step, and so does the rank that
failed.

What this cannot see or tell apart: a rank that left its step outside a transfer and then runs
a collective of its own before its next call (its peers wait for it in a header, it waits for
them in its collective, until the header's deadline); a rank that left its step while its peers
compile the step's next function (a compile is never taken for a call that goes on with the
step: every rank raises, that rank at its next step's first call, and from then on each of its
steps pairs with its peers' previous one); before the ranks have seen a step end, a rank whose
steps open with a function its peers do not call (taken for a peer still in the step: the
others wait for it, and may end up a step apart from it); one compiled function called twice in
a step with the same plans; two processes running the same code on different data.

*Deadlines.* Every wait has one. A transfer waits ``RingDilatedConfig.timeout``. A header, and a
compile's agreement, wait for every rank to arrive: twice that, and at least ``HEADER_TIMEOUT``
(a peer may still compile, wait out a transfer of its own after a stall, or run the user's code
between calls); a peer that never comes is an error then. gloo's own ``wait(timeout)`` closes
every connection of the group when it expires, so a transfer is waited for on one helper thread
(``_Waiter``) while the calling thread waits on a deadline; past it, the call raises naming the
site, branch, step, tag and peers, and the transfer stays *left over*, its buffers held (gloo
may still write into them).

*Recovery.* The next header at which every rank opens a call sees what is left over, and every
rank recovers: they exchange what they started since their last such header, each completes its
peers' half-done transfers (a recv nobody sent to gets zeros, a send nobody received is received
and dropped), then waits for its own. After that nothing is pending and nothing stale is on the
wire. The call number (mod 64) is part of every message tag besides: a message a failed call
left can never pair with a later call's. Only such a header is followed by collectives: a rank
that announced a failed call may be in the user's code when its peers read its header. A header
that misses its deadline cannot be recovered (a collective half done leaves the group's
collectives out of order): the group is marked broken and every later call raises at once,
naming the first error.

Note [Group ranks]
~~~~~~~~~~~~~~~~~~
A ring runs in one process group (``RingDilatedConfig.group``): WORLD, a ``new_group``, or one
dimension of a DeviceMesh, such as ``cp`` of a ``(dp, cp)`` mesh. Its traffic (headers,
agreement, recovery, data) runs on a group of its own, ``ring_group``: the same ranks, made once
per user group at the first compile (``new_group`` among its members), so that nothing of the
ring can pair with a collective of the user's on their group, even after a fault left one of
ours half done. Everything here speaks that group's ranks: the plans (``SitePlan.rank``,
``BranchPlan.ring``), ``ring_shift_start``'s ``send_to`` / ``recv_from``, the gathers and
recovery. torch's ``P2POp`` takes a global rank, and ``global_rank`` is the one translation:
where a ``P2POp`` is built (``_p2p``), and where an error or the report names a rank. A tag needs
no group in it: gloo keeps one context per process group, and a message matches only a receive
posted in its own group (two groups over the same two ranks, the same tag, received in the other
order: each got its own message). So two ``cp`` groups never cross, nor a rank's ring its ``dp``
collectives (FSDP, DDP).

Note [The CUDA transport]
~~~~~~~~~~~~~~~~~~~~~~~~~
On a process group of NCCL the ring's own group (``ring_group``) is ``cpu:gloo,cuda:nccl``:
what the ring exchanges on the CPU (headers, a compile's agreement, recovery's lists) goes over
gloo with the deadlines above, the K/V, dK/dV and gathered tensors, on the GPU, over NCCL. The
transfers keep torch's stream contract (``ProcessGroupNCCL``; its functional collectives'
``wait_tensor`` does the same):

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

import atexit
import dataclasses
import datetime
import functools
import logging
import os
import pickle
import queue
import threading
import time
import zlib

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

__all__ = [
    "Rotater", "Ring", "InFlight", "KV", "KV_BACK", "DKV", "Tag", "transfer_tag", "checking_transfers",
    "inductor_lowering", "ring_shift_start", "ring_shift_wait", "all_gather_seq", "site_token",
    "resume_token", "close_call", "resolve_group", "global_rank", "global_ranks", "check_agreement",
    "variant_hash", "name_sites", "ring_group", "TransferTimeout", "RingOutOfStep", "MAX_BRANCHES",
]  # fmt: skip

log = logging.getLogger(__name__)

_CHECK = os.environ.get("RING_REWRITE_CHECK_TRANSFERS", "0") not in ("", "0")

# Transfer kinds, a field of a tag.
KV, KV_BACK, DKV, GATHER = range(4)
_KINDS = ("K/V", "K/V (backward)", "dK/dV", "gather")
# A tag's fields and their widths in bits, from the low bits up (Tag.encode).
_TAG_LAYOUT = (("step", 10), ("chunk", 6), ("kind", 2), ("branch", 4))
_TAG_BITS = sum(bits for _, bits in _TAG_LAYOUT)  # 22: a transfer's tag within its call
MAX_BRANCHES = 1 << dict(_TAG_LAYOUT)["branch"]  # 16
_CALL_BITS = 6  # the call number's low bits above it; 8 * (wire tag) + message < 2**31 (gloo)
FORWARD, BACKWARD = 0, 1


class TransferTimeout(RuntimeError):
    """A ring transfer, a call's header or a gather did not finish within its deadline.

    A ring step's send/recv or a gather past ``RingDilatedConfig.timeout`` seconds raises this on
    the rank that waited, naming the site, branch, step (or gather), tag, call and the peer ranks
    it sends to and receives from: a peer failed, stopped, or is out of step. The rank tells its
    peers at once; the transfer is left over, and every rank completes it at the next call's
    header, so the next call works. A header waits twice ``timeout`` and at least
    ``HEADER_TIMEOUT`` (10 minutes); a header past its deadline cannot be recovered: the ring's
    process group is marked broken, and every later call raises a ``RuntimeError`` at once,
    naming this first error (Note [Calls, deadlines and recovery]). A ``RuntimeError``.

    Example::

        model = torch.compile(model, backend=ring_rewrite.backend(timeout=60))
        try:
            model(x).sum().backward()
        except ring_rewrite.TransferTimeout:
            pass  # every rank's next step is the same step, or raises

    .. warning::
        Tested over gloo on CPU only (``tests/test_faults.py``); NCCL has never run.
    """


class RingOutOfStep(RuntimeError):
    """The ranks of a group entered different attention site calls.

    Every call of a site, forward and backward, opens with a header every rank of the group
    exchanges: call number, site, direction and the compiled graph's identity (Note [Calls,
    deadlines and recovery]). When they differ (a rank skipped or repeated a call, raised between
    calls and went on, took another compiled variant or function, recompiled alone), this is
    raised before any transfer of the call, naming each rank's call and where its site is in the
    code; ranks that already began the next step (they raised between calls, or skipped a
    backward) wait for the others instead of raising, so that every rank's next step is the
    same step. Ranks that call the same compiled functions in different orders all raise, at
    every call whose headers differ. A ``RuntimeError``; on a rank whose compile found it,
    dynamo wraps it in ``BackendCompilerFailed``.

    Example::

        try:
            model(x).sum().backward()
        except ring_rewrite.RingOutOfStep as error:
            print(error)  # "... rank 1: call 7, site 0 forward at model.py:40, graph variant 0x..."

    .. warning::
        Tested over gloo on CPU only (``tests/test_faults.py``); NCCL has never run.
    """


def checking_transfers() -> bool:
    """Whether ``RING_REWRITE_CHECK_TRANSFERS`` fingerprints every message (read at import)."""
    return _CHECK


@dataclasses.dataclass(frozen=True)
class Tag:
    """A transfer's place in its site call: which branch, kind (``KV``, ``KV_BACK``, ``DKV``,
    ``GATHER``), ring step and head chunk. A gather's is branch 0, its step the gather's index
    in the call or, for each of its messages, the distance it goes (``all_gather_seq``).

    Graphs, ``_PENDING`` and the messages carry it as one int, ``encode()``: from the low bits
    up the step (10 bits), head chunk (6), kind (2) and branch (4), below ``2**22``; on the wire
    the call number's low bits go above it (``_wire``). ``decode`` is its inverse, and ``str``
    is how errors name the transfer. Nothing else reads the bits.

    Example::

        >>> Tag(branch=1, kind=DKV, step=5, chunk=7).encode()
        400389
        >>> str(Tag.decode(400389))
        'branch 1, step 5, dK/dV, head chunk 7'
    """

    branch: int
    kind: int
    step: int
    chunk: int = 0

    def __post_init__(self) -> None:
        for name, bits in _TAG_LAYOUT:
            value = getattr(self, name)
            if not 0 <= value < 1 << bits:
                raise ValueError(f"Tag.{name} must be in [0, {1 << bits}), got {value}")

    def encode(self) -> int:
        """The tag as one int, below ``2**22``."""
        tag, shift = 0, 0
        for name, bits in _TAG_LAYOUT:
            tag |= getattr(self, name) << shift
            shift += bits
        return tag

    @classmethod
    def decode(cls, tag: int) -> Tag:
        """The ``Tag`` whose ``encode()`` is ``tag``."""
        if not 0 <= tag < 1 << _TAG_BITS:
            raise ValueError(f"a transfer tag is in [0, {1 << _TAG_BITS}), got {tag}")
        fields = {}
        for name, bits in _TAG_LAYOUT:
            fields[name], tag = tag & ((1 << bits) - 1), tag >> bits
        return cls(**fields)

    def __str__(self) -> str:
        if self.kind == GATHER:
            return f"gather at distance {self.step}"
        return f"branch {self.branch}, step {self.step}, {_KINDS[self.kind]}, head chunk {self.chunk}"


def transfer_tag(branch: int, kind: int, step: int, chunk: int = 0) -> int:
    """A transfer's tag within its site call, as graphs carry it: ``Tag(...).encode()``."""
    return Tag(branch, kind, step, chunk).encode()


def _describe(site: int, call: int, tag: int) -> str:
    return f"site {site}, {Tag.decode(tag)} (tag {tag}, call {call})"


def _group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


# ---- calls: tokens, headers, recovery (Note [Calls, deadlines and recovery]) -------------------

# A token: int64 (site, call id, group call, timeout in ms, variant). The call id is unique in
# this process (it keys the pending transfers); the group call is the call's number in its
# group, the same on every rank (it goes into the wire tags and the headers).
_SITE, _CALL_ID, _GROUP_CALL, _TIMEOUT_MS, _VARIANT = range(5)
_TOKEN_SIZE = 5

# A header: int64 of one size for everything the ring exchanges between calls, so that any two
# ranks' headers pair up in gloo and each rank reads the other's, whatever each was doing.
_KIND, _H_CALL, _H_SITE, _H_DIRECTION, _H_VARIANT, _H_LEFTOVER, _H_CLOSED = range(7)
_HEADER_SIZE = 8
CALL, COMPILE, FAILED = 1, 2, 3
"""Header kinds: a site call opens, a compile agrees on its plans (``check_agreement``), a call
failed on this rank (``_announce``)."""


@dataclasses.dataclass
class _GroupState:
    """What this rank knows of its calls in one group."""

    call: int = 0
    """The next call's number in the group."""
    started: dict = dataclasses.field(default_factory=dict)
    """``(group call, tag) -> _Started`` of every transfer started since the last header."""
    broken: str | None = None
    """Why the group can no longer be used by the ring (a collective missed its deadline)."""
    open: int | None = None
    """The number of this rank's call that has not closed (``close_call``), if any."""
    opening: tuple = ()
    """Its key ``(site, direction, variant)``."""
    posted: tuple | None = None
    """The header ``_announce`` posted and this rank has not read yet."""
    last: tuple | None = None
    """The key ``(site, direction, variant)`` of the last call every rank opened together;
    ``_UNSURE`` after a round whose headers differed."""
    step_calls: set | None = None
    """The keys every rank opened together since they last opened a step together; ``None``
    when a round since showed different calls (then no rank is known to be ahead)."""
    starts: set = dataclasses.field(default_factory=set)
    """Keys that open a step: the first call, and each forward right after a backward."""
    ends: set = dataclasses.field(default_factory=set)
    """Keys that close a step: each call right before one that opens a step (backwards only,
    once the group has run a backward)."""
    follows: set = dataclasses.field(default_factory=set)
    """``(key, next key)`` of every two calls seen one after the other."""
    backwards: bool = False
    """Whether the group ran a backward."""

    def learn(self, key: tuple, closed: bool) -> None:
        """Every rank opened ``key`` together: where steps begin and end (Note [Calls,
        deadlines and recovery]). Learned from these rounds only, so the same on every rank,
        and only from a call that every rank closed to the next."""
        last = self.last
        if last is None or (closed and last != _UNSURE):
            if key[1] == FORWARD and (last is None or last[1] == BACKWARD):
                self.starts.add(key)
            if last is not None:
                self.follows.add((last, key))
                if key in self.starts and (last[1] == BACKWARD or not self.backwards):
                    self.ends.add(last)
        self.backwards |= key[1] == BACKWARD
        if key in self.starts:
            self.step_calls = set()
        if self.step_calls is not None:
            self.step_calls.add(key)
        self.last = key

    def diverged(self, headers: torch.Tensor) -> None:
        """The ranks' headers differed: the next call's number follows the highest of theirs,
        and which step each rank is in is unknown until they open one together again."""
        self.call, self.last, self.step_calls = int(headers[:, _H_CALL].max()) + 1, _UNSURE, None

    def waiting(self, headers: torch.Tensor) -> list[int]:
        """After headers that differ: the ranks that left the step every rank was in and began
        the next one (they wait; the others raise), or ``[]`` when every rank must raise."""
        kinds = headers[:, _KIND].tolist()
        last, step = self.last, self.step_calls
        if COMPILE in kinds or step is None or last in self.ends:
            return []
        keys = [_key(h) if kind == CALL else None for h, kind in zip(headers, kinds)]
        early = [r for r, key in enumerate(keys) if key in self.starts and (last, key) not in self.follows]
        behind = [key for r, key in enumerate(keys) if r not in early]
        if not early or not behind or len({keys[r] for r in early}) > 1:
            return []
        # NOTE: a rank behind goes on with the step (it failed its call, or opens one that has
        # followed the last call, or one not yet opened in this step); one that opens again a
        # call of this step runs the functions in an order of its own, and then no rank left.
        if any(key is not None and (last, key) not in self.follows and key in step for key in behind):
            return []
        return early


_UNSURE = ()


def _key(header: torch.Tensor) -> tuple[int, int, int]:
    return tuple(int(header[i]) for i in (_H_SITE, _H_DIRECTION, _H_VARIANT))


@dataclasses.dataclass(frozen=True)
class _Started:
    """A transfer as its peers need to know it to complete it (recovery)."""

    call: int
    tag: int
    send_to: int
    recv_from: int
    sends: tuple
    """``(message index, shape, dtype)`` of each message sent."""
    recvs: tuple
    device: torch.device
    """Where the messages live (a CUDA device: NCCL), as recovery must post them."""


_GROUPS: dict[str, _GroupState] = {}
_CALL_IDS = iter(range(1, 2**62))
_SITE_NAMES: dict[tuple[int, int], str] = {}  # (variant, site) -> where the site is, for errors
HEADER_TIMEOUT = 600.0
"""Seconds a header and a compile's agreement wait for every rank to arrive, at least: a peer
may still compile, wait out a transfer after a stall, or run the user's code between calls."""


def _state(group_name: str) -> _GroupState:
    return _GROUPS.setdefault(group_name, _GroupState())


def variant_hash(graph: list, sites: list) -> int:
    """The identity of a compiled graph, the same on every rank: a hash of what it computes
    (its ops, where its sites are in the code) and of its sites' plans. Two different functions
    differ in it, so their calls never pair up (Note [Calls, deadlines and recovery])."""
    return zlib.crc32(repr((graph, sites)).encode()) & 0x7FFFFFFF


def name_sites(variant: int, names: dict[int, str]) -> None:
    """Where each site of the graph ``variant`` is (``site -> location``), for errors."""
    for site, name in names.items():
        _SITE_NAMES[variant, site] = name


@torch.library.custom_op("ring_rewrite::site_token", mutates_args=())
def site_token(site: int, group_name: str, variant: int, timeout_ms: int) -> torch.Tensor:
    """Open a call of ``site`` (its forward): the header every rank of the group exchanges
    (Note [Calls, deadlines and recovery]), then the first token of the call's chain. Tokens
    order the transfers (each op takes one and returns the next) and carry the call's site,
    number and deadline to the ops, for the tags and the errors.

    An op, not ``torch.full``: inductor would build one kernel per site index.
    """
    return _open_call(group_name, site, FORWARD, variant, timeout_ms)


@site_token.register_fake
def _(site, group_name, variant, timeout_ms):
    return torch.empty((_TOKEN_SIZE,), dtype=torch.int64)


@torch.library.custom_op("ring_rewrite::resume_token", mutates_args=())
def resume_token(token: torch.Tensor, group_name: str) -> torch.Tensor:
    """Open the backward call of the site whose forward left ``token``: its own header and call
    number, so a backward that one rank runs and another does not fails at once."""
    site, _, _, timeout_ms, variant = token.tolist()
    return _open_call(group_name, site, BACKWARD, variant, timeout_ms)


@resume_token.register_fake
def _(token, group_name):
    return token.new_empty(token.shape)


torch.fx.node.has_side_effect(torch.ops.ring_rewrite.site_token.default)
torch.fx.node.has_side_effect(torch.ops.ring_rewrite.resume_token.default)


def _usable(state: _GroupState, what: str) -> None:
    if state.broken is not None:
        raise RuntimeError(
            f"ring_rewrite: {what}: the process group can no longer be used by the ring: "
            f"{state.broken}. Restart the job (or re-create the process group)."
        )


def _open_call(group_name: str, site: int, direction: int, variant: int, timeout_ms: int):
    state = _state(group_name)
    what = f"site {site} ({('forward', 'backward')[direction]})"
    _usable(state, what)
    group = _group(group_name)
    timeout = timeout_ms / 1000
    key = (site, direction, variant)
    deadline = max(2 * timeout, HEADER_TIMEOUT)
    _settle(group, state, timeout)
    while True:
        leftover = [p for p in _PENDING.values() if p.group_name == group_name]
        header = _header(state, CALL, site, direction, variant, len(leftover))
        headers = _all_gather(group, header, deadline, f"the header of {what}, call {state.call}", state)
        verdict = _round(group, state, header, headers, leftover, timeout)
        if verdict is None:
            break
        if verdict == _WAIT:
            log.warning("ring_rewrite: %s waits for the other ranks to leave the step they are in", what)
            continue
        raise verdict
    state.learn(key, closed=bool((headers[:, _H_CLOSED] == 1).all()))
    call = state.open = state.call
    state.opening = key
    state.call += 1
    token = torch.empty((_TOKEN_SIZE,), dtype=torch.int64)
    token[_SITE], token[_CALL_ID], token[_GROUP_CALL] = site, next(_CALL_IDS), call
    token[_TIMEOUT_MS], token[_VARIANT] = timeout_ms, variant
    return token


_WAIT = object()


def _round(group, state, header, headers, leftover, timeout):
    """What one exchange of headers means for this rank: ``None`` (the call goes on),
    ``_WAIT`` (exchange again) or the error to raise (Note [Calls, deadlines and recovery]).
    Every rank reads the same headers the same way. Only a round of calls on every rank is
    followed by collectives (recovery): a rank that announced a failed call reads the round
    later, and may be in the user's code meanwhile."""
    kinds = headers[:, _KIND]
    if bool((kinds == CALL).all()):
        if int(headers[:, _H_LEFTOVER].sum()):
            _recover(group, group.group_name, state, state.started, leftover, timeout)
        state.started = {}
        if bool((headers[:, :_H_LEFTOVER] == headers[0, :_H_LEFTOVER]).all()):
            return None
    names = [_call_name(h) for h in headers]
    waiting = state.waiting(headers)
    state.diverged(headers)
    me = dist.get_rank(group)
    if int(header[_KIND]) == FAILED:
        return None  # this rank raised when its call failed
    if me in waiting:
        return _WAIT
    everyone = "; ".join(f"rank {global_rank(group, r)}: {n}" for r, n in enumerate(names))
    if waiting or bool((kinds == FAILED).any()):
        return RingOutOfStep(
            "ring_rewrite: the ranks are out of step: a call failed on some ranks, or some began "
            f"the next step while this rank goes on with the one they left ({everyone}). This "
            "call is refused so that every rank starts the next step together."
        )
    return RingOutOfStep(
        "ring_rewrite: the ranks are out of step: they entered different attention site calls "
        "(a rank skipped or repeated a call, raised and went on, compiles a graph the others "
        f"do not, or runs another compiled function or variant): {everyone}. No transfer of "
        "this call was made; the next call starts in step again."
    )


def _announce(group_name: str) -> None:
    """This rank's call failed (a transfer missed its deadline): post a header saying so, so
    that peers that finished the call, or wait in the next one, raise there instead of waiting
    for this rank in vain. Posted, not waited for: the peers may be in the user's code, and it
    pairs with their next header; this rank reads it at its own (``_settle``). A call that ends
    a step is not announced: its peers go on to the next step, and so does this rank."""
    state = _state(group_name)
    if state.posted is not None or state.open is None or state.opening in state.ends:
        return
    group = _group(group_name)
    site, direction, variant = state.opening
    leftover = [p for p in _PENDING.values() if p.group_name == group_name]
    header = _header(state, FAILED, site, direction, variant, len(leftover))
    header[_H_CALL] = state.open
    out = [torch.empty_like(header) for _ in range(dist.get_world_size(group))]
    try:
        work = dist.all_gather(out, header, group=group, async_op=True)
    except Exception as error:  # noqa: BLE001  (the group is gone: say so at the next call)
        state.broken = f"announcing a failed call failed: {error}"
        return
    state.posted = (work, out, header, leftover)
    state.open = None


def _settle(group, state: _GroupState, timeout: float) -> None:
    """Read the header ``_announce`` posted, once every rank has sent its own."""
    if state.posted is None:
        return
    work, out, header, leftover = state.posted
    state.posted = None
    what = "the announcement of a failed call"
    try:
        _wait_collective(work, max(2 * timeout, HEADER_TIMEOUT))
    except TransferTimeout:
        state.broken = f"{what} did not finish"
        raise TransferTimeout(f"ring_rewrite: {what} did not finish: a rank did not reach it") from None
    except Exception as error:
        state.broken = f"{what} failed: {error}"
        raise RuntimeError(f"ring_rewrite: {what} failed: {error}") from error
    _round(group, state, header, torch.stack(out), leftover, timeout)


@torch.library.custom_op("ring_rewrite::close_call", mutates_args=())
def close_call(token: torch.Tensor, group_name: str, after: list[torch.Tensor]) -> torch.Tensor:
    """Close the call the token belongs to, on this rank: its last transfer and ``after`` (the
    call's results, unread) are done. The next header says whether it closed (Note [Calls,
    deadlines and recovery]); returns the next token."""
    state = _state(group_name)
    if state.open == int(token[_GROUP_CALL]):
        state.open = None
    return token.clone()


@close_call.register_fake
def _(token, group_name, after):
    return token.new_empty(token.shape)


torch.fx.node.has_side_effect(torch.ops.ring_rewrite.close_call.default)


def _header(state: _GroupState, kind: int, site: int, direction: int, variant: int, leftover=0):
    header = torch.zeros(_HEADER_SIZE, dtype=torch.int64)
    closed = int(state.open is None)
    header[: _H_CLOSED + 1] = torch.tensor([kind, state.call, site, direction, variant, leftover, closed])
    return header


def _call_name(header: torch.Tensor) -> str:
    kind, call, site, direction, variant, _ = header[: _H_LEFTOVER + 1].tolist()
    if kind == COMPILE:
        return f"compiles a graph of {site} attention site(s) (plans {variant:#x})"
    where = _SITE_NAMES.get((variant, site))
    return (
        f"call {call}, site {site} {('forward', 'backward')[direction]}"
        + (f" at {where}" if where else "")
        + f", graph variant {variant:#x}"
        + (" failed there" if kind == FAILED else "")
    )


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


def _wire(call: int, tag: int) -> int:
    """A transfer's wire tag: its tag within the call, the call number's low bits above it."""
    return (call % (1 << _CALL_BITS)) << _TAG_BITS | tag


def _message_tag(token: torch.Tensor, tag: int) -> tuple[tuple[int, int], int, str, float]:
    """The transfer's key in ``_PENDING``, its wire tag, how errors name it, and its deadline."""
    site, call_id, call, timeout_ms, _ = token.tolist()
    return (call_id, tag), _wire(call, tag), _describe(site, call, tag), timeout_ms / 1000


class _Work:
    """A transfer's work, whether it was waited for (waiting twice would block: gloo counts),
    and whether it runs on a CUDA stream (Note [The CUDA transport])."""

    __slots__ = ("work", "done", "on_stream")

    def __init__(self, work, on_stream: bool = False) -> None:
        self.work, self.done, self.on_stream = work, False, on_stream


def _on_stream(x: torch.Tensor) -> bool:
    """Whether a transfer of ``x`` runs on a CUDA stream (NCCL) rather than gloo's threads."""
    return x.is_cuda


def _wait(works: list[_Work], timeout: float) -> None:
    """Wait for ``works``: CUDA works on this thread, making the current stream wait for them
    (returns at once, no deadline: Note [The CUDA transport]); gloo works on the waiter thread,
    ``TransferTimeout`` past ``timeout`` seconds."""
    for work in works:
        if work.on_stream and not work.done:
            work.done = True
            work.work.wait()
    _WAITER.wait([w for w in works if not w.on_stream], timeout)


class _Job:
    __slots__ = ("works", "finished", "error")

    def __init__(self, works) -> None:
        self.works, self.finished, self.error = works, threading.Event(), None


class _Waiter:
    """Waits for gloo works on one helper thread, so that the caller can stop waiting at a
    deadline without gloo's own timeout, which would close the group's connections (Note
    [Calls, deadlines and recovery]). Jobs run in order; a work is waited for once."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def wait(self, works: list[_Work], timeout: float) -> None:
        """Wait for ``works``; ``TransferTimeout`` past ``timeout`` seconds, or their error."""
        if all(w.done for w in works):
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="ring_rewrite-waiter", daemon=True
                )
                self._thread.start()
        job = _Job(works)
        self._jobs.put(job)
        if not job.finished.wait(timeout):
            raise TransferTimeout()
        if job.error is not None:
            raise job.error

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            works, job.works = job.works, ()
            try:
                self._wait_all(works)
            except BaseException as error:  # noqa: BLE001  (handed to the caller)
                job.error = error
            # NOTE: a gloo work holds its tensors; this thread keeps no work once the caller may
            # go on, so the caller frees them (what it frees, torch.profiler sees), never this
            # thread later on (it held a job's works until the next job came).
            del works
            job.finished.set()
            del job

    @staticmethod
    def _wait_all(works: list[_Work]) -> None:
        for work in works:
            if not work.done:
                try:
                    work.work.wait()
                finally:
                    work.done = True


_WAITER = _Waiter()


@atexit.register
def _release_at_exit() -> None:
    """A transfer a failed call left pending (a fault in the program's last step) holds the
    waiter thread inside gloo's wait. Woken while the interpreter shuts down (a peer exits and
    closes the connection), that thread would abort the process (``std::terminate``). At exit,
    while Python still runs, a wait on it whose deadline has passed makes gloo close the group's
    connections, which wakes the thread now; it is given a few seconds to let go."""
    stuck = [w for p in [*_PENDING.values(), *_ABANDONED] for w in p.works if not w.done and not w.on_stream]
    if not stuck:
        return
    try:
        stuck[0].work.wait(datetime.timedelta(milliseconds=1))
    except Exception:  # noqa: BLE001  (the deadline has passed: that is the point)
        pass
    deadline = time.monotonic() + 5
    while any(not w.done for w in stuck) and time.monotonic() < deadline:
        time.sleep(0.01)


@dataclasses.dataclass
class _Pending:
    """A transfer started and not yet waited for."""

    group_name: str
    name: str
    peers: tuple[int, int]
    """Global ranks sent to and received from (what errors name)."""
    works: list[_Work]
    received: list[torch.Tensor]
    sent: list[torch.Tensor]
    """What gloo reads: the tensors given, or start's own copy of a non-contiguous one. Held
    here too, so that the memory is never freed in flight."""
    given: list[int | None]
    """Address of each tensor given, where gloo reads it in place (None: start's own copy)."""
    fingerprints: tuple[torch.Tensor, torch.Tensor] | None
    """(ours at the start, the sender's as received), with RING_REWRITE_CHECK_TRANSFERS."""


# Transfers started and not yet waited for, by (call id, tag); left over by a failed call until
# the next header of their group recovers them.
_PENDING: dict[tuple[int, int], _Pending] = {}
# Transfers whose wait failed with a gloo error: their buffers are never freed, since gloo may
# still write into them (until a recovery of their group).
_ABANDONED: list[_Pending] = []
_MAX_TENSORS = 4


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

    @classmethod
    def resume(cls, group_name: str, token) -> Rotater:
        """The backward's rotater, from the token the forward's chain ended with: the backward
        is a call of its own (``resume_token``)."""
        return cls(group_name, torch.ops.ring_rewrite.resume_token(token, group_name))

    def ring(self, branch: int, send_to: int, recv_from: int) -> Ring:
        """Branch ``branch``'s ring, in which this rank sends to ``send_to`` and receives from
        ``recv_from`` (ranks of the group, Note [Group ranks])."""
        return Ring(self, branch, send_to, recv_from)

    def wait(self, flight: InFlight, after: list = ()) -> list:
        """What arrived for ``flight``, once ``after`` (the compute it overlaps) is done."""
        got = torch.ops.ring_rewrite.ring_shift_wait(
            flight.sent, self.token, flight.tag, list(after)
        )
        received = [got[j] for j in range(len(flight.sent))]
        self.token = got[len(flight.sent)]
        return received

    def close(self, after: list) -> None:
        """The call's last op: ``after`` (its results) are done (``close_call``)."""
        if self.token is not None:
            self.token = torch.ops.ring_rewrite.close_call(self.token, self.group_name, list(after))

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
            raise RuntimeError(f"ring_rewrite: transfer {Tag.decode(tag)} (tag {tag}) started twice in one graph")
        pending[tag] = (sent, started.get_name(), len(V.graph.operations))
        return started

    @register_lowering(wait_op, type_promotion_kind=None)
    def _(xs, token, tag, after):
        flight = in_flight.get(V.graph, {}).pop(tag, None)
        if flight is None:
            raise RuntimeError(
                f"ring_rewrite: ring_shift_wait of {Tag.decode(tag)} (tag {tag}) has no start before it"
            )
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


def resolve_group(group) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(process group, world size, rank)``; ``(None, 1, 0)`` without torch.distributed."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1, 0
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        group = group.get_group()  # a 1-D DeviceMesh
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


def check_agreement(group: dist.ProcessGroup, sites: list[dict], timeout: float) -> None:
    """Raise on every rank, naming the difference, unless all ranks planned the same ``sites``.

    Ranks that disagree (another sequence length, another config) would otherwise exchange
    mismatched messages and hang until the group timeout. The agreement opens with a header of
    the calls' kind (Note [Calls, deadlines and recovery]): a rank that compiles while the
    others call a site (a recompile on one rank only) is named by them, and names them.
    """
    state = _state(group.group_name)
    _usable(state, "the compile's agreement")
    _settle(group, state, timeout)
    plans = zlib.crc32(repr(sites).encode()) & 0x7FFFFFFF
    header = _header(state, COMPILE, len(sites), FORWARD, plans)
    deadline = max(2 * timeout, HEADER_TIMEOUT)
    headers = _all_gather(group, header, deadline, "the compile's agreement", state)
    if bool((headers[:, :_H_LEFTOVER] == headers[0, :_H_LEFTOVER]).all()):
        return
    if not bool((headers[:, _KIND] == COMPILE).all()):
        names = [_call_name(h) for h in headers]
        state.diverged(headers)
        raise RingOutOfStep(
            "ring_rewrite: the ranks are out of step: this rank compiles a graph while another "
            "calls one already compiled (a recompile on one rank only: grad mode, dtype, "
            "requires_grad or a length that differs on this rank): " + "; ".join(
                f"rank {global_rank(group, r)}: {n}" for r, n in enumerate(names)
            ) + ". Every rank of the group must compile the same graphs."
        )
    everyone = _gather_objects(group, sites, deadline, "the compile's agreement", state)
    mine = everyone[0]
    first = global_rank(group, 0)  # errors name global ranks
    for r, theirs in enumerate(everyone):
        rank = global_rank(group, r)
        if len(theirs) != len(mine):
            raise RuntimeError(
                f"ring_rewrite: ranks disagree on the rewrite: {len(mine)} attention sites on "
                f"rank {first} but {len(theirs)} on rank {rank}"
            )
        for a, b in zip(mine, theirs):
            if ("reason" in a) != ("reason" in b):
                raise RuntimeError(
                    f"ring_rewrite: ranks disagree on the rewrite of attention site "
                    f"{a.get('site')}: " + " but ".join(
                        f"left alone on rank {r} ({x['reason']})" if "reason" in x
                        else f"rewritten on rank {r}"
                        for r, x in ((first, a), (rank, b))
                    )
                )
            for key in [*a, *(k for k in b if k not in a)]:
                if a.get(key) != b.get(key):
                    raise RuntimeError(
                        f"ring_rewrite: ranks disagree on the rewrite of attention site "
                        f"{a.get('site')}: {key}={a.get(key)!r} on rank {first} but "
                        f"{key}={b.get(key)!r} on rank {rank}"
                    )
    raise RuntimeError("ring_rewrite: ranks disagree on the rewrite (their plans hash differently)")
