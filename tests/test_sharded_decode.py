"""Sharded decoding (Note [A sharded KV cache] in ring_rewrite/decode.py): ``prefill`` leaves each
rank its part of the prompt's KV cache, and every decode step attends each rank's keys at their
positions and merges the ranks' partial results. Greedy generation must equal recomputing the
dilated model in float64 on the whole prefix at every step; what cannot be rewritten raises."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ring_rewrite
from conftest import rel_err
from ranks import run_ranks
from ring_rewrite.decode import sharded_keys
from ring_rewrite.passes import UnsupportedSiteError
from ring_rewrite.reference import reference_attention

DILATED = ([8, 16], [1, 2])
EXACT = (None, None)

# ---- a Hugging Face model's generate() on P ranks ------------------------------------------------

# Llama: grouped K/V heads, full rotary, separate q/k/v projections. GPT-NeoX: one fused qkv
# projection chunked into q, k, v, partial rotary, no grouped heads, parallel residual.
_FIELDS = {"Llama": {"num_key_value_heads": 2}, "GPTNeoX": {}}


def _lm(name: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)  # the same weights in the parent (reference) and on every rank
    config = getattr(transformers, f"{name}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        attn_implementation="sdpa", pad_token_id=0, eos_token_id=None, **_FIELDS[name],
    )  # fmt: skip
    return getattr(transformers, f"{name}ForCausalLM")(config).eval()


def _reference_tokens(name, ids, steps, segs, rates):
    """Greedy tokens of the dilated model in float64, recomputed on the whole prefix at every step
    (the dense float64 reference in place of SDPA)."""

    def reference_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert attn_mask is None  # prompts without padding: transformers passes is_causal alone
        out = reference_attention(
            q, k, v, segment_lengths=segs, dilation_rates=rates, is_causal=is_causal, scale=scale
        )
        return out.to(q.dtype)

    model = _lm(name).double()
    with torch.no_grad(), mock.patch.object(F, "scaled_dot_product_attention", reference_sdpa):
        for _ in range(steps):
            logits = model(ids, use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def _generate_on_a_rank(rank, world, cases, check_errors):
    for name, layout, (segs, rates), ids, steps, want in cases:
        torch._dynamo.reset()
        model = _lm(name)
        backend = ring_rewrite.backend(segment_lengths=segs, dilation_rates=rates, sharding="sharded", layout=layout)
        model.forward = torch.compile(model.forward, backend=backend)  # inductor
        cache = ring_rewrite.prefill(model, ids, layout=layout, multiple_of=max(rates or [1]))
        with torch.no_grad():
            got = model.generate(ids, cache=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        every = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(every, got)
        what = f"{name} {layout} {segs} rank {rank}/{world}"
        assert all(torch.equal(other, got) for other in every), (what, every)
        assert torch.equal(got, want), (what, got, want)

        # The decode steps were rewritten: the first length, then one symbolic length; two layers.
        decode = [r for r in backend.records if r.decode]
        assert 2 <= len(decode) <= 4 and all(r.rewritten for r in backend.records), (what, backend.records)

        # Every rank's cache holds ceil(length / P) of the prompt's keys (less its last token; the
        # ranks evened out, Note [An even cache]) and one key per step fed; the ranks' prompt
        # positions are the prompt's, each once, and only rank 0 attends the new tokens.
        length = ids.shape[1] - 1
        share = -(-length // world)
        new = torch.arange(length, length + steps) if rank == 0 else torch.full((steps,), -1)
        for layer in cache.layers:
            assert layer.keys.shape[2] == layer.values.shape[2] == share + steps, (what, layer.keys.shape)
            assert torch.equal(layer.positions[share:], new), (what, layer.positions)
            every = [torch.empty_like(layer.positions) for _ in range(world)]
            dist.all_gather(every, layer.positions)
            prompt = torch.cat([p[:share] for p in every])
            assert torch.equal(prompt[prompt >= 0].sort().values, torch.arange(length)), (what, every)
        assert cache.get_seq_length() == length + steps

        if check_errors:
            # A left-padded prompt's mask at a decode step indexes the keys as one sequence.
            keep = torch.ones(got.shape, dtype=torch.long)
            keep[1, :2] = 0
            with torch.no_grad(), pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
                model.generate(got, attention_mask=keep, cache=cache, max_new_tokens=1, do_sample=False)
            assert isinstance(info.value.inner_exception, UnsupportedSiteError), info.value
            assert "attn_mask" in str(info.value), info.value
            # The model uncompiled: the cache's keys reach plain SDPA.
            with torch.no_grad(), pytest.raises(RuntimeError, match="ShardedCache"):
                type(model).forward(model, input_ids=got[:, -1:], cache=cache)


def _case(name, layout, config, batch, n, steps):
    torch.manual_seed(n)
    ids = torch.randint(1, 64, (batch, n))
    return name, layout, config, ids, steps, _reference_tokens(name, ids, steps, *config)


def test_generate_from_a_sharded_cache_on_two_ranks_zigzag():
    """P = 2, zigzag. Llama, dilated: 12 prompt tokens padded to 16 (rank 0 holds 0-3 and four
    padding tokens, rank 1 4-11, so rank 1 sends two to rank 0), steps at 12 .. 19 crossing the
    16-token segment. GPT-NeoX, exact: 6 padded to 8 (2 and 4 prompt tokens, evened to 3). Then the errors of a decode step that cannot run over a sharded cache."""
    cases = [
        _case("Llama", "zigzag", DILATED, batch=2, n=13, steps=8),
        _case("GPTNeoX", "zigzag", EXACT, batch=2, n=7, steps=5),
    ]
    run_ranks(2, _generate_on_a_rank, cases, True)


def test_generate_from_a_sharded_cache_on_four_ranks_contiguous():
    """P = 4, contiguous, GPT-NeoX, dilated: 18 prompt tokens padded to 32, so ranks 0 and 1 hold
    8, rank 2 two and rank 3 padding only, evened out to at most 5 each; steps at 18 .. 25 cross the 8-token segment at 24.
    (One model: every compile runs on four ranks.)"""
    case = _case("GPTNeoX", "contiguous", DILATED, batch=2, n=19, steps=8)
    run_ranks(4, _generate_on_a_rank, [case], False)


# ---- one decode step at the graph level ----------------------------------------------------------


class ShardedStep(nn.Module):
    """A decode step whose keys are this rank's part of a sharded cache."""

    def forward(self, q, k, v, key_positions, query_positions):
        keys = sharded_keys(k, key_positions, query_positions, "contiguous", 2)
        return F.scaled_dot_product_attention(q, keys, v, enable_gqa=True)


