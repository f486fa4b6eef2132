"""The ring's graphs on every rank, compiled one rank at a time with the fake process group.

What must hold for the ring not to hang or silently mis-pair messages: every rank
issues the same transfers in the same order, forward and backward, even where its causal blocks
skip compute (no transfer is dead-code eliminated on one rank only), and each transfer is issued
before the compute it overlaps.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import ring_rewrite
from ring_rewrite import testing
from ring_rewrite.comm import tags
from ring_rewrite.comm.tags import DKV, GATHER, KV, KV_BACK, MAX_BRANCHES, Tag
from ring_rewrite.testing import Capture, Transfer, assert_same_p2p_schedule, capture_ranks, site_body

WORLD = 4


def _branch_of(tag: int) -> int:
    return Tag.decode(tag).branch


@pytest.mark.parametrize("kind", [KV, KV_BACK, DKV, GATHER])
def test_tags_decode_to_what_they_encode(kind):
    tags = [
        Tag(branch, kind, step, chunk)
        for branch in range(MAX_BRANCHES)
        for step in (0, 1, 2, 511, 512, 1023)
        for chunk in (0, 1, 31, 63)
    ]
    encoded = [t.encode() for t in tags]
    assert [Tag.decode(n) for n in encoded] == tags
    assert len(set(encoded)) == len(tags) and all(0 <= n < 2**22 for n in encoded)
    for n in range(kind << 16, (kind + 1) << 16, 97):  # every tag int decodes, and back
        assert Tag.decode(n).encode() == n


@pytest.mark.parametrize(
    "tag, encoded",
    [
        (Tag(0, KV, 0), 0),
        (Tag(0, KV, 3), 3),
        (Tag(2, KV, 3), 524291),
        (Tag(1, DKV, 5, 7), 400389),
        (Tag(0, GATHER, 4), 196612),
        (Tag(15, GATHER, 1023, 63), 2**22 - 1),
    ],
)
def test_tags_encode_as_on_the_wire(tag, encoded):
    # ((branch * 4 + kind) * 64 + chunk) * 1024 + step: the ints graphs and messages carry.
    assert tag.encode() == encoded == ((tag.branch * 4 + tag.kind) * 64 + tag.chunk) * 1024 + tag.step
    assert tags.transfer_tag(tag.branch, tag.kind, tag.step, tag.chunk) == encoded


@pytest.mark.parametrize(
    "fields", [(MAX_BRANCHES, KV, 0), (0, 4, 0), (0, KV, 1024), (0, KV, 0, 64), (-1, KV, 0), (0, KV, -1)]
)
def test_tag_fields_out_of_range_are_errors(fields):
    with pytest.raises(ValueError, match="Tag\\.(branch|kind|step|chunk) must be in"):
        Tag(*fields)


@pytest.mark.parametrize("encoded", [-1, 2**22])
def test_tag_ints_out_of_range_are_errors(encoded):
    with pytest.raises(ValueError, match="a transfer tag is in"):
        Tag.decode(encoded)


def test_errors_name_a_transfer_by_its_tag():
    assert str(Tag(1, DKV, 5, 7)) == "branch 1, step 5, dK/dV, head chunk 7"
    assert str(Tag(0, KV_BACK, 2)) == "branch 0, step 2, K/V (backward), head chunk 0"
    assert str(Tag(0, GATHER, 3)) == "gather at distance 3"
    named = "site 2, branch 1, step 5, dK/dV, head chunk 7 (tag 400389, call 9)"
    assert tags._describe(2, 9, 400389) == named
    assert tags._describe(0, 1, 196611) == "site 0, gather at distance 3 (tag 196611, call 1)"


def _send_recv(capture: Capture, graph: str) -> list[Transfer]:
    """The ring's send/recv transfers of the AOT ``graph`` ("forward" or "backward"), in order."""
    return [t for t in capture.schedule() if t.graph == graph and t.kind == "send_recv"]


