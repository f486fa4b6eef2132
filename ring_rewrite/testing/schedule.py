"""The ring's transfers as graphs issue them, and how the ranks' schedules compare."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from tabulate import tabulate

from ..program import Start, build
from .graphs import callable_label, walk

__all__ = ["Transfer", "planned_transfers", "transfers"]

# A ring step's transfer is counted at its start (``ring_shift_wait`` only finishes it).
P2P = {"ring_rewrite.ring_shift_start": "send_recv", "ring_rewrite.all_gather_seq": "all_gather"}


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One ring transfer as a graph issues it; ``transfers`` lists them.

    ``str(t)`` reads ``send_recv 262144 1x4x8x16,1x4x8x16 f32 to 1 from 1``: kind, tag, shapes
    and dtype sent, and the peers of a ring shift.

    Args:
        graph (str): ``"forward"`` or ``"backward"``.
        kind (str): ``"send_recv"`` (a ring shift, ``ring_rewrite::ring_shift_start``) or
            ``"all_gather"`` (``all_gather_seq``).
        tag (int): the transfer's tag within its site call.
        shapes (tuple[tuple[int, ...], ...] or None): shapes of the tensors sent (AOT graphs;
            ``None`` in dynamo subgraphs, which carry no values).
        dtypes (tuple[torch.dtype, ...] or None): their dtypes.
        send_to (int or None): the rank sent to, a rank of the ring's process group; ``None``
            for a gather.
        recv_from (int or None): the rank received from.

    Attributes:
        shape (tuple[int, ...] or None): the shape of the first tensor sent.
        key (tuple): what every rank must agree on: all but the peers.
    """

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
    """The rank sent to, as a rank of the ring's process group (Note [Group ranks]);
    None for a gather."""
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
    A ring shift is counted at its start (its wait only finishes it).

    Args:
        graphs (fx.GraphModule or Iterable[fx.GraphModule]): the graph(s) to read.
        graph (str): the label of the result's ``Transfer.graph``. Default: ``"forward"``.

    Returns:
        list[Transfer]: the transfers in the order the graphs issue them.

    Example::

        cap = capture(model, x, aot=True, backward=True, **config)
        sent = transfers(cap.forward, "forward") + transfers(cap.backward, "backward")
        # the same as cap.schedule()
    """
    if isinstance(graphs, fx.GraphModule):
        graphs = [graphs]
    found = []
    for gm in graphs:
        for _, node in walk(gm):
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


def planned_transfers(plan: Any, graph: str = "forward") -> list[Transfer]:
    """The ring transfers a site's program lists, in order, without compiling anything.

    Read from the plan's program (``ring_rewrite.program.build``, Note [The site program]), which
    lists exactly what the traced bodies issue: the same
    ``Transfer`` values ``transfers`` reads from the graphs, shapes and dtypes included. Compare
    the plans of every rank (``SitePlan.build(..., rank=r)``) to check a schedule at any size.

    Args:
        plan (SitePlan): a site's plan on one rank (``SiteRecord.plan``, or built).
        graph (str): ``"forward"`` or ``"backward"``. Default: ``"forward"``.

    Returns:
        list[Transfer]: the ring shifts and gathers in issue order.

    Example::

        plans = [SitePlan.build(world=4, rank=r, **site) for r in range(4)]
        schedules = [planned_transfers(p, "backward") for p in plans]
        assert all(s == schedules[0] for s in schedules)  # peers aside: compare .key
    """
    program = build(plan, graph)
    found = []
    for t in program.transfers():
        if isinstance(t, Start):
            found.append(Transfer(graph, "send_recv", t.tag.encode(), t.shapes, t.dtypes, t.send_to, t.recv_from))
        else:
            found.append(Transfer(graph, "all_gather", t.tag.encode(), (t.shape,), (t.dtype,), None, None))
    return found


def _p2p_op(node: fx.Node) -> tuple[str, Any, tuple, dict] | None:
    """``(kind, op, args, kwargs)`` when ``node`` is a ring transfer."""
    if node.op != "call_function":
        return None
    target, args = node.target, node.args
    kind = P2P.get(callable_label(target)) if callable(target) else None
    return None if kind is None else (kind, target, tuple(args), dict(node.kwargs))



def first_difference(a: list[Transfer], b: list[Transfer]) -> tuple[int, str, str] | None:
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x is None or y is None or x.key != y.key:
            show = lambda t: "(no transfer)" if t is None else f"{t.graph} {t}"  # noqa: E731
            return i, show(x), show(y)
    return None


def unpaired(ranks: list[int], schedules: list[list[Transfer]]) -> list[str]:
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


def schedule_table(ranks: list[int], schedules: list[list[Transfer]], context: int = 6) -> str:
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

