"""Capture the dynamo graphs before and after the passes, and the AOT graphs inductor would get."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._dynamo.testing import AotEagerAndRecordGraphs

from ..backend import RingDilatedBackend
from ..config import RingDilatedConfig
from ..p2p import resolve_group
from ..report import Report
from .diff import GraphDiff, graph_diff
from .graphs import site_subgraphs
from .schedule import Transfer, transfers

__all__ = ["Capture", "capture", "capture_ranks"]


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
        fwd = [getattr(gm, n) for gm in self.after for n, _ in site_subgraphs(gm, "fwd")]
        bwd = [getattr(gm, n) for gm in self.after for n, _ in site_subgraphs(gm, "bwd")]
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
    ``aot_eager`` instead of the compiler and keeps its forward / backward graphs (which then
    run as they are); ``backward=True`` also
    runs backward on the sum of the outputs that require grad (so the AOT backward graph is
    compiled and the rewritten backward runs). Dynamo's caches are reset first, so every call
    compiles afresh; the model itself is not modified. Keyword arguments of the model: pass
    ``functools.partial(model, **kwargs)``.
    """
    config.setdefault("compiler", "eager")
    cfg = RingDilatedConfig(**config)
    # The rewritten graph goes through aot_eager, which keeps its forward / backward graphs.
    recorder = AotEagerAndRecordGraphs() if aot else None
    be = RingDilatedBackend(cfg, inner=recorder)
    before: list[fx.GraphModule] = []
    after: list[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any):
        before.append(_copy_graph_module(gm))
        compiled = be(gm, example_inputs, **kwargs)
        after.append(gm)  # the passes rewrite ``gm`` in place
        return compiled

    torch._dynamo.reset()
    with warnings.catch_warnings():
        # NOTE: torch's recorder hands AOT unboxed functions, which then warns at every call.
        warnings.filterwarnings("ignore", "Your compiler for AOTAutograd is returning a function")
        out = torch.compile(model, backend=keep, fullgraph=fullgraph, dynamic=dynamic)(*args)
        if backward:
            _run_backward(out)
    _, world, rank = resolve_group(cfg.group)
    forward, backward_graphs = (recorder.fw_graphs, recorder.bw_graphs) if aot else ([], [])
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

