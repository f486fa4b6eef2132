"""End to end: ``torch.compile(backend="ring_dilated")`` on SDPA vs the float64 reference
(docs/semantics.md, Accuracy).

Every test compiles ``F.scaled_dot_product_attention`` with ``fullgraph=True`` (``aot_eager``
lowering unless it says inductor), checks that the site was rewritten, and compares the output
and the q/k/v gradients with ``ring_rewrite.reference.reference_attention``.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import ring_rewrite
from conftest import rel_err
from ring_rewrite.merge import merge_partials
from ring_rewrite.reference import connection_counts, reference_attention

TOL = 1e-5  # float32 (docs/semantics.md, Accuracy)

# name -> (segment_lengths, dilation_rates); None is the exact config.
CONFIGS = {
    "exact": None,
    "longnet": ([16, 32, 64], [1, 2, 4]),
    "one_branch": ([32], [1]),
    "rate8": ([8, 64], [1, 8]),
    "rate_first": ([64, 16], [2, 1]),  # branch order must not matter
}

# name -> (batch, hq, hkv, n, d, dv, scale)
SHAPES = {
    "mha_n100": (2, 4, 4, 100, 16, 16, None),
    "gqa8x2_n37": (1, 8, 2, 37, 8, 8, None),
    "gqa6x2_n50": (1, 6, 2, 50, 8, 8, None),  # g = 3 does not divide by r = 2 (or 4, 8)
    "d!=dv_scale_n64": (2, 2, 2, 64, 8, 12, 0.3),
}


def _options(config, compiler="aot_eager"):
    options = {"compiler": compiler}
    if config is not None:
        options["segment_lengths"], options["dilation_rates"] = config
    return options


def _sdpa(q, k, v, mask=None, *, is_causal=False, scale=None, enable_gqa=False):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )


def _compile(config, compiler="aot_eager", **sdpa_kwargs):
    fn = functools.partial(_sdpa, **sdpa_kwargs)
    return torch.compile(
        fn, backend="ring_dilated", options=_options(config, compiler), fullgraph=True
    )


def _inputs(batch, hq, hkv, n, d, dv, dtype=torch.float32):
    q = torch.randn(batch, hq, n, d, dtype=dtype)
    k = torch.randn(batch, hkv, n, d, dtype=dtype)
    v = torch.randn(batch, hkv, n, dv, dtype=dtype)
    return q, k, v


def _forward_backward(fn, q, k, v, dout, mask=None):
    """``fn``'s output and the gradients of ``<out, dout>`` w.r.t. q, k, v."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves) if mask is None else fn(*leaves, mask)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return out.detach(), grads


def _reference(config, q, k, v, dout, *, mask=None, is_causal=False, scale=None):
    seg, rates = config if config is not None else (None, None)
    ref = functools.partial(
        reference_attention,
        segment_lengths=seg,
        dilation_rates=rates,
        is_causal=is_causal,
        scale=scale,
        key_bias=mask,
    )
    return _forward_backward(ref, q.double(), k.double(), v.double(), dout.double())


def _assert_rewritten(sites=1):
    assert counters["ring_rewrite"]["rewritten"] == sites
    assert counters["ring_rewrite"]["skipped"] == 0


def _assert_close(got, expected, tol=TOL):
    out, grads = got
    ref_out, ref_grads = expected
    assert torch.isfinite(out).all()
    assert rel_err(out, ref_out) < tol, "out"
    for name, g, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, r) < tol, f"d{name}"


