"""Decode steps (docs/semantics.md, Decode steps): a query shorter than its keys computes the last
rows of the site's function, one graph for every cache length, so that greedy generation equals
recomputing the dilated model on the whole prefix."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ring_rewrite
from conftest import rel_err
from ring_rewrite.decode import decode_attention
from ring_rewrite.reference import reference_attention
from ring_rewrite.testing import assert_left_alone, capture

CONFIGS = [(None, None), ([8, 16], [1, 2]), ([4, 8, 64], [1, 2, 4])]


@pytest.mark.parametrize("segs, rates", CONFIGS, ids=["exact", "two-branches", "three-branches"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "key-mask"])
def test_decode_rows_are_the_last_rows_of_the_function(segs, rates, m, masked):
    b, hq, hkv, n, d = 2, 4, 2, 37, 8
    q, k, v = torch.randn(b, hq, n, d), torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    keep = torch.ones(b, 1, 1, n, dtype=torch.bool)
    keep[1, ..., :5] = False
    keep[0, ..., 3::7] = False
    mask = keep if masked else None
    branches = [(1 << 62, 1)] if segs is None else list(zip(segs, rates))
    bias = None if mask is None else torch.where(mask, 0.0, float("-inf"))
    out = decode_attention(q[:, :, -m:], k, v, bias, branches=branches, scale=d**-0.5, is_causal=False)
    for causal in (False, True) if m == 1 else (False,):  # the last row: causal or not, the same
        ref = reference_attention(q, k, v, segment_lengths=segs, dilation_rates=rates, is_causal=causal, key_bias=mask)
        assert rel_err(out, ref[:, :, -m:]) < 1e-5


@pytest.mark.parametrize("segs, rates", CONFIGS, ids=["exact", "two-branches", "three-branches"])
def test_decode_fills_at_the_dtypes_lowest_mask_as_minus_inf(segs, rates):
    """A key bias of ``finfo.min`` masks as ``-inf`` does, also in a row it masks whole (a
    branch's segment of padding only, or every key): that row attends to nothing, 0."""
    b, hq, hkv, n, d = 2, 4, 2, 37, 8
    q, k, v = torch.randn(b, hq, 1, d), torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    keep = torch.ones(b, 1, 1, n, dtype=torch.bool)
    keep[0, ..., 16:] = False  # the last row's segment of 8 or 16 keys is all padding
    keep[1] = False  # every key
    branches = [(1 << 62, 1)] if segs is None else list(zip(segs, rates))
    out = [
        decode_attention(q, k, v, torch.zeros(keep.shape).masked_fill(~keep, fill), branches=branches, scale=0.3,
                         is_causal=False)  # fmt: skip
        for fill in (float("-inf"), torch.finfo(torch.float32).min)
    ]
    assert torch.equal(out[0], out[1])
    assert not out[1][1].any()


def test_decode_with_alibi_at_length_is_as_accurate_as_the_dense_bias():
    """ALiBi's key bias ``slope_h * t`` reaches 2,048 at 8,192 tokens: a decode row adds it less
    its largest value, so it is as accurate as the dense ``slope_h * (t - p)`` (a float32 score
    of 2,048 keeps 4 bits after the point)."""
    torch.manual_seed(0)
    n, d = 8192, 16
    q, k, v = (torch.randn(1, 2, n, d) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25]).view(1, 2, 1, 1)
    t = torch.arange(n)
    key_bias, dense = slopes * t.view(1, 1, 1, n), slopes * (t - (n - 1)).view(1, 1, 1, n)
    whole = [(1 << 62, 1)]
    ref = decode_attention(*(x.double() for x in (q[:, :, -1:], k, v, key_bias)), branches=whole, scale=0.25, is_causal=False)
    got = decode_attention(q[:, :, -1:], k, v, key_bias, branches=whole, scale=0.25, is_causal=False)
    as_dense = decode_attention(q[:, :, -1:], k, v, dense, branches=whole, scale=0.25, is_causal=False)
    assert rel_err(got, ref) <= 2 * rel_err(as_dense, ref) + 1e-7