CASES = {
    "contiguous-causal": dict(segment_lengths=[8, 32, 64], dilation_rates=[1, 2, 4], sharding="sharded"),
    "zigzag-causal": dict(
        segment_lengths=[16, 64], dilation_rates=[1, 2], sharding="sharded", layout="zigzag"
    ),
    "zigzag-replicated": dict(layout="zigzag"),
}


@pytest.fixture(scope="module", params=list(CASES))
def per_rank(request) -> list[Capture]:
    """Dynamo and AOT forward/backward graphs of one causal site, as compiled on each rank."""
    config = CASES[request.param]
    n = 16 if config.get("sharding") == "sharded" else 16 * WORLD

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def inputs(rank):
        return [torch.randn(1, 4, n, 8, requires_grad=True) for _ in range(3)]

    return capture_ranks(attend, inputs, world=WORLD, fullgraph=True, **config)


def test_same_transfers_in_the_same_order_on_every_rank(per_rank):
    # Forward then backward: same op, tag, shapes and dtypes at every position on every rank,
    # and each send meets a receive from its sender on the peer.
    assert_same_p2p_schedule(per_rank)
    for graph in ("forward", "backward"):
        tags = [t.tag for t in per_rank[0].schedule() if t.graph == graph]
        assert tags and len(set(tags)) == len(tags)  # one tag per transfer


def test_transfer_counts_follow_the_plan(per_rank):
    for c in per_rank:
        (record,) = c.records
        plan = record.plan
        fw, bw = _send_recv(c, "forward"), _send_recv(c, "backward")
        for i, branch in enumerate(plan.branches):
            size, chunks = len(branch.ring), plan.head_chunks(branch)
            assert sum(_branch_of(t.tag) == i for t in fw) == (size - 1) * chunks
            # K/V go round again (size - 1 hops); dK/dV as many, the last one home (the owner's
            # own share never leaves). Local: none.
            expected = 0 if branch.is_local else 2 * (size - 1) * chunks
            assert sum(_branch_of(t.tag) == i for t in bw) == expected


def test_only_dilated_rows_travel(per_rank):
    """A branch of rate r sends (m = part / r) rows of each part per kv head: 1/r of the
    undilated ring (a ring branch holds a rank's parts one after another, Note [Rows of a ring
    branch])."""
    (record,) = per_rank[0].records
    plan = record.plan
    for t in _send_recv(per_rank[0], "forward"):
        layout = plan.branches[_branch_of(t.tag)].layout
        rows = (layout.batch, layout.kv_heads, layout.nseg * layout.m)
        assert t.shapes == ((*rows, plan.d), (*rows, plan.dv))


def test_each_transfer_starts_before_the_compute_it_overlaps_and_ends_after(per_rank):
    start, wait = torch.ops.ring_rewrite.ring_shift_start, torch.ops.ring_rewrite.ring_shift_wait
    for c in per_rank:
        (gm,) = c.after
        fwd = site_body(gm, 0)
        first, last = {}, {}  # (branch, step, what) -> node index
        for index, node in enumerate(fwd.graph.nodes):
            tag = node.meta.get("ring_rewrite", {})
            if tag.get("step") is None:
                continue
            op = getattr(node.target, "overloadpacket", node.target)
            what = "start" if op is start else "wait" if op is wait else tag["role"]
            key = (tag["branch"], tag["step"], what)
            first.setdefault(key, index)
            last[key] = index
        overlapped = 0
        for (branch, step, what), index in first.items():
            if what == "attention" and (branch, step, "start") in first:
                assert first[(branch, step, "start")] < index
                assert last[(branch, step, "attention")] < first[(branch, step, "wait")]
                overlapped += 1
        assert overlapped


