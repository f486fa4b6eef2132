"""Graph-diff testing: see, and assert in your own tests, what the rewrite did to your model.

Capture the dynamo graph before and after the ``ring_dilated`` passes (no backend to write),
diff them, and assert on the result::

    from ring_rewrite.testing import assert_expected_graph, assert_rewritten, capture

    cap = capture(model, x, segment_lengths=[64, 256], dilation_rates=[1, 4])
    diff = cap.diff()
    print(diff)               # per-site table and op counts (tabulate)
    print(diff.text)          # unified diff of the printed graphs, names normalised
    assert diff.removed_by_op == {"scaled_dot_product_attention": 2}
    assert_rewritten(cap, 2)  # fails with the report table when an upgrade stops rewriting
    assert_expected_graph(cap.after[0], "expected/block.txt")  # RING_REWRITE_ACCEPT=1 refreshes

What each piece looks at (SPEC §4):

* ``capture``: the dynamo graphs before and after the passes, the site records, and with
  ``aot=True`` the AOT forward / backward graphs that inductor would receive.
* ``graph_diff``: nodes removed and added (matched by graph, name and op), counts by op and by
  ``node.meta["ring_rewrite"]["role"]``, one summary row per attention site.
* ``assert_rewritten`` / ``assert_left_alone``: the site records and the graphs agree with what
  the test expects; failures show the report table.
* ``assert_same_p2p_schedule``: compiled once per rank of a fake process group, every rank issues
  the same ring transfers (op, tag, shape, dtype) in the same order, forward and backward, and
  each message has a receiver (Note [Ordering the ring's messages] in ``ring_rewrite/p2p.py``).
* ``buffers_in_flight_violations``: in the code inductor generated (``run_and_get_code``),
  every buffer a transfer sends stays alive and unwritten from its start to its wait, and the
  wait reads the buffers the start sent (Note [Buffers in flight] in ``ring_rewrite/p2p.py``).
* ``assert_expected_graph``: the normalised graph text equals a stored file; with
  ``RING_REWRITE_ACCEPT=1`` in the environment the file is (re)written instead, as
  ``EXPECTTEST_ACCEPT=1`` does for torch's ``assertExpectedInline``.

The ``ring_graphs`` pytest fixture (``ring_rewrite.pytest_plugin``) hands all of these to a test.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import difflib
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from tabulate import tabulate

from .passes import location

from .backend import RingDilatedBackend
from .config import RingDilatedConfig
from .p2p import resolve_group
from .report import Report

__all__ = [
    "ACCEPT_ENV",
    "Capture",
    "GraphDiff",
    "NodeInfo",
    "SiteSummary",
    "Transfer",
    "assert_expected_graph",
    "assert_left_alone",
    "assert_rewritten",
    "assert_same_p2p_schedule",
    "buffers_in_flight_violations",
    "capture",
    "capture_ranks",
    "graph_diff",
    "graph_text",
    "op_label",
    "site_body",
    "transfers",
]

ACCEPT_ENV = "RING_REWRITE_ACCEPT"
"""Set to ``1`` to (re)write the files ``assert_expected_graph`` compares against."""

_SDPA = ("scaled_dot_product_attention",)
# What a site left alone still shows: its SDPA node, or its attention-module node.
_LEFT_ALONE = (*_SDPA, "multi_head_attention_forward", "_transformer_encoder_layer_fwd")
_ATTENTION = "ring_rewrite.block_attention"
_ATTENTION_BWD = "ring_rewrite.block_attention_backward"
# A ring step's transfer is counted at its start (``ring_shift_wait`` only finishes it).
_P2P = {"ring_rewrite.ring_shift_start": "send_recv", "ring_rewrite.all_gather_seq": "all_gather"}


# ---- capture ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Capture:
    """What one ``torch.compile`` run through the ``ring_dilated`` passes produced.

    Every list has one entry per dynamo graph (one per graph break + 1), in compile order.
    """

    before: list[fx.GraphModule]
    """Dynamo graphs as the backend received them (copies taken before the passes ran)."""
    after: list[fx.GraphModule]
    """The same graphs after the passes: what the lowering compiler receives."""
    records: list[Any]
    """One ``SiteRecord`` per attention site (site ids restart at 0 in every graph)."""
    forward: list[fx.GraphModule] = dataclasses.field(default_factory=list)
    """AOT forward (or inference) graphs, with ``aot=True``."""
    backward: list[fx.GraphModule] = dataclasses.field(default_factory=list)
    """AOT backward graphs, with ``aot=True`` and ``backward=True``."""
    output: Any = None
    """What the compiled model returned."""
    rank: int = 0
    world: int = 1

    @property
    def report(self) -> Report:
        """The rewrite report (``str()`` is the table ``ring_rewrite.explain`` prints)."""
        return Report(list(self.records))

    def diff(self) -> GraphDiff:
        """``graph_diff`` of every graph before and after the passes."""
        return graph_diff(self.before, self.after)

    def sites(self) -> list[tuple[int, Any]]:
        """``(graph index, SiteRecord)`` of every attention site."""
        return [(i, r) for i, gm in enumerate(self.after) for r in gm.meta.get("ring_rewrite_sites", ())]

    def schedule(self) -> list[Transfer]:
        """Ring transfers in issue order: AOT forward then backward graphs with ``aot=True``, else
        the rewritten sites' forward then backward subgraphs."""
        if self.forward or self.backward:
            return [*transfers(self.forward, "forward"), *transfers(self.backward, "backward")]
        fwd = [getattr(gm, n) for gm in self.after for n, _ in _site_subgraphs(gm, "fwd")]
        bwd = [getattr(gm, n) for gm in self.after for n, _ in _site_subgraphs(gm, "bwd")]
        return [*transfers(fwd, "forward"), *transfers(bwd, "backward")]


