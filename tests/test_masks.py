"""Dense masks read from the graph that builds them (passes/masks.py; docs/semantics.md, Masks):
which structure each construction has, that the dense construction is gone, and the numerics at
P = 1, 2, 4 against the float64 reference given the same dense mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from ranks import run_ranks
from ring_rewrite.testing import assert_left_alone, assert_rewritten, capture

BOUND = 1e-5
W = 6  # window


# ---- constructions, each as models write them ---------------------------------------------------
# Each takes the site's q and a key-padding vector (B, N) (the rank's keys in sharded mode) and
# returns the mask SDPA gets; positions are the rank's own (sharded mode reads them as global).


def hf_causal(q, pad):
    """transformers 5.x (sdpa_mask): index vectors, an and of mask functions, advanced indexing."""
    b, n = q.shape[0], q.shape[2]
    batch = torch.arange(b)[:, None, None, None]
    q_idx = (torch.arange(n) + 0)[None, None, :, None]
    kv_idx = (torch.arange(n) + 0)[None, None, None, :]
    mask = q_idx.new_ones((), dtype=torch.bool) & (kv_idx <= q_idx).to(q.device)
    mask = mask & pad.to(torch.bool)[batch, kv_idx]
    return mask.expand(b, -1, n, n)


def hf_encoder(q, pad):
    """transformers' bidirectional mask: ``q_idx >= 0`` (always true) and padding."""
    b, n = q.shape[0], q.shape[2]
    batch = torch.arange(b)[:, None, None, None]
    q_idx = torch.arange(n)[None, None, :, None]
    kv_idx = torch.arange(n)[None, None, None, :]
    mask = q_idx.new_ones((), dtype=torch.bool) & (q_idx >= 0) & pad[batch, kv_idx]
    return mask.expand(b, -1, n, n)


def hf_window(q, pad):
    """transformers' sliding window overlay: ``kv_idx > q_idx - W`` and causal, and padding."""
    n = q.shape[2]
    i = torch.arange(n)
    q_idx, kv_idx = i[None, None, :, None], i[None, None, None, :]
    return (kv_idx <= q_idx) & (kv_idx > q_idx - W) & pad[:, None, None, :]


def tril_float(q, pad):
    """A hand-written additive causal mask (tril of ones) with padding: 0 or -inf."""
    n = q.shape[2]
    keep = torch.ones(n, n, dtype=torch.bool).tril() & pad[:, None, None, :]
    return torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))


def subsequent_window(q, pad):
    """nn.Transformer.generate_square_subsequent_mask (float, -inf above the diagonal) plus a
    window cut by triu, and a key bias."""
    n = q.shape[2]
    future = torch.full((n, n), float("-inf")).triu(1)
    old = torch.ones(n, n, dtype=torch.bool).triu(1 - W)
    return future + torch.where(old, 0.0, float("-inf")) + torch.where(pad, 0.0, -1.5)[:, None, None, :]


def two_sided(q, pad):
    """Local attention, not causal: ``|t - p| <= W`` written as two comparisons."""
    i = torch.arange(q.shape[2])
    d = i.view(1, -1) - i.view(-1, 1)
    return (d <= W) & (-d <= W) & pad.view(pad.shape[0], 1, 1, -1)


def hf_bidirectional_window(q, pad):
    """transformers' bidirectional sliding window (ModernBERT's local layers):
    ``abs(q_idx - kv_idx) <= W`` with Python's ``abs``, which dynamo records as ``operator.abs``,
    and padding."""
    b, n = q.shape[0], q.shape[2]
    batch = torch.arange(b)[:, None, None, None]
    q_idx = torch.arange(n)[None, None, :, None]
    kv_idx = torch.arange(n)[None, None, None, :]
    mask = q_idx.new_ones((), dtype=torch.bool) & (abs(q_idx - kv_idx) <= W) & pad[batch, kv_idx]
    return mask.expand(b, -1, n, n)