def test_each_head_chunks_last_hop_home_overlaps_the_next_chunks_compute(monkeypatch):
    # Note [Head chunks]: with every kv head its own chunk, chunk c's dK/dV travel home while
    # chunk c + 1 computes; only the last chunk's last hop has no compute inside it.
    from ring_rewrite import site_plan

    monkeypatch.setattr(site_plan, "RING_CHUNK_BYTES", 1)
    start, wait = torch.ops.ring_rewrite.ring_shift_start, torch.ops.ring_rewrite.ring_shift_wait
    backward_block = torch.ops.ring_rewrite.block_attention_backward

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def inputs(rank):
        return [torch.randn(1, 4, 16, 8, requires_grad=True) for _ in range(3)]

    for c in capture_ranks(attend, inputs, world=WORLD, sharding="sharded"):
        (gm,) = c.after
        (record,) = c.records
        (branch,) = record.plan.branches
        chunks = record.plan.head_chunks(branch)
        assert chunks == 4
        last = len(branch.ring) - 1
        last_hops = {Tag(0, DKV, last, chunk).encode() for chunk in range(chunks)}
        blocks_since, overlapped = {}, []  # last hop started -> backward blocks since its start
        for node in site_body(gm, 0, "bwd").graph.nodes:
            op = getattr(node.target, "overloadpacket", node.target)
            if op is start and node.args[-1] in last_hops:
                blocks_since[node.args[-1]] = 0
            elif op is backward_block:
                blocks_since = {tag: count + 1 for tag, count in blocks_since.items()}
            elif op is wait and node.args[2] in last_hops:
                overlapped.append(blocks_since.pop(node.args[2]) > 0)
        assert overlapped == [True] * (chunks - 1) + [False]


_START = re.compile(r"torch\.ops\.ring_rewrite\.ring_shift_start\.default\(.*, (\d+)\)$")
_WAIT = re.compile(r"torch\.ops\.ring_rewrite\.ring_shift_wait\.default\(.*, (\d+), \[[^\[\]]*\]\)$")
_BLOCK = re.compile(r"torch\.ops\.ring_rewrite\.(block_attention(_backward)?|dilated_block_backward)\.default\(")
_ALLOC = re.compile(r"empty_strided_cpu\(\(([\d, ]*)\), \(([\d, ]*)\)")

# Sites compiled by inductor on a fake process group of 2 ranks: (config, heads q/kv, local
# tokens, causal). Every ring branch runs in as many head chunks as it can (RING_CHUNK_BYTES=1).
INDUCTOR_CASES = {
    "exact": (dict(sharding="sharded"), (2, 2), 32, False),
    # A branch of rate 4 across ranks: its dilated K/V are gathered into buffers that a transfer
    # sends, which inductor must not reuse while in flight (Note [Buffers in flight]).
    "dilated": (dict(segment_lengths=[16, 128], dilation_rates=[1, 4], sharding="sharded"), (4, 4), 64, False),
    "zigzag-gqa": (
        dict(segment_lengths=[16, 64], dilation_rates=[1, 2], layout="zigzag"), (4, 2), 64, True
    ),
}