def capture(
    model: Callable[..., Any],
    /,
    *args: Any,
    aot: bool = False,
    backward: bool = False,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    **config: Any,
) -> Capture:
    """Run ``model(*args)`` once through ``torch.compile`` with the ``ring_dilated`` passes.

    ``config`` holds ``RingDilatedConfig`` fields; the rewritten graph runs eagerly
    (``compiler="eager"``) unless another compiler is named. ``aot=True`` lowers through
    ``aot_autograd`` instead of the compiler and keeps its forward / backward graphs (which then
    run as they are); ``backward=True`` also
    runs backward on the sum of the outputs that require grad (so the AOT backward graph is
    compiled and the rewritten backward runs). Dynamo's caches are reset first, so every call
    compiles afresh; the model itself is not modified. Keyword arguments of the model: pass
    ``functools.partial(model, **kwargs)``.
    """
    config.setdefault("compiler", "eager")
    cfg = RingDilatedConfig(**config)
    forward: list[fx.GraphModule] = []
    backward_graphs: list[fx.GraphModule] = []
    inner = _aot_keeping(forward, backward_graphs) if aot else None
    be = RingDilatedBackend(cfg, inner=inner)
    before: list[fx.GraphModule] = []
    after: list[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any):
        before.append(_copy_graph_module(gm))
        compiled = be(gm, example_inputs, **kwargs)
        after.append(gm)  # the passes rewrite ``gm`` in place
        return compiled

    torch._dynamo.reset()
    out = torch.compile(model, backend=keep, fullgraph=fullgraph, dynamic=dynamic)(*args)
    if backward:
        _run_backward(out)
    _, world, rank = resolve_group(cfg.group)
    return Capture(before, after, list(be.records), forward, backward_graphs, out, rank, world)


