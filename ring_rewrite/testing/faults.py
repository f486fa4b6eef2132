"""Fault injection for tests of a distributed model: make this rank's block attention fail,
stall or exit where the ring is in the middle of its transfers (docs/semantics.md, Faults)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

from ring_rewrite import kernels

__all__ = ["InjectedFault", "in_block_kernel"]


class InjectedFault(RuntimeError):
    """A fault a test raised on purpose."""


@contextlib.contextmanager
def in_block_kernel(fault: Callable[[], object], *, times: int | None = None) -> Iterator[None]:
    """Call ``fault()`` at the start of this rank's block attention kernel calls (the first
    ``times`` of them, or all): it may raise (``InjectedFault``), sleep, or exit the process.
    The kernel runs inside the compiled graph, between a transfer's start and its wait."""
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
