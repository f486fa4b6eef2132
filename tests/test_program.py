"""A site's program (Note [The site program]) lists exactly what
the traced bodies do: every transfer in order with its tag, shapes, dtypes and peers, and every
block call in order, on every rank; and the ranks' programs agree without compiling anything."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ring_rewrite import site_plan, testing
from ring_rewrite.comm.tags import DKV, KV, KV_BACK
from ring_rewrite.program import Block, Start, Wait, build
from ring_rewrite.site_plan import SitePlan
from ring_rewrite.testing import capture_ranks, site_body

WINDOW = 6


def _windowed(q, k, v):
    """transformers' sliding window: read as ``is_causal`` and a band (Note [Bands])."""
    i = torch.arange(q.shape[2])
    keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - WINDOW)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


# (function, heads q/kv, tokens per rank, world, config): ring branches in head chunks (their K/V
# messages at least 1 byte), local branches in place, gathered or in head chunks, blocks full,
# partial and skipped.
CASES = {
    "zigzag-gqa-sharded": (_causal, (4, 2), 16, 4, dict(
        segment_lengths=[8, 32, 64], dilation_rates=[1, 2, 4], sharding="sharded", layout="zigzag")),
    "window-replicated": (_windowed, (2, 2), 32, 2, dict(segment_lengths=[16, 64], dilation_rates=[1, 2])),
    "window-zigzag-replicated": (_windowed, (2, 2), 32, 4, dict(layout="zigzag")),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CASES))
def captured(request):
    """Every rank's AOT graphs and site bodies, with every head its own chunk, ring and local."""
    attend, (hq, hkv), n, world, config = CASES[request.param]
    sharded = config.get("sharding") == "sharded"

    def inputs(rank):
        tokens = n if sharded else n * world
        q = torch.randn(1, hq, tokens, 8, requires_grad=True)
        return [q, *(torch.randn(1, hkv, tokens, 8, requires_grad=True) for _ in range(2))]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(site_plan, "RING_CHUNK_BYTES", 1)
        patch.setattr(site_plan, "LOCAL_CHUNK_BYTES", 1)
        return capture_ranks(attend, inputs, world=world, fullgraph=True, **config)


def test_the_program_lists_every_transfer_the_graphs_issue_in_order(captured):
    kinds = set()
    for cap in captured:
        (record,) = cap.records
        plan = record.plan
        for graph, program in (("forward", build(plan, "forward")), ("backward", build(plan, "backward"))):
            issued = [t for t in cap.schedule() if t.graph == graph]
            assert testing.planned_transfers(plan, graph) == issued, f"rank {plan.rank} {graph}:\n{program}"
            kinds |= {t.tag.kind for t in program.transfers() if isinstance(t, Start)}
            # Every transfer started is waited for once, after it started.
            started = {s.tag: k for k, s in enumerate(program.steps) if isinstance(s, Start)}
            waited = {s.tag: k for k, s in enumerate(program.steps) if isinstance(s, Wait)}
            assert len(waited) == sum(isinstance(s, Wait) for s in program.steps)
            assert waited.keys() == started.keys() and all(waited[t] > started[t] for t in started)
    assert kinds == {KV, KV_BACK, DKV} or not any(len(b.ring) > 1 for b in plan.branches)


_BLOCKS = {
    torch.ops.ring_rewrite.block_attention,
    torch.ops.ring_rewrite.block_attention_backward,
    torch.ops.ring_rewrite.dilated_block_attention,
    torch.ops.ring_rewrite.dilated_block_backward,
}


def _block_calls(body) -> list[tuple[int, int | None]]:
    """``(branch, ring step)`` of every block call of a site body, in order."""
    calls = []
    for node in body.graph.nodes:
        if getattr(node.target, "overloadpacket", node.target) in _BLOCKS:
            meta = node.meta["ring_rewrite"]
            calls.append((meta["branch"], meta.get("step")))
    return calls


def test_the_program_lists_every_block_the_bodies_call_in_order(captured):
    kinds = set()
    for cap in captured:
        (record,) = cap.records
        plan = record.plan
        (gm,) = cap.after
        for which, program in (("fwd", build(plan, "forward")), ("bwd", build(plan, "backward"))):
            planned = [(b.branch, b.step) for b in program.blocks() if b.kind != "skip"]
            assert planned == _block_calls(site_body(gm, 0, which)), f"rank {plan.rank}:\n{program}"
            kinds |= {b.kind for b in program.blocks()}
    if plan.band is not None:  # at P = 4 a rank also holds keys the window never reaches
        assert "partial" in kinds and ("skip" in kinds) == (plan.world == 4)


def _plans(world: int, **site) -> list[SitePlan]:
    return [SitePlan.build(world=world, rank=rank, **site) for rank in range(world)]