def capture_ranks(
    model: Callable[..., Any],
    inputs: Sequence[Any] | Callable[[int], Sequence[Any]],
    *,
    world: int = 4,
    aot: bool = True,
    backward: bool = True,
    **config: Any,
) -> list[Capture]:
    """``capture`` once per rank ``0 .. world-1`` of a fake process group (no communication).

    ``inputs`` are the model's arguments on every rank, or a function of the rank that returns
    them (in ``sharding="sharded"`` mode: the rank's shard). Every rank compiles the same
    rewrite a real ``torchrun`` rank would, which is what ``assert_same_p2p_schedule`` compares.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "capture_ranks initialises a fake process group per rank, but a process group is "
            "already initialised; call it outside torch.distributed"
        )
    captures = []
    for rank in range(world):
        args = inputs(rank) if callable(inputs) else inputs
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            captures.append(capture(model, *args, aot=aot, backward=backward, **config))
        finally:
            dist.destroy_process_group()
    return captures


def _aot_keeping(forward: list[fx.GraphModule], backward: list[fx.GraphModule]) -> Callable:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keeper(graphs: list[fx.GraphModule]) -> Callable:
        def compiler(gm: fx.GraphModule, example_inputs: list[Any]):
            graphs.append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=keeper(forward), bw_compiler=keeper(backward))


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    # NOTE: a copy of the graph over the same root shares parameters and the example values in
    # node.meta (Graph.__deepcopy__ copies each node's meta dict shallowly), so it costs no
    # tensor memory; the passes then mutate only the original graph.
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    new.meta = dict(gm.meta)
    return new


def _run_backward(out: Any) -> None:
    leaves = [
        t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    if not leaves:
        raise ValueError(
            "backward=True, but no output of the model requires grad: give an input "
            "requires_grad=True, or use a model with parameters"
        )
    sum(t.float().sum() for t in leaves).backward()


# ---- printing and labelling nodes ------------------------------------------------------------


def op_label(node: fx.Node) -> str:
    """A short, version-stable name for what ``node`` computes.

    ``scaled_dot_product_attention``, ``ring_rewrite.block_attention``, ``aten.mm``,
    ``Tensor.view`` (a method), ``getitem``, ``get_attr``, ``invoke_subgraph``.
    """
    if node.op in ("placeholder", "output", "get_attr", "call_module"):
        return node.op
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return _callable_label(node.target)


def _callable_label(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.replace("::", ".")
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    return getattr(target, "__name__", str(target))


def _p2p_op(node: fx.Node) -> tuple[str, Any, tuple, dict] | None:
    """``(kind, op, args, kwargs)`` when ``node`` is a ring transfer."""
    if node.op != "call_function":
        return None
    target, args = node.target, node.args
    kind = _P2P.get(_callable_label(target)) if callable(target) else None
    return None if kind is None else (kind, target, tuple(args), dict(node.kwargs))


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
_EVAL_KEY = re.compile(r"<eval_with_key>\.\d+")
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\w.~-]*[/\\])+([\w.-]+\.py)")
_NESTED_CLASS = re.compile(r"^    class \w+\(torch\.nn\.Module\):$", re.M)
_LINENO = re.compile(r"(\.py)(?::|\", line |, line )\d+")


def graph_text(
    graphs: fx.GraphModule | Sequence[fx.GraphModule] | str, *, subgraphs: bool = True
) -> str:
    """The printed graph(s), normalised so the text is stable across runs and machines.

    ``print_readable`` (nested subgraph modules such as ``ring_rewrite_fwd_0`` included), then
    ``torch._dynamo.testing.normalize_gm`` (comments with file names go, blank lines squashed),
    then memory addresses, directories, line numbers and ``<eval_with_key>`` counters masked.
    Several graphs are separated by ``# graph i`` headers. ``subgraphs=False`` leaves out the
    nested subgraph modules (the rewritten sites' ``ring_rewrite_fwd_N`` / ``_bwd_N``): the
    top-level graph alone shows which SDPA calls became site nodes, and does not change when
    the library changes how it computes a site. A string is only stripped of trailing
    whitespace and memory addresses.
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


def _walk(gm: fx.GraphModule, prefix: str = "") -> Iterator[tuple[str, fx.Node]]:
    """``(module path, node)`` over ``gm`` and, depth first, the graph modules it references."""
    for node in gm.graph.nodes:
        yield prefix, node
        if node.op == "get_attr":
            sub = _attr(gm, node.target)
            if isinstance(sub, fx.GraphModule):
                yield from _walk(sub, f"{prefix}{node.target}.")


def _attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def site_body(gm: fx.GraphModule, site: int, which: str = "fwd") -> fx.GraphModule:
    """The graph of a rewritten site's forward (``"fwd"``) or backward (``"bwd"``): the body its
    ``ring_rewrite_fwd_N`` / ``_bwd_N`` subgraph calls through ``invoke_subgraph``, shared by
    every site of ``gm`` with the same plan (Note [One body per plan] in ``passes/rewrite_sdpa.py``)."""
    return getattr(gm, f"ring_rewrite_{which}_{site}").body


_SITE_MODULE = re.compile(r"ring_rewrite_(?:fwd|bwd)_(\d+)\.")


def _site_subgraphs(gm: fx.GraphModule, which: str) -> list[tuple[str, int]]:
    """``(attribute name, site)`` of the ``ring_rewrite_{which}_N`` subgraphs of ``gm``."""
    found = []
    for name, _ in gm.named_children():
        match = re.fullmatch(rf"ring_rewrite_{which}_(\d+)", name)
        if match:
            found.append((name, int(match.group(1))))
    return sorted(found, key=lambda x: x[1])


# ---- the diff --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """One node of a diff."""

    graph: int
    """Index of the dynamo graph."""
    module: str
    """``""`` for the top-level graph, ``"ring_rewrite_fwd_0."`` for a node of that subgraph."""
    name: str
    op: str
    """``op_label(node)``."""
    location: str
    """``file:line`` of the user's code the node came from (its stack trace), or ``"?"``."""
    tag: dict[str, Any] | None
    """``node.meta["ring_rewrite"]`` (``site``, ``role``, ``branch``, ``step``), if any."""
    replaced_by: int | None = None
    """For a removed node: the site whose inserted nodes took its place (found through the
    nodes that consumed it), if any."""

    @property
    def role(self) -> str | None:
        return None if self.tag is None else self.tag.get("role")

    @property
    def site(self) -> int | None:
        return None if self.tag is None else self.tag.get("site")

    def __str__(self) -> str:
        where = f"graph {self.graph} {self.module}{self.name}"
        role = f" [{self.role}]" if self.tag else ""
        return f"{where}: {self.op}{role} ({self.location})"


@dataclasses.dataclass(frozen=True)
class SiteSummary:
    """What the rewrite did at one attention site (one row of ``GraphDiff.table()``)."""

    graph: int
    site: int
    location: str
    rewritten: bool
    reason: str | None
    removed: dict[str, int]
    """Ops removed at the site's source line (the SDPA call, a decomposed module)."""
    added_by_role: dict[str, int]
    """Nodes added for the site, subgraphs included, by role."""
    attention: tuple[int, int]
    """``block_attention`` nodes in the forward, ``block_attention_backward`` in the backward."""
    transfers: tuple[int, int]
    """Ring transfers (send/recv and gathers) in the forward and the backward subgraph."""


@dataclasses.dataclass
class GraphDiff:
    """Nodes removed and added by the passes; ``str()`` is a table, ``.text`` a unified diff.

    Nodes are matched by graph, module, name and op (placeholders and outputs are interfaces,
    not counted). A node the passes inserted carries ``meta["ring_rewrite"]`` with its site and
    role: ``untagged`` lists added nodes that do not (SPEC §4 says none should).
    """

    removed: list[NodeInfo]
    added: list[NodeInfo]
    sites: list[SiteSummary]
    ops_before: collections.Counter
    ops_after: collections.Counter
    text: str
    """Unified diff of ``graph_text(before)`` and ``graph_text(after)``."""

    @property
    def removed_by_op(self) -> collections.Counter:
        return collections.Counter(n.op for n in self.removed)

    @property
    def added_by_op(self) -> collections.Counter:
        return collections.Counter(n.op for n in self.added)

    @property
    def added_by_role(self) -> collections.Counter:
        return collections.Counter(n.role or "(no role)" for n in self.added)

    @property
    def untagged(self) -> list[NodeInfo]:
        """Added nodes without a site id and role in ``meta["ring_rewrite"]``."""
        return [n for n in self.added if n.site is None or n.role is None]

    @property
    def ops_changed(self) -> dict[str, tuple[int, int]]:
        """``op -> (count before, count after)`` for every op whose count changed."""
        ops = sorted(set(self.ops_before) | set(self.ops_after))
        return {
            op: (self.ops_before[op], self.ops_after[op])
            for op in ops
            if self.ops_before[op] != self.ops_after[op]
        }

    def site_table(self) -> str:
        rows = []
        for s in self.sites:
            rows.append(
                {
                    "graph": s.graph,
                    "site": s.site,
                    "where": s.location,
                    "status": "rewritten" if s.rewritten else f"left alone: {s.reason}",
                    "removed": _counts(s.removed),
                    "added by role": _counts(s.added_by_role),
                    "attention fwd / bwd": "%d / %d" % s.attention if s.rewritten else "-",
                    "P2P fwd / bwd": "%d / %d" % s.transfers if s.rewritten else "-",
                }
            )
        return tabulate(rows, headers="keys", tablefmt="simple") if rows else "(no attention site)"

    def op_table(self) -> str:
        rows = [
            (op, before, after, f"{after - before:+d}")
            for op, (before, after) in self.ops_changed.items()
        ]
        if not rows:
            return "(no op count changed)"
        return tabulate(rows, headers=("op", "before", "after", "change"), tablefmt="simple")

    def table(self) -> str:
        rewritten = sum(s.rewritten for s in self.sites)
        head = (
            f"ring_dilated graph diff: {rewritten} of {len(self.sites)} attention sites rewritten; "
            f"{_plural(len(self.removed), 'node')} removed, {len(self.added)} added"
        )
        return "\n\n".join([head, self.site_table(), self.op_table()])

    def __str__(self) -> str:
        return self.table()


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def _counts(counter: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counter.items()) or "-"


def graph_diff(
    before: fx.GraphModule | Sequence[fx.GraphModule], after: fx.GraphModule | Sequence[fx.GraphModule]
) -> GraphDiff:
    """What the passes changed between ``before`` and ``after`` (a graph each, or lists of them
    paired in order, as ``Capture.before`` / ``Capture.after``)."""
    before_list = [before] if isinstance(before, fx.GraphModule) else list(before)
    after_list = [after] if isinstance(after, fx.GraphModule) else list(after)
    if len(before_list) != len(after_list):
        raise ValueError(f"{len(before_list)} graphs before but {len(after_list)} after")
    removed, added, sites = [], [], []
    ops_before, ops_after = collections.Counter(), collections.Counter()
    for index, (b, a) in enumerate(zip(before_list, after_list)):
        nodes_b, nodes_a = _nodes(b, index), _nodes(a, index)
        ops_before.update(n.op for n in nodes_b.values())
        ops_after.update(n.op for n in nodes_a.values())
        gone = [key for key in nodes_b if key not in nodes_a]
        replaced_by = _replacing_sites(b, a, {name for module, name, _ in gone if not module})
        graph_removed = [
            dataclasses.replace(nodes_b[key], replaced_by=replaced_by.get(key[1]) if not key[0] else None)
            for key in gone
        ]
        graph_added = [n for key, n in nodes_a.items() if key not in nodes_b]
        removed += graph_removed
        added += graph_added
        sites += _site_summaries(a, index, graph_removed, graph_added)
    text = "".join(
        difflib.unified_diff(
            graph_text(before_list).splitlines(keepends=True),
            graph_text(after_list).splitlines(keepends=True),
            "before",
            "after",
        )
    )
    return GraphDiff(removed, added, sites, ops_before, ops_after, text)


def _nodes(gm: fx.GraphModule, index: int) -> dict[tuple[str, str, str], NodeInfo]:
    nodes = {}
    for module, node in _walk(gm):
        if node.op in ("placeholder", "output"):
            continue
        tag = node.meta.get("ring_rewrite")
        within = _SITE_MODULE.match(module)
        if tag is not None and within:
            # A shared body's nodes carry the first site's index; reached through this site's
            # subgraph, they are this site's.
            tag = {**tag, "site": int(within.group(1))}
        info = NodeInfo(index, module, node.name, op_label(node), location(node), tag)
        nodes[(module, node.name, info.op)] = info
    return nodes


def _replacing_sites(before: fx.GraphModule, after: fx.GraphModule, removed: set[str]) -> dict[str, int]:
    """``removed node name -> site`` of the inserted nodes that its kept consumers now read.

    A removed SDPA node's consumers read the site's ``autograd_function_apply`` node instead;
    a decomposed module's ``getitem`` consumers read the site's ``decompose`` nodes. Removed
    nodes connected to each other (the module node and its ``getitem``) share the site.
    """
    kept_after = {n.name: n for n in after.graph.nodes}
    by_name = {n.name: n for n in before.graph.nodes if n.name in removed}
    sites: dict[str, int] = {}
    for name, node in by_name.items():
        for user in node.users:
            if user.name in removed or user.name not in kept_after:
                continue
            for arg in kept_after[user.name].all_input_nodes:
                site = (arg.meta.get("ring_rewrite") or {}).get("site")
                if site is not None:
                    sites.setdefault(name, site)
    changed = True
    while changed:  # spread along edges between removed nodes
        changed = False
        for name, node in by_name.items():
            if name in sites:
                continue
            for other in [*node.users, *node.all_input_nodes]:
                if other.name in sites and other.name in by_name:
                    sites[name] = sites[other.name]
                    changed = True
                    break
    return sites


def _site_summaries(
    gm: fx.GraphModule, index: int, removed: list[NodeInfo], added: list[NodeInfo]
) -> list[SiteSummary]:
    out = []
    for record in gm.meta.get("ring_rewrite_sites", ()):
        mine = [n for n in added if n.site == record.site]
        fwd = [n for n in mine if n.module.startswith(f"ring_rewrite_fwd_{record.site}.")]
        bwd = [n for n in mine if n.module.startswith(f"ring_rewrite_bwd_{record.site}.")]

        out.append(
            SiteSummary(
                graph=index,
                site=record.site,
                location=record.location,
                rewritten=record.rewritten,
                reason=record.reason,
                removed=dict(collections.Counter(n.op for n in removed if n.replaced_by == record.site)),
                added_by_role=dict(collections.Counter(n.role or "(no role)" for n in mine)),
                attention=(
                    sum(n.op == _ATTENTION for n in fwd),
                    sum(n.op == _ATTENTION_BWD for n in bwd),
                ),
                transfers=(sum(n.op in _P2P for n in fwd), sum(n.op in _P2P for n in bwd)),
            )
        )
    return out


# ---- ring transfers --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One ring transfer as a graph issues it."""

    graph: str
    """``"forward"`` or ``"backward"``."""
    kind: str
    """``"send_recv"`` (a ring shift, ``ring_rewrite::ring_shift_start``) or ``"all_gather"``
    (``all_gather_seq``)."""
    tag: int
    shapes: tuple[tuple[int, ...], ...] | None
    """Shapes of the tensors sent (AOT graphs; None in dynamo subgraphs, which carry no values)."""
    dtypes: tuple[torch.dtype, ...] | None
    send_to: int | None
    recv_from: int | None

    @property
    def shape(self) -> tuple[int, ...] | None:
        """Shape of the (first) tensor sent."""
        return self.shapes[0] if self.shapes else None

    @property
    def key(self) -> tuple:
        """What every rank must agree on: all but the peers."""
        return (self.graph, self.kind, self.tag, self.shapes, self.dtypes)

    def __str__(self) -> str:
        sent = ""
        if self.shapes is not None:
            dtypes = [_DTYPE_ABBR.get(d, str(d).replace("torch.", "")) for d in self.dtypes or ()]
            shapes = ["x".join(map(str, s)) for s in self.shapes]
            if len(set(dtypes)) == 1:
                sent = f" {','.join(shapes)} {dtypes[0]}"
            else:
                sent = " " + ",".join(f"{s} {d}" for s, d in zip(shapes, dtypes))
        peers = f" to {self.send_to} from {self.recv_from}" if self.kind == "send_recv" else ""
        return f"{self.kind} {self.tag}{sent}{peers}"


_DTYPE_ABBR = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.uint8: "u8",
}


