"""What a rank knows of its calls in each group, and the layouts of a call's token and of
a header (Note [Calls, deadlines and recovery])."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["BACKWARD", "CALL", "COMPILE", "FAILED", "FORWARD"]


# A token: int64 (site, call id, group call, timeout in ms, variant). The call id is unique in
# this process (it keys the pending transfers); the group call is the call's number in its
# group, the same on every rank (it goes into the wire tags and the headers).
_SITE, _CALL_ID, _GROUP_CALL, _TIMEOUT_MS, _VARIANT = range(5)
_TOKEN_SIZE = 5

# A header: int64 of one size for everything the ring exchanges between calls, so that any two
# ranks' headers pair up in gloo and each rank reads the other's, whatever each was doing.
_KIND, _H_CALL, _H_SITE, _H_DIRECTION, _H_VARIANT, _H_LEFTOVER, _H_CLOSED, _H_LENGTH = range(8)
_HEADER_SIZE = 8
CALL, COMPILE, FAILED = 1, 2, 3
"""Header kinds: a site call opens, a compile agrees on its plans (``check_agreement``), a call
failed on this rank (``_announce``)."""


FORWARD, BACKWARD = 0, 1


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


def _state(group_name: str) -> _GroupState:
    return _GROUPS.setdefault(group_name, _GroupState())
