"""A site call's header, token and close, and a compile's agreement.

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
"""

from __future__ import annotations

import logging
import zlib

import torch
import torch.distributed as dist

from .errors import RingOutOfStep, TransferTimeout
from .groups import _group, global_rank
from .recovery import _all_gather, _gather_objects, _recover, _wait_collective
from .state import (
    _CALL_ID, _GROUP_CALL, _H_CALL, _H_CLOSED, _H_LEFTOVER, _H_LENGTH, _HEADER_SIZE, _KIND, _SITE, _TIMEOUT_MS,
    _TOKEN_SIZE, _VARIANT, BACKWARD, CALL, COMPILE, FAILED, FORWARD, _GroupState, _state,
)  # fmt: skip
from .waiter import _PENDING

__all__ = [
    "check_agreement", "close_call", "name_sites", "resume_token", "site_token", "variant_hash",
]  # fmt: skip

log = logging.getLogger(__name__)


_CALL_IDS = iter(range(1, 2**62))
_SITE_NAMES: dict[tuple[int, int], str] = {}  # (variant, site) -> where the site is, for errors
HEADER_TIMEOUT = 600.0
"""Seconds a header and a compile's agreement wait for every rank to arrive, at least: a peer
may still compile, wait out a transfer after a stall, or run the user's code between calls."""


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
def site_token(site: int, group_name: str, variant: int, timeout_ms: int, length: torch.Tensor | None = None) -> torch.Tensor:
    """Open a call of ``site`` (its forward): the header every rank of the group exchanges
    (Note [Calls, deadlines and recovery]), then the first token of the call's chain. Tokens
    order the transfers (each op takes one and returns the next) and carry the call's site,
    number and deadline to the ops, for the tags and the errors. ``length`` (a 0-d int64
    tensor), the real rows of each part of a shard padded to a length bucket (in replicated
    mode the sequence's real length), goes into the
    header: the ranks must agree on it, as one graph serves every length of the bucket.

    An op, not ``torch.full``: inductor would build one kernel per site index.
    """
    return _open_call(group_name, site, FORWARD, variant, timeout_ms, 0 if length is None else int(length))


@site_token.register_fake
def _(site, group_name, variant, timeout_ms, length=None):
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


def _open_call(group_name: str, site: int, direction: int, variant: int, timeout_ms: int, length: int = 0):
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
        header[_H_LENGTH] = length
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
            return _lengths_differ(group, headers)
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


def _lengths_differ(group, headers: torch.Tensor) -> ValueError | None:
    """The error every rank raises when the ranks open the same call of a bucketed graph with
    sequences or shards of different real lengths (one graph serves every length of a bucket, so nothing
    else tells them apart); None when they agree."""
    lengths = headers[:, _H_LENGTH]
    if bool((lengths == lengths[0]).all()):
        return None
    each = ", ".join(f"rank {global_rank(group, r)}: {int(n)}" for r, n in enumerate(lengths))
    return ValueError(
        f"ring_rewrite: the ranks hold sequences or shards of different lengths ({each} real "
        "positions: of the sequence in replicated mode, of each part of a shard in sharded mode); "
        "in replicated mode every rank must hold the same sequence, in sharded mode its equal "
        "shard of one sequence (ring_rewrite.shard and shard_batch cut them so). No transfer of "
        "this call was made."
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