def transfers(graphs: fx.GraphModule | Iterable[fx.GraphModule], graph: str = "forward") -> list[Transfer]:
    """Every ring transfer of ``graphs`` (subgraphs included), in graph order.

    Works on AOT graphs and on dynamo graphs (the sites' ``ring_rewrite_fwd_N`` / ``_bwd_N``
    subgraphs and the bodies they call), walking every ``invoke_subgraph`` body at each call.
    ``graph`` labels the result.
    """
    if isinstance(graphs, fx.GraphModule):
        graphs = [graphs]
    found = []
    for gm in graphs:
        for _, node in _walk(gm):
            p2p = _p2p_op(node)
            if p2p is None:
                continue
            kind, op, args, kwargs = p2p
            schema = getattr(op, "default", op)._schema
            bound = dict(zip((a.name for a in schema.arguments), args))
            bound.update(kwargs)
            sent = bound["x"] if "x" in bound else bound.get("xs", ())
            sent = list(sent) if isinstance(sent, (list, tuple)) else [sent]
            vals = [
                n.meta.get("val", n.meta.get("example_value")) if isinstance(n, fx.Node) else None
                for n in sent
            ]
            known = all(isinstance(v, torch.Tensor) for v in vals)
            found.append(
                Transfer(
                    graph,
                    kind,
                    int(bound["tag"]),
                    tuple(tuple(int(s) for s in v.shape) for v in vals) if known else None,
                    tuple(v.dtype for v in vals) if known else None,
                    bound.get("send_to"),
                    bound.get("recv_from"),
                )
            )
    return found