# ---- float32 grid -----------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_matches_reference(config, shape, is_causal):
    batch, hq, hkv, n, d, dv, scale = shape
    q, k, v = _inputs(batch, hq, hkv, n, d, dv)
    dout = torch.randn(batch, hq, n, dv)
    kwargs = dict(is_causal=is_causal, scale=scale, enable_gqa=hq != hkv)
    got = _forward_backward(_compile(config, **kwargs), q, k, v, dout)
    _assert_rewritten()
    _assert_close(got, _reference(config, q, k, v, dout, is_causal=is_causal, scale=scale))
    if config is None:
        # The exact config is plain SDPA.
        out, grads = got
        sdpa_out, sdpa_grads = _forward_backward(functools.partial(_sdpa, **kwargs), q, k, v, dout)
        assert rel_err(out, sdpa_out) < 1e-6
        for g, s in zip(grads, sdpa_grads):
            assert rel_err(g, s) < 1e-6


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("config", [CONFIGS["exact"], ([8, 16], [1, 2])], ids=["exact", "dilated"])
def test_one_key_value_head_without_enable_gqa(config, is_causal):
    """Multi-query attention as Falcon calls SDPA: one key/value head and no ``enable_gqa`` (SDPA
    broadcasts the head), rewritten as grouped-query attention with one group; under inductor,
    with gradients (dk and dv sum over every query head)."""
    batch, hq, hkv, n, d = 2, 4, 1, 37, 8
    q, k, v = _inputs(batch, hq, hkv, n, d, d)
    dout = torch.randn(batch, hq, n, d)
    got = _forward_backward(_compile(config, "inductor", is_causal=is_causal), q, k, v, dout)
    _assert_rewritten()
    _assert_close(got, _reference(config, q, k, v, dout, is_causal=is_causal))


# ---- local branches in head chunks ------------------------------------------------------------


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
@pytest.mark.parametrize(
    "config, shape, is_causal, mask",
    [
        (CONFIGS["longnet"], SHAPES["mha_n100"], False, "bool"),
        (CONFIGS["rate_first"], SHAPES["gqa8x2_n37"], False, "float"),  # g = 4: kv shared at r = 2
        (CONFIGS["longnet"], SHAPES["gqa6x2_n50"], True, None),  # g = 3: one kv head per query head
        (CONFIGS["exact"], SHAPES["d!=dv_scale_n64"], False, None),
    ],
    ids=["longnet-mha-bool", "rate_first-gqa4-float", "longnet-gqa3", "exact-d!=dv"],
)
def test_local_branches_in_head_chunks(config, shape, is_causal, mask, compiler, monkeypatch):
    """The local branches' backward runs one chunk of whole kv heads at a time, each chunk's sums
    written into the site's gradients before the next computes (Note [Head chunks of local
    branches]): here as many chunks as kv heads."""
    from ring_rewrite import site_plan

    monkeypatch.setattr(site_plan, "LOCAL_CHUNK_BYTES", 1)
    batch, hq, hkv, n, d, dv, scale = shape
    q, k, v = _inputs(batch, hq, hkv, n, d, dv)
    dout = torch.randn(batch, hq, n, dv)
    m = None if mask is None else _mask(mask, batch, hq, n)
    fn = _compile(config, compiler, is_causal=is_causal, scale=scale, enable_gqa=hq != hkv)
    got = _forward_backward(fn, q, k, v, dout, m)
    _assert_rewritten()
    _assert_close(got, _reference(config, q, k, v, dout, mask=m, is_causal=is_causal, scale=scale))


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
def test_local_head_chunks_in_bf16_are_cast_once(compiler, monkeypatch):
    """In bf16 a chunk's sums (float32) are cast once into the site's gradients
    (``ops.write_heads``); in float32 they add up in the site's gradients in place. Chunked or
    not, the gradients are the same sums rounded once."""
    from ring_rewrite import site_plan

    batch, hq, hkv, n, d = 2, 4, 2, 100, 16
    q, k, v = _inputs(batch, hq, hkv, n, d, d, dtype=torch.bfloat16)
    dout = torch.randn(batch, hq, n, d, dtype=torch.bfloat16)
    got = {}
    for chunk_bytes in (1 << 30, 1):
        monkeypatch.setattr(site_plan, "LOCAL_CHUNK_BYTES", chunk_bytes)
        torch._dynamo.reset()
        counters.clear()
        fn = _compile(CONFIGS["longnet"], compiler, is_causal=True, enable_gqa=True)
        got[chunk_bytes] = _forward_backward(fn, q, k, v, dout)
        _assert_rewritten()
    (out, grads), (chunked_out, chunked_grads) = got[1 << 30], got[1]
    assert all(g.dtype == torch.bfloat16 for g in chunked_grads)
    assert torch.equal(out, chunked_out)
    for whole, chunked in zip(grads, chunked_grads):
        assert rel_err(chunked, whole) < 1e-2


