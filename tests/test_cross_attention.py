"""Self or cross attention, decided by the graph's data flow, not by equal lengths
(docs/semantics.md, Self and cross attention; Note [Self or cross attention])."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from ring_rewrite.passes import UnsupportedSiteError
from ring_rewrite.testing import assert_left_alone, assert_rewritten, capture

from conftest import Capture

B, N, E, H = 2, 16, 32, 4
CROSS = "cross attention: query from x but key/value from memory"


def _heads(t: torch.Tensor, heads: int = H) -> torch.Tensor:
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)  # (B, H, N, D)


def _tokens(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).flatten(2)  # (B, N, H * D)


def _rope(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding at positions ``pos (B, N)``: elementwise with ``t``."""
    inv_freq = 10000.0 ** (-torch.arange(0, t.shape[-1], 2, dtype=torch.float32) / t.shape[-1])
    angles = (pos[:, None, :, None].float() * inv_freq).repeat(1, 1, 1, 2)
    t1, t2 = t.chunk(2, dim=-1)
    return t * angles.cos() + torch.cat([-t2, t1], dim=-1) * angles.sin()


class DecoderLayer(nn.Module):
    """Causal self attention over ``x``, then cross attention to ``memory``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.cross_q, self.cross_kv, self.cross_out = nn.Linear(E, E), nn.Linear(E, 2 * E), nn.Linear(E, E)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t) for t in self.qkv(x).chunk(3, -1))
        x = x + self.out(_tokens(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        k, v = (_heads(t) for t in self.cross_kv(memory).chunk(2, -1))
        return x + self.cross_out(_tokens(F.scaled_dot_product_attention(_heads(self.cross_q(x)), k, v)))


class Decoder(nn.Module):
    """Layer 2's stream depends on the memory through layer 1's cross attention."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(layers))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, memory)
        return x


@pytest.mark.parametrize("layers", [1, 2])
def test_equal_length_cross_attention_left_alone(layers):
    cap = capture(Decoder(layers), torch.randn(B, N, E), torch.randn(B, N, E), fullgraph=True)
    assert_rewritten(cap, layers)
    for i in range(layers):
        assert cap.records[2 * i].rewritten, cap.report
        record = assert_left_alone(cap, site=2 * i + 1, reason="cross attention")
        assert record.reason == CROSS
        assert f"layers.{i}" in record.location


def test_cross_attention_under_strict_raises():
    with pytest.raises(Exception, match="cannot be rewritten") as info:
        capture(Decoder(1), torch.randn(B, N, E), torch.randn(B, N, E), fullgraph=True, strict=True)
    error = info.value.inner_exception
    assert isinstance(error, UnsupportedSiteError) and CROSS in str(error)


# ---- left alone, and why --------------------------------------------------------------------


class Attention(nn.Module):
    """One attention site whose q, k, v the case's ``forward`` builds."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.q, self.kv = nn.Linear(E, E), nn.Linear(E, 2 * E)
        self.latents = nn.Parameter(torch.randn(N, E))

    def forward(self, x: torch.Tensor, memory: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        query = self.latents.expand(x.shape[0], -1, -1) if self.case == "latents" else x
        if self.case == "shifted-input":  # the encoder encodes x, the decoder reads x shifted
            q, k, v = (_heads(t) for t in (self.q(x), *self.kv(x).chunk(2, -1)))
            memory = x + _tokens(F.scaled_dot_product_attention(q, k, v))  # site 0: the encoder's
            query = x.roll(1, dims=1)
        if self.case == "pooled-memory":  # the stream sees the memory, but its rows are x's
            query = x + memory.mean(dim=1, keepdim=True)
        q = _heads(self.q(query))
        keys = x if self.case == "kv-cache" else memory
        k, v = (_heads(t) for t in self.kv(keys).chunk(2, -1))
        if self.case == "kv-cache":  # memory holds the keys and values of earlier tokens
            cached_k, cached_v = (_heads(t) for t in memory.chunk(2, -1))
            k, v = torch.cat([cached_k, k], dim=2), torch.cat([cached_v, v], dim=2)
        if self.case == "shared-positions":  # rotated at the same positions: still cross
            q, k = _rope(q, pos), _rope(k, pos)
        return F.scaled_dot_product_attention(q, k, v)


LEFT_ALONE = [
    pytest.param("cross", N, CROSS, id="cross"),
    pytest.param("cross", N // 2, CROSS, id="cross-shorter-memory"),
    pytest.param("shared-positions", N, "cross attention: query from pos, x but key/value from memory, pos",
                 id="shared-positions"),
    pytest.param("pooled-memory", N, "cross attention: query from memory, x but key/value from memory",
                 id="pooled-memory"),
    pytest.param("latents", N, "cross attention: query from no input (module state and constants only) "
                 "but key/value from memory", id="latents"),
    pytest.param("shifted-input", N, "cross attention: key/value come out of the attention at site 0 "
                 "(test_cross_attention.py:", id="shifted-input"),
]  # fmt: skip


@pytest.mark.parametrize("case, memory, reason", LEFT_ALONE)
def test_site_left_alone_with_its_reason(case, memory, reason):
    inputs = torch.randn(B, N, E), torch.randn(B, memory, E), torch.arange(N).expand(B, N)
    cap = capture(Attention(case), *inputs, fullgraph=True)
    site = len(cap.records) - 1  # the last: after the encoder's with "shifted-input"
    record = assert_left_alone(cap, site=site, reason=reason)
    assert counters["ring_rewrite"]["skipped"] == 1, record


def test_keys_of_a_cache_and_the_query_make_a_decode_step():
    """A query shorter than keys of the cache and its own sequence: self attention, rewritten as a
    decode step (tests/test_decode.py), never as cross attention."""
    inputs = torch.randn(B, N, E), torch.randn(B, N // 2, 2 * E), torch.arange(N).expand(B, N)
    cap = capture(Attention("kv-cache"), *inputs, fullgraph=True)
    (record,) = cap.records
    assert record.rewritten and record.decode, record


def test_raw_query_against_projected_keys_is_cross_attention():
    """The graph cannot tell what sequence a raw query came from: left alone, not rewritten."""
    kv = nn.Linear(E, 2 * E)

    def attend(q, x):
        return F.scaled_dot_product_attention(q, *(_heads(t) for t in kv(x).chunk(2, -1)))

    cap = capture(attend, torch.randn(B, H, N, E // H), torch.randn(B, N, E), fullgraph=True)
    assert_left_alone(cap, site=0, reason="cross attention: query from q but key/value from x")


# ---- rewritten as self attention ------------------------------------------------------------


class RopeGqaAttention(nn.Module):
    """Self attention with RoPE at ``position_ids`` (an input of its own) and GQA by repeating the
    key/value heads (expand + reshape)."""

    def __init__(self, kv_heads: int = 2) -> None:
        super().__init__()
        self.kv_heads = kv_heads
        self.q, self.kv = nn.Linear(E, E), nn.Linear(E, 2 * kv_heads * (E // H))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        q = _rope(_heads(self.q(x)), position_ids)
        k, v = (_heads(t, self.kv_heads) for t in self.kv(x).chunk(2, -1))
        k = _rope(k, position_ids)
        b, g, n, d = k.shape
        k, v = (t[:, :, None].expand(b, g, H // g, n, d).reshape(b, H, n, d) for t in (k, v))
        return _tokens(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class SharedKVLayers(nn.Module):
    """Two layers of self attention; the second reads the first's keys and values (cross-layer
    KV sharing): taken at an earlier layer of the query's own stream."""

    def __init__(self) -> None:
        super().__init__()
        self.q1, self.q2, self.kv = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, 2 * E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, v = (_heads(t) for t in self.kv(x).chunk(2, -1))
        x = x + _tokens(F.scaled_dot_product_attention(_heads(self.q1(x)), k, v, is_causal=True))
        return x + _tokens(F.scaled_dot_product_attention(_heads(self.q2(x)), k, v, is_causal=True))