def _global_step(n):
    """A step's query at position ``n - 1`` and the keys and values of positions ``0 .. n - 1``,
    the same on every rank."""
    torch.manual_seed(0)
    b, hq, hkv, d = 2, 4, 2, 8
    return torch.randn(b, hq, 1, d), torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)


def _parts(n, world):
    """Each rank's positions: the cached ``0 .. n - 2`` dealt out in a shuffled order, the new
    token ``n - 1`` on rank 0, and padding (-1) of different lengths."""
    torch.manual_seed(1)
    order = torch.randperm(n - 1)
    parts = [order[r::world] for r in range(world)]
    parts[0] = torch.cat([parts[0], torch.tensor([n - 1])])
    return [torch.cat([p, torch.full((2 + r,), -1)]) for r, p in enumerate(parts)]


def _step_on_a_rank(rank, world, n, configs):
    q, k, v = _global_step(n)
    at = _parts(n, world)[rank]
    # Padding keys and values that would swamp the result if they were attended.
    k_mine = torch.where((at >= 0).view(1, 1, -1, 1), k[:, :, at.clamp_min(0)], 50.0)
    v_mine = torch.where((at >= 0).view(1, 1, -1, 1), v[:, :, at.clamp_min(0)], 1e3)
    for segs, rates in configs:
        torch._dynamo.reset()
        backend = ring_rewrite.backend(segment_lengths=segs, dilation_rates=rates, sharding="sharded")  # inductor
        with torch.no_grad():
            out = torch.compile(ShardedStep(), backend=backend)(q, k_mine, v_mine, at, torch.tensor([n - 1]))
        (record,) = backend.records
        assert record.decode and record.rewritten, record
        full_q = torch.cat([torch.zeros(q.shape[0], q.shape[1], n - 1, q.shape[3]), q], 2)
        ref = reference_attention(full_q, k, v, segment_lengths=segs, dilation_rates=rates)[:, :, -1:]
        assert out.dtype == q.dtype and out.shape == q.shape
        assert rel_err(out, ref) < 1e-5, (rank, segs, rel_err(out, ref))