# ---- assertions ------------------------------------------------------------------------------


def _records(obj: Any) -> list[Any]:
    if isinstance(obj, (Capture, Report, RingDilatedBackend)):
        return list(obj.records)
    return list(obj)


def _report(records: list[Any]) -> str:
    return str(Report(records))


def _site_name(record: Any) -> str:
    return f"site {record.site} ({record.location})"


def _left_alone_locations(gm: fx.GraphModule) -> list[str]:
    return [location(n) for _, n in _walk(gm) if op_label(n) in _LEFT_ALONE]


def assert_rewritten(result: Any, n: int | None = None) -> None:
    """Assert that ``n`` attention sites were rewritten (``None``: every site, at least one).

    ``result`` is a ``Capture``, a ``Report``, a ``RingDilatedBackend`` or a list of site
    records. With a ``Capture`` the graphs must agree too: one ``autograd_function_apply`` site
    node per rewritten site and an SDPA (or attention-module) node still in place for each site
    left alone.
    """
    __tracebackhide__ = True
    records = _records(result)
    done = [r for r in records if r.rewritten]
    alone = [r for r in records if not r.rewritten]
    expected = len(records) if n is None else n
    if len(done) != expected or (n is None and not records):
        want = "every attention site" if n is None else f"{n} attention site{'s' * (n != 1)}"
        lines = [f"expected {want} rewritten; ring_dilated rewrote {len(done)} of {len(records)}"]
        lines += [f"  {_site_name(r)} left alone: {r.reason}" for r in alone]
        lines += ["", _report(records)]
        raise AssertionError("\n".join(lines))
    if isinstance(result, Capture):
        site_nodes = [
            node
            for gm in result.after
            for _, node in _walk(gm)
            if op_label(node) == "autograd_function_apply"
            and (node.meta.get("ring_rewrite") or {}).get("role") == "site"
        ]
        left = sum(len(_left_alone_locations(gm)) for gm in result.after)
        if len(site_nodes) != len(done) or left < len(alone):
            raise AssertionError(
                f"the site records say {len(done)} rewritten and {len(alone)} left alone, but the "
                f"rewritten graphs hold {len(site_nodes)} rewritten site node(s) and {left} "
                f"attention node(s) left in place\n\n{result.diff()}"
            )