def test_local_chunks_are_whole_kv_heads_and_one_with_dropout(monkeypatch):
    from ring_rewrite import site_plan

    monkeypatch.setattr(site_plan, "LOCAL_CHUNK_BYTES", 1)
    kwargs = dict(batch=1, hq=6, hkv=2, n=64, d=8, dv=8, dtype=torch.float32, scale=0.3,
                  is_causal=True, has_mask=False, branches=((16, 1), (64, 2)))  # fmt: skip
    plan = site_plan.SitePlan.build(**kwargs)
    assert plan.local_chunks() == [(slice(0, 3), slice(0, 1)), (slice(3, 6), slice(1, 2))]
    whole = [(slice(0, 6), slice(0, 2))]
    assert site_plan.SitePlan.build(**kwargs, dropout=0.1).local_chunks() == whole
    monkeypatch.setattr(site_plan, "LOCAL_CHUNK_BYTES", 1 << 30)
    assert plan.local_chunks() == whole


# ---- key-padding masks ------------------------------------------------------------------------


def _mask(kind: str, batch: int, heads: int, n: int) -> torch.Tensor:
    if kind == "bool":  # keep-mask (B, 1, 1, N) with some padded keys
        mask = torch.ones(batch, 1, 1, n, dtype=torch.bool)
        mask[0, ..., -7:] = False
        mask[1, ..., 3:12] = False
        return mask
    if kind == "float":  # additive (B, H, 1, N), random
        return torch.randn(batch, heads, 1, n)
    assert kind == "empty_row"  # batch row 1 attends to nothing
    mask = torch.ones(batch, 1, 1, n, dtype=torch.bool)
    mask[0, ..., ::5] = False
    mask[1] = False
    return mask


@pytest.mark.parametrize("kind", ["bool", "float", "empty_row"])
@pytest.mark.parametrize(
    "config", [CONFIGS["exact"], CONFIGS["longnet"], CONFIGS["rate_first"]],
    ids=["exact", "longnet", "rate_first"],
)
def test_key_padding_mask(config, kind):
    batch, hq, hkv, n, d = 2, 4, 2, 50, 8
    q, k, v = _inputs(batch, hq, hkv, n, d, d)
    dout = torch.randn(batch, hq, n, d)
    mask = _mask(kind, batch, hq, n)
    fn = _compile(config, enable_gqa=True)
    got = _forward_backward(fn, q, k, v, dout, mask)
    _assert_rewritten()
    _assert_close(got, _reference(config, q, k, v, dout, mask=mask))
    if kind == "empty_row":
        out, (dq, dk, dv) = got
        assert (out[1] == 0).all(), "a batch row with every key masked outputs 0"
        assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()


# ---- bf16 -------------------------------------------------------------------------------------


def _same_function_sdpa(config, n, heads, *, is_causal, enable_gqa=False):
    """Plain SDPA computing the function of ``config`` (the dense form).

    For a dilated config: SDPA with the additive bias ``log c`` (causality folded in: c = 0 gives
    -inf). The bias stays float32 (SDPA takes a float mask for bf16 inputs; the CPU kernel is the
    same flash kernel with or without it), so the baseline carries no bias-rounding error.
    """
    if config is None:
        return functools.partial(_sdpa, is_causal=is_causal, enable_gqa=enable_gqa)
    counts = connection_counts(n, heads, list(zip(*config)), is_causal=is_causal)
    return functools.partial(_sdpa, mask=counts.log().float(), enable_gqa=enable_gqa)


def _errors(got, expected):
    """``{"out": .., "dq": .., "dk": .., "dv": ..}`` relative errors vs the float64 reference."""
    names = ["out", "dq", "dk", "dv"]
    tensors = [got[0], *got[1]]
    refs = [expected[0], *expected[1]]
    for name, t in zip(names, tensors):
        assert torch.isfinite(t).all(), name
    return {name: rel_err(t, r) for name, t, r in zip(names, tensors, refs)}


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "config, what",
    [
        pytest.param(CONFIGS["exact"], "out", id="exact-out"),
        pytest.param(CONFIGS["exact"], "grads", id="exact-grads"),
        pytest.param(CONFIGS["longnet"], "out", id="longnet-out"),
        pytest.param(CONFIGS["longnet"], "grads", id="longnet-grads"),
    ],
)
def test_bf16_no_worse_than_sdpa(config, what, is_causal):
    """In bf16, error vs the float64 reference <= 2x that of SDPA in bf16 computing the same
    function on the same inputs (``_same_function_sdpa``; docs/semantics.md, Accuracy)."""
    batch, hq, hkv, n, d = 2, 4, 2, 100, 16
    q, k, v = _inputs(batch, hq, hkv, n, d, d, dtype=torch.bfloat16)
    dout = torch.randn(batch, hq, n, d, dtype=torch.bfloat16)
    got = _forward_backward(_compile(config, is_causal=is_causal, enable_gqa=True), q, k, v, dout)
    _assert_rewritten()
    assert got[0].dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got[1])
    expected = _reference(config, q, k, v, dout, is_causal=is_causal)
    sdpa = _same_function_sdpa(config, n, hq, is_causal=is_causal, enable_gqa=True)
    ours = _errors(got, expected)
    theirs = _errors(_forward_backward(sdpa, q, k, v, dout), expected)
    for name in ["out"] if what == "out" else ["dq", "dk", "dv"]:
        assert ours[name] <= 2 * theirs[name], (name, ours[name], theirs[name])


