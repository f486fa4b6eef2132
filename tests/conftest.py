"""Shared helpers for the tests (all CPU)."""

from __future__ import annotations

import os

import pytest
import torch

import ring_rewrite  # noqa: F401  (registers the backend and the custom ops)

# NOTE: our CPU kernel for every block it serves, in this process and the ranks it spawns: the
# choice by measurement (Note [Choosing the CPU block kernel] in ring_rewrite/cpu_choice.py) would
# time a new block class for seconds inside a ring call, past the short transfer deadlines of the
# fault tests, and make which kernel a test runs depend on the machine's load.
# tests/test_kernel_choice.py tests the choice itself, with the variable unset.
os.environ.setdefault("RING_REWRITE_CPU_KERNEL", "ours")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max-abs error / max-abs value, the measure of docs/semantics.md, Accuracy."""
    expected = expected.double()
    scale = expected.abs().max().clamp_min(1e-30)
    return ((actual.double() - expected).abs().max() / scale).item()


class Capture:
    """A backend that runs ``ring_rewrite.backend(...)`` and keeps each rewritten graph module."""

    def __init__(self, **config) -> None:
        config.setdefault("compiler", "eager")
        self.inner = ring_rewrite.backend(**config)
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs, **kwargs):
        compiled = self.inner(gm, example_inputs, **kwargs)
        self.graphs.append(gm)
        return compiled

    @property
    def records(self):
        return self.inner.records


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    yield