def test_sharded_step_equals_the_reference_on_two_ranks():
    """P = 2 under inductor: each rank holds keys at shuffled positions, padding (-1) included,
    and the merged step equals the float64 reference's last row over all the keys."""
    parts = _parts(21, 2)
    assert sorted(torch.cat(parts).tolist()) == [-1] * 5 + list(range(21))
    run_ranks(2, _step_on_a_rank, 21, [DILATED, EXACT])


# ---- what cannot run over a sharded cache raises ---------------------------------------------------


def test_the_marker_run_eagerly_raises():
    q, k, v = _global_step(5)
    with pytest.raises(RuntimeError, match="ShardedCache"):
        ShardedStep()(q, k, v, torch.arange(5), torch.tensor([4]))


@pytest.fixture
def fake_ranks():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _compile_error(module, *args, grad=False, **config):
    backend = ring_rewrite.backend(**config)  # inductor; the error comes before it runs
    with torch.set_grad_enabled(grad), pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(module, backend=backend)(*args)
    assert isinstance(info.value.inner_exception, UnsupportedSiteError), info.value
    return str(info.value.inner_exception)


def _step_inputs():
    q, k, v = _global_step(9)
    return q, k[:, :, :5], v[:, :, :5], torch.tensor([0, 1, 6, 7, 8]), torch.tensor([8])


def test_replicated_mode_with_a_sharded_cache_raises(fake_ranks):
    message = _compile_error(ShardedStep(), *_step_inputs(), sharding="replicated")
    assert "sharding='replicated'" in message and "sharded cache" in message, message


def test_sharded_step_with_a_mask_raises(fake_ranks):
    class Masked(ShardedStep):
        def forward(self, q, k, v, key_positions, query_positions, mask):
            keys = sharded_keys(k, key_positions, query_positions, "contiguous", 2)
            return F.scaled_dot_product_attention(q, keys, v, attn_mask=mask, enable_gqa=True)

    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    mask[..., 0] = False
    message = _compile_error(Masked(), *_step_inputs(), mask, sharding="sharded")
    assert "attn_mask" in message, message


def test_a_cache_of_another_layout_raises(fake_ranks):
    """A cache prefilled with one layout, decoded by a backend of another: its positions would be
    read against the wrong shards, so the first step raises before any token."""
    message = _compile_error(ShardedStep(), *_step_inputs(), sharding="sharded", layout="zigzag")
    assert "layout='contiguous' over 2 ranks" in message and "layout='zigzag'" in message, message


def test_sharded_step_with_gradients_raises(fake_ranks):
    q, k, v, at, new = _step_inputs()
    message = _compile_error(ShardedStep(), q.requires_grad_(), k, v, at, new, grad=True, sharding="sharded")
    assert "torch.no_grad" in message, message


def test_prefill_of_one_token_raises():
    with pytest.raises(ValueError, match="N >= 2"):
        ring_rewrite.prefill(nn.Identity(), torch.tensor([[5]]))