@pytest.fixture(scope="module", params=list(INDUCTOR_CASES))
def generated_code(request) -> tuple[list[str], list[tuple[int, int]], int]:
    """Inductor's generated code (forward, backward) of one site on rank 0 of 2, the head
    chunks and ring size of each ring branch, and how many local branches it has."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ring_rewrite import site_plan

    config, (hq, hkv), n, causal = INDUCTOR_CASES[request.param]
    q = torch.randn(1, hq, n, 8, requires_grad=True)
    k, v = (torch.randn(1, hkv, n, 8, requires_grad=True) for _ in range(2))
    backend = ring_rewrite.backend(compiler="inductor", **config)
    attend = torch.compile(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv),
        backend=backend,
        fullgraph=True,
    )
    torch._dynamo.reset()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(site_plan, "RING_CHUNK_BYTES", 1)
            _, codes = testing.inductor_code(lambda: attend(q, k, v).sum().backward())
            (record,) = backend.records
            plan = record.plan
            rings = [(plan.head_chunks(b), len(b.ring)) for b in plan.branches if not b.is_local]
            local = sum(b.is_local for b in plan.branches)
    finally:
        dist.destroy_process_group()
    return codes, rings, local


def test_inductors_code_keeps_every_buffer_in_flight_alive_and_unwritten(generated_code):
    """Note [Buffers in flight]: in the code that runs, no buffer a transfer sends is freed,
    reused or written before its wait, and the wait reads the buffers the start sent. (What
    ``buffers_in_flight_violations`` reports: a sent buffer handed to a later kernel before its
    wait, such as the K/V sent at step 0 to the next gather, or a wait given a copy.)"""
    codes, rings, _ = generated_code
    assert rings
    for code in codes:
        assert "ring_shift_start" in code
        assert testing.buffers_in_flight_violations(code) == []


@pytest.mark.parametrize("graph, block", [(0, "block_attention"), (1, "block_attention_backward")])
def test_inductors_code_runs_a_block_inside_the_first_transfer(generated_code, graph, block):
    """In the order the code runs: the first transfer starts, a block computes, then it is
    waited for (forward, then backward)."""
    codes, _, _ = generated_code
    testing.check_code(
        codes[graph],
        f"""
        CHECK: torch.ops.ring_rewrite.ring_shift_start.default(
        CHECK-NOT: torch.ops.ring_rewrite.ring_shift_wait.default(
        CHECK: torch.ops.ring_rewrite.{block}.default(
        CHECK: torch.ops.ring_rewrite.ring_shift_wait.default(
        """,
    )


def test_inductors_code_overlaps_every_transfer_and_allocates_contiguous_buffers(generated_code):
    """What runs, not only the traced body: in inductor's generated code every transfer has block
    compute between its start and its wait, forward and backward, except each ring branch's last
    chunk's last hop home where the site has no local branch (with one, that hop lands after the
    local branches computed: Note [Overlap across branches]). Each dK/dV wait takes the results
    of the block it overlaps, so that inductor's peak-memory reordering cannot move it ahead of
    that block (Note [Ordering the ring's messages]). And every buffer is contiguous: with
    one-head chunks inductor would lay the output out channels-last and copy it back, which
    ``attention._cat_heads`` prevents."""
    codes, rings, local = generated_code
    assert rings and all(chunks > 1 for chunks, _ in rings)
    overlapped = []  # per transfer, in the order of the waits: was a block run inside it?
    for code in codes:
        blocks_since = {}  # started transfer -> blocks run since its start
        for line in code.splitlines():
            if start := _START.search(line):
                blocks_since[start.group(1)] = 0
            elif wait := _WAIT.search(line):
                overlapped.append(blocks_since.pop(wait.group(1)) > 0)
            elif _BLOCK.search(line):
                blocks_since = {tag: count + 1 for tag, count in blocks_since.items()}
            for size, stride in _ALLOC.findall(line):
                size, stride = _ints(size), _ints(stride)
                assert torch.empty_strided(size, stride).is_contiguous(), line
        assert not blocks_since
    # Forward: one K/V hop per chunk. Backward: per chunk one K/V hop and one dK/dV hop, home.
    hops = sum(chunks * (size - 1) for chunks, size in rings)
    assert len(overlapped) == 3 * hops
    assert overlapped.count(False) == (0 if local else len(rings))
    assert all(overlapped[:hops])


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def test_a_branch_no_shard_fits_runs_whole_on_every_rank():
    """Note [Whole on every rank]: segments of 100 with a rate of 1024 fit no shards within 4x
    padding. Replicated mode computes the whole site on each rank (no transfer), says so in the
    report and in a warning; sharded mode raises."""
    config = dict(segment_lengths=[100, 1024], dilation_rates=[1, 1024], compiler="eager")
    attend = lambda q: F.scaled_dot_product_attention(q, q, q)  # noqa: E731
    captures = capture_ranks(attend, [torch.randn(1, 2, 100, 8)], world=2, backward=False, strict=True, **config)
    for cap in captures:
        (record,) = cap.records
        assert record.rewritten and record.plan.world == 1 and record.plan.n == 100
        assert record.reason.startswith("whole on every rank, not across them: branch (w=1024, r=1024)")
        assert "rewritten, whole on every rank" in str(cap.report)
        assert not [t for t in cap.schedule()]
    with pytest.raises(Exception, match="sharded mode cannot leave it alone: branch"):
        capture_ranks(attend, [torch.randn(1, 2, 50, 8)], world=2, backward=False, sharding="sharded", **config)
