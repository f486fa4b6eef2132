"""Expected graphs: the normalised text of a graph against a stored file (refreshed on request)."""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.fx as fx

from .diff import GraphDiff
from .graphs import graph_text

__all__ = ["ACCEPT_ENV", "assert_expected_graph"]

ACCEPT_ENV = "RING_REWRITE_ACCEPT"
"""The environment variable ``RING_REWRITE_ACCEPT``: set it to ``1`` (or ``true``, ``yes``) and
``assert_expected_graph`` (re)writes the files it compares against instead of failing."""


def assert_expected_graph(
    actual: fx.GraphModule | Sequence[fx.GraphModule] | GraphDiff | str,
    path: str | os.PathLike[str] | None = None,
    *,
    expected: str | None = None,
    subgraphs: bool = True,
) -> None:
    """Assert that ``actual`` prints as the text stored at ``path``, or as ``expected``.

    ``actual`` is turned into stable text (``graph_text``: names, addresses, directories and
    line numbers normalised) and compared with the stored text, normalised the same way. With
    ``RING_REWRITE_ACCEPT=1`` (``true``, ``yes``; see ``ACCEPT_ENV``) in the environment a
    file that is missing or different is written with the actual text (its folders made) and
    the assertion passes: review the change with ``git diff``, as with ``EXPECTTEST_ACCEPT=1``.
    Otherwise a mismatch fails with a unified diff, expected to actual. An inline
    ``expected=`` string cannot be refreshed: the failure shows the text to paste.

    Args:
        actual (fx.GraphModule, Sequence[fx.GraphModule], GraphDiff or str): a graph or a list
            of them (compared as ``graph_text``), a ``GraphDiff`` (its table) or a string.
        path (str or os.PathLike, optional): the file that holds the expected text.
            Default: ``None``.
        expected (str, optional): the expected text inline, instead of ``path``.
            Default: ``None``.
        subgraphs (bool): ``False`` compares top-level graphs only (see ``graph_text``).
            Default: ``True``.

    Returns:
        None.

    Raises:
        TypeError: neither or both of ``path`` and ``expected`` are given.
        AssertionError: the text differs, or the file is missing (and accepting is off).

    Example::

        cap = capture(model, x, segment_lengths=[64, 256], dilation_rates=[1, 4])
        assert_expected_graph(cap.after[0], "expected/block.txt", subgraphs=False)
    """
    __tracebackhide__ = True
    if (path is None) == (expected is None):
        raise TypeError("assert_expected_graph needs exactly one of path or expected=")
    text = _as_text(actual, subgraphs)
    if expected is not None:
        want = _as_text(expected)
        if text != want:
            raise AssertionError(
                "graph differs from the inline expectation (-expected +actual):\n"
                + _unified(want, text, "expected", "actual")
                + "\nthe actual text, to paste:\n"
                + text
            )
        return
    path = Path(path)
    stored = path.read_text() if path.exists() else None
    if stored is not None and _as_text(stored) == text:
        return
    if os.environ.get(ACCEPT_ENV, "").lower() in ("1", "true", "yes"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"ring_rewrite.testing: wrote expected graph {path}", file=sys.stderr)
        return
    if stored is None:
        raise AssertionError(
            f"no expected graph at {path}; run with {ACCEPT_ENV}=1 to write it. Actual graph:\n{text}"
        )
    raise AssertionError(
        f"graph differs from {path} (-expected +actual); if the change is intended, run with "
        f"{ACCEPT_ENV}=1 to accept it:\n" + _unified(_as_text(stored), text, str(path), "actual")
    )


def _as_text(obj: Any, subgraphs: bool = True) -> str:
    if isinstance(obj, (str, fx.GraphModule)) or (
        isinstance(obj, Sequence) and obj and all(isinstance(g, fx.GraphModule) for g in obj)
    ):
        return graph_text(obj, subgraphs=subgraphs)
    return graph_text(str(obj))


def _unified(a: str, b: str, name_a: str, name_b: str) -> str:
    return "".join(
        difflib.unified_diff(a.splitlines(keepends=True), b.splitlines(keepends=True), name_a, name_b)
    )

