"""The transport's errors: a transfer or header past its deadline, ranks out of step."""

from __future__ import annotations

__all__ = ["RingOutOfStep", "TransferTimeout"]


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
