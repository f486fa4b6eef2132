"""Transfers in flight: their works, the thread that waits for gloo's (Note [Calls,
deadlines and recovery]), and the transfers started and not
yet waited for."""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import queue
import threading
import time

import torch

from .errors import TransferTimeout


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
