"""What the passes changed: nodes removed and added, by op, by role and by attention site."""

from __future__ import annotations

import collections
import dataclasses
import difflib
from collections.abc import Sequence
from typing import Any

import torch.fx as fx
from tabulate import tabulate

from ..passes import location
from .graphs import SITE_MODULE, graph_text, op_label, walk
from .schedule import P2P

__all__ = ["GraphDiff", "NodeInfo", "SiteSummary", "graph_diff"]

# A local branch run in place is one node for all of its blocks (Note [Local branches in place]).
ATTENTION = ("ring_rewrite.block_attention", "ring_rewrite.dilated_block_attention")
ATTENTION_BWD = ("ring_rewrite.block_attention_backward", "ring_rewrite.dilated_block_backward")


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """One node removed or added by the passes, as ``GraphDiff`` lists it.

    ``str(node)`` reads ``graph 0 ring_rewrite_fwd_0.name: op [role] (file:line)``.

    Args:
        graph (int): index of the dynamo graph.
        module (str): ``""`` for the top-level graph, ``"ring_rewrite_fwd_0."`` for a node of
            that subgraph.
        name (str): the node's name.
        op (str): ``op_label(node)``.
        location (str): ``file:line`` of the user's code the node came from, or ``"?"``.
        tag (dict, optional): ``node.meta["ring_rewrite"]`` (``site``, ``role``, ``branch``,
            ``step``), if any.
        replaced_by (int, optional): for a removed node, the site whose inserted nodes took its
            place, if found. Default: ``None``.

    Attributes:
        role (str or None): ``tag["role"]``.
        site (int or None): ``tag["site"]``.
    """

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
    """What the rewrite did at one attention site: one row of ``GraphDiff.site_table()``.

    Args:
        graph (int): index of the dynamo graph.
        site (int): the site id within that graph.
        location (str): module path and ``file:line`` of the site.
        rewritten (bool): whether the site was rewritten.
        reason (str or None): why it was left alone (or a rewritten site's note).
        removed (dict[str, int]): ops removed for the site (the SDPA call, a decomposed
            module), by op.
        added_by_role (dict[str, int]): nodes added for the site, subgraphs included, by role.
        attention (tuple[int, int]): block attention nodes in the forward subgraph and block
            backward nodes in the backward subgraph.
        transfers (tuple[int, int]): ring transfers (send/recv and gathers) in the forward and
            the backward subgraph.
    """

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
    """``block_attention`` and ``dilated_block_attention`` nodes in the forward,
    ``block_attention_backward`` and ``dilated_block_backward`` in the backward."""
    transfers: tuple[int, int]
    """Ring transfers (send/recv and gathers) in the forward and the backward subgraph."""


@dataclasses.dataclass
class GraphDiff:
    """The nodes the passes removed and added, by op, by role and by attention site.

    Made by ``graph_diff`` (or ``Capture.diff()``). Nodes are matched by graph, module, name and
    op (placeholders and outputs are interfaces, not counted). A node the passes inserted
    carries ``meta["ring_rewrite"]`` with its site and role; ``untagged`` lists added nodes that
    do not (there should be none). ``str(diff)`` is ``table()``: a summary line, the per-site
    table and the op counts that changed; ``.text`` is a unified diff of the graphs' text.

    Args:
        removed (list[NodeInfo]): nodes in the graphs before but not after.
        added (list[NodeInfo]): nodes in the graphs after but not before.
        sites (list[SiteSummary]): one per attention site.
        ops_before (collections.Counter): op counts before the passes.
        ops_after (collections.Counter): op counts after the passes.
        text (str): unified diff of ``graph_text(before)`` and ``graph_text(after)``.

    Attributes:
        removed_by_op, added_by_op (collections.Counter): nodes by ``op_label``.
        added_by_role (collections.Counter): added nodes by role (``"(no role)"`` untagged).
        untagged (list[NodeInfo]): added nodes without a site id and role.
        ops_changed (dict[str, tuple[int, int]]): ``op -> (count before, count after)`` for
            every op whose count changed.
        site_table(), op_table(), table() (str): the tables ``str()`` joins.

    Example::

        diff = capture(model, x, segment_lengths=[64, 256], dilation_rates=[1, 4]).diff()
        assert diff.removed_by_op == {"scaled_dot_product_attention": 2}
        assert not diff.untagged
        print(diff)
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
    """What the passes changed between ``before`` and ``after``.

    Walks every graph with its subgraphs, matches nodes by graph, module, name and op, finds
    the site each removed node was replaced by (through the nodes that consumed it), and sums
    one ``SiteSummary`` per site record in the ``after`` graphs' ``meta``.

    Args:
        before (fx.GraphModule or Sequence[fx.GraphModule]): the graph(s) before the passes.
        after (fx.GraphModule or Sequence[fx.GraphModule]): the graph(s) after them, paired
            with ``before`` in order (as ``Capture.before`` / ``Capture.after``).

    Returns:
        GraphDiff: the nodes removed and added, and a summary per site.

    Raises:
        ValueError: ``before`` and ``after`` hold different numbers of graphs.

    Example::

        cap = capture(model, x)
        diff = graph_diff(cap.before, cap.after)   # the same as cap.diff()
    """
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
    for module, node in walk(gm):
        if node.op in ("placeholder", "output"):
            continue
        tag = node.meta.get("ring_rewrite")
        within = SITE_MODULE.match(module)
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
                    sum(n.op in ATTENTION for n in fwd),
                    sum(n.op in ATTENTION_BWD for n in bwd),
                ),
                transfers=(sum(n.op in P2P for n in fwd), sum(n.op in P2P for n in bwd)),
            )
        )
    return out

