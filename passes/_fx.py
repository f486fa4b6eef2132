"""Small FX helpers shared by the passes: emit Python code as graph nodes, stamped with roles."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor

from ring_rewrite.roles import current

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_LOCAL = re.compile(r"^[LG]\['[^']*'\](\[\d+\])?\.?")  # the compiled module: L['self'], L['args'][0], G['model']


class RoleTracer(fx.proxy.GraphAppendingTracer):
    """Appends to ``graph``; every node gets ``meta["ring_rewrite"]`` and the site's stack trace."""

    def __init__(
        self, graph: fx.Graph, site: int, stack_trace: str | None, module_stack: Any = None
    ) -> None:
        super().__init__(graph)
        self.site = site
        self.stack_trace = stack_trace
        self.module_stack = module_stack

    def create_node(self, kind, target, args, kwargs, *rest: Any, **more: Any) -> fx.Node:
        # A symbol of the graph's shapes read from a shape (a mask's batch under dynamic
        # shapes, say) goes in as the graph's own node of it, not as a value FX would bake in.
        args, kwargs = fx.node.map_aggregate((args, kwargs), self._symbol)
        node = super().create_node(kind, target, args, kwargs, *rest, **more)
        stamp(node, self.site, self.stack_trace)
        if self.module_stack is not None:
            node.meta["nn_module_stack"] = self.module_stack
        return node


    def _symbol(self, x: Any) -> Any:
        if not isinstance(x, torch.SymInt) or x.node.is_constant():
            return x
        if not hasattr(self, "_symbols"):
            self._symbols = {
                str(v.node.expr): n
                for n in self.graph.find_nodes(op="placeholder")
                if isinstance(v := n.meta.get("example_value"), torch.SymInt)
            }
        return self._symbols.get(str(x.node.expr), x)


def stamp(node: fx.Node, site: int, stack_trace: str | None, **info: Any) -> None:
    node.meta["ring_rewrite"] = {"site": site, **current(), **info}
    if stack_trace is not None:
        node.meta["stack_trace"] = stack_trace


def emit(tracer: RoleTracer, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` on proxies of ``args`` (nodes or constants); returns nodes in place of proxies."""
    wrap = lambda a: fx.Proxy(a, tracer) if isinstance(a, fx.Node) else a  # noqa: E731
    out = fn(*[wrap(a) for a in args])
    return fx.node.map_aggregate(out, lambda x: x.node if isinstance(x, fx.Proxy) else x)


def trace_subgraph(
    fn: Callable[..., Any], names: Sequence[str], site: int, stack_trace: str | None
) -> fx.GraphModule:
    """A standalone GraphModule of ``fn(*placeholders)``."""
    graph = fx.Graph()
    tracer = RoleTracer(graph, site, stack_trace)
    inputs = [graph.placeholder(name) for name in names]
    for node in inputs:
        stamp(node, site, stack_trace, role="input")
    out = emit(tracer, fn, *inputs)
    graph.output(out)
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph)


def location(node: fx.Node) -> str:
    """Where ``node`` came from: the module path of the layer that made it (dynamo's
    ``nn_module_stack``, the root left out) and ``file:line`` of the user's code (the last frame of
    its stack trace), as ``layers.3.self_attn (model.py:12)``; either alone where the other is
    unknown; ``?`` where both are."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    line = ""
    if frames:
        path, number = frames[-1]
        line = f"{path.replace(chr(92), '/').rsplit('/', 1)[-1]}:{number}"
    # NOTE: dynamo keeps no user frame for code inside a compiled nn.Module's own library
    # modules (nn.TransformerEncoder, say): the module path names the site there.
    modules = node.meta.get("nn_module_stack") or {}
    module = _LOCAL.sub("", list(modules.values())[-1][0]) if modules else ""
    if module and line:
        return f"{module} ({line})"
    return module or line or "?"


def erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` if nothing reads it, then its inputs that nothing reads any more, and so
    on (pure nodes only: never a placeholder or an op with side effects)."""
    stack, erased = [node], set()
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op not in ("call_function", "call_method") or n.is_impure():
            continue
        stack.extend(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)


def propagate_example_values(nodes: list[fx.Node]) -> None:
    """Give each new node the ``example_value`` dynamo would have (the passes read them), in
    the fake mode of its inputs' values."""
    inputs = (arg.meta.get("example_value") for node in nodes for arg in node.all_input_nodes)
    fake_mode = next((v.fake_mode for v in inputs if isinstance(v, FakeTensor)), None)
    # NOTE: the Python dispatcher, as dynamo has it, runs ops on symbolic shapes.
    with fake_mode if fake_mode is not None else contextlib.nullcontext(), enable_python_dispatcher():
        for node in nodes:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["example_value"])
            if node.op == "call_method":
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                value = node.target(*args, **kwargs)
            node.meta["example_value"] = value