def distance_bias(q, pad):
    """A float two-sided band ``|t - p| <= W`` (``torch.abs``) and a key bias that reads ``abs``
    too: keys far from the middle weigh less."""
    n = q.shape[2]
    i = torch.arange(n)
    band = torch.where((i[None, :] - i[:, None]).abs() <= W, 0.0, float("-inf"))
    return band + (i - n // 2).abs() * -0.1 + torch.where(pad, 0.0, float("-inf"))[:, None, None, :]


def slopes(heads: int) -> torch.Tensor:
    """ALiBi's slopes: ``2 ** (-8 (j + 1) / H)`` for head ``j``."""
    return torch.tensor([2.0 ** (-8 * (j + 1) / heads) for j in range(heads)])


def alibi_key(q, pad):
    """ALiBi as BLOOM and MPT add it, the key bias ``slope_h * t`` (``-slope_h * p`` is constant
    along a row), under a causal mask and padding filled with ``finfo.min``, as transformers
    fills float masks."""
    n = q.shape[2]
    i = torch.arange(n)
    allowed = (i[None, :] <= i[:, None]) & pad[:, None, None, :]
    return torch.where(allowed, 0.0, torch.finfo(q.dtype).min) + slopes(q.shape[1]).view(1, -1, 1, 1) * i.view(1, 1, 1, n)


def alibi_relative(q, pad):
    """ALiBi written relative, ``slope_h * (t - p)``, under a causal mask, and padding."""
    i = torch.arange(q.shape[2])
    distance = (i[None, :] - i[:, None]).to(q.dtype)
    causal = torch.where(i[None, :] <= i[:, None], 0.0, float("-inf"))
    return causal + slopes(q.shape[1]).view(1, -1, 1, 1) * distance + torch.where(pad, 0.0, float("-inf"))[:, None, None, :]


def bart_padding(q, pad):
    """The key-padding mask of BART-era code: a float ``(B, 1, N, N)`` of zeros filled with
    ``-inf`` where ``~pad``."""
    n = q.shape[2]
    return torch.zeros(q.shape[0], 1, n, n).masked_fill(~pad[:, None, None, :], float("-inf"))


def constant_bias(q, pad):
    """A key bias of constants alone (no tensor read) on a causal mask filled with ``finfo.min``:
    the bias is computed in the graph."""
    i = torch.arange(q.shape[2])
    causal = torch.where(i[None, :] <= i[:, None], 0.0, torch.finfo(q.dtype).min)
    return torch.zeros(q.shape[0], q.shape[1], 1, q.shape[2]) * 0.5 + causal


CONSTRUCTIONS = {
    f.__name__: f
    for f in (
        hf_causal, hf_encoder, hf_window, tril_float, subsequent_window, two_sided, hf_bidirectional_window,
        distance_bias, alibi_key, alibi_relative, bart_padding, constant_bias,
    )
}  # fmt: skip
# (is_causal, band, key bias) each reads as.
STRUCTURE = {
    "hf_causal": (True, None, True),
    "hf_encoder": (False, None, True),
    "hf_window": (True, (1 - W, None), True),
    "tril_float": (True, None, True),
    "subsequent_window": (True, (1 - W, None), True),
    "two_sided": (False, (-W, W), True),
    "hf_bidirectional_window": (False, (-W, W), True),
    "distance_bias": (False, (-W, W), True),
    "alibi_key": (True, None, True),
    "alibi_relative": (True, None, True),
    "bart_padding": (False, None, True),
    "constant_bias": (True, None, True),
}


def dense(kind: str, n: int, pad: torch.Tensor, heads: int) -> torch.Tensor:
    """The mask over the global sequence, as a bool keep-mask or additive bias (the reference's):
    a ``finfo.min`` fill as the ``-inf`` it is read as (docs/semantics.md, Accuracy)."""
    mask = CONSTRUCTIONS[kind](torch.empty(pad.shape[0], heads, n, 1), pad)
    if mask.dtype == torch.bool:
        return mask
    return mask.masked_fill(mask <= torch.finfo(mask.dtype).min / 2, float("-inf"))


def _padding(b: int, n: int) -> torch.Tensor:
    pad = torch.ones(b, n, dtype=torch.bool)
    pad[1, : n // 5] = False  # left padding in row 1
    pad[0, 1::9] = False
    return pad


def _attend(kind):
    build = CONSTRUCTIONS[kind]

    def attend(q, k, v, pad):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=build(q, pad))

    return attend


# ---- what is read -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(CONSTRUCTIONS))
def test_structure_is_read_and_the_dense_mask_is_gone(kind):
    n = 32
    q = torch.randn(2, 2, n, 8)
    cap = capture(_attend(kind), q, q, q, _padding(2, n))
    assert_rewritten(cap, 1)
    plan = cap.records[0].plan
    assert (plan.is_causal, plan.band, plan.has_mask) == STRUCTURE[kind]
    if plan.band is not None:
        assert (f"True, window {W}" if plan.is_causal else f"{-W} <= t - p <= {W}") in str(cap.report)
    (gm,) = cap.after
    square = [
        node for node in gm.graph.nodes
        if isinstance(node.meta.get("example_value"), torch.Tensor)
        and tuple(node.meta["example_value"].shape[-2:]) == (n, n)
    ]  # fmt: skip
    assert not square, f"(N, N) nodes left in the graph: {square}"


def _query_padding(q, pad):
    return pad[:, None, :, None] & torch.ones(q.shape[2], q.shape[2], dtype=torch.bool)


def _or_across(q, pad):
    i = torch.arange(q.shape[2])
    return (i[None, :] <= i[:, None]) | (i[None, :] % 5 == 0)  # causal, or global keys everyone sees


def _or_window_blocks(q, groups):
    """A window OR blocks: ``(causal & window) | same block`` is no block-causal relation."""
    i = torch.arange(q.shape[2])
    p, t = i[None, None, :, None], i[None, None, None, :]
    same = (groups[:, None, :, None] == groups[:, None, None, :]) & (groups[:, None, :, None] >= 0)
    return ((t <= p) & (t > p - W)) | same


def _query_prefix(q, pad):
    i = torch.arange(q.shape[2])
    return (i[:, None] < 8) & pad[:, None, None, :]  # only the first queries attend


def _given(q, pad):
    return pad[:, None, None, :] & (torch.rand(q.shape[2], q.shape[2]) > 0.5)


@pytest.mark.parametrize(
    "build, reason",
    [
        (_query_padding, "not a band"),
        (_or_across, "not a band"),
        (_or_window_blocks, "not a band"),
        (_query_prefix, "not a band"),
        (_given, "not a band"),
    ],
    ids=["query-padding", "or-across-positions", "or-window-blocks", "query-prefix", "data-of-both-positions"],
)
def test_mask_without_a_structure_is_left_alone(build, reason):
    q = torch.randn(2, 2, 16, 8)

    def attend(q, k, v, pad):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=build(q, pad))

    data = _groups(2, 16) if build is _or_window_blocks else _padding(2, 16)
    cap = capture(attend, q, q, q, data)
    assert_left_alone(cap, site=0, reason=reason)


# ---- numerics ------------------------------------------------------------------------------------


