"""``ring_rewrite.plan``: the per-rank needs of a configuration, without running it. Its plans
are the ones the rewrite builds for a real site (checked on a fake process group), and its
totals follow the closed forms of the exact ring."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ring_rewrite
from ring_rewrite.report import attention_flops, attention_memory_bytes, bytes_sent

SEGS, RATES = [16, 64, 256], [1, 2, 4]


@pytest.mark.parametrize("rank", [0, 3])
def test_plan_is_what_the_rewrite_builds(rank):
    """A sharded LongNet site on rank ``rank`` of 4 (fake process group): the rewrite's plan and
    ``plan()``'s plan for that rank count the same FLOPs, bytes and memory."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ring_rewrite.testing import capture

    n, world = 256, 4
    q = torch.randn(2, 4, n // world, 8)
    k = v = torch.randn(2, 2, n // world, 8)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        cap = capture(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            q, k, v, sharding="sharded", layout="zigzag", segment_lengths=SEGS, dilation_rates=RATES,
        )  # fmt: skip
    finally:
        dist.destroy_process_group()
    built = cap.records[0].plan
    planned = ring_rewrite.plan(
        n, world, heads=4, kv_heads=2, head_dim=8, batch=2, dtype=torch.float32, device="cpu",
        segment_lengths=SEGS, dilation_rates=RATES,
    ).plans[rank]  # fmt: skip
    assert [(b.w, b.r, b.ring, b.steps) for b in planned.branches] == [
        (b.w, b.r, b.ring, b.steps) for b in built.branches
    ]
    for count in (attention_flops, bytes_sent, attention_memory_bytes):
        assert count(planned) == count(built), count.__name__


@pytest.mark.parametrize("world", [2, 8, 64])
def test_exact_ring_closed_forms(world):
    """Exact causal attention, zigzag: every rank computes 1/P of the causal pairs and sends
    its K/V P - 1 times forward; backward sends K/V again and dK/dV (float32)."""
    n, b, hq, hkv, d = 4096, 2, 8, 2, 16
    p = ring_rewrite.plan(n, world, heads=hq, kv_heads=hkv, head_dim=d, batch=b, dtype=torch.bfloat16)
    totals = p.totals
    pairs = n * (n + 1) // 2
    assert totals["forward flops"] == 2 * b * hq * pairs * 2 * d // world
    kv = b * (n // world) * hkv * 2 * d
    assert totals["sent forward"] == (world - 1) * kv * 2
    assert totals["sent backward"] == (world - 1) * kv * (2 + 4)
    assert totals["q, k, v"] == b * (n // world) * (hq + 2 * hkv) * d * 2
    (row,) = p.branch_rows
    assert row["where"] == f"ring of {world}" and row["message"] == kv * 4 // row["head chunks"]


def test_a_billion_tokens_over_512_ranks():
    """docs/scale.md's table: it builds without memory or a process group, every rank's share is
    1/512, and branches longer than a rank's shard are rings."""
    segs = [2048 * 4**i for i in range(6)] + [2**30]
    rates = [2**i for i in range(7)]
    p = ring_rewrite.plan(2**30, 512, heads=16, kv_heads=4, head_dim=64, segment_lengths=segs, dilation_rates=rates)
    assert p.site.n_local == 2**21
    where = [r["where"] for r in p.branch_rows]
    assert where[:5] == ["local"] * 5 and where[5].startswith("ring of") and where[6] == "ring of 512"
    text = str(p)
    assert "1,073,741,824 tokens over 512 ranks" in text and "largest message" in text


def test_a_config_the_shards_cannot_carry_raises():
    with pytest.raises(ValueError, match="not a multiple of the dilation rate"):
        ring_rewrite.plan(4096, 64, heads=4, head_dim=16, segment_lengths=[16, 4096], dilation_rates=[1, 64])


def test_memory_of_branches_summed_in_place():
    """Two local branches at P = 1 (Note [Memory of a site]). In float64 (aten's kernel) each
    branch's gradients are added to the site's sums once computed, so the backward peak is the
    saved out and lse, the sums (dq, dk, dv) and the second branch running: at rate 2 its dilated
    copies (q, dout, out at half the rows, their lse, and K/V per query head: kv rows as many as
    q rows), its dq, dk, dv, and the largest beside its contiguous copy. In float32 the CPU
    kernel reads every branch's rows in place and adds into the site's dq, dk, dv (Note [Local
    branches in place]): the peak is the saved tensors and those."""
    for dtype, item in ((torch.float32, 4), (torch.float64, 8)):
        site = ring_rewrite.plan(
            64, 1, heads=2, head_dim=8, dtype=dtype, device="cpu", segment_lengths=[16, 64],
            dilation_rates=[1, 2],
        ).site  # fmt: skip
        assert site.local_in_place == (dtype == torch.float32)
        q = 2 * 64 * 8 * item  # bytes of q, and of out, dq, dk, dv
        saved = q + 2 * 64 * item
        half = q // 2  # one q-sized tensor at rate 2
        copies = 3 * half + 2 * 32 * item + 2 * half
        peak = saved + 3 * q + (0 if site.local_in_place else 3 * half + copies + half)
        assert attention_memory_bytes(site) == {"saved": saved, "peak": peak}


def test_memory_of_a_lone_rate_one_branch():
    """Exact attention at P = 1: the branch's gradients are the site's (nothing to sum), so the
    peak is the saved tensors and the kernel's dq, dk, dv; in float64 (aten's kernel) one of
    them beside its contiguous copy (dq, the largest: 2 query heads per kv head)."""
    for dtype, item, copy in ((torch.float32, 4, 0), (torch.float64, 8, 1)):
        site = ring_rewrite.plan(64, 1, heads=4, kv_heads=2, head_dim=8, dtype=dtype, device="cpu").site
        q = 4 * 64 * 8 * item
        saved = q + 4 * 64 * item
        peak = saved + (q + q // 2 + q // 2) + copy * q
        assert attention_memory_bytes(site) == {"saved": saved, "peak": peak}


def test_memory_walks_the_program():
    """The peak is the most held at any step of the site's programs (Note [Memory of a site]).
    Forward, every ring's rows are dilated before the first ring's blocks (their first transfers
    start early), so the second ring's dilated q, k, v are held while the first ring runs; walked
    with that ``Dilate`` moved to just before its own blocks, the forward peak drops by exactly
    those copies (the first ring's blocks are the forward's busiest step)."""
    from ring_rewrite import memory
    from ring_rewrite.program import Block, Dilate, build

    site = ring_rewrite.plan(
        8192, 4, heads=8, head_dim=64, dtype=torch.float32, device="cpu", segment_lengths=[1024, 2048, 4096],
        dilation_rates=[1, 2, 4],
    ).site  # fmt: skip
    rings = [i for i, b in enumerate(site.branches) if not b.is_local]
    assert len(rings) == 2
    steps = memory._inductor_order(site, build(site, "forward", folded=True))
    late = [s for s in steps if not (isinstance(s, Dilate) and s.branch == rings[1])]
    first = next(j for j, s in enumerate(late) if isinstance(s, Block) and s.branch == rings[1])
    late.insert(first, next(s for s in steps if isinstance(s, Dilate) and s.branch == rings[1]))
    early, moved = memory._Forward(site, site.world).walk(steps), memory._Forward(site, site.world).walk(late)
    copies = 2048 // 4 * 8 * (64 + 2 * 64) * 4  # q, k, v of 2,048 rows at rate 4, 8 heads, float32
    assert early - moved == copies
    assert memory.site_memory(site)["peak"] >= early


def test_a_plan_says_what_every_other_comm_would_send():
    """Exact attention over 8 ranks: the all-to-all sends 7/8 of q, k, v and out forward (of dout,
    dq, dk, dv backward), the ring its K/V 7 times forward and K/V with dK/dV backward, the hybrid
    in groups of 4 both: 3/4 of each tensor, and its K/V (as large as the ring's) once round a
    ring of 2; where the heads cannot be split over the ranks the plan says why."""
    n, world, heads, kv, d = 2**14, 8, 16, 8, 64
    p = ring_rewrite.plan(n, world, heads=heads, kv_heads=kv, head_dim=d, dtype=torch.bfloat16)
    others = dict(p.alternatives)
    assert list(others) == ["comm='all_to_all'", "comm='hybrid', a2a_ranks=2", "comm='hybrid', a2a_ranks=4"]
    other, hybrid = others["comm='all_to_all'"], others["comm='hybrid', a2a_ranks=4"]
    assert p.site.comm == "ring" and other.site.comm == "all_to_all" and other.site.exchanged
    shard = n // world * d * 2  # one head's shard, bfloat16
    exchanged = (heads + kv + kv + heads) * shard  # q, k, v and out (dout, dq, dk, dv)
    sent = exchanged * (world - 1) // world + 4 * 8 * (world - 1)  # one 8-byte tag a message
    assert other.totals["sent forward"] == other.totals["sent backward"] == sent
    ring = (world - 1) * 2 * kv * shard
    assert p.totals["sent forward"] == ring and p.totals["sent backward"] == 3 * ring  # dK/dV in float32
    tags = 4 * 8 * 3
    assert hybrid.totals["sent forward"] == exchanged * 3 // 4 + tags + ring // 7
    assert hybrid.totals["sent backward"] == exchanged * 3 // 4 + tags + 3 * ring // 7
    assert "comm='all_to_all' instead: sends" in str(p) and p.least_sent == "comm='all_to_all'"
    assert str(p).endswith("sends least: comm='all_to_all'")
    wide = ring_rewrite.plan(n, 32, heads=heads, kv_heads=kv, head_dim=d)
    refused = dict(wide.alternatives)
    assert "not a multiple of 32" in refused["comm='all_to_all'"]
    assert refused["comm='hybrid', a2a_ranks=16"].site.kv_copies == 2  # 8 kv heads, groups of 16
    assert "a2a_ranks=16 instead: sends" in str(wide) and "kv heads sent in 2 copies (8 do not split over 16 ranks)" in str(wide)
    assert "copies" not in str(p).split("\n")[0]  # the ring sends each kv head once
