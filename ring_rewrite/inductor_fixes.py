"""Corrections to inductor that the code the rewrite emits needs.

Note [Inductor's loop split]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Inductor's C++ scheduler rewrites a pointwise kernel whose index reads ``x // c`` (``c`` an
integer over 8, ``x`` one of its loop variables) by splitting the loop over ``x`` into ``x = c *
y + z`` with ``y < size // c`` and ``z < c`` (``CppScheduling.try_loop_split``). In torch 2.13 it
does so whatever the loop's size: where ``c`` does not divide it, the last ``size % c`` entries
are never written, and the kernel's output keeps whatever memory it got. ``arange(59) // 14``
compiles to 56 values and 3 stale ones. Our rewrite computes the ids of chunked and block-causal
masks that way (``passes/masks.py``: ``t // C`` over the keys), so such a site was silently
wrong under inductor, differently at each compile, and so is the same expression in any graph.

``install()`` wraps ``try_loop_split`` so that it leaves the kernel as it is (the split is an
optional optimisation) unless every such division divides its loop's size, a size that is
provably a multiple of ``c`` when it is a symbol. The wrapper changes what inductor generates,
so ``cache_key()``'s pass keys inductor's FX graph cache to this file: code compiled without it
is never reused. ``tests/test_masks.py`` compiles the ids, alone and in a site, several times.

Note [Donated buffers in subgraphs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A backward graph may write into the buffers of the tensors it was handed that nothing else holds
(AOT autograd's donated buffers: saved intermediates, listed by their place among the backward's
inputs). In torch 2.13 an ``invoke_subgraph`` body's lowering (``SubgraphLowering``) reads the
same list for its own inputs, by their place among the body's arguments: so a body argument whose
place matches that of a donated input of the backward is taken as donated, whatever it is. The
site's backward body (Note [One body per plan]) takes the saved ``q, k, v``, which are the user's
tensors: where a rank reads nothing of one (in replicated mode a rank whose rows are all padding
reads no row of ``v``), inductor wrote its own buffers into it, and the user's ``v`` came back
zeroed (campaign seed 81902). ``install()`` gives a subgraph's lowering no donated inputs: it
then writes into no argument (a body's scratch is its own), as a top-level graph does with the
inputs it was not given to own. ``tests/test_fuzz.py`` keeps the seed.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["cache_key", "install"]


def _divides(nodes: list[Any]) -> bool:
    """Whether every ``x // c`` (``c`` an integer, ``x`` a loop variable) in the indices of
    ``nodes`` has ``c`` dividing the size of ``x``'s loop."""
    import sympy
    from torch._inductor import ir
    from torch.utils._sympy.functions import FloorDiv

    for node in nodes:
        if not isinstance(getattr(node, "node", None), ir.ComputedBuffer):
            return False
        _, body, _ = node.node.get_default_sizes_body()
        ranges = body.var_ranges
        for expr in body.indexing_exprs.values():
            if not isinstance(expr, sympy.Expr):
                continue
            for div in expr.find(FloorDiv):
                x, c = div.args
                if x in ranges and isinstance(c, sympy.Integer) and sympy.Mod(ranges[x], c) != 0:
                    return False
    return True


@functools.cache
def install() -> None:
    """Make inductor's loop split leave a kernel alone where it would drop the loop's tail
    (Note [Inductor's loop split]), and a subgraph's lowering write into none of its arguments
    (Note [Donated buffers in subgraphs]). Idempotent."""
    from torch._inductor.codegen.cpp import CppScheduling

    split = CppScheduling.try_loop_split

    @functools.wraps(split)
    def try_loop_split(self, nodes):
        return split(self, nodes) if _divides(nodes) else nodes

    CppScheduling.try_loop_split = try_loop_split

    from torch._inductor.graph import SubgraphLowering

    init = SubgraphLowering.__init__

    @functools.wraps(init)
    def subgraph_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.bw_donated_idxs = None  # its inputs are its caller's (Note [Donated buffers in subgraphs])

    SubgraphLowering.__init__ = subgraph_init


@functools.cache
def cache_key() -> Any:
    """A post-grad pass that changes nothing, whose uuid keys inductor's FX graph cache to this
    file (Notes [Inductor's loop split], [Donated buffers in subgraphs]) and to the schemas of
    our custom ops: compiled code calls them with every argument of the schema it was compiled
    against, so code cached before a schema changed would call the op with arguments it no
    longer has."""
    import hashlib

    import torch
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class _Key(CustomGraphPass):
        def __call__(self, graph) -> None:
            pass

        def uuid(self) -> bytes:
            schemas = sorted(str(s) for s in torch._C._jit_get_all_schemas() if s.name.startswith("ring_rewrite::"))
            return get_hash_for_files((__file__,)) + hashlib.sha256("\n".join(schemas).encode()).digest()

    return _Key()