@pytest.mark.parametrize("config", [CONFIGS["exact"], CONFIGS["longnet"]], ids=["exact", "longnet"])
def test_bf16_gradients_where_q_and_k_share_an_offset(config):
    """bfloat16 q and k sharing an offset (scores about 100): the true dq and dk cancel it, and
    a backward that reads out rounded to bfloat16 leaves them that rounding times |k| and |q|
    (aten's flash kernel does: tens of times its math kernel's error). Ours reads out as its
    blocks computed it (Note [Backward from the merged statistics]): within
    2x of SDPA's math kernel computing the same function."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, hq, n, d = 2, 4, 64, 16
    q, k, v = _inputs(batch, hq, hq, n, d, d)
    shared = torch.zeros(d)
    shared[0] = 10.0
    q, k, v = (q + shared).bfloat16(), (k + shared).bfloat16(), v.bfloat16()
    dout = torch.randn(batch, hq, n, d, dtype=torch.bfloat16)
    got = _forward_backward(_compile(config, is_causal=True), q, k, v, dout)
    _assert_rewritten()
    expected = _reference(config, q, k, v, dout, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        theirs = _errors(_forward_backward(_same_function_sdpa(config, n, hq, is_causal=True), q, k, v, dout), expected)
    ours = _errors(got, expected)
    for name in ("dq", "dk"):
        assert ours[name] <= 2 * theirs[name], (name, ours[name], theirs[name])


# ---- extreme inputs ---------------------------------------------------------------------------


def _extreme(regime: str, batch, hq, n, d):
    """Inputs whose scores reach magnitude 1e4.

    ``one_hot``: random q scaled up, so each softmax row is (nearly) one-hot: underflow hazards.
    ``offset``: q and k share one large direction, so every score is 1e4 + O(1) and the softmax
    stays spread: exp(1e4) overflows unless every max is subtracted.
    """
    q, k, v = _inputs(batch, hq, hq, n, d, d)
    if regime == "one_hot":
        scores = q @ k.transpose(-1, -2) * d**-0.5
        return q * (1e4 / scores.abs().max()), k, v
    common = torch.zeros(d)
    common[0] = (1e4 * d**0.5) ** 0.5  # q.k * scale = 1e4 along the shared direction
    return q + common, k + common, v


_EXTREME_XFAIL = pytest.mark.xfail(
    strict=True,
    reason="dilated config at |score| ~ 1e4: dq/dk up to ~13x the error of float32 SDPA computing "
    "the same function (2.5 vs 0.2 relative, one-hot rows; 2.8e-3 vs 7e-4 offset). The merged "
    "float32 lse is rounded at ulp(1e4) ~ 1e-3 and each branch's backward re-derives its "
    "probabilities from it. Outputs and the exact config are within bound; no NaN/inf anywhere.",
)


@pytest.mark.parametrize("regime", ["one_hot", "offset"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "config",
    [
        pytest.param(CONFIGS["exact"], id="exact"),
        pytest.param(CONFIGS["longnet"], id="longnet", marks=_EXTREME_XFAIL),
    ],
)
def test_extreme_scores(config, is_causal, regime):
    """No NaN or inf, and no worse than float32 SDPA computing the same function
    (docs/semantics.md, Accuracy).

    At |score| ~ 1e4 float32 resolves a score only to ~1e4 * 2**-24 ~ 6e-4, so no float32
    attention, SDPA included, meets 1e-5 vs float64 here (the exact config *is* SDPA's kernel and
    shows ~1e-3 in the offset regime). The attainable bar is the low-precision rule of
    docs/semantics.md, Accuracy: at most 2x the error of SDPA in the same dtype, floored at the
    float32 bound.
    """
    batch, hq, n, d = 1, 4, 64, 16
    q, k, v = _extreme(regime, batch, hq, n, d)
    assert (q @ k.transpose(-1, -2) * d**-0.5).abs().max() > 0.9e4
    dout = torch.randn(batch, hq, n, d)
    got = _forward_backward(_compile(config, is_causal=is_causal), q, k, v, dout)
    _assert_rewritten()
    expected = _reference(config, q, k, v, dout, is_causal=is_causal)
    ours = _errors(got, expected)  # also asserts no NaN / inf
    sdpa = _same_function_sdpa(config, n, hq, is_causal=is_causal)
    theirs = _errors(_forward_backward(sdpa, q, k, v, dout), expected)
    for name in ours:
        assert ours[name] <= max(TOL, 2 * theirs[name]), (name, ours[name], theirs[name])


@pytest.mark.parametrize("regime", ["one_hot", "offset"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_extreme_scores_finite(is_causal, regime):
    """The hard requirement for extreme inputs, on a dilated config: no NaN or inf
    (docs/semantics.md, Accuracy)."""
    config = CONFIGS["longnet"]
    batch, hq, n, d = 1, 4, 64, 16
    q, k, v = _extreme(regime, batch, hq, n, d)
    dout = torch.randn(batch, hq, n, d)
    got = _forward_backward(_compile(config, is_causal=is_causal), q, k, v, dout)
    _assert_rewritten()
    out, grads = got
    assert torch.isfinite(out).all()
    for g in grads:
        assert torch.isfinite(g).all()


def test_merge_weights_sum_to_one_at_large_lse():
    """Merging equal partial outputs must give that output back, whatever the lse magnitude."""
    out = torch.randn(2, 4, 5, 8)
    lse = 1e4 + torch.rand(2, 4, 5)
    merged, merged_lse = merge_partials([out, out, out], [lse, lse, lse - 0.3])
    assert rel_err(merged, out) < 1e-6
    expected_lse = torch.logsumexp(torch.stack([lse, lse, lse - 0.3]).double(), 0)
    assert (merged_lse.double() - expected_lse).abs().max() < 1e4 * 2**-22


# ---- dynamic sequence length ------------------------------------------------------------------


# Lengths 16 (static), then 24 (dynamo makes the length a symbol: bucket 32), 40 (bucket 64), 28
# and 32 (bucket 32 again): three graphs, where specialising compiles one per length.
LENGTHS = (16, 24, 40, 28, 32)


def _mask_of(kind: str, n: int):
    """A key-padding mask over ``n`` keys that masks some of them, or None."""
    if kind == "none":
        return None
    keep = torch.ones(2, 1, 1, n, dtype=torch.bool)
    keep[0, ..., 1::3] = False
    return keep if kind == "bool" else torch.where(keep, 0.5, float("-inf"))


@pytest.mark.parametrize(
    "config, is_causal, mask",
    [(CONFIGS["exact"], True, "none"), (([8, 16], [1, 2]), False, "none"), (([8, 16], [1, 2]), False, "bool"),
     (([8, 16], [1, 2]), False, "float")],
    ids=["exact-causal", "dilated", "dilated-bool-mask", "dilated-float-mask"],
)  # fmt: skip
def test_dynamic_sequence_length_compiles_one_graph_per_bucket(config, is_causal, mask):
    fn = _compile(config, is_causal=is_causal)
    for n in LENGTHS:
        q, k, v = _inputs(2, 2, 2, n, 8, 8)
        dout = torch.randn(2, 2, n, 8)
        m = _mask_of(mask, n)
        got = _forward_backward(fn, q, k, v, dout, m)
        _assert_close(got, _reference(config, q, k, v, dout, mask=m, is_causal=is_causal))
    assert counters["ring_rewrite"]["rewritten"] == 3
    assert counters["ring_rewrite"]["bucketed"] == 2
    assert counters["ring_rewrite"]["skipped"] == 0


@pytest.mark.parametrize("config", [CONFIGS["exact"], ([64, 256], [1, 4])], ids=["exact", "dilated"])
def test_twenty_random_lengths_compile_a_handful_of_graphs(config):
    """Twenty batches of random lengths from 100 to 1,000, as a collator padding each batch to its
    longest row makes them: the first length compiles a static graph, every later one the graph
    of its bucket ``(L/2, L]``, so at most five graphs, far from dynamo's recompile limit; every
    call equal to the float64 reference, gradients too."""
    rng = random.Random(0)
    lengths = [rng.randint(100, 1000) for _ in range(20)]
    fn = _compile(config, is_causal=True)
    for n in lengths:
        q, k, v = _inputs(1, 2, 2, n, 8, 8)
        dout = torch.randn(1, 2, n, 8)
        _assert_close(_forward_backward(fn, q, k, v, dout), _reference(config, q, k, v, dout, is_causal=True))
    buckets = {1 << (n - 1).bit_length() for n in lengths[1:] if n != lengths[0]}
    graphs = counters["ring_rewrite"]["rewritten"]
    assert graphs == 1 + len(buckets) <= 5 < torch._dynamo.config.recompile_limit, (lengths, graphs)
    assert counters["ring_rewrite"]["skipped"] == 0


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
@pytest.mark.parametrize("config", [CONFIGS["exact"], ([8, 32], [1, 4])], ids=["exact", "dilated"])
def test_bucketed_causal_site_computes_only_real_rows(config, compiler, monkeypatch):
    """A causal site padded to its bucket (Note [Padding to a bucket]):
    the local branches' kernel calls cover each head's real rows
    only, forward and backward, one graph for the bucket, and the results are the reference's."""
    from ring_rewrite import cpu_kernel

    calls = []
    for name in ("forward_in_place", "backward_in_place"):
        real_fn = getattr(cpu_kernel, name)

        def spy(results, inputs, layouts, sizes, nseg, *rest, _fn=real_fn, _name=name):
            calls.append((_name, sizes[0], sizes[1], sizes[3]))  # batch x segments, heads, rows
            return _fn(results, inputs, layouts, sizes, nseg, *rest)

        monkeypatch.setattr(cpu_kernel, name, spy)
    fn = torch.compile(functools.partial(_sdpa, is_causal=True), backend="ring_dilated",
                       options=_options(config, compiler), fullgraph=True, dynamic=True)  # fmt: skip
    branches = [(64, 1)] if config is None else list(zip(*config))
    batch, heads, bucket = 2, 4, 64
    for n in (33, 47, 64):
        calls.clear()
        q, k, v = _inputs(batch, heads, heads, n, 8, 8)
        dout = torch.randn(batch, heads, n, 8)
        _assert_close(_forward_backward(fn, q, k, v, dout), _reference(config, q, k, v, dout, is_causal=True))
        expected = []
        for w, r in branches:  # head j holds positions s * w + j % r + r * i of segment s
            seg = min(w, bucket)
            real = [[sum(s * seg + j % r + r * i < n for i in range(seg // r)) for j in range(heads)]
                    for s in range(bucket // seg)]  # fmt: skip
            whole = [s for s, rows in enumerate(real) if min(rows) == seg // r]
            expected += [(batch * len(whole), heads, seg // r)] * bool(whole)
            rest = real[len(whole)] if len(whole) < len(real) else []
            for rows in sorted(set(rest) - {0}):
                expected.append((batch, rest.count(rows), rows))
        for kind in ("forward_in_place", "backward_in_place"):
            ran = [c[1:] for c in calls if c[0] == kind]
            assert sorted(ran) == sorted(expected), (n, kind, calls)
            if n < bucket:
                assert sum(b * h * rows for b, h, rows in ran) < sum(batch * heads * bucket // r for _, r in branches)
    assert counters["ring_rewrite"]["bucketed"] == 1


@pytest.mark.parametrize("config", [None, ([16, 64], [1, 4])], ids=["exact", "dilated"])
def test_explain_says_what_a_bucket_computes_at_its_length(config):
    """``explain(..., dynamic=True)``: the site padded to its bucket says which share of the
    bucket's query-key pairs its kernel calls compute at the example's length, counted here from
    the positions each head's causal rows hold."""
    n, bucket, heads = 37, 64, 4
    segments, rates = config or (None, None)
    q, k, v = _inputs(2, heads, heads, n, 8, 8)
    report = ring_rewrite.explain(
        functools.partial(_sdpa, is_causal=True), q, k, v, dynamic=True, segment_lengths=segments, dilation_rates=rates
    )  # fmt: skip
    (record,) = report.records
    computed = whole = 0
    for w, r in [(bucket, 1)] if config is None else zip(*config):
        for s in range(bucket // w):
            for j in range(heads):  # head j's rows of segment s: positions s * w + j % r + r * i
                rows = sum(s * w + j % r + r * i < n for i in range(w // r))
                computed += rows * (rows + 1) // 2
                whole += (w // r) * (w // r + 1) // 2
    assert record.reason.startswith(f"a bucket of {bucket}: reads and writes the real rows only"), record.reason
    assert f"compiled at {n} positions: {computed / whole:.0%} of the bucket's" in record.reason, record.reason


def test_dynamic_sequence_length_specialised_without_buckets():
    options = {**_options(([8, 16], [1, 2])), "disable_passes": ["length_buckets"]}
    fn = torch.compile(_sdpa, backend="ring_dilated", options=options, fullgraph=True)
    for n in LENGTHS[:3]:
        q, k, v = _inputs(2, 2, 2, n, 8, 8)
        _assert_close(_forward_backward(fn, q, k, v, q), _reference(([8, 16], [1, 2]), q, k, v, q))
    assert counters["ring_rewrite"]["rewritten"] == 3 and not counters["ring_rewrite"]["bucketed"]


# ---- inductor ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, n", [(([16, 32], [1, 2]), 48), (([16, 64], [2, 1]), 64)], ids=["padded", "rate-1-last"]
)
def test_inductor_multi_branch_causal_gqa(config, n):
    # At 64 tokens the local branches run in place (Note [Local branches in place]), the first
    # at rate 2: the running out and lse start empty, and the rate-1 branch merges into them.
    batch, hq, hkv, d = 1, 4, 2, 16
    q, k, v = _inputs(batch, hq, hkv, n, d, d)
    dout = torch.randn(batch, hq, n, d)
    fn = _compile(config, compiler="inductor", is_causal=True, enable_gqa=True)
    got = _forward_backward(fn, q, k, v, dout)
    _assert_rewritten()
    _assert_close(got, _reference(config, q, k, v, dout, is_causal=True))


# ---- NaN and empty inputs ---------------------------------------------------------------------


def _nan_rows(x: torch.Tensor) -> torch.Tensor:
    return x.isnan().any(-1)


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_nan_reaches_the_rows_sdpa_reaches(is_causal, compiler):
    """A NaN in q, k or v reaches the rows that attend to it, in the reference (both of its
    paths) and in the rewritten attention, and so in SDPA, with one exception: SDPA's flash
    kernel multiplies a NaN value by probability 0 (the rows before it, under ``is_causal``,
    within one kernel block), which the definition, and our kernel, leave alone."""
    fn = _compile(None, compiler=compiler, is_causal=is_causal)
    for where in ("q", "k", "v"):
        q, k, v = _inputs(1, 2, 2, 40, 8, 8)
        x = {"q": q, "k": k, "v": v}[where]
        with torch.no_grad():
            x[0, 1, 17] = float("nan")
        sdpa = _nan_rows(F.scaled_dot_product_attention(q, k, v, is_causal=is_causal))
        ours = _nan_rows(fn(q, k, v))
        connected = torch.zeros_like(sdpa)
        if where == "q":
            connected[0, 1, 17] = True
        else:
            connected[0, 1, 17 if is_causal else 0 :] = True
        for chunk in (None, 7):
            ref = reference_attention(q, k, v, is_causal=is_causal, query_chunk=chunk)
            assert torch.equal(_nan_rows(ref), connected), (where, chunk)
        assert torch.equal(ours, connected), where
        if not (is_causal and where == "v"):
            assert torch.equal(connected, sdpa), where


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
@pytest.mark.parametrize("config", [None, ([8, 16], [1, 2])], ids=["exact", "dilated"])
def test_batch_of_zero_gives_empty_results(config, compiler):
    fn = _compile(config, compiler=compiler, is_causal=True)
    q, k, v = _inputs(0, 2, 2, 32, 8, 8)
    out, grads = _forward_backward(fn, q, k, v, torch.randn(0, 2, 32, 8))
    _assert_rewritten()
    assert [tuple(x.shape) for x in (out, *grads)] == [(0, 2, 32, 8)] * 4