def _raw(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def _raw_elementwise(q, k, v):
    """Views, casts and elementwise ops of their own; a second site on the first's output."""
    a = F.scaled_dot_product_attention((q * 0.5).float(), k.transpose(2, 3).transpose(2, 3), v + 1)
    return F.scaled_dot_product_attention(a, k, v)


def _qkv():
    return tuple(torch.randn(B, H, N, E // H) for _ in range(3))


REWRITTEN = [
    pytest.param(_raw, _qkv, 1, id="raw-inputs"),
    pytest.param(_raw_elementwise, _qkv, 2, id="raw-inputs-elementwise"),
    pytest.param(SharedKVLayers(), lambda: (torch.randn(B, N, E),), 2, id="kv-shared-across-layers"),
    pytest.param(RopeGqaAttention(), lambda: (torch.randn(B, N, E), torch.arange(N).expand(B, N)), 1,
                 id="rope-gqa"),
]  # fmt: skip


@pytest.mark.parametrize("fn, inputs, sites", REWRITTEN)
def test_self_attention_rewritten(fn, inputs, sites):
    cap = capture(fn, *inputs(), fullgraph=True, strict=True)
    assert_rewritten(cap, sites)
    assert counters["ring_rewrite"]["skipped"] == 0


def test_dynamic_lengths_bucket_self_attention_only():
    """The bucket pass pads a symbolic length in self attention, never in cross attention."""
    recorder = Capture()
    compiled = torch.compile(Decoder(1), backend=recorder, fullgraph=True, dynamic=True)
    compiled(torch.randn(B, N - 3, E), torch.randn(B, N - 3, E))
    self_site, cross_site = recorder.records
    assert self_site.passes == ("length_buckets", "rewrite_sdpa") and self_site.plan.n == N
    assert not cross_site.rewritten and cross_site.reason == CROSS
    assert counters["ring_rewrite"]["bucketed"] == 1


# ---- a real encoder-decoder -----------------------------------------------------------------


@pytest.mark.parametrize("decoder_input", [True, False], ids=["decoder-input-ids", "shifted-input-ids"])
def test_bart_cross_attention_left_alone_at_equal_lengths(decoder_input):
    """Without ``decoder_input_ids`` BART's decoder reads ``input_ids`` shifted right: its cross
    attention is told apart by the encoder's attention on the keys' way."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.BartForConditionalGeneration(config).eval()
    inputs = [torch.randint(4, 64, (2, 16)) for _ in range(1 + decoder_input)]

    def logits(input_ids, decoder_input_ids=None):
        return model(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits

    cap = capture(logits, *inputs)
    reason = (
        "cross attention: query from decoder_input_ids but key/value from input_ids" if decoder_input
        else "cross attention: key/value come out of the attention at site 1 "
    )  # fmt: skip
    for i in range(2):
        (encoder,) = [r for r in cap.records if f"encoder.layers.{i}.self_attn" in r.location]
        assert encoder.rewritten, cap.report
        assert_left_alone(cap, site=f"decoder.layers.{i}.encoder_attn", reason=reason)
    assert_rewritten(cap, 4)  # the encoder's and the decoder's self attention
    torch.testing.assert_close(cap.output, logits(*inputs))