class CachedAttention(nn.Module):
    """One attention layer with a KV cache, as a decoder's step calls it: q from the new tokens,
    k and v the cache with the new tokens' keys appended. With one key/value head it is
    multi-query attention, called without ``enable_gqa`` (SDPA broadcasts that head)."""

    def __init__(self, dim=16, heads=4, kv_heads=4):
        super().__init__()
        self.head_dim, self.kv_heads = dim // heads, kv_heads
        self.q = nn.Linear(dim, dim)
        self.k, self.v = (nn.Linear(dim, kv_heads * self.head_dim) for _ in range(2))

    def split(self, x):
        return x.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def forward(self, x, cache_k, cache_v, mask=None):
        k = torch.cat([cache_k, self.split(self.k(x))], 2)
        v = torch.cat([cache_v, self.split(self.v(x))], 2)
        out = F.scaled_dot_product_attention(self.split(self.q(x)), k, v, attn_mask=mask)
        return out, k, v


def _step(model, n, m=1):
    x = torch.randn(2, m, 16)
    cache_k, cache_v = (torch.randn(2, model.kv_heads, n - m, model.head_dim) for _ in range(2))
    return x, cache_k, cache_v


def _reference_step(model, x, cache_k, cache_v, segs, rates, mask=None):
    """The same step's rows from the dense float64 reference over the whole prefix (the cache's
    queries are not needed: only the last rows are compared)."""
    with torch.no_grad():
        k = torch.cat([cache_k, model.split(model.k(x))], 2)
        v = torch.cat([cache_v, model.split(model.v(x))], 2)
        q = model.split(model.q(x))
        full_q = torch.cat([torch.zeros(2, 4, k.shape[2] - q.shape[2], 4), q], 2)
        ref = reference_attention(full_q, k, v, segment_lengths=segs, dilation_rates=rates, key_bias=mask)
    return ref[:, :, -q.shape[2]:]


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
def test_one_graph_for_every_cache_length(compiler):
    segs, rates = [8, 16], [1, 2]
    model = CachedAttention()
    backend = ring_rewrite.backend(segment_lengths=segs, dilation_rates=rates, compiler=compiler)
    compiled = torch.compile(model, backend=backend)
    lengths = range(5, 5 + torch._dynamo.config.recompile_limit + 4)  # past the recompile limit
    for n in lengths:
        x, ck, cv = _step(model, n)
        out, _, _ = compiled(x, ck, cv)
        assert rel_err(out, _reference_step(model, x, ck, cv, segs, rates)) < 1e-5, n
    # The first length, then one symbolic length for every later one (dynamo's automatic dynamic).
    assert len(backend.records) == 2 and all(r.rewritten and r.decode for r in backend.records)


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "multi-query"])
def test_decode_with_a_key_mask(kv_heads):
    segs, rates = [8, 16], [1, 2]
    model = CachedAttention(kv_heads=kv_heads)
    x, ck, cv = _step(model, 21)
    keep = torch.ones(2, 1, 1, 21, dtype=torch.bool)
    keep[1, ..., :4] = False
    cap = capture(model, x, ck, cv, keep, segment_lengths=segs, dilation_rates=rates)
    assert cap.records[0].decode and cap.records[0].rewritten, cap.records
    out, _, _ = torch.compile(model, backend=ring_rewrite.backend(segment_lengths=segs, dilation_rates=rates))(
        x, ck, cv, keep
    )
    assert rel_err(out, _reference_step(model, x, ck, cv, segs, rates, keep)) < 1e-5


def test_decode_step_left_alone_where_it_is_not_the_last_rows():
    class CausalStep(CachedAttention):
        def forward(self, x, cache_k, cache_v):
            k = torch.cat([cache_k, self.split(self.k(x))], 2)
            v = torch.cat([cache_v, self.split(self.v(x))], 2)
            return F.scaled_dot_product_attention(self.split(self.q(x)), k, v, is_causal=True)

    model = CausalStep()
    assert_left_alone(capture(model, *_step(model, 9, m=2)), site=0, reason="SDPA aligns it top-left")


def test_decode_step_in_sharded_mode_raises():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model = CachedAttention()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        backend = ring_rewrite.backend(compiler="eager", sharding="sharded")
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="a decode step over a whole KV cache in sharded mode"):
            torch.compile(model, backend=backend)(*_step(model, 9))
    finally:
        dist.destroy_process_group()


# ---- a Hugging Face model's generate() ------------------------------------------------------------