def _check(
    kind, segs, rates, compiler, *, world=1, rank=0, sharding="replicated", layout="contiguous", n=64, comm="ring",
    a2a=None,
):  # fmt: skip
    import ring_rewrite
    from ring_rewrite.reference import reference_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 8, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 4, n, 8)
    pad = _padding(2, n)
    ref = reference_attention(q, k, v, segment_lengths=segs, dilation_rates=rates, key_bias=dense(kind, n, pad, q.shape[1]))
    expected = [ref, *torch.autograd.grad(ref, (q, k, v), dout.double())]
    torch._dynamo.reset()
    backend = ring_rewrite.backend(
        segment_lengths=segs, dilation_rates=rates, compiler=compiler, sharding=sharding, layout=layout, comm=comm,
        a2a_ranks=a2a,
    )
    compiled = torch.compile(_attend(kind), backend=backend, fullgraph=True)
    inputs = (q, k, v)
    if sharding == "sharded" and world > 1:
        cut = lambda x, dim=2: ring_rewrite.shard(x.detach(), dim, layout=layout)  # noqa: E731
        inputs = tuple(cut(x).requires_grad_() for x in (q, k, v))
        expected, dout, pad = [cut(x) for x in expected], cut(dout), cut(pad, 1)
    out = compiled(*inputs, pad)
    grads = torch.autograd.grad(out, inputs, dout)
    errors = [rel_err(a, b) for a, b in zip((out, *grads), expected)]
    assert max(errors) < BOUND, (rank, kind, segs, sharding, layout, errors)
    (record,) = backend.records
    assert record.rewritten and (record.plan.is_causal, record.plan.band) == STRUCTURE[kind][:2]
    assert record.plan.comm == (comm if world > 1 else "ring")


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
@pytest.mark.parametrize("segs, rates", [(None, None), ([8, 32], [1, 2])], ids=["exact", "dilated"])
@pytest.mark.parametrize(
    "kind",
    [
        "hf_causal", "hf_encoder", "hf_window", "subsequent_window", "two_sided", "hf_bidirectional_window",
        "distance_bias", "alibi_key", "alibi_relative", "bart_padding", "constant_bias",
    ],
)  # fmt: skip
def test_one_rank_matches_reference(kind, segs, rates, compiler):
    _check(kind, segs, rates, compiler, n=40)


# (kind, segment_lengths, dilation_rates, sharding, layout): windows of 6 against shards of 16 to
# 32 tokens, so ring blocks are skipped, banded and whole.
CASES_P2 = [
    ("hf_causal", [16, 64], [1, 2], "sharded", "zigzag"),
    ("hf_window", None, None, "sharded", "zigzag"),
    ("subsequent_window", [8, 64], [1, 2], "replicated", "contiguous"),
    ("two_sided", [16, 64], [1, 2], "sharded", "contiguous"),
    ("alibi_key", [16, 64], [1, 2], "sharded", "zigzag"),  # key positions: global ones
]
CASES_P4 = [("hf_window", [8, 32, 64], [1, 2, 4], "sharded", "zigzag")]  # one: a P = 4 compile is costly


def _cases(rank, world, cases, compiler):
    for kind, segs, rates, sharding, layout in cases:
        _check(kind, segs, rates, compiler, world=world, rank=rank, sharding=sharding, layout=layout)


@pytest.mark.parametrize(
    "world, cases, compiler",
    [(2, CASES_P2, "inductor"), (4, CASES_P4, "inductor")],
    ids=["P2-inductor", "P4-inductor"],
)
def test_ring_matches_reference(world, cases, compiler):
    run_ranks(world, _cases, cases, compiler)


# ---- documents (packed sequences) ---------------------------------------------------------------


def hf_packed(q, pos):
    """transformers' packed-sequence mask from ``position_ids`` (no attention_mask, no cache):
    documents where the positions restart, causal on the position values."""
    b, n = pos.shape
    diff = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
    seg = (diff != 1).cumsum(-1)
    batch = torch.arange(b)[:, None, None, None]
    q_idx, kv_idx = torch.arange(n)[None, None, :, None], torch.arange(n)[None, None, None, :]
    mask = q_idx.new_ones((), dtype=torch.bool) & (pos[batch, kv_idx] <= pos[batch, q_idx])
    mask = mask & (seg[batch, q_idx] == seg[batch, kv_idx])
    return mask.expand(b, -1, n, n)


def doc_window(q, doc):
    """Document ids given, a window on the indices, not causal."""
    i = torch.arange(q.shape[2])
    d = i.view(1, -1) - i.view(-1, 1)
    return (d.abs() <= W) & (doc[:, None, :, None] == doc[:, None, None, :])


