"""Rings on process groups other than WORLD: one dimension of a ``(dp, cp)`` DeviceMesh, and
groups of non-adjacent ranks (Note [Group ranks] in ring_rewrite/comm/groups.py).

On 4 gloo ranks, every ``cp`` group holds its own sequence, as a data-parallel replica would; its
outputs and gradients must equal the float64 reference on that sequence. On a fake process group,
every message goes to the global rank of the group rank its graph names, and the report says so.
"""

from __future__ import annotations

import pytest
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

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    out = torch.compile(attend, backend=backend, fullgraph=True)(*inputs)
    got = [out, *torch.autograd.grad(out, inputs, dout)]
    errors = [rel_err(a, b) for a, b in zip(got, expected)]
    assert max(errors) < 1e-5, (dist.get_rank(), replica, sharding, layout, errors)
    (record,) = backend.records
    assert not all(b.is_local for b in record.plan.branches)
    return record.plan


def _tags_stay_in_their_group(rank, apart):
    """Rank r and r + 2 share WORLD and ``apart``: a message in each, under one tag, received in
    the other order, still lands in its own group (Note [Group ranks])."""
    peer = (rank + 2) % 4
    got = [torch.empty(2), torch.empty(2)]
    works = [
        dist.isend(torch.full((2,), float(rank)), peer, tag=3),
        dist.isend(torch.full((2,), rank + 10.0), peer, group=apart, tag=3),
        dist.irecv(got[1], peer, group=apart, tag=3),
        dist.irecv(got[0], peer, tag=3),
    ]
    for work in works:
        work.wait()
    assert [x.tolist() for x in got] == [[peer] * 2, [peer + 10] * 2]


def _recovery_in_the_group(rank, apart):
    """A transfer that only one rank of ``apart`` started is completed by the next header, by
    group ranks (Note [Calls, deadlines and recovery])."""
    from torch._dynamo.utils import counters

    from ring_rewrite.comm.calls import site_token
    from ring_rewrite.comm.waiter import _PENDING

    ops, name = torch.ops.ring_rewrite, apart.group_name
    me = dist.get_rank(apart)
    x = torch.full((4,), float(rank))
    token = site_token(0, name, 0, 20_000)
    if me == 1:
        ops.ring_shift_start([x], token, name, 0, 0, 7)  # its peer never starts; nobody waits
    token = ops.ring_shift_start([x], site_token(0, name, 0, 20_000), name, 1 - me, 1 - me, 7)
    (got, _) = ops.ring_shift_wait([x], token, 7, [])
    assert got.tolist() == [float((rank + 2) % 4)] * 4
    assert not _PENDING and counters["ring_rewrite"]["recovered_transfers"] == me


def _errors_name_global_ranks(rank, apart):
    from ring_rewrite.comm.calls import site_token

    name, me = apart.group_name, dist.get_rank(apart)
    token = site_token(1, name, 0, 20_000)
    same = torch.full((1,), float(me))  # replicated mode's check: the ranks hold other sequences
    first, second = rank % 2, rank % 2 + 2
    with pytest.raises(RuntimeError, match=rf"rank\(s\) \[{second}\] differ from rank {first}'s"):
        torch.ops.ring_rewrite.all_gather_seq(torch.zeros(2), token, name, 2, 0, same)


def _groups(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    # Every rank makes every group (torch requires it), then runs the cases of its own.
    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    line = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "cp"))
    apart = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    _tags_stay_in_their_group(rank, apart)
    _recovery_in_the_group(rank, apart)
    _errors_name_global_ranks(rank, apart)
    # The case: each dp replica's ring in its own cp group.
    _check(square["cp"], rank // 2, "sharded", "zigzag", True, [8, 32], [1, 2])
    _check(apart, rank % 2, "replicated", "contiguous", False, [8, 32], [1, 2])
    plan = _check(line["cp"], 0, "sharded", "contiguous", True, [16, 32], [1, 2])
    assert [len(b.ring) for b in plan.branches] == [2, 4]  # a sub-ring and the full ring


def test_rings_on_mesh_dimensions_and_sub_groups():
    run_ranks(4, _groups)


def _capture_on_fake_rank(rank, world, make_group, n):
    """``capture`` of a sharded causal site on ``rank`` of a fake process group of ``world``, its
    ring in ``make_group()``; with the global peers of every ``P2POp`` the ring built."""
    from unittest import mock

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ring_rewrite.testing import capture

    built = []
    batch = dist.batch_isend_irecv

    def record(ops):
        built.extend(("send" if op.op is dist.isend else "recv", op.peer) for op in ops)
        return batch(ops)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        group = make_group()
        q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for _ in range(3))
        with mock.patch.object(dist, "batch_isend_irecv", record):
            cap = capture(
                attend, q, k, v, aot=True, backward=True, group=group, sharding="sharded",
                segment_lengths=[n * 2, n * 4], dilation_rates=[1, 2],
            )  # fmt: skip
    finally:
        dist.destroy_process_group()
    return cap, built


def _mesh_cp():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "cp"))["cp"]


def _odd_ranks():
    return [dist.new_group([0, 2]), dist.new_group([1, 3])][1]


# (world, group, rank, the group's global ranks, global ranks sent to / received from, the
# report's rank and rings): shards of 8 tokens, branches (16, 1) and (32, 2).
FAKE = {
    "mesh-2x4-rank5": (8, _mesh_cp, 5, [4, 5, 6, 7], {4, 6}, {4}, "5 (4-7)", "(16,1) ring 4-5 (32,2) ring 4-7"),
    "mesh-2x4-rank6": (8, _mesh_cp, 6, [4, 5, 6, 7], {7}, {5, 7}, "6 (4-7)", "(16,1) ring 6-7 (32,2) ring 4-7"),
    "new_group-1,3": (4, _odd_ranks, 3, [1, 3], {1}, {1}, "3 (1,3)", "(16,1) ring 1,3 (32,2) ring 1,3"),
}


@pytest.mark.parametrize("case", list(FAKE))
def test_transfers_go_to_the_global_ranks_of_the_group(case):
    world, make_group, rank, ranks, send_to, recv_from, where, rings = FAKE[case]
    cap, built = _capture_on_fake_rank(rank, world, make_group, 8)
    # The graphs name group ranks; each message goes to (comes from) that rank's global rank.
    ring = [t for t in cap.schedule() if t.kind == "send_recv"]
    assert ring and all(t.send_to < len(ranks) and t.recv_from < len(ranks) for t in ring)
    expected = [
        (way, ranks[peer])
        for t in ring
        for way, peer in (("send", t.send_to), ("recv", t.recv_from))
        for _ in t.shapes
    ]
    assert built == expected
    assert {p for way, p in built if way == "send"} == send_to
    assert {p for way, p in built if way == "recv"} == recv_from
    # The report names global ranks: this process, its group, each branch's ring.
    (row,) = cap.report.rows()
    assert (row["rank (group)"], row["branches (w, r)"]) == (where, rings)