def _recompute(model, ids, keep, steps, segs, rates, monkeypatch):
    """Greedy tokens from the dilated model run on the whole prefix at every step (the float64
    reference in place of SDPA), positions as ``generate`` makes them."""

    def reference_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        out = reference_attention(
            q, k, v, segment_lengths=segs, dilation_rates=rates, is_causal=is_causal, scale=scale, key_bias=attn_mask
        )
        return out.to(q.dtype)

    with torch.no_grad(), monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", reference_sdpa)
        for _ in range(steps):
            positions = (keep.cumsum(-1) - 1).clamp_min(0)
            logits = model(ids, attention_mask=keep, position_ids=positions, use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
            keep = torch.cat([keep, torch.ones(2, 1, dtype=keep.dtype)], 1)
    return ids


def _lm(name: str, **fields):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = getattr(transformers, f"{name}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa", pad_token_id=0, eos_token_id=None, **fields,
    )  # fmt: skip
    return getattr(transformers, f"{name}ForCausalLM")(config).eval()


@pytest.mark.parametrize(
    "name, fields", [("Llama", {}), ("Mistral", {"sliding_window": 4})], ids=["llama", "mistral-sliding-cache"]
)
def test_generate_equals_recomputing_the_dilated_model(name, fields, monkeypatch):
    """Llama's cache holds the whole prefix; Mistral's holds the last W - 1 keys and its mask
    places them (``masks.decode_positions``): both decode steps compute the dilated model's last
    row at the tokens' own positions, past dynamo's recompile limit, with left padding."""
    segs, rates = [8, 16], [1, 2]
    model = _lm(name, **fields)
    ids = torch.randint(1, 64, (2, 11))
    keep = torch.ones(2, 11, dtype=torch.long)
    keep[1, :3] = 0  # left padding
    steps = torch._dynamo.config.recompile_limit + 4
    want = _recompute(model, ids, keep, steps, segs, rates, monkeypatch)
    backend = ring_rewrite.backend(segment_lengths=segs, dilation_rates=rates, compiler="aot_eager")
    model.forward = torch.compile(model.forward, backend=backend)
    with torch.no_grad():
        got = model.generate(ids, attention_mask=keep, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    assert torch.equal(got, want)
    decode = [r for r in backend.records if r.decode]
    assert decode and all(r.rewritten for r in backend.records), backend.records
    assert len(backend.records) <= 3 * 2  # prefill, first step, every later step; two layers


def test_dilated_decode_with_a_static_cache_is_left_alone():
    """A static cache writes the new keys into a buffer (index_copy_, a static input): where
    they sit is not in the graph, so under a dilated config its decode steps are left alone
    (the buffer reads as no sequence of the query's: cross attention, or keys not appended)."""
    model = _lm("Llama")
    ids = torch.randint(1, 64, (2, 11))
    backend = ring_rewrite.backend(segment_lengths=[8, 16], dilation_rates=[1, 2], compiler="aot_eager")
    model.forward = torch.compile(model.forward, backend=backend)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, cache_implementation="static")
    steps = [r for r in backend.records if r.shapes["query"][2] == 1]
    reasons = ("not a cache with the new tokens appended", "cross attention")
    assert steps and all(not r.rewritten and any(x in r.reason for x in reasons) for r in steps), steps


def _decode_on_a_rank(rank, world):
    segs, rates = [8, 16], [1, 2]
    torch.manual_seed(0)  # every rank the same model and inputs (replicated mode)
    model = CachedAttention()
    x, ck, cv = _step(model, 21, m=2)
    x.requires_grad_()
    ck.requires_grad_()
    backend = ring_rewrite.backend(segment_lengths=segs, dilation_rates=rates)  # inductor
    out, _, _ = torch.compile(model, backend=backend)(x, ck, cv)
    (record,) = backend.records
    assert record.decode and record.rewritten
    k = torch.cat([ck, model.split(model.k(x))], 2)
    v = torch.cat([cv, model.split(model.v(x))], 2)
    q = model.split(model.q(x))
    full_q = torch.cat([torch.zeros(2, 4, k.shape[2] - 2, 4), q], 2)
    ref = reference_attention(full_q, k, v, segment_lengths=segs, dilation_rates=rates)[:, :, -2:]
    dout = torch.randn(out.shape)
    got = torch.autograd.grad(out, (x, ck), dout)
    want = torch.autograd.grad(ref, (x, ck), dout.double())
    assert rel_err(out, ref) < 1e-5
    assert max(rel_err(a, b) for a, b in zip(got, want)) < 1e-5


def test_decode_step_across_ranks_with_gradients():
    """At P = 2 (replicated mode) a decode step runs on every rank, under inductor, gradients
    included, against the float64 reference."""
    from ranks import run_ranks

    run_ranks(2, _decode_on_a_rank)
