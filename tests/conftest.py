"""Shared helpers for the tests (all CPU)."""

from __future__ import annotations

import pytest
import torch

import ring_rewrite  # noqa: F401  (registers the backend and the custom ops)


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
