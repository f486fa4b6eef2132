"""Inductor's lowering of a ring transfer (Note [Buffers in flight])."""

from __future__ import annotations

import functools

import torch

from .tags import Tag

__all__ = ["inductor_lowering"]


@functools.cache
def inductor_lowering() -> dict:
    """Teach inductor that a transfer reads its sent buffers until its wait (Note [Buffers in
    flight]); returns the config patch our compiles run under. Idempotent.

    ``ring_shift_start`` lowers as the plain fallback kernel it would be, on its inputs made
    contiguous buffers; ``ring_shift_wait`` lowers as one whose ``xs`` are *those very buffers*
    (found by tag in the graph being lowered), whatever its own ``xs`` argument lowered to. So the
    wait reads what the start sent, and the memory planner cannot reuse or overwrite it before.
    And every operation lowered between the two is scheduled after the start.
    """
    import weakref

    from torch._inductor import ir
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
    from torch._inductor.lowering import fallback_handler, register_lowering
    from torch._inductor.virtualized import V

    start_op = torch.ops.ring_rewrite.ring_shift_start.default
    wait_op = torch.ops.ring_rewrite.ring_shift_wait.default
    start_kernel = fallback_handler(start_op, add_to_fallback_set=False)
    wait_kernel = fallback_handler(wait_op, add_to_fallback_set=False)
    in_flight: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {tag: sent}

    @register_lowering(start_op, type_promotion_kind=None)
    def _(xs, token, group_name, send_to, recv_from, tag):
        sent = [ir.ExternKernel.require_contiguous(x) for x in xs]
        started = start_kernel(sent, token, group_name, send_to, recv_from, tag)
        pending = in_flight.setdefault(V.graph, {})
        if tag in pending:  # two sites' transfers interleaved in one graph: not ours to pair
            raise RuntimeError(f"ring_rewrite: transfer {Tag.decode(tag)} (tag {tag}) started twice in one graph")
        pending[tag] = (sent, started.get_name(), len(V.graph.operations))
        return started

    @register_lowering(wait_op, type_promotion_kind=None)
    def _(xs, token, tag, after):
        flight = in_flight.get(V.graph, {}).pop(tag, None)
        if flight is None:
            raise RuntimeError(
                f"ring_rewrite: ring_shift_wait of {Tag.decode(tag)} (tag {tag}) has no start before it"
            )
        sent, started, mark = flight
        # NOTE: what the graph computes between the start and the wait runs after the start:
        # the peak-memory reordering otherwise hoists a step's blocks (which need no token)
        # above the start they should overlap.
        for op in V.graph.operations[mark:]:
            V.graph.additional_buffer_deps[op.operation_name].add(started)
        return wait_kernel(sent, token, tag, after)

    class _Key(CustomGraphPass):
        """Changes nothing. Its uuid keys inductor's FX graph cache to this file, which holds the
        lowering above: code compiled under another lowering of the ring is never reused."""

        def __call__(self, graph) -> None:
            pass

        def uuid(self) -> bytes:
            return get_hash_for_files((__file__,))

    return {"post_grad_custom_post_pass": _Key()}
