"""The ring's graphs on every rank, compiled one rank at a time with the fake process group.

What must hold for the ring not to hang or silently mis-pair messages (FINDINGS.md): every rank
issues the same transfers in the same order, forward and backward, even where its causal blocks
skip compute (no transfer is dead-code eliminated on one rank only), and each transfer is issued
before the compute it overlaps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.testing._internal.distributed.fake_pg import FakeStore

from ring_rewrite import RingDilatedConfig
from ring_rewrite.backend import RingDilatedBackend

WORLD = 4
SEND_RECV = torch.ops.ring_rewrite.ring_send_recv.default


def _compile_on_rank(rank: int, config: RingDilatedConfig, is_causal: bool, n_local: int = 16):
    """Dynamo subgraphs and AOT forward/backward graphs of one site, as compiled on ``rank``."""
    graphs: dict = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        torch._dynamo.reset()
        backend = RingDilatedBackend(config, inner=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")))
        n = n_local if config.sharding == "sharded" else n_local * WORLD
        q, k, v = (torch.randn(1, 4, n, 8, requires_grad=True) for _ in range(3))

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

        def capture_dynamo(gm, example_inputs):
            graphs["dynamo"] = gm
            return backend(gm, example_inputs)

        out = torch.compile(attend, backend=capture_dynamo, fullgraph=True)(q, k, v)
        out.sum().backward()
        (record,) = backend.records
        graphs["plan"] = record.plan
    finally:
        dist.destroy_process_group()
    return graphs


def _transfers(gm) -> list[tuple[int, tuple[tuple[int, ...], ...]]]:
    """``(tag, shapes sent)`` of every ring transfer of an AOT graph, in graph order."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and SEND_RECV in node.args:
            sent = node.args[node.args.index(SEND_RECV) + 1]
            found.append((node.args[-1], tuple(tuple(x.meta["val"].shape) for x in sent)))
    return found


def _branch_of(tag: int) -> int:
    return tag // 4096 % 64


CASES = {
    "contiguous-causal": RingDilatedConfig(
        segment_lengths=[8, 32, 64], dilation_rates=[1, 2, 4], sharding="sharded"
    ),
    "zigzag-causal": RingDilatedConfig(
        segment_lengths=[16, 64], dilation_rates=[1, 2], sharding="sharded", layout="zigzag"
    ),
    "zigzag-replicated": RingDilatedConfig(layout="zigzag"),
}


@pytest.fixture(scope="module", params=list(CASES))
def per_rank(request):
    config = CASES[request.param]
    return [_compile_on_rank(rank, config, is_causal=True) for rank in range(WORLD)]


def test_same_transfers_in_the_same_order_on_every_rank(per_rank):
    for graph in ("fw", "bw"):
        sequences = [_transfers(g[graph]) for g in per_rank]
        assert all(seq == sequences[0] for seq in sequences), graph
        tags = [tag for tag, _ in sequences[0]]
        assert len(set(tags)) == len(tags)  # one tag per transfer


def test_transfer_counts_follow_the_plan(per_rank):
    for g in per_rank:
        plan = g["plan"]
        fw, bw = _transfers(g["fw"]), _transfers(g["bw"])
        for i, branch in enumerate(plan.branches):
            size = len(branch.ring)
            assert sum(_branch_of(t) == i for t, _ in fw) == size - 1
            # K/V go round again (size - 1 hops); dK/dV make one more hop, home. Local: none.
            expected = 0 if branch.is_local else (size - 1) + size
            assert sum(_branch_of(t) == i for t, _ in bw) == expected


def test_only_dilated_rows_travel(per_rank):
    """A branch of rate r sends (m = part / r) rows per kv head: 1/r of the undilated ring."""
    plan = per_rank[0]["plan"]
    for tag, shape in _transfers(per_rank[0]["fw"]):
        layout = plan.branches[_branch_of(tag)].layout
        rows = (layout.batch * layout.nseg, layout.kv_heads, layout.m)
        assert shape == ((*rows, plan.d), (*rows, plan.dv))


def test_each_transfer_is_issued_before_the_compute_it_overlaps(per_rank):
    for g in per_rank:
        gm = g["dynamo"]
        fwd = gm.ring_rewrite_fwd_0
        order = {}
        for index, node in enumerate(fwd.graph.nodes):
            tag = node.meta.get("ring_rewrite", {})
            if tag.get("step") is not None:
                order.setdefault((tag["branch"], tag["step"], tag["role"]), index)
        for (branch, step, role), index in order.items():
            if role == "attention" and (branch, step, "p2p") in order:
                assert order[(branch, step, "p2p")] < index
