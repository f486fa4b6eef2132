"""Reading graphs: stable text of a graph, short op names, and the subgraphs of rewritten sites."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

__all__ = ["graph_text", "op_label", "site_body"]


def op_label(node: fx.Node) -> str:
    """A short name for what ``node`` computes, stable across torch versions.

    The op names ``GraphDiff`` counts and tests assert on: an op overload by its packet's
    qualified name (``aten.mm``, ``ring_rewrite.block_attention``), a higher-order operator by
    its name (``invoke_subgraph``), a method as ``Tensor.<name>``, any other function by its
    ``__name__`` (``scaled_dot_product_attention``, ``getitem``), and ``placeholder``,
    ``output``, ``get_attr`` and ``call_module`` nodes by their ``op``.

    Args:
        node (fx.Node): a node of a dynamo or AOT graph.

    Returns:
        str: the name.

    Example::

        ops = [op_label(n) for n in cap.after[0].graph.nodes]
        assert "scaled_dot_product_attention" not in ops
    """
    if node.op in ("placeholder", "output", "get_attr", "call_module"):
        return node.op
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return callable_label(node.target)


def callable_label(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.replace("::", ".")
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    return getattr(target, "__name__", str(target))



_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
_EVAL_KEY = re.compile(r"<eval_with_key>\.\d+")
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\w.~-]*[/\\])+([\w.-]+\.py)")
_NESTED_CLASS = re.compile(r"^    class \w+\(torch\.nn\.Module\):$", re.M)
_LINENO = re.compile(r"(\.py)(?::|\", line |, line )\d+")


def graph_text(
    graphs: fx.GraphModule | Sequence[fx.GraphModule] | str, *, subgraphs: bool = True
) -> str:
    """The printed graph(s), normalised so that the text is stable across runs and machines.

    ``print_readable`` (nested subgraph modules such as ``ring_rewrite_fwd_0`` included), then
    ``torch._dynamo.testing.normalize_gm`` (comments with file names go, blank lines squashed),
    then memory addresses, directories, line numbers and ``<eval_with_key>`` counters masked.
    Several graphs are separated by ``# graph i`` headers. A string is only stripped of
    trailing whitespace and memory addresses. What ``assert_expected_graph`` compares.

    Args:
        graphs (fx.GraphModule, Sequence[fx.GraphModule] or str): the graph(s), or text.
        subgraphs (bool): ``False`` leaves out the nested subgraph modules (the rewritten
            sites' ``ring_rewrite_fwd_N`` / ``_bwd_N``): the top-level graph alone shows which
            SDPA calls became site nodes, and does not change when the library changes how it
            computes a site. Default: ``True``.

    Returns:
        str: the text, ending in one newline.

    Example::

        print(graph_text(cap.after, subgraphs=False))
    """
    from torch._dynamo.testing import normalize_gm

    if isinstance(graphs, str):
        text = _ADDRESS.sub("0x?", graphs)
    elif isinstance(graphs, fx.GraphModule):
        text = normalize_gm(graphs.print_readable(print_output=False))
        if not subgraphs:
            nested = _NESTED_CLASS.search(text)
            text = text if nested is None else text[: nested.start()]
        text = _ADDRESS.sub("0x?", text)
        text = _EVAL_KEY.sub("<eval_with_key>", text)
        text = _PATH.sub(r"\1", text)
        text = _LINENO.sub(r"\1:?", text)
    else:
        graphs = list(graphs)
        if len(graphs) == 1:
            return graph_text(graphs[0], subgraphs=subgraphs)
        return "".join(
            f"# graph {i}\n{graph_text(gm, subgraphs=subgraphs)}" for i, gm in enumerate(graphs)
        )
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    return "\n".join(lines) + "\n"


def walk(gm: fx.GraphModule, prefix: str = "") -> Iterator[tuple[str, fx.Node]]:
    """``(module path, node)`` over ``gm`` and, depth first, the graph modules it references."""
    for node in gm.graph.nodes:
        yield prefix, node
        if node.op == "get_attr":
            sub = _attr(gm, node.target)
            if isinstance(sub, fx.GraphModule):
                yield from walk(sub, f"{prefix}{node.target}.")


def _attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def site_body(gm: fx.GraphModule, site: int, which: str = "fwd") -> fx.GraphModule:
    """The graph of a rewritten site's forward or backward.

    The body that the site's ``ring_rewrite_fwd_N`` / ``_bwd_N`` subgraph calls through
    ``invoke_subgraph``, shared by every site of ``gm`` with the same plan (Note [One body per
    plan]).

    Args:
        gm (fx.GraphModule): a dynamo graph after the passes (``Capture.after[i]``).
        site (int): the site id within ``gm``.
        which (str): ``"fwd"`` or ``"bwd"``. Default: ``"fwd"``.

    Returns:
        fx.GraphModule: the body.

    Raises:
        AttributeError: ``gm`` has no such subgraph (the site was not rewritten, or
            ``which`` is neither ``"fwd"`` nor ``"bwd"``).

    Example::

        body = site_body(cap.after[0], 0, "bwd")
        print(graph_text(body))
    """
    return getattr(gm, f"ring_rewrite_{which}_{site}").body



SITE_MODULE = re.compile(r"ring_rewrite_(?:fwd|bwd)_(\d+)\.")


def site_subgraphs(gm: fx.GraphModule, which: str) -> list[tuple[str, int]]:
    """``(attribute name, site)`` of the ``ring_rewrite_{which}_N`` subgraphs of ``gm``."""
    found = []
    for name, _ in gm.named_children():
        match = re.fullmatch(rf"ring_rewrite_{which}_(\d+)", name)
        if match:
            found.append((name, int(match.group(1))))
    return sorted(found, key=lambda x: x[1])

