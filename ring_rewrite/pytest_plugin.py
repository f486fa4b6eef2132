"""pytest plugin: the ``ring_graphs`` fixture, ``ring_rewrite.testing`` bound to one test.

::

    def test_attention_is_rewritten(ring_graphs):
        cap = ring_graphs.capture(model, x, segment_lengths=[64, 256], dilation_rates=[1, 4])
        ring_graphs.assert_rewritten(cap, 2)
        ring_graphs.assert_expected_graph(cap.after[0])  # expected/<test module>/<test>.txt

Off unless used: installing ``ring_rewrite`` registers this module under the ``pytest11`` entry
point ``ring_rewrite.pytest_plugin``, so pytest loads it in every session of that environment.
It therefore defines no hooks, adds no options and no autouse fixture: it only offers a
fixture, and a fixture does nothing until a test asks for it (``ring_rewrite.testing`` is
imported then). Loading it does import the ``ring_rewrite`` package, and with it torch (the
package ``__init__`` registers the backend), a few seconds at pytest start-up. Where plugin
autoloading is off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``), opt in with
``-p ring_rewrite.pytest_plugin`` or ``pytest_plugins = ["ring_rewrite.pytest_plugin"]`` in the
root ``conftest.py``; opt out with ``-p no:ring_rewrite.pytest_plugin``.

NOTE: the entry point is named after the module on purpose. pytest registers a plugin under the
name it was requested by; had the entry point another name, ``-p ring_rewrite.pytest_plugin``
together with autoloading would register the module twice and fail ("Plugin already
registered under a different name").
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

__all__ = ["RingGraphs", "ring_graphs"]


class RingGraphs:
    """The helpers of ``ring_rewrite.testing`` for one test.

    ``capture``, ``graph_diff``, ``assert_rewritten``, ``assert_left_alone``,
    ``assert_same_p2p_schedule``, ``capture_ranks``, ``graph_text`` and ``transfers`` are those
    of ``ring_rewrite.testing``; ``assert_expected_graph`` also finds its file by itself.
    """

    def __init__(self, request: pytest.FixtureRequest) -> None:
        from ring_rewrite import testing

        self.testing = testing
        self._request = request
        self._expected_count = 0
        for name in (
            "capture",
            "capture_ranks",
            "graph_diff",
            "graph_text",
            "transfers",
            "assert_rewritten",
            "assert_left_alone",
            "assert_same_p2p_schedule",
        ):
            setattr(self, name, getattr(testing, name))

    def expected_path(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Where an expected graph lives: ``path`` relative to the test file's directory, or by
        default ``expected/<test module>/<test name>.txt`` there (``_2``, ``_3`` ... for the
        second and later checks of one test)."""
        here = Path(self._request.path).parent
        if path is not None:
            return here / path
        self._expected_count += 1
        name = re.sub(r"[^\w.-]+", "_", self._request.node.name).strip("_")
        suffix = "" if self._expected_count == 1 else f"_{self._expected_count}"
        return here / "expected" / Path(self._request.path).stem / f"{name}{suffix}.txt"

    def assert_expected_graph(
        self,
        actual: Any,
        path: str | os.PathLike[str] | None = None,
        *,
        expected: str | None = None,
        subgraphs: bool = True,
    ) -> None:
        """``ring_rewrite.testing.assert_expected_graph`` with the file found by
        ``expected_path(path)``, unless an inline ``expected=`` text is given.
        ``RING_REWRITE_ACCEPT=1`` writes the file."""
        __tracebackhide__ = True
        if expected is not None:
            self.testing.assert_expected_graph(actual, expected=expected, subgraphs=subgraphs)
        else:
            self.testing.assert_expected_graph(actual, self.expected_path(path), subgraphs=subgraphs)


@pytest.fixture
def ring_graphs(request: pytest.FixtureRequest) -> RingGraphs:
    """``ring_rewrite.testing`` for this test, with dynamo's caches and counters reset."""
    import torch

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return RingGraphs(request)