SITE = dict(
    batch=1, hq=8, hkv=2, n=1 << 12, d=16, dv=16, dtype=torch.bfloat16, scale=0.25, is_causal=True,
    has_mask=False, branches=((64, 1), (512, 2), (4096, 4)), sharding="sharded", layout="zigzag",
)  # fmt: skip


@pytest.mark.parametrize("world", [2, 4, 8, 64])
def test_every_ranks_program_issues_the_same_transfers_and_they_pair_up(world):
    # What assert_same_p2p_schedule checks of compiled graphs, from the plans alone, at any size.
    plans = _plans(world, **{**SITE, "n": max(SITE["n"], world * 128)}, band=(-300, None))
    assert testing.assert_same_p2p_schedule(plans) == plans
    assert all(testing.planned_transfers(p, "backward") for p in plans)


def test_a_changed_program_is_a_different_schedule():
    plans = _plans(4, **SITE)
    # Rank 1 with wider values: the same transfers, of other shapes.
    plans[1] = SitePlan.build(world=4, rank=1, **{**SITE, "dv": 32})
    with pytest.raises(AssertionError, match="rank 1 differs from rank 0 at transfer #0"):
        testing.assert_same_p2p_schedule(plans)
    # Rank 1 as rank 2 of the ring: it sends where rank 2 does, which nobody receives.
    plans[1] = SitePlan.build(world=4, rank=2, **SITE)
    plans[1] = dataclasses.replace(plans[1], rank=1)
    with pytest.raises(AssertionError, match="receives from"):
        testing.assert_same_p2p_schedule(plans)


def test_a_band_skips_blocks_the_window_never_reaches_and_the_report_counts_none_of_them():
    from ring_rewrite.report import attention_flops

    whole = SitePlan.build(world=4, rank=3, **SITE)
    window = SitePlan.build(world=4, rank=3, **SITE, band=(-300, None))
    blocks = build(window, "forward").blocks()
    assert [b.parts for b in blocks] == [b.parts for b in build(whole, "forward").blocks()]
    skipped = [b for b in blocks if b.kind == "skip"]
    partial = [b for b in blocks if b.kind == "partial"]
    assert skipped and partial and all(b.band == (-300, None) for b in partial)
    # A skipped block's keys all lie more than the window before its queries.
    for b in skipped:
        last_key = max(b.k_starts) + (b.keys // len(b.k_starts) - 1) * b.stride
        assert last_key - min(b.q_starts) < -300
    assert attention_flops(window) < attention_flops(whole)
    assert sum(2 * b.batch * b.heads * b.pairs * 32 for b in blocks) == attention_flops(window)


def test_a_program_prints_one_line_a_step():
    plan = SitePlan.build(world=4, rank=2, **SITE, band=(-300, None))
    for program in (build(plan, "forward"), build(plan, "backward")):
        lines = str(program).splitlines()
        assert lines[0] == f"site 0 {program.graph}, rank 2 of 4 (sharded, zigzag)"
        assert len(lines) == len(program.steps) + 1
    text = str(build(plan, "forward"))
    assert "start     b2 s0 c0  K/V  k 1x8x256x16 bf16,v 1x8x256x16 bf16 to 3 from 1" in text
    assert "skip" in text and "partial band -300,open" in text
    assert isinstance(build(plan, "forward").block(2, 0, 1, 0), Block)


def test_the_program_in_the_architecture_doc_is_what_prints():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    shown = doc.split("## A site's program", 1)[1].split("```\n", 2)[1]
    plan = SitePlan.build(
        batch=1, hq=2, hkv=2, n=64, d=8, dv=8, dtype=torch.float32, scale=0.35, is_causal=True, has_mask=False,
        branches=((16, 1), (64, 2)), world=2, rank=0, layout="zigzag", sharding="sharded", band=(-7, None),
    )  # fmt: skip
    assert shown == f"{build(plan, 'forward')}\n{build(plan, 'backward')}\n"


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("band", [None, (-300, None), (-100, 100)], ids=["whole", "window", "two-sided"])
def test_a_folded_program_counts_what_the_program_does(layout, band):
    # The report counts folded programs (each ring's transfers once, equal blocks once, with how
    # many times they run): the same FLOPs, bytes and largest message as the steps one by one.
    for sharding in ("sharded", "replicated"):
        site = {**SITE, "layout": layout, "sharding": sharding, "band": band, "is_causal": band is None or band[1] is None}
        for plan in _plans(4, **site):
            for graph in ("forward", "backward"):
                full, folded = build(plan, graph), build(plan, graph, folded=True)
                assert len(folded.steps) < len(full.steps)
                for branch in (None, *range(len(plan.branches))):
                    counts = [(p.flops(branch), p.bytes_sent(branch), p.largest_message(branch)) for p in (full, folded)]
                    assert counts[0] == counts[1], (graph, branch, counts)
                assert full.flops() > 0 and full.bytes_sent() > 0
