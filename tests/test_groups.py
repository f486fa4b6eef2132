"""Rings on process groups other than WORLD: one dimension of a ``(dp, cp)`` DeviceMesh, and
groups of non-adjacent ranks (Note [Group ranks] in ring_rewrite/p2p.py).

Every ``cp`` group holds its own sequence, as a data-parallel replica would; its outputs and
gradients must equal the float64 reference on that sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import rel_err
from ranks import run_ranks


def _check(group, replica, sharding, layout, causal, segments, rates):
    """One case on this rank: ``group`` holds the sequence of data-parallel ``replica``."""
    import ring_rewrite
    from ring_rewrite.reference import reference_attention

    gen = torch.Generator().manual_seed(replica)
    q = torch.randn(1, 4, 32, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, 32, 8, generator=gen, requires_grad=True) for _ in range(2))
    dout = torch.randn(1, 4, 32, 8, generator=gen)
    config = dict(segment_lengths=segments, dilation_rates=rates)
    ref = reference_attention(q, k, v, is_causal=causal, **config)
    expected = [ref, *torch.autograd.grad(ref, (q, k, v), dout.double())]
    inputs = (q, k, v)
    if sharding == "sharded":
        cut = lambda x: ring_rewrite.shard(x.detach(), 2, group=group, layout=layout)  # noqa: E731
        inputs = tuple(cut(x).requires_grad_() for x in inputs)
        expected, dout = [cut(x) for x in expected], cut(dout)
    torch._dynamo.reset()
    backend = ring_rewrite.backend(sharding=sharding, layout=layout, group=group, **config)
    attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)  # noqa: E731
    out = torch.compile(attend, backend=backend, fullgraph=True)(*inputs)
    got = [out, *torch.autograd.grad(out, inputs, dout)]
    errors = [rel_err(a, b) for a, b in zip(got, expected)]
    assert max(errors) < 1e-5, (dist.get_rank(), replica, sharding, layout, errors)
    (record,) = backend.records
    assert not all(b.is_local for b in record.plan.branches)
    return record.plan


def _groups(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    # Every rank makes every group (torch requires it), then runs the cases of its own.
    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    line = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "cp"))
    apart = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    # The case: each dp replica's ring in its own cp group.
    _check(square["cp"], rank // 2, "sharded", "zigzag", True, [8, 32], [1, 2])
    _check(apart, rank % 2, "replicated", "contiguous", False, [8, 32], [1, 2])
    plan = _check(line["cp"], 0, "sharded", "contiguous", True, [16, 32], [1, 2])
    assert [len(b.ring) for b in plan.branches] == [2, 4]  # a sub-ring and the full ring


def test_rings_on_mesh_dimensions_and_sub_groups():
    run_ranks(4, _groups)