def assert_left_alone(result: Any, site: int | str | None = None, reason: str | None = None) -> Any:
    """Assert that an attention site was left alone (not rewritten), with a reason containing
    ``reason``; returns its record.

    ``site`` is a site id or a substring of its ``file:line`` location; ``None`` means any site.
    With a ``Capture`` the site's SDPA (or attention-module) node must also still be in its graph.
    """
    __tracebackhide__ = True
    records = _records(result)
    if isinstance(site, int):
        chosen = [r for r in records if r.site == site]
    elif isinstance(site, str):
        chosen = [r for r in records if site in r.location]
    else:
        chosen = records
    which = "any attention site" if site is None else f"attention site {site!r}"
    want = f"left alone{f' with a reason containing {reason!r}' if reason else ''}"
    if not chosen:
        raise AssertionError(f"expected {which} {want}, but no site matches\n\n{_report(records)}")
    alone = [r for r in chosen if not r.rewritten]
    matching = [r for r in alone if reason is None or reason in (r.reason or "")]
    if not matching:
        if not alone:
            found = "; ".join(f"{_site_name(r)} was rewritten" for r in chosen)
        else:
            found = "; ".join(f"{_site_name(r)} was left alone because: {r.reason}" for r in alone)
        raise AssertionError(f"expected {which} {want}, but {found}\n\n{_report(records)}")
    record = matching[0]
    if isinstance(result, Capture) and record.location != "?":
        for index, rec in result.sites():
            if rec is record and record.location not in _left_alone_locations(result.after[index]):
                raise AssertionError(
                    f"{_site_name(record)} is recorded as left alone ({record.reason}), but graph "
                    f"{index} no longer holds its attention node\n\n{result.diff()}"
                )
    return record


