"""Fault injection for tests of a distributed model: make this rank's block attention fail,
stall or exit where the ring is in the middle of its transfers (docs/semantics.md, Faults)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

from ring_rewrite import kernels

__all__ = ["InjectedFault", "in_block_kernel"]


class InjectedFault(RuntimeError):
    """A fault a test raised on purpose, to tell it from the errors it provokes.

    Raise it from the ``fault`` callable of ``in_block_kernel``; a subclass of
    ``RuntimeError``.

    Example::

        def fault():
            raise InjectedFault("block failed")
    """


@contextlib.contextmanager
def in_block_kernel(fault: Callable[[], object], *, times: int | None = None) -> Iterator[None]:
    """Within the ``with`` block, call ``fault()`` as this rank's block attention starts.

    A context manager for fault tests of a distributed model (docs/semantics.md, Faults;
    ``tests/test_faults.py``). It replaces the forward of the CPU entry of the block kernel
    table (``ring_rewrite/kernels.py``) with one that calls ``fault()`` first, for the first
    ``times`` calls or all of them, and restores it on exit. The kernel runs inside the
    compiled graph, between a ring transfer's start and its wait, so a fault there leaves the
    peers waiting on a transfer. ``fault`` may raise (``InjectedFault``), sleep past the
    timeout, or exit the process.

    Args:
        fault (Callable[[], object]): what to do; its result is ignored.
        times (int, optional): how many kernel calls get the fault. Default: ``None`` (all).

    Returns:
        A context manager (yields ``None``).

    Example::

        # on rank 1 of a ring compiled with timeout=3: the other ranks raise TransferTimeout
        with in_block_kernel(lambda: time.sleep(4), times=1):
            attend(q, k, v).sum().backward()

    .. warning::
        Only the CPU entry's ``forward`` is replaced, which ring blocks call: CUDA inputs, the
        backward, blocks with dropout and local branches run in place (float32 on CPU, Note
        [Local branches in place]) get no fault.
    """
    kernel = kernels.KERNELS["cpu"]
    left = [times]

    def forward(*args):
        if left[0] is None or left[0] > 0:
            left[0] = None if left[0] is None else left[0] - 1
            fault()
        return kernel.forward(*args)

    kernels.KERNELS["cpu"] = dataclasses.replace(kernel, forward=forward)
    try:
        yield
    finally:
        kernels.KERNELS["cpu"] = kernel