def _packed(b: int, n: int) -> torch.Tensor:
    """Position ids of packed sequences: each row restarts at its own boundaries."""
    pos = torch.empty(b, n, dtype=torch.long)
    for row, cuts in enumerate(([0, n // 3, n // 2], [0, 5, n - 7])[:b]):
        for start, stop in zip(cuts, [*cuts[1:], n]):
            pos[row, start:stop] = torch.arange(stop - start)
    return pos


def _check_documents(
    build, data, segs, rates, compiler, *, world=1, rank=0, n=48, sharding="replicated", layout="contiguous",
    dtype=torch.float32, documents=True, comm="ring", a2a=None,
):  # fmt: skip
    import ring_rewrite
    from ring_rewrite.reference import reference_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 4, n, 8, dtype=dtype)
    mask = build(torch.empty(2, 1, n, 1, dtype=dtype), data)
    if mask.is_floating_point():  # what a fill at the dtype's lowest means (docs/masks.md)
        mask = mask.double().masked_fill(mask <= torch.finfo(dtype).min / 2, float("-inf"))
    ref = reference_attention(q, k, v, segment_lengths=segs, dilation_rates=rates, key_bias=mask)
    expected = [ref, *torch.autograd.grad(ref, (q, k, v), dout.double())]
    torch._dynamo.reset()
    backend = ring_rewrite.backend(
        segment_lengths=segs, dilation_rates=rates, compiler=compiler, sharding=sharding, layout=layout, comm=comm,
        a2a_ranks=a2a,
    )

    def attend(q, k, v, data):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=build(q, data))

    inputs = (q, k, v)
    if sharding == "sharded" and world > 1:  # each rank its own queries, keys and their ids
        cut = lambda x, dim=2: ring_rewrite.shard(x.detach(), dim, layout=layout)  # noqa: E731
        inputs = tuple(cut(x).requires_grad_() for x in (q, k, v))
        expected, dout, data = [cut(x) for x in expected], cut(dout), cut(data, 1)
    out = torch.compile(attend, backend=backend, fullgraph=True)(*inputs, data)
    grads = torch.autograd.grad(out, inputs, dout)
    errors = [rel_err(a, b) for a, b in zip((out, *grads), expected)]
    assert max(errors) < (BOUND if dtype == torch.float32 else 1e-12), (rank, build.__name__, segs, sharding, layout, errors)
    (record,) = backend.records
    assert record.rewritten and bool(record.plan.documents) == documents and record.plan.world == world
    assert record.plan.comm == (comm if world > 1 else "ring")


def chunked(q, pad):
    """Chunked attention (transformers' Llama 4): causal within chunks of 8 tokens counted from
    each row's first real token, ``(t - pad_b) // 8 == (p - pad_b) // 8``: documents."""
    n = q.shape[2]
    start = (~pad).sum(-1).view(-1, 1, 1, 1)  # left padding
    i = torch.arange(n)
    p, t = i[None, None, :, None], i[None, None, None, :]
    return (t <= p) & ((t - start) // 8 == (p - start) // 8) & pad[:, None, None, :]


def _left_pad(b, n):
    pad = torch.ones(b, n, dtype=torch.bool)
    pad[1, :5] = False
    return pad


def fixed_chunks(q, _):
    """Chunks of 8 counted from position 0, causal within each: document ids of the positions
    alone, which the rewrite computes once as constants of the graph."""
    i = torch.arange(q.shape[2])
    p, t = i[None, None, :, None], i[None, None, None, :]
    return (t <= p) & (t // 8 == p // 8)


DOCUMENTS = [
    (hf_packed, _packed), (doc_window, lambda b, n: _packed(b, n).eq(0).cumsum(-1)), (chunked, _left_pad),
    (fixed_chunks, _left_pad),
]


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
@pytest.mark.parametrize("segs, rates", [(None, None), ([8, 32], [1, 2])], ids=["exact", "dilated"])
@pytest.mark.parametrize("build, data", DOCUMENTS, ids=["hf-packed", "doc-window", "chunked", "fixed-chunks"])
def test_documents_match_reference(build, data, segs, rates, compiler):
    _check_documents(build, data(2, 48), segs, rates, compiler)


def _documents_on_ranks(rank, world, compiler):
    for build, data in DOCUMENTS:
        _check_documents(build, data(2, 64), [16, 64], [1, 2], compiler, world=world, rank=rank, n=64)


def test_documents_across_ranks_match_reference():
    run_ranks(2, _documents_on_ranks, "inductor")  # replicated mode: every rank holds every id


def _sharded_documents_on_ranks(rank, world, compiler, names):
    # Each rank holds its shard's position_ids, document ids or block ids; the site gathers them.
    for name in names:
        build, data = SHARDED_DOCUMENTS[name]
        _check_documents(
            build, data(2, 64), [16, 64], [1, 2], compiler, world=world, rank=rank, n=64, sharding="sharded",
            layout="zigzag",
        )  # fmt: skip


@pytest.mark.parametrize(
    "world, names", [(2, ["hf-packed", "doc-window", "hf-blocks"]), (4, ["hf-packed"])], ids=["P2", "P4"]
)  # a P = 4 compile is costly: one case
def test_documents_sharded_match_reference(world, names):
    run_ranks(world, _sharded_documents_on_ranks, "inductor", names)


def test_positions_that_do_not_count_up_in_a_document_raise():
    """The band compares position values: within a document they must step by one, else the
    structure read from the graph does not hold for these inputs (checked at run time)."""

    def attend(q, k, v, pos, doc):
        b, n = pos.shape
        p, t = pos[:, None, :, None], pos[:, None, None, :]
        same = doc[:, None, :, None] == doc[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(t <= p) & same)

    import ring_rewrite

    q = torch.randn(2, 2, 16, 8)
    doc = torch.zeros(2, 16, dtype=torch.long)
    pos = torch.arange(16).expand(2, 16).clone()
    compiled = torch.compile(attend, backend=ring_rewrite.backend(compiler="aot_eager"))
    compiled(q, q, q, pos, doc)  # positions count up: fine
    pos[1, 5] = 9
    with pytest.raises(ValueError, match="do not step by one within a document"):
        compiled(q, q, q, pos, doc)


def test_documents_of_key_positions_in_sharded_mode_raise():
    """Chunks counted from each row's first token read the key's position as a number: in
    sharded mode that is the rank's local one, so the site raises naming it."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import ring_rewrite

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        backend = ring_rewrite.backend(compiler="eager", sharding="sharded")

        def attend(q, k, v, pad):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=chunked(q, pad))

        q = torch.randn(2, 2, 16, 8)
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="read key positions as numbers"):
            torch.compile(attend, backend=backend)(q, q, q, _left_pad(2, 16))
    finally:
        dist.destroy_process_group()


def block_causal(q, pad):
    """Block-causal attention: every key of the query's block of 8 and of the blocks before."""
    i = torch.arange(q.shape[2])
    return (i[None, :] // 8 <= i[:, None] // 8) & pad[:, None, None, :]


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
@pytest.mark.parametrize("segs, rates", [(None, None), ([8, 32], [1, 2])], ids=["exact", "dilated"])
def test_block_causal_matches_reference(segs, rates, compiler):
    _check_documents(block_causal, _left_pad(2, 48), segs, rates, compiler)


def test_ids_of_chunks_that_do_not_divide_the_length_are_whole_under_inductor():
    """``arange(59) // 14``, the ids the rewrite computes for chunks of 14 over 59 positions:
    inductor's loop split wrote 56 of them and left 3 stale (Note [Inductor's loop split]).
    Alone, compiled anew each time, with fresh memory."""
    import ring_rewrite

    for _ in range(3):
        torch._dynamo.reset()
        ids = torch.compile(lambda x: torch.arange(x.shape[-1]).view(1, -1) // 14, backend=ring_rewrite.backend())
        assert torch.equal(ids(torch.empty(59)), (torch.arange(59) // 14).view(1, -1))


@pytest.mark.parametrize("relation", ["chunked", "block-causal"])
def test_chunks_that_do_not_divide_the_length_match_sdpa_at_every_compile(relation):
    """Chunks of 14 over 59 positions, ids built in the graph (Llama 4's chunked attention, a
    block-causal mask), exact config, under inductor: equal to SDPA's dense mask, compiled three
    times after ``torch._dynamo.reset()`` (each compile's stale memory differed)."""
    import ring_rewrite

    def attend(q, k, v):
        ids = torch.arange(q.shape[2]) // 14
        allowed = ids[None, :] == ids[:, None] if relation == "chunked" else ids[None, :] <= ids[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    q, k, v = (torch.randn(1, 2, 59, 16, requires_grad=True) for _ in range(3))
    expected = attend(*(x.double() for x in (q, k, v)))
    for _ in range(3):
        torch._dynamo.reset()
        backend = ring_rewrite.backend()
        out = torch.compile(attend, backend=backend, fullgraph=True)(q, k, v)
        assert backend.records[0].rewritten
        assert rel_err(out, expected) < BOUND


# ---- causal OR blocks (a prefix LM, transformers' block_sequence_ids) ----------------------------


def prefix_lm(q, pad):
    """A prefix LM: every query sees the first 10 keys (the prefix, bidirectional) and causal
    keys after them, with padding."""
    i = torch.arange(q.shape[2])
    return ((i[None, :] <= i[:, None]) | (i[None, :] < 10)) & pad[:, None, None, :]


def hf_blocks(q, groups):
    """transformers 5.x's ``create_causal_mask(..., block_sequence_ids=groups)``: causal, OR the
    same block (ids >= 0: images, a PaliGemma prefix), built as ``or_masks`` builds it."""
    b, n = groups.shape
    batch = torch.arange(b)[:, None, None, None]
    q_idx, kv_idx = torch.arange(n)[None, None, :, None], torch.arange(n)[None, None, None, :]
    q_group, kv_group = groups[batch, q_idx], groups[batch, kv_idx]
    mask = q_idx.new_zeros((), dtype=torch.bool) | (kv_idx <= q_idx)
    mask = mask | ((q_group == kv_group) & (q_group >= 0))
    return mask.expand(b, -1, n, n)


def _groups(b: int, n: int) -> torch.Tensor:
    """Row 0: two image blocks (ids 0 and 1) in text; row 1: a prefix of 9 tokens (id 0)."""
    groups = torch.full((b, n), -1, dtype=torch.long)
    groups[0, 3:8], groups[0, 12:15] = 0, 1
    groups[1, :9] = 0
    return groups


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
@pytest.mark.parametrize("segs, rates", [(None, None), ([8, 32], [1, 2])], ids=["exact", "dilated"])
@pytest.mark.parametrize("build, data", [(prefix_lm, _left_pad), (hf_blocks, _groups)], ids=["prefix-lm", "hf-blocks"])
def test_causal_or_blocks_match_reference(build, data, segs, rates, compiler):
    _check_documents(build, data(2, 48), segs, rates, compiler)


def test_a_block_id_in_two_runs_raises():
    """The blocks must be runs: an id that comes back later is no block-causal relation, and
    the guard (``ops.block_ends``, O(N)) raises rather than compute another function."""
    import ring_rewrite

    def attend(q, k, v, groups):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=hf_blocks(q, groups))

    q = torch.randn(2, 2, 16, 8)
    groups = _groups(2, 16)
    compiled = torch.compile(attend, backend=ring_rewrite.backend(compiler="aot_eager"))
    compiled(q, q, q, groups)
    groups[0, 14] = 0  # id 0 again, after block 1
    with pytest.raises(ValueError, match="appears in more than one run"):
        compiled(q, q, q, groups)


SHARDED_DOCUMENTS = {"hf-packed": DOCUMENTS[0], "doc-window": DOCUMENTS[1], "hf-blocks": (hf_blocks, _groups)}


# ---- a new length every call: one graph per bucket -------------------------------------------------

# 16 (static), then 24 (dynamo makes the length a symbol: bucket 32), 40 (bucket 64), 28 and 32
# (bucket 32 again): three graphs, where a mask specialised to its length compiles one per length.
LENGTHS = (16, 24, 40, 28, 32)
BUCKETED = {
    "hf-causal": (hf_causal, _padding),  # a batch padded to its longest row, as transformers masks it
    "hf-window": (hf_window, _padding),
    "hf-packed": (hf_packed, _packed),
    "hf-blocks": (hf_blocks, _groups),
}


@pytest.mark.parametrize(
    "name, compiler",
    [("hf-causal", "inductor"), ("hf-window", "aot_eager"), ("hf-packed", "aot_eager"), ("hf-blocks", "aot_eager")],
)
def test_dense_mask_of_a_new_length_compiles_one_graph_per_bucket(name, compiler):
    import ring_rewrite
    from ring_rewrite.reference import reference_attention

    build, data = BUCKETED[name]
    segs, rates = [8, 16], [1, 2]
    backend = ring_rewrite.backend(segment_lengths=segs, dilation_rates=rates, compiler=compiler)

    def attend(q, k, v, data):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=build(q, data))

    compiled = torch.compile(attend, backend=backend, fullgraph=True)
    for n in LENGTHS:
        q, k, v = (torch.randn(2, 4, n, 8, requires_grad=True) for _ in range(3))
        dout, mask_data = torch.randn(2, 4, n, 8), data(2, n)
        ref = reference_attention(
            q, k, v, segment_lengths=segs, dilation_rates=rates, key_bias=build(torch.empty(2, 1, n, 1), mask_data)
        )
        expected = [ref, *torch.autograd.grad(ref, (q, k, v), dout.double())]
        out = compiled(q, k, v, mask_data)
        got = [out, *torch.autograd.grad(out, (q, k, v), dout)]
        errors = [rel_err(a, b) for a, b in zip(got, expected)]
        assert max(errors) < BOUND, (name, n, errors)
    counts = torch._dynamo.utils.counters["ring_rewrite"]
    assert (counts["rewritten"], counts["bucketed"], counts["skipped"]) == (3, 2, 0), dict(counts)


def _real_calls(branches, bucket: int, n: int, batch: int, heads: int) -> list[tuple[int, int]]:
    """The block calls ``(batch x segments, rows)`` of the real rows of each local branch of a
    sequence of ``n`` padded to ``bucket``: head ``j`` holds positions ``s * seg + j % r + r * i``
    of segment ``s``; the segments whose rows are all real in one call, the next one's first
    rows (the most any head holds there) in another."""
    calls = []
    for w, r in branches:
        seg = min(w, bucket)
        real = [[sum(s * seg + j % r + r * i < n for i in range(seg // r)) for j in range(heads)]
                for s in range(bucket // seg)]  # fmt: skip
        whole = next((s for s, rows in enumerate(real) if min(rows) < seg // r), len(real))
        calls += [(batch * whole, seg // r)] * bool(whole)
        last = max(real[whole]) if whole < len(real) else 0
        calls += [(batch, last)] * bool(last)
    return calls


@pytest.mark.parametrize(
    "name, compiler",
    [("hf-causal", "inductor"), ("hf-encoder", "inductor"), ("hf-packed", "aot_eager"), ("hf-window", "inductor"),
     ("hf-bidirectional-window", "aot_eager")],
)  # fmt: skip
def test_a_masked_bucket_computes_only_its_real_rows(name, compiler, monkeypatch):
    """A dense mask at a symbolic length, padded to its bucket (Note [Padding to a bucket]): every
    block call, forward and backward, takes the real rows and keys only (``_real_calls``; a
    band's calls run in chunks of query rows, each with its call's keys), and the results equal
    the float64 reference's at lengths across the bucket."""
    import ring_rewrite
    from ring_rewrite import ops
    from ring_rewrite.reference import reference_attention

    calls = []
    for kind in ("_attend", "_attend_backward"):

        def spy(*args, _fn=getattr(ops, kind), _kind=kind):
            q, k = args[:2] if _kind == "_attend" else args[1:3]
            calls.append((_kind, q.shape[0], q.shape[2], k.shape[2]))
            return _fn(*args)

        monkeypatch.setattr(ops, kind, spy)
    sources = []  # the rows of every tensor a branch's rows are gathered from
    gather = ops.BranchLayout.gather

    def gather_spy(self, x, **kwargs):
        sources.append(x.shape[2])
        return gather(self, x, **kwargs)

    monkeypatch.setattr(ops.BranchLayout, "gather", gather_spy)
    build, data = {
        "hf-causal": (hf_causal, _padding), "hf-encoder": (hf_encoder, _padding), "hf-packed": (hf_packed, _packed),
        "hf-window": (hf_window, _padding), "hf-bidirectional-window": (hf_bidirectional_window, _padding),
    }[name]  # fmt: skip
    segs, rates, batch, heads, bucket = [8, 16], [1, 2], 2, 4, 64
    backend = ring_rewrite.backend(segment_lengths=segs, dilation_rates=rates, compiler=compiler)

    def attend(q, k, v, data):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=build(q, data))

    compiled = torch.compile(attend, backend=backend, fullgraph=True, dynamic=True)
    for n in (33, 47, 64):
        q, k, v = (torch.randn(batch, heads, n, 8, requires_grad=True) for _ in range(3))
        dout, mask_data = torch.randn(batch, heads, n, 8), data(batch, n)
        ref = reference_attention(
            q, k, v, segment_lengths=segs, dilation_rates=rates, key_bias=build(torch.empty(batch, 1, n, 1), mask_data)
        )
        expected = [ref, *torch.autograd.grad(ref, (q, k, v), dout.double())]
        calls.clear()
        sources.clear()
        out = compiled(q, k, v, mask_data)
        got = [out, *torch.autograd.grad(out, (q, k, v), dout)]
        errors = [rel_err(a, b) for a, b in zip(got, expected)]
        assert max(errors) < BOUND, (name, n, errors)
        # At the real length (SitePlan.bucketed) the dilated branch gathers from the real rows;
        # packed documents pad q, k, v to the bucket first.
        assert sources and set(sources) == {bucket if name == "hf-packed" else n}, (n, sources)
        want = sorted(_real_calls(zip(segs, rates), bucket, n, batch, heads))
        for kind in ("_attend", "_attend_backward"):
            if name.endswith("window"):
                assert {(b, keys) for c, b, rows, keys in calls if c == kind} == set(want), (n, kind, calls)
                continue
            ran = sorted((b, rows) for c, b, rows, keys in calls if c == kind and rows == keys)
            assert ran == want and len(ran) == sum(c[0] == kind for c in calls), (n, kind, calls)
    assert torch._dynamo.utils.counters["ring_rewrite"]["bucketed"] == 1
    # explain() says what share of the bucket's query-key pairs those calls compute at 37.
    causal = name not in ("hf-encoder", "hf-bidirectional-window")

    def pairs(calls):
        return sum(b * (rows * (rows + 1) // 2 if causal else rows * rows) for b, rows in calls)

    share = pairs(_real_calls(zip(segs, rates), bucket, 37, 1, heads)) / pairs(_real_calls(zip(segs, rates), bucket, bucket, 1, heads))
    q = torch.randn(batch, heads, 37, 8)
    report = ring_rewrite.explain(attend, q, q, q, data(batch, 37), dynamic=True, segment_lengths=segs, dilation_rates=rates)
    (record,) = report.records
    assert not record.plan.recentred  # rebuilt at the bucket, its keys are a conjunct still, no bias to recentre
    # Packed documents pad q, k, v to the bucket; the others run on the real rows (SitePlan.bucketed).
    rows = "its blocks compute" if name == "hf-packed" else "reads and writes"
    assert record.plan.bucketed == (name != "hf-packed")
    assert record.reason.startswith(f"a bucket of {bucket}: {rows} the real rows only"), record.reason
    assert f"compiled at 37 positions: {share:.0%} of the bucket's" in record.reason, record.reason


@pytest.mark.parametrize(
    "name, segs, rates, compiler",
    [("hf-causal", [12, 24], [1, 2], "inductor"), ("hf-encoder", [5, 30], [1, 3], "aot_eager")],
)
def test_a_bucket_its_segments_do_not_divide_runs_at_the_real_length(name, segs, rates, compiler):
    """Segments and a rate that do not divide the bucket of 32, GQA: the rate-1 branch's segments
    fall where the real sequence's do (its last one cut short), the dilated one is gathered from
    the real rows, and the results equal the float64 reference's at lengths across the bucket,
    one graph (``SitePlan.bucketed``)."""
    import ring_rewrite
    from ring_rewrite.reference import reference_attention

    build = {"hf-causal": hf_causal, "hf-encoder": hf_encoder}[name]
    backend = ring_rewrite.backend(segment_lengths=segs, dilation_rates=rates, compiler=compiler)

    def attend(q, k, v, pad):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=build(q, pad), enable_gqa=True)

    compiled = torch.compile(attend, backend=backend, dynamic=True)
    for n in (19, 26, 32):
        g = torch.Generator().manual_seed(n)
        q, dout = (torch.randn(2, 4, n, 8, generator=g) for _ in range(2))
        k, v = (torch.randn(2, 2, n, 8, generator=g) for _ in range(2))
        pad = _padding(2, n)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = compiled(*leaves, pad)
        got = [out, *torch.autograd.grad(out, leaves, dout)]
        ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
        kv = [x.repeat_interleave(2, 1) for x in ref_leaves[1:]]
        ref = reference_attention(
            ref_leaves[0], *kv, segment_lengths=segs, dilation_rates=rates, key_bias=build(torch.empty(2, 1, n, 1), pad)
        )
        expected = [ref, *torch.autograd.grad(ref, ref_leaves, dout.double())]
        errors = [rel_err(a, b) for a, b in zip(got, expected)]
        assert max(errors) < BOUND, (name, n, errors)
    assert [r.plan.bucketed for r in backend.records] == [True], backend.records


@pytest.mark.parametrize(
    "name, compiler, dtype",
    [("hf-causal", "inductor", torch.float32), ("hf-encoder", "aot_eager", torch.bfloat16),
     ("hf-window", "inductor", torch.float32)],
)  # fmt: skip
def test_an_exact_bucket_runs_at_its_real_length(name, compiler, dtype, monkeypatch):
    """Exact attention with a dense mask at a symbolic length, in one process: the site is
    planned for the bucket and runs on the unpadded q, k, v, its key bias at the real keys
    (``SitePlan.bucketed``): every block, forward and backward, sees the real length, the
    results equal the float64 reference's across the bucket, one graph."""
    import ring_rewrite
    from ring_rewrite import ops
    from ring_rewrite.reference import reference_attention

    seen = []
    for name_, at in (("_block_forward", 0), ("_block_backward", 1)):  # where q and k are

        def spy(*args, _fn=getattr(ops, name_), _at=at, **kwargs):
            q, k = (kwargs["q"], kwargs["k"]) if kwargs else args[_at : _at + 2]
            seen.append((q.shape[2], k.shape[2]))
            return _fn(*args, **kwargs)

        monkeypatch.setattr(ops, name_, spy)
    build = {"hf-causal": hf_causal, "hf-encoder": hf_encoder, "hf-window": hf_window}[name]
    backend = ring_rewrite.backend(compiler=compiler)

    def attend(q, k, v, pad):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=build(q, pad))

    compiled = torch.compile(attend, backend=backend, dynamic=True)
    bound = BOUND if dtype == torch.float32 else 1e-2
    for n in (33, 47, 64):
        g = torch.Generator().manual_seed(n)
        q, k, v, dout = (torch.randn(2, 4, n, 8, generator=g).to(dtype) for _ in range(4))
        pad = _padding(2, n)
        leaves = [x.double().requires_grad_() for x in (q, k, v)]
        ref = reference_attention(*leaves, key_bias=build(torch.empty(2, 1, n, 1), pad))
        expected = [ref, *torch.autograd.grad(ref, leaves, dout.double())]
        inputs = [x.requires_grad_() for x in (q, k, v)]
        seen.clear()
        out = compiled(*inputs, pad)
        got = [out, *torch.autograd.grad(out, inputs, dout)]
        errors = [rel_err(a.double(), b) for a, b in zip(got, expected)]
        assert max(errors) < bound, (name, n, errors)
        assert seen and set(seen) == {(n, n)}, (n, seen)
    (record,) = backend.records
    assert record.plan.bucketed and record.plan.n == 64
    assert record.reason.startswith("a bucket of 64: reads and writes the real rows only"), record.reason


# ---- ALiBi at length --------------------------------------------------------------------------


def _relative_alibi(q, k, v, scale):
    """Causal attention with ALiBi's dense bias ``slope_h * (t - p)`` in ``q``'s dtype: the
    accuracy a key bias ``slope_h * t`` must match (Note [Recentred key biases])."""
    i = torch.arange(q.shape[2])
    bias = slopes(q.shape[1]).view(1, -1, 1, 1) * (i[None, :] - i[:, None]).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(i[None, :] > i[:, None], float("-inf")))


def test_alibi_key_bias_is_as_accurate_as_the_dense_bias_at_length():
    """At 4,096 tokens ``slope_h * t`` reaches 2,048, where a float32 score keeps 4 bits after
    the point: added as it is the error is about 100x the dense bias's; recentred on each row's
    own bias it is the dense bias's, forward and backward."""
    import ring_rewrite
    from ring_rewrite.reference import reference_attention

    torch.manual_seed(0)
    n, scale = 4096, 0.25
    q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 2, n, 16)
    key_bias = (slopes(2).view(1, -1, 1, 1) * torch.arange(n).view(1, 1, 1, n)).double()
    ref = reference_attention(q, k, v, is_causal=True, scale=scale, key_bias=key_bias, query_chunk=1024)
    expected = [ref, *torch.autograd.grad(ref, (q, k, v), dout.double())]
    dense = _relative_alibi(q, k, v, scale)
    dense_errors = [rel_err(a, b) for a, b in zip((dense, *torch.autograd.grad(dense, (q, k, v), dout)), expected)]

    def attend(q, k, v):
        i = torch.arange(q.shape[2])
        bias = slopes(q.shape[1]).view(1, -1, 1, 1) * i.view(1, 1, 1, -1).to(q.dtype)
        mask = torch.where(i[None, :] <= i[:, None], 0.0, float("-inf")) + bias
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    torch._dynamo.reset()
    backend = ring_rewrite.backend()
    out = torch.compile(attend, backend=backend, fullgraph=True)(q, k, v)
    errors = [rel_err(a, b) for a, b in zip((out, *torch.autograd.grad(out, (q, k, v), dout)), expected)]
    assert backend.records[0].plan.recentred
    assert all(e <= 2 * d for e, d in zip(errors, dense_errors)), (errors, dense_errors)


def _given_min_fill(q, pad):
    """A float key-padding mask as it is given: 0 or ``finfo.min``."""
    return torch.zeros(pad.shape, dtype=q.dtype).masked_fill(~pad, torch.finfo(q.dtype).min)[:, None, None, :]


def _bert_min_fill(q, pad):
    """BERT's extended mask, a key bias ``(1 - pad) * finfo.min`` read from the graph."""
    return (1.0 - pad[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min


@pytest.mark.parametrize("build", [_given_min_fill, _bert_min_fill], ids=["given", "bert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finfo_min_fills_mask_as_minus_inf_where_a_segment_holds_only_masked_keys(build, dtype):
    """A dilated config; keys 16 to 31 masked with ``finfo.min``: rows 17, 19, .., 31 sit on no
    lattice of the rate-2 branch, so their only keys are masked ones and they attend to nothing
    (0, no gradient), as the same mask with ``-inf`` gives; forward and backward, inductor."""
    import ring_rewrite
    from ring_rewrite.reference import reference_attention

    n, segs, rates = 64, [16, 64], [1, 2]
    pad = torch.ones(2, n, dtype=torch.bool)
    pad[:, 16:32] = False
    pad[1, 40:44] = False
    q, k, v = (torch.randn(2, 2, n, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 2, n, 8, dtype=dtype)
    masked = torch.zeros(2, 1, 1, n, dtype=torch.float64).masked_fill(~pad[:, None, None, :], float("-inf"))
    ref = reference_attention(q, k, v, segment_lengths=segs, dilation_rates=rates, key_bias=masked)
    expected = [ref, *torch.autograd.grad(ref, (q, k, v), dout.double())]
    backend = ring_rewrite.backend(segment_lengths=segs, dilation_rates=rates)
    attend = torch.compile(lambda q, k, v, pad: F.scaled_dot_product_attention(q, k, v, attn_mask=build(q, pad)),
                           backend=backend, fullgraph=True)  # fmt: skip
    out = attend(q, k, v, pad)
    got = [out, *torch.autograd.grad(out, (q, k, v), dout)]
    assert backend.records[0].rewritten
    assert max(rel_err(a, b) for a, b in zip(got, expected)) < (BOUND if dtype == torch.float32 else 1e-12)


def test_a_band_over_values_given_as_inputs_is_checked_at_every_call():
    """``pos[t] <= pos[p]`` with ``pos`` an input is read as causal over position values: right
    where they count up by one (one document), and each call with values that do not (block ids,
    all equal, counting down) raises naming the site, never a band over other values; inductor."""
    import ring_rewrite

    n = 32
    q, k, v = (torch.randn(2, 2, n, 8, requires_grad=True) for _ in range(3))
    backend = ring_rewrite.backend()

    def attend(q, k, v, pos):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=pos[:, None, None, :] <= pos[:, None, :, None])

    compiled = torch.compile(attend, backend=backend)
    pos = torch.arange(n).expand(2, n) + 3
    expected = attend(*(x.double() for x in (q, k, v)), pos)
    assert rel_err(compiled(q, k, v, pos), expected) < BOUND
    assert backend.records[0].rewritten
    for pos in (torch.arange(n).expand(2, n) // 4, torch.zeros(2, n, dtype=torch.long), torch.arange(n).flip(0)[None]):
        with pytest.raises(ValueError, match="compares position values that do not step by one"):
            compiled(q, k, v, pos.expand(2, n))


def _causal_and_padding_min_fill(q, pad):
    """A float64 model's mask as transformers fills it: ``finfo(float64).min`` where causal or
    padding masks, the two parts added."""
    n, lowest = q.shape[2], torch.finfo(q.dtype).min
    i = torch.arange(n)
    causal = torch.zeros(n, n, dtype=q.dtype).masked_fill(i[None, :] > i[:, None], lowest)
    padding = torch.zeros(pad.shape, dtype=q.dtype).masked_fill(~pad, lowest)[:, None, None, :]
    return causal[None, None] + padding


@pytest.mark.parametrize("segs, rates", [(None, None), ([8, 32], [1, 2])], ids=["exact", "dilated"])
def test_float64_masks_at_the_dtypes_lowest_run(segs, rates):
    """``finfo(float64).min`` fills (a key bias and a causal part) compile and equal the float64
    reference of the same mask with ``-inf``; they overflowed a float32 scalar in the graph."""
    _check_documents(
        _causal_and_padding_min_fill, _left_pad(2, 48), segs, rates, "inductor", dtype=torch.float64, documents=False
    )


def _min_fills_on_ranks(rank, world):
    for dtype in (torch.float32, torch.float64):
        _check_documents(
            _causal_and_padding_min_fill, _left_pad(2, 64), [16, 64], [1, 2], "inductor", world=world, rank=rank,
            n=64, dtype=dtype, documents=False,
        )  # fmt: skip


def test_finfo_min_fills_across_ranks_match_reference():
    """The same fills (a key bias and a causal part at the dtype's lowest) at P = 2, replicated,
    dilated, under inductor, with gradients, float32 and float64."""
    run_ranks(2, _min_fills_on_ranks)


def test_a_dense_mask_at_a_symbolic_batch_bakes_no_symbol_into_the_graph():
    """Under dynamic shapes a mask's batch is a symbol too: the rewrite reads it from the
    graph's own node of it, never baking the value into its nodes (FX warns "Raw SymInt")."""
    import warnings

    import ring_rewrite

    backend = ring_rewrite.backend(compiler="aot_eager")

    def attend(q, pad):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=hf_causal(q, pad))

    compiled = torch.compile(attend, backend=backend, dynamic=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (33, 47):
            q = torch.randn(2, 4, n, 8, requires_grad=True)
            compiled(q, _padding(2, n)).sum().backward()
    assert not [w for w in caught if "Raw SymInt" in str(w.message)], [str(w.message) for w in caught]
    assert all(r.rewritten for r in backend.records), [r.reason for r in backend.records]