def assert_same_p2p_schedule(
    model: Callable[..., Any] | Sequence[Capture],
    inputs: Sequence[Any] | Callable[[int], Sequence[Any]] | None = None,
    *,
    world: int = 4,
    backward: bool = True,
    expect_transfers: bool = True,
    **config: Any,
) -> list[Capture]:
    """Assert that every rank issues the same ring transfers in the same order; returns the
    per-rank captures.

    ``model`` is compiled once per rank of a fake process group of ``world`` ranks
    (``capture_ranks``; ``config`` holds the config fields, ``inputs`` the arguments or a function
    of the rank), or is a list of per-rank captures already made. On every rank the AOT forward
    then backward graphs must issue the same transfers (op, tag, sent shape and dtype) in the same
    order, and every send must meet a receive from its sender at the same position on the peer.
    ``expect_transfers`` fails when no rank transfers anything (a rewrite that became local, or
    no rewrite at all, would otherwise pass vacuously).
    """
    __tracebackhide__ = True
    if inputs is None and isinstance(model, Sequence):
        captures = list(model)
    else:
        if inputs is None:
            raise TypeError("assert_same_p2p_schedule needs the model's inputs (or a list of captures)")
        captures = capture_ranks(model, inputs, world=world, backward=backward, **config)
    schedules = [c.schedule() for c in captures]
    ranks = [c.rank for c in captures]
    if expect_transfers and not any(schedules):
        raise AssertionError(
            f"no ring transfer on any of {len(captures)} ranks, so there is no schedule to compare "
            f"(every branch local, or no site rewritten?)\n\n{_report(captures[0].records)}"
        )
    problems = []
    for rank, schedule in zip(ranks[1:], schedules[1:]):
        mismatch = _first_difference(schedules[0], schedule)
        if mismatch is not None:
            i, mine, theirs = mismatch
            problems.append(
                f"  rank {rank} differs from rank {ranks[0]} at transfer #{i}:\n"
                f"    rank {ranks[0]}: {mine}\n    rank {rank}: {theirs}"
            )
    if not problems:
        problems = _unpaired(ranks, schedules)
    if problems:
        table = _schedule_table(ranks, schedules)
        raise AssertionError(
            f"the ring's P2P schedule is not the same on every rank (world={len(captures)}, "
            "forward then backward transfers):\n" + "\n".join(problems) + f"\n\n{table}"
        )
    return captures


def _first_difference(a: list[Transfer], b: list[Transfer]) -> tuple[int, str, str] | None:
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x is None or y is None or x.key != y.key:
            show = lambda t: "(no transfer)" if t is None else f"{t.graph} {t}"  # noqa: E731
            return i, show(x), show(y)
    return None


def _unpaired(ranks: list[int], schedules: list[list[Transfer]]) -> list[str]:
    by_rank = dict(zip(ranks, schedules))
    problems = []
    for rank, schedule in by_rank.items():
        for i, t in enumerate(schedule):
            if t.kind != "send_recv" or t.send_to not in by_rank:
                continue
            peer = by_rank[t.send_to][i]
            if peer.recv_from != rank:
                problems.append(
                    f"  transfer #{i} ({t.graph}, tag {t.tag}): rank {rank} sends to rank {t.send_to}, "
                    f"but rank {t.send_to} receives from rank {peer.recv_from}"
                )
    return problems[:8]


def _schedule_table(ranks: list[int], schedules: list[list[Transfer]], context: int = 6) -> str:
    """The transfers of every rank side by side, around the first position where they differ."""
    length = max(map(len, schedules), default=0)
    differs = [
        i
        for i in range(length)
        if len({s[i].key if i < len(s) else None for s in schedules}) > 1
    ]
    first = differs[0] if differs else 0
    lo, hi = max(0, first - context), min(length, first + context + 1)
    rows = []
    for i in range(lo, hi):
        row: list[Any] = [i]
        for schedule in schedules:
            t = schedule[i] if i < len(schedule) else None
            row.append("-" if t is None else f"{'fw' if t.graph == 'forward' else 'bw'} {t}")
        row.append("<<" if i in differs else "")
        rows.append(row)
    table = tabulate(rows, headers=["#", *(f"rank {r}" for r in ranks), ""], tablefmt="simple")
    shown = f"transfers {lo}..{hi - 1} of {length}" if (lo, hi) != (0, length) else f"{length} transfers"
    legend = "fw/bw: forward/backward graph, kind, tag, shapes sent, peers; << where ranks differ"
    return f"{shown} ({legend}):\n{table}"


