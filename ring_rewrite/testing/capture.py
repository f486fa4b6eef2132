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
from ..comm.groups import resolve_group
from ..config import RingDilatedConfig
from ..report import Report
from .diff import GraphDiff, graph_diff
from .graphs import site_subgraphs
from .schedule import Transfer, transfers

__all__ = ["Capture", "capture", "capture_ranks"]


@dataclasses.dataclass
class Capture:
    """What one ``torch.compile`` run through the ``ring_dilated`` passes produced.

    Made by ``capture`` (or ``capture_ranks``, one per rank): the dynamo graphs before and
    after the passes, the site records, and with ``aot=True`` the AOT graphs the lowering
    compiler would get. Every graph list has one entry per graph compiled (one per graph break
    + 1), in compile order.

    Args:
        before (list[fx.GraphModule]): dynamo graphs as the backend received them (copies
            taken before the passes ran).
        after (list[fx.GraphModule]): the same graphs after the passes: what the lowering
            compiler receives.
        records (list[SiteRecord]): one record per attention site (site ids restart at 0 in
            every graph).
        forward (list[fx.GraphModule]): AOT forward (or inference) graphs, with ``aot=True``.
            Default: ``[]``.
        backward (list[fx.GraphModule]): AOT backward graphs, with ``aot=True`` and
            ``backward=True``. Default: ``[]``.
        output (Any): what the compiled model returned. Default: ``None``.
        rank (int): this rank of the config's group. Default: 0.
        world (int): the size of the config's group. Default: 1.

    Attributes:
        report (Report): the rewrite report of ``records``.
        diff() (GraphDiff): ``graph_diff(before, after)``.
        sites() (list[tuple[int, SiteRecord]]): ``(graph index, record)`` of every site.
        schedule() (list[Transfer]): the ring transfers in issue order, forward then backward.

    Example::

        cap = capture(model, x, segment_lengths=[64, 256], dilation_rates=[1, 4])
        print(cap.report)
        print(cap.diff().text)
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

    Resets dynamo's caches (``torch._dynamo.reset()``, so every call compiles afresh), compiles
    ``model`` with a backend that copies each graph before the passes and keeps it after them,
    runs it once and returns everything in a ``Capture``. The rewritten graph runs eagerly
    (``compiler="eager"``) unless another compiler is named; ``aot=True`` lowers through
    ``aot_eager`` instead and keeps its forward / backward graphs (which then run as they are).
    The model itself is not modified. For keyword arguments of the model pass
    ``functools.partial(model, **kwargs)``.

    Args:
        model (Callable): an ``nn.Module`` or a function (positional only).
        *args: its positional arguments.
        aot (bool): lower through ``aot_eager`` and keep the AOT graphs. Default: ``False``.
        backward (bool): also run backward on the sum of the outputs that require grad, so the
            rewritten backward runs (and with ``aot=True`` its graph is kept). Default: ``False``.
        fullgraph (bool): as ``torch.compile``'s. Default: ``False``.
        dynamic (bool, optional): as ``torch.compile``'s. Default: ``None``.
        **config: ``RingDilatedConfig`` fields; ``compiler`` defaults to ``"eager"``.

    Returns:
        Capture: the graphs, records and output of the run.

    Raises:
        ValueError: ``backward=True`` but no output requires grad, or a bad config field.
        TypeError: a config field that does not exist.
        torch._dynamo.exc.BackendCompilerFailed: the rewrite raised while compiling.

    Example::

        cap = capture(model, x, segment_lengths=[64, 256], dilation_rates=[1, 4], backward=True)
        assert cap.diff().removed_by_op == {"scaled_dot_product_attention": 2}
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
    """``capture`` once per rank ``0 .. world-1`` of a fake process group.

    For each rank, initialises torch's ``"fake"`` process group (no communication: transfers
    do nothing) as that rank of ``world``, runs ``capture`` and destroys the group again. Every
    rank compiles the rewrite a real ``torchrun`` rank would, which is what
    ``assert_same_p2p_schedule`` compares.

    Args:
        model (Callable): an ``nn.Module`` or a function.
        inputs (Sequence or Callable[[int], Sequence]): the model's arguments on every rank, or
            a function of the rank that returns them (in ``sharding="sharded"`` mode: the
            rank's shard).
        world (int): the number of ranks. Default: 4.
        aot (bool): as ``capture``'s. Default: ``True``.
        backward (bool): as ``capture``'s. Default: ``True``.
        **config: ``RingDilatedConfig`` fields (without ``group``: the fake WORLD is used).

    Returns:
        list[Capture]: one capture per rank, rank 0 first.

    Raises:
        RuntimeError: a process group is already initialised.

    Example::

        caps = capture_ranks(model, lambda rank: (shards[rank],), world=4,
                             sharding="sharded", segment_lengths=[64, 256], dilation_rates=[1, 4])
        print([len(c.schedule()) for c in caps])
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