def assert_expected_graph(
    actual: fx.GraphModule | Sequence[fx.GraphModule] | GraphDiff | str,
    path: str | os.PathLike[str] | None = None,
    *,
    expected: str | None = None,
    subgraphs: bool = True,
) -> None:
    """Assert that ``actual`` prints as the text stored at ``path`` (or as ``expected``).

    ``actual`` is a graph module or a list of them (compared as ``graph_text``), a ``GraphDiff``
    (its table) or a string; ``subgraphs=False`` compares top-level graphs only (see
    ``graph_text``). With ``RING_REWRITE_ACCEPT=1`` in the environment a file that is
    missing or different is written with the actual text and the assertion passes: review the
    change with ``git diff``. Otherwise a mismatch fails with a unified diff, expected to actual.
    An inline ``expected=`` string cannot be refreshed: the failure shows the text to paste.
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


# ---- inductor's generated code -----------------------------------------------------------------

_CODE_START = re.compile(r"ring_rewrite\.ring_shift_start\.default\(\[([^\]]*)\], .*, (\d+)\)$")
_CODE_WAIT = re.compile(r"ring_rewrite\.ring_shift_wait\.default\(\[([^\]]*)\], [\w.]+, (\d+), \[")
_CODE_KERNEL = re.compile(r"^(\w+) = async_compile\.\w+\(\[([^\]]*)\]")
_CODE_CALL = re.compile(r"^\s*(\w+)\((.*)\)\s*$")
_CODE_ALIAS = re.compile(r"^\s*\w+ = (?:reinterpret_tensor\()?(\w+)[,;)]")
_CODE_DEL = re.compile(r"\bdel (\w+)")
_CODE_OUT = re.compile(r"\bout=(\w+)")


def buffers_in_flight_violations(code: str) -> list[str]:
    """Where inductor's generated wrapper ``code`` lets a ring transfer's send buffer die, be
    reused or be written between the transfer's start and its wait, or waits on other buffers
    than it sent; an empty list when none.

    Reads the wrapper as ``torch._inductor.utils.run_and_get_code`` returns it: a buffer is
    freed by ``del``, handed on by ``# reuse`` (``bufB = bufA; del bufA``), and written by a C++
    kernel at a non-``const`` pointer argument or by an extern kernel's ``out=``.
    """
    outputs: dict[str, list[bool]] = {}  # kernel -> per argument: is it written?
    in_flight: dict[str, tuple[str, ...]] = {}  # tag -> buffers sent
    problems = []
    for number, line in enumerate(code.splitlines(), 1):
        where = f"line {number}: {line.strip()}"
        if kernel := _CODE_KERNEL.match(line):
            types = [t.strip().strip("'\"") for t in kernel.group(2).split(",")]
            outputs[kernel.group(1)] = [not t.startswith("const") for t in types]
            continue
        if start := _CODE_START.search(line):
            in_flight[start.group(2)] = tuple(_names(start.group(1)))
            continue
        if wait := _CODE_WAIT.search(line):
            sent = in_flight.pop(wait.group(2), None)
            if sent is None:
                problems.append(f"a wait without a start (tag {wait.group(2)}), {where}")
            elif tuple(_names(wait.group(1))) != sent:
                problems.append(f"the wait reads other buffers than its start sent {sent}, {where}")
            continue
        busy = {name: tag for tag, names in in_flight.items() for name in names}
        if not busy:
            continue
        touched = set(_CODE_DEL.findall(line)) | set(_CODE_OUT.findall(line))
        if (alias := _CODE_ALIAS.match(line)) and "# reuse" in line:
            touched.add(alias.group(1))
        if (call := _CODE_CALL.match(line)) and call.group(1) in outputs:
            args = [a.strip() for a in call.group(2).split(",")]
            touched |= {a for a, out in zip(args, outputs[call.group(1)]) if out}
        for name in sorted(touched & set(busy)):
            problems.append(f"{name}, in flight (tag {busy[name]}), is freed or written, {where}")
    problems += [f"transfer {tag} of {sent} is never waited for" for tag, sent in in_flight.items()]
    return problems


def _names(listed: str) -> list[str]:
    """Buffer names in a wrapper's list argument, views included (``reinterpret_tensor(buf3,
    (..), (..), 0)`` is ``buf3``)."""
    return [x for x in re.findall(r"\b[A-Za-z_]\w*\b", listed) if x != "reinterpret_tensor"]
