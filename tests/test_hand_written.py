"""Attention written by hand becomes SDPA (``passes/hand_written.py``), then is rewritten.

Every spelling of Note [Hand-written attention] is a small module below (``SPELLINGS``). Each
is checked on its dynamo graph (the pass alone: one SDPA node, the arguments it should have,
the same outputs), then together in one model (``Mixed``: one compile per config), forward and
gradients, equal to eager in the exact config and to the float64 reference in the dilated one,
under inductor at P = 1 and at P = 2 (``INDUCTOR``: each spelling in both configs and at both P). transformers' "eager" attention gives the same
sites and results as its "sdpa"; sites that are not SDPA's function are left alone with their
reason.

Every module: batch 2, 16 tokens, width 32, 4 heads of 8 (GQA: 2 or 1 key/value heads), right
padding (no row without a key), eval mode unless a test says otherwise."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import ring_rewrite
from ring_rewrite import RingDilatedConfig, reference_attention
from ring_rewrite.passes.find_sdpa import SDPA_TARGETS
from ring_rewrite.passes.hand_written import ROLE, find_hand_written_sites, hand_written_to_sdpa

from conftest import Capture, rel_err
from ranks import run_ranks

B, N, E, H, D = 2, 16, 32, 4, 8
BOUND = 1e-5
CONFIGS = {"exact": {}, "dilated": {"segment_lengths": [8, 16], "dilation_rates": [1, 2]}}
LOWEST = torch.finfo(torch.float32).min


def _pad() -> torch.Tensor:
    """(B, N) keep-mask: right padding, 4 and 7 keys masked."""
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[0, 12:] = False
    keep[1, 9:] = False
    return keep


def _causal(n: int = N) -> torch.Tensor:
    q = torch.arange(n)[:, None]
    return torch.arange(n)[None, :] <= q


# ---- the spellings ------------------------------------------------------------------------------


class Spelling(nn.Module):
    """Projections around one attention written by hand (``attend``). With ``reference`` set (a
    config dict) the attention is ``reference_attention`` in float64 instead, with the
    semantics the spelling has: ``causal``, the padding as a key mask where ``padded``."""

    causal = False
    padded = False
    kv_heads = H

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(E, E)
        self.k = nn.Linear(E, self.kv_heads * D)
        self.v = nn.Linear(E, self.kv_heads * D)
        self.o = nn.Linear(E, E)
        self.reference: dict | None = None

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(B, N, H, D).transpose(1, 2)
        k = self.k(x).view(B, N, self.kv_heads, D).transpose(1, 2)
        v = self.v(x).view(B, N, self.kv_heads, D).transpose(1, 2)
        if self.reference is None:
            out = self.attend(q, k, v, keep)
        else:
            bias = keep[:, None, None, :] if self.padded else None
            out = reference_attention(
                q, k, v, is_causal=self.causal, key_bias=bias, scale=D**-0.5,
                segment_lengths=self.reference.get("segment_lengths"),
                dilation_rates=self.reference.get("dilation_rates"),
            ).to(x.dtype)  # fmt: skip
        return self.o(out.transpose(1, 2).reshape(B, N, E))

    def attend(self, q, k, v, keep):
        raise NotImplementedError


class Matmul(Spelling):
    """``q @ k.transpose(-2, -1) * (1 / sqrt(d))``, no mask."""

    def attend(self, q, k, v, keep):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        return F.softmax(att, dim=-1) @ v


class NanoGPT(Spelling):
    """nanoGPT's slow path: a ``tril`` buffer, ``masked_fill(bias[..] == 0, -inf)``, dropout."""

    causal = True

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64))
        self.attn_dropout = nn.Dropout(dropout)

    def attend(self, q, k, v, keep):
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        return att @ v


class MatmulMtDiv(Spelling):
    """``torch.matmul(q, k.mT) / sqrt(d)``, an additive key-padding bias of ``finfo.min``."""

    padded = True

    def attend(self, q, k, v, keep):
        bias = torch.zeros(B, 1, 1, N).masked_fill(~keep[:, None, None, :], LOWEST)
        scores = torch.matmul(q, k.mT) / math.sqrt(D) + bias
        return scores.softmax(-1).matmul(v)


class ScaledQueryPretransposedKey(Spelling):
    """timm's ``q * scale`` and a key stored transposed ``(B, H, D, N)``."""

    def attend(self, q, k, v, keep):
        kt = k.transpose(-1, -2).contiguous()
        attn = torch.matmul(q * D**-0.5, kt)
        return attn.softmax(dim=-1) @ v


class ScaledKeyFloat32(Spelling):
    """The scale on ``k``; transformers' eager mask ``where(allowed, 0, finfo.min)`` (causal and
    padding) added; softmax in float32, cast back."""

    causal = padded = True

    def attend(self, q, k, v, keep):
        allowed = _causal()[None, None] & keep[:, None, None, :]
        mask = torch.where(allowed, torch.zeros((), dtype=q.dtype), LOWEST)
        scores = q @ (k * D**-0.5).transpose(2, 3) + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)


class Bmm(Spelling):
    """Heads folded into the batch: ``bmm`` over ``(B*H, N, D)``, the key mask on the 4-D view."""

    padded = True

    def attend(self, q, k, v, keep):
        q3, k3, v3 = (t.reshape(B * H, N, D) for t in (q, k, v))
        scores = torch.bmm(q3, k3.transpose(1, 2)) * D**-0.5
        scores = scores.view(B, H, N, N).masked_fill(~keep[:, None, None, :], float("-inf")).view(B * H, N, N)
        return torch.bmm(scores.softmax(-1), v3).view(B, H, N, D)


class Baddbmm(Spelling):
    """GPT-2's ``_upcast_and_reordered_attn``: ``baddbmm(empty, q, k, beta=0, alpha=scale)``
    on float32 copies, then ``where(bias, s, full([], finfo.min))`` of a bool ``tril`` buffer."""

    causal = True

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(64, 64, dtype=torch.bool)).view(1, 1, 64, 64))

    def attend(self, q, k, v, keep):
        w = torch.empty(B * H, N, N, dtype=torch.float32)
        q3, k3 = q.reshape(-1, N, D), k.transpose(-1, -2).reshape(-1, D, N)
        w = torch.baddbmm(w, q3.float(), k3.float(), beta=0, alpha=D**-0.5).reshape(B, H, N, N)
        causal = self.bias[:, :, :N, :N]
        w = torch.where(causal, w, torch.full([], LOWEST, dtype=w.dtype))
        w = nn.functional.softmax(w, dim=-1).type(v.dtype)
        return torch.matmul(w, v)


class Einsum(Spelling):
    """``einsum`` in ``(B, N, H, D)`` layout, output in that layout too."""

    def attend(self, q, k, v, keep):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).transpose(1, 2)


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


class RepeatKv(Spelling):
    """transformers' eager GQA: ``repeat_kv`` and the causal padding mask added."""

    causal = padded = True
    kv_heads = 2

    def attend(self, q, k, v, keep):
        k, v = _repeat_kv(k, 2), _repeat_kv(v, 2)
        allowed = _causal()[None, None] & keep[:, None, None, :]
        mask = torch.where(allowed, torch.zeros(()), LOWEST)
        w = torch.matmul(q, k.transpose(2, 3)) * D**-0.5 + mask
        return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


class RepeatInterleave(Spelling):
    kv_heads = 2

    def attend(self, q, k, v, keep):
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        return (q @ k.transpose(-2, -1) * D**-0.5).softmax(-1) @ v


class ExpandOneHead(Spelling):
    """Multi-query attention: one key/value head ``expand``-ed over the query heads."""

    kv_heads = 1

    def attend(self, q, k, v, keep):
        k, v = k.expand(-1, H, -1, -1), v.expand(-1, H, -1, -1)
        return (q @ k.transpose(-2, -1) / math.sqrt(D)).softmax(-1) @ v


class InPlace(Spelling):
    """In-place forms: ``s *= scale``, ``s.masked_fill_(~causal, -inf)`` of a ``tril``."""

    causal = True

    def attend(self, q, k, v, keep):
        s = q @ k.transpose(-1, -2)
        s *= D**-0.5
        s.masked_fill_(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
        return s.softmax(-1) @ v


SPELLINGS: dict[str, type[Spelling]] = {
    "matmul": Matmul,
    "nanogpt": NanoGPT,
    "matmul_mT_div": MatmulMtDiv,
    "scaled_query_pretransposed_key": ScaledQueryPretransposedKey,
    "scaled_key_float32": ScaledKeyFloat32,
    "bmm": Bmm,
    "baddbmm": Baddbmm,
    "einsum": Einsum,
    "repeat_kv": RepeatKv,
    "repeat_interleave": RepeatInterleave,
    "expand_one_head": ExpandOneHead,
    "in_place": InPlace,
}
# What the SDPA node the pass makes should say: (is_causal, the mask's dtype or None, enable_gqa).
EXPECTED_SDPA = {
    "matmul": (False, None, False),
    "nanogpt": (True, None, False),
    "matmul_mT_div": (False, torch.float32, False),
    "scaled_query_pretransposed_key": (False, None, False),  # the scale stays on q: SDPA's is 1
    "scaled_key_float32": (False, torch.float32, False),  # the scale stays on k
    "bmm": (False, torch.bool, False),
    "baddbmm": (True, None, False),
    "einsum": (False, None, False),
    "repeat_kv": (False, torch.float32, True),
    "repeat_interleave": (False, None, True),
    "expand_one_head": (False, None, True),
    "in_place": (False, torch.bool, False),
}


def _build(name: str) -> Spelling:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return SPELLINGS[name]().eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(B, N, E, generator=torch.Generator().manual_seed(1)), _pad()


def _on_graph(fn, inputs, check) -> None:
    """``check(gm, example_inputs)`` on the dynamo graph of ``fn(*inputs)``, untouched by any pass,
    inside the backend (where dynamo's placeholders still name the module state they hold)."""
    seen = []

    def backend(gm, example_inputs):
        check(gm, list(example_inputs))
        seen.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    assert len(seen) == 1


def _sdpa_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]


# ---- each spelling, on its graph ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spelling_becomes_one_sdpa_computing_the_same(name):
    model = _build(name)

    def check(gm, inputs):
        (expected,) = gm(*inputs)
        assert len(find_hand_written_sites(gm)) == 1
        assert hand_written_to_sdpa(gm, inputs, config=RingDilatedConfig()) is gm
        assert counters["ring_rewrite"]["hand_written"] == 1
        assert not gm.meta.get("ring_rewrite_sites"), gm.meta.get("ring_rewrite_sites")
        (sdpa,) = _sdpa_nodes(gm)
        assert not [n for n in gm.graph.nodes if "softmax" in str(n.target)]
        causal, mask, gqa = EXPECTED_SDPA[name]
        kwargs = sdpa.kwargs
        assert kwargs["is_causal"] is causal and kwargs["enable_gqa"] is gqa
        on_inputs = name in ("scaled_query_pretransposed_key", "scaled_key_float32")
        assert kwargs["scale"] == pytest.approx(1.0 if on_inputs else D**-0.5)
        got_mask = kwargs["attn_mask"]
        assert (None if got_mask is None else got_mask.meta["example_value"].dtype) == mask
        assert kwargs["dropout_p"] == 0.0
        q = sdpa.args[0].meta["example_value"]
        k = sdpa.args[1].meta["example_value"]
        assert tuple(q.shape) == (B, H, N, D) and tuple(k.shape) == (B, model.kv_heads, N, D)
        made = [n for n in gm.graph.nodes if "ring_rewrite" in n.meta]
        assert sdpa in made and all(n.meta["ring_rewrite"] == {"site": 0, "role": ROLE} for n in made)
        assert rel_err(gm(*inputs)[0], expected) < BOUND

    _on_graph(model, _inputs(), check)


@pytest.mark.parametrize("training", [True, False])
def test_dropout_reaches_sdpa_only_in_training(training):
    model = NanoGPT(dropout=0.25).train(training)

    def check(gm, inputs):
        hand_written_to_sdpa(gm, inputs, config=RingDilatedConfig())
        (sdpa,) = _sdpa_nodes(gm)
        assert sdpa.kwargs["dropout_p"] == (0.25 if training else 0.0)
        assert not [n for n in gm.graph.nodes if n.target is F.dropout]

    _on_graph(model, _inputs(), check)


class WindowBuffer(nn.Module):
    """A sliding window of 4 from a bool buffer, and a key-padding mask: two masks, one SDPA mask."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        ones = torch.ones(64, 64)
        self.register_buffer("window", (torch.tril(ones) - torch.tril(ones, -4)).bool())

    def forward(self, x, keep):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, H, D).transpose(1, 2) for t in self.qkv(x).split(E, 2))
        att = (q @ k.transpose(-2, -1)) * D**-0.5
        att = att.masked_fill(~self.window[:n, :n], float("-inf"))
        att = att.masked_fill(~keep[:, None, None, :], float("-inf"))
        return (att.softmax(-1) @ v).transpose(1, 2).reshape(b, n, E)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_band_from_a_buffer_is_read_at_every_length(dynamic):
    """The window (a band of t - p read from the buffer's values) and the padding reach the rewrite
    as one mask; at a symbolic length the buffer is read to its end, so lengths share a bucket."""
    model = WindowBuffer()
    backend = ring_rewrite.backend(compiler="eager")
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    for n in (16, 20, 24):
        x = torch.randn(B, n, E)
        keep = torch.ones(B, n, dtype=torch.bool)
        keep[1, n - 2 :] = False  # every window keeps a key
        assert rel_err(compiled(x, keep), model(x, keep)) < BOUND, n
    assert len(backend.records) == (3 if not dynamic else 2)  # 16, then 20 and 24 in the bucket 32
    for record in backend.records:
        assert record.rewritten and record.plan.is_causal and record.plan.band == (-3, None), record
        assert record.passes == ("hand_written", *(("length_buckets",) if dynamic else ()), "rewrite_sdpa")


# ---- every spelling in one model, under inductor at P = 1 and P = 2 ----------------------------


class Mixed(nn.Module):
    """Spellings side by side on one input: one graph, one site each."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.spellings = nn.ModuleDict({name: _build(name) for name in names})

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x, keep) for m in self.spellings.values()])


# NOTE: an inductor compile costs ~5 s a site here, so each spelling runs in one config at P = 1
# and in the other at P = 2: every spelling in both configs and at both P, every mask kind's plan
# in both configs at both P (what the pass makes depends on neither).
_NAMES = sorted(SPELLINGS)
INDUCTOR = {
    ("exact", 1): _NAMES[0::2], ("dilated", 1): _NAMES[1::2],
    ("exact", 2): _NAMES[1::2], ("dilated", 2): _NAMES[0::2],
}  # fmt: skip


def _mixed(names: list[str], config: dict | None = None) -> Mixed:
    """The model; with ``config`` its float64 reference (``Spelling.reference``)."""
    model = Mixed(names).eval()
    if config is not None:
        model = model.double()
        for m in model.spellings.values():
            m.reference = config
    return model


def _loss(out: torch.Tensor) -> torch.Tensor:
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    return (out * weights.to(out.dtype)).sum()


def _forward_backward(model: nn.Module, runner=None, dtype=torch.float32):
    x, keep = _inputs()
    x = x.to(dtype).requires_grad_()
    out = (model if runner is None else runner)(x, keep)
    _loss(out).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return out.detach(), {"x": x.grad, **grads}


def _check_mixed(config_name: str, compiler: str, names: list[str]) -> None:
    """The compiled model against eager (exact) or the float64 reference (dilated): every
    spelling's output and every gradient."""
    config = CONFIGS[config_name]
    torch._dynamo.reset()
    model = _mixed(names)
    backend = ring_rewrite.backend(compiler=compiler, **config)
    got = _forward_backward(model, torch.compile(model, backend=backend, fullgraph=True))
    records = backend.records
    assert len(records) == len(names), records
    assert all(r.rewritten and r.passes == ("hand_written", "rewrite_sdpa") for r in records), records
    reference = _mixed(names, config or None)
    expected = _forward_backward(reference, dtype=torch.float64 if config else torch.float32)
    for i, name in enumerate(names):
        assert rel_err(got[0][i], expected[0][i]) < BOUND, (config_name, compiler, name)
    largest = max(g.abs().max().item() for g in expected[1].values())
    for key, grad in expected[1].items():
        if key.endswith(".k.bias"):
            # NOTE: a key bias shifts every score of a row alike, which softmax ignores: its
            # gradient is 0 up to rounding, measured against the largest gradient.
            error = (got[1][key].double() - grad.double()).abs().max().item() / largest
        else:
            error = rel_err(got[1][key], grad)
        assert error < BOUND, (config_name, compiler, key, error)


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_spellings_match_under_inductor(config_name):
    _check_mixed(config_name, "inductor", INDUCTOR[config_name, 1])


def _two_ranks(rank: int, world: int) -> None:
    for config_name in sorted(CONFIGS):
        _check_mixed(config_name, "inductor", INDUCTOR[config_name, 2])


def test_spellings_match_under_inductor_on_two_ranks():
    run_ranks(2, _two_ranks)  # one pair of processes for both configs


# ---- sites left alone ---------------------------------------------------------------------------


class Softcap(Matmul):
    """Gemma 2's softcap: ``tanh`` on the scores."""

    def attend(self, q, k, v, keep):
        s = q @ k.transpose(-2, -1) * D**-0.5
        s = torch.tanh(s / 50.0) * 50.0
        return s.softmax(-1) @ v


class RelativeBias(Matmul):
    """T5: a learned bias per head and relative position, added to unscaled scores."""

    def __init__(self) -> None:
        super().__init__()
        self.relative = nn.Embedding(2 * N - 1, H)

    def attend(self, q, k, v, keep):
        relative = torch.arange(N)[None, :] - torch.arange(N)[:, None] + N - 1
        bias = self.relative(relative).permute(2, 0, 1)[None]
        return (q @ k.transpose(-2, -1) + bias).softmax(-1) @ v


class ApproximateFill(Matmul):
    """A fill of -1e9: it masks only while the scores stay far above it."""

    def attend(self, q, k, v, keep):
        s = (q @ k.transpose(-2, -1)) * D**-0.5
        return s.masked_fill(~_causal(), -1e9).softmax(-1) @ v


class ReturnsProbabilities(Matmul):
    """The probabilities are an output too (``output_attentions=True``)."""

    def forward(self, x, keep):
        self.probs = None
        return super().forward(x, keep), self.probs

    def attend(self, q, k, v, keep):
        self.probs = (q @ k.transpose(-2, -1) * D**-0.5).softmax(-1)
        return self.probs @ v


def _alibi(keep: torch.Tensor) -> torch.Tensor:
    """ALiBi from the padding, as Falcon and BLOOM build it: ``(B, H, 1, N)``, a slope per head
    times the key's position among the kept keys."""
    slopes = 2.0 ** -torch.arange(1, H + 1, dtype=torch.float32)
    position = (keep.long().cumsum(-1) - 1) * keep.long()
    return slopes[None, :, None, None] * position[:, None, None, :].float()


class MaskThenScale(Matmul):
    """A mask, then the scale: ``masked_fill(s, ~causal, -inf) / sqrt(d)``."""

    def attend(self, q, k, v, keep):
        s = (q @ k.transpose(-2, -1)).masked_fill(~_causal(), float("-inf"))
        return (s / math.sqrt(D)).softmax(-1) @ v


class LearnedTemperatureAfterBias(Matmul):
    """``(s + alibi) * t`` with ``t`` a parameter: SDPA's mask would take no gradient to ``t``."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.tensor(D**-0.5))

    def attend(self, q, k, v, keep):
        return ((q @ k.transpose(-2, -1) + _alibi(keep)) * self.t).softmax(-1) @ v


class AddedToThemselves(Matmul):
    """``s + s``: no bias (the pass reads no scale spelled as a sum)."""

    def attend(self, q, k, v, keep):
        s = q @ k.transpose(-2, -1) * (0.5 * D**-0.5)
        return (s + s).softmax(-1) @ v


LEFT_ALONE = {
    "softcap": (Softcap, "a softcap (tanh) on the scores"),
    "learned_bias": (RelativeBias, "a bias on the scores that requires grad"),
    "approximate_fill": (ApproximateFill, "the scores are masked with -1e+09, not -inf"),
    "returns_probabilities": (ReturnsProbabilities, "the attention probabilities are used elsewhere"),
    "mask_then_scale": (MaskThenScale, "the scores are scaled after a mask is applied"),
    "learned_temperature_after_bias": (
        LearnedTemperatureAfterBias, "the scores are scaled after a bias by a tensor that requires grad"
    ),
    "added_to_themselves": (AddedToThemselves, "the scores are added to themselves"),
}


@pytest.mark.parametrize("case", sorted(LEFT_ALONE))
def test_left_alone_with_the_reason(case):
    cls, reason = LEFT_ALONE[case]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = cls().eval()
    recorder = Capture()
    x, keep = _inputs()
    got = torch.compile(model, backend=recorder, fullgraph=True)(x, keep)
    (record,) = recorder.records
    assert not record.rewritten and record.kind == "hand_written", record
    assert record.reason.startswith(reason), record.reason
    assert record.passes == () and counters["ring_rewrite"]["hand_written"] == 0
    assert not _sdpa_nodes(recorder.graphs[0])
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(model(x, keep))):
        torch.testing.assert_close(a, b)


def test_a_bias_that_needs_the_query_position_is_left_alone():
    """T5's relative bias without gradients (eval, no_grad): no mask the rewrite reads."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = RelativeBias().eval()
    recorder = Capture()
    with torch.no_grad():
        torch.compile(model, backend=recorder, fullgraph=True)(*_inputs())
    (record,) = recorder.records
    assert record.reason.startswith("a bias on the scores that needs the query position"), record.reason


def test_a_disabled_pass_leaves_every_site_alone_and_strict_raises():
    model = _build("matmul")
    recorder = Capture(disable_passes=["hand_written"])
    torch.compile(model, backend=recorder, fullgraph=True)(*_inputs())
    (record,) = recorder.records
    assert record.reason == "pass hand_written is disabled (disable_passes)" and record.kind == "hand_written"
    torch._dynamo.reset()
    softcap = Softcap().eval()
    backend = ring_rewrite.backend(compiler="eager", strict=True)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="a softcap"):
        torch.compile(softcap, backend=backend, fullgraph=True)(*_inputs())


def test_the_report_names_the_pass():
    recorder = Capture()
    torch.compile(_build("nanogpt"), backend=recorder, fullgraph=True)(*_inputs())
    (row,) = ring_rewrite.Report(recorder.records).rows()
    assert row["passes"] == "hand_written, rewrite_sdpa" and row["status"] == "rewritten"
    assert row["kind"] == "sdpa" and recorder.records[0].plan.is_causal  # the tril buffer, read


# ---- transformers: "eager" as "sdpa" ------------------------------------------------------------

V = 64


def _ids() -> torch.Tensor:
    return torch.randint(3, V, (B, N), generator=torch.Generator().manual_seed(1))


def _left_padding() -> torch.Tensor:
    """Left padding in one row: its first three queries have no key (SDPA gives them 0)."""
    mask = torch.ones(B, N, dtype=torch.long)
    mask[1, :3] = 0
    return mask


def _hf(name: str, impl: str) -> tuple[nn.Module, object, str]:
    """A tiny random-init model (tests/test_zoo.py's sizes), how it is called, and the regular
    expression of its parameters whose gradient is 0 up to rounding (a key bias)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=V, hidden_size=E, intermediate_size=64, num_hidden_layers=2, num_attention_heads=H,
            num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, attn_implementation=impl,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
        return model.eval(), lambda m: m(_ids(), attention_mask=_left_padding(), use_cache=False).logits, ""
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=V, n_embd=E, n_layer=2, n_head=H, n_positions=64, initializer_range=0.2,
            bos_token_id=1, eos_token_id=2, attn_implementation=impl,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
        return model.eval(), lambda m: m(_ids(), attention_mask=_left_padding(), use_cache=False).logits, ""
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=E, num_hidden_layers=2, num_attention_heads=H, intermediate_size=64,
        max_position_embeddings=64, initializer_range=0.2, attn_implementation=impl,
    )  # fmt: skip
    model = transformers.BertModel(cfg)
    keep = _pad().long()
    return model.eval(), lambda m: m(_ids(), attention_mask=keep).last_hidden_state, r"\.key\.bias$"


def _run_hf(model, call, runner=None):
    for p in model.parameters():
        p.grad = None
    out = call(model if runner is None else runner)
    _loss(out).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _hf_compiled(name: str, impl: str, **config):
    model, call, _ = _hf(name, impl)
    torch._dynamo.reset()
    backend = ring_rewrite.backend(compiler="aot_eager", **config)
    result = _run_hf(model, call, torch.compile(model, backend=backend))
    sites = [
        (r.location.split(" (")[0], r.rewritten, r.reason, r.plan and (r.plan.is_causal, r.plan.band))
        for r in backend.records
    ]
    return result, sites, list(backend.records)


def _hf_errors(got, expected, zero: str) -> float:
    import re

    (out, grads), (ref, ref_grads) = got, expected
    largest = max(g.abs().max().item() for g in ref_grads.values())
    errors = [rel_err(out, ref)]
    for key, grad in ref_grads.items():
        if zero and re.search(zero, key):
            errors.append((grads[key] - grad).abs().max().item() / largest)
        else:
            errors.append(rel_err(grads[key], grad))
    return max(errors)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_transformers_eager_is_rewritten_as_sdpa(name):
    """The same sites, rewritten alike, and the same outputs and gradients as "sdpa": against
    eager "sdpa" in the exact config (rows without a key give 0, as SDPA's), and against
    "sdpa" compiled in the dilated config."""
    zero = _hf(name, "sdpa")[2]
    expected = _run_hf(*_hf(name, "sdpa")[:2])
    got, sites, records = _hf_compiled(name, "eager")
    _, sdpa_sites, _ = _hf_compiled(name, "sdpa")
    assert sites == sdpa_sites and all(r.passes == ("hand_written", "rewrite_sdpa") for r in records), sites
    assert len(sites) == 2 and all(rewritten for _, rewritten, _, _ in sites), sites
    assert _hf_errors(got, expected, zero) < BOUND
    if name == "llama":  # GQA, rotary positions, a causal band and a key mask
        config = CONFIGS["dilated"]
        got, sites, _ = _hf_compiled(name, "eager", **config)
        expected, sdpa_sites, _ = _hf_compiled(name, "sdpa", **config)
        assert sites == sdpa_sites
        assert _hf_errors(got, expected, zero) < BOUND


def test_bloom_alibi_is_rewritten_and_equal_to_eager():
    """BLOOM has no "sdpa" path: its eager attention (``alibi.baddbmm(batch1=q, batch2=kt)``, the
    key bias ``slope_h * t``, a float causal mask) is read as SDPA with a recentred key bias and
    equals eager, padded on the right (a left-padded row with no key differs: docs/semantics.md,
    Accuracy)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=V, hidden_size=E, n_layer=2, n_head=H, initializer_range=0.2)
    model = transformers.BloomForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    keep = torch.ones(B, N, dtype=torch.long)
    keep[0, N - 3 :] = 0

    def call(m):
        return m(_ids(), attention_mask=keep, use_cache=False).logits

    expected = _run_hf(model, call)
    torch._dynamo.reset()
    backend = ring_rewrite.backend()
    got = _run_hf(model, call, torch.compile(model, backend=backend))
    assert len(backend.records) == 2
    records = backend.records
    assert all(r.rewritten and r.plan.recentred and r.passes == ("hand_written", "rewrite_sdpa") for r in records)
    assert _hf_errors(got, expected, "") < BOUND


def test_transformers_output_attentions_is_left_alone():
    model, _, _ = _hf("llama", "eager")
    recorder = Capture()
    call = lambda m: m(_ids(), attention_mask=_left_padding(), use_cache=False, output_attentions=True)  # noqa: E731
    got = call(torch.compile(model, backend=recorder))
    expected = call(model)
    assert len(recorder.records) == 2
    for record in recorder.records:
        assert not record.rewritten and record.kind == "hand_written"
        assert record.reason.startswith("the attention probabilities are used elsewhere"), record.reason
    torch.testing.assert_close(got.logits, expected.logits)
    for a, b in zip(got.attentions, expected.attentions):
        torch.testing.assert_close(a, b)


def test_transformers_softcap_and_learned_bias_are_left_alone():
    """Gemma 2 (softcap) and T5 (a learned relative position bias), as transformers runs them."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=V, hidden_size=E, intermediate_size=64, num_hidden_layers=1, num_attention_heads=H,
        num_key_value_heads=2, head_dim=D, attn_implementation="eager",
    )).eval()  # fmt: skip
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=V, d_model=E, d_kv=D, d_ff=64, num_layers=1, num_heads=H, attn_implementation="eager",
    )).eval()  # fmt: skip
    for model, reason in ((gemma, "a softcap (tanh) on the scores"), (t5, "a bias on the scores that requires grad")):
        torch._dynamo.reset()
        recorder = Capture()
        torch.compile(model, backend=recorder)(_ids(), attention_mask=torch.ones(B, N, dtype=torch.long))
        assert recorder.records and all(r.reason.startswith(reason) for r in recorder.records), recorder.records


# ---- a key bias scaled with the scores, einsum with the keys first ------------------------------


class KeyBiasSpelling(Spelling):
    """Causal and padded, with the float key bias ``key_bias(keep)`` in the reference."""

    causal = padded = True

    def key_bias(self, keep):
        return torch.zeros(B, H, 1, N)

    def forward(self, x, keep):
        if self.reference is None:
            return super().forward(x, keep)
        q, k, v = (p(x).view(B, N, H, D).transpose(1, 2) for p in (self.q, self.k, self.v))
        bias = self.key_bias(keep).double().masked_fill(~keep[:, None, None, :], float("-inf"))
        out = reference_attention(
            q, k, v, is_causal=True, key_bias=bias, scale=D**-0.5,
            segment_lengths=self.reference.get("segment_lengths"),
            dilation_rates=self.reference.get("dilation_rates"),
        ).to(x.dtype)  # fmt: skip
        return self.o(out.transpose(1, 2).reshape(B, N, E))


class FalconAlibi(KeyBiasSpelling):
    """Falcon's eager ALiBi: ``s + alibi``, then ``*= 1 / sqrt(d)`` (a scale after a bias), then
    transformers' mask, which holds ``alibi / sqrt(d)`` again."""

    def key_bias(self, keep):
        return 2 * _alibi(keep) * D**-0.5

    def attend(self, q, k, v, keep):
        alibi = _alibi(keep)
        allowed = _causal()[None, None] & keep[:, None, None, :]
        mask = torch.where(allowed, torch.full((), 0.0), LOWEST)
        mask = torch.masked_fill(alibi / math.sqrt(D), mask < -1, LOWEST)
        s = q @ k.transpose(-1, -2)
        s = s + alibi.view(B, H, 1, -1)
        s *= 1.0 / math.sqrt(D)
        return F.softmax(s + mask, dim=-1, dtype=torch.float32) @ v


class BloomAlibi(KeyBiasSpelling):
    """BLOOM: ``alibi.baddbmm(batch1=q, batch2=kt, beta=1, alpha=c)`` with keyword operands."""

    def key_bias(self, keep):
        return _alibi(keep)

    def attend(self, q, k, v, keep):
        alibi = _alibi(keep).reshape(B * H, 1, N)
        q3, kt3 = q.reshape(B * H, N, D), k.transpose(-1, -2).reshape(B * H, D, N)
        s = alibi.baddbmm(batch1=q3, batch2=kt3, beta=1.0, alpha=D**-0.5).view(B, H, N, N)
        s = torch.masked_fill(s, ~(_causal()[None, None] & keep[:, None, None, :]), LOWEST)
        p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(p.view(B * H, N, N), v.reshape(B * H, N, D)).view(B, H, N, D)


class ScaleTensorAfterBias(KeyBiasSpelling):
    """``(s + bias) / t``, ``t`` a one-element tensor (it moves onto q, and divides the bias)."""

    def key_bias(self, keep):
        return _alibi(keep) / math.sqrt(D)

    def attend(self, q, k, v, keep):
        s = (q @ k.transpose(-1, -2) + _alibi(keep)) / torch.tensor(math.sqrt(D))
        s = s.masked_fill(~(_causal()[None, None] & keep[:, None, None, :]), float("-inf"))
        return s.softmax(-1) @ v


class EinsumKeysFirst(KeyBiasSpelling):
    """``einsum("bhmd,bhnd->bhnm", k, q)`` and ``einsum("bhmd,bhnm->bhnd", v, p)``."""

    def attend(self, q, k, v, keep):
        s = torch.einsum("bhmd,bhnd->bhnm", k, q) * D**-0.5
        s = s.masked_fill(~_causal(), float("-inf")).masked_fill(~keep[:, None, None, :], float("-inf"))
        return torch.einsum("bhmd,bhnm->bhnd", v, s.softmax(-1))


KEY_BIAS_SPELLINGS = {
    "falcon_alibi": FalconAlibi, "bloom_alibi": BloomAlibi, "scale_tensor_after_bias": ScaleTensorAfterBias,
    "einsum_keys_first": EinsumKeysFirst,
}  # fmt: skip


class KeyBiasMixed(Mixed):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.spellings = nn.ModuleDict({name: cls() for name, cls in KEY_BIAS_SPELLINGS.items()})


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_a_bias_scaled_with_the_scores_and_keys_first_einsum(config_name):
    """``(s + b) * c`` is SDPA with scale ``c`` and the bias ``b * c``: rewritten, equal to eager
    (exact) and to the float64 reference with the key bias (dilated), outputs and gradients."""
    config = CONFIGS[config_name]
    model = KeyBiasMixed().eval()
    backend = ring_rewrite.backend(compiler="aot_eager", **config)
    got = _forward_backward(model, torch.compile(model, backend=backend, fullgraph=True))
    assert len(backend.records) == len(KEY_BIAS_SPELLINGS), backend.records
    assert all(r.rewritten and r.plan.is_causal for r in backend.records), backend.records
    reference = KeyBiasMixed().eval()
    if config:
        reference = reference.double()
        for m in reference.spellings.values():
            m.reference = config
    expected = _forward_backward(reference, dtype=torch.float64 if config else torch.float32)
    for i, name in enumerate(KEY_BIAS_SPELLINGS):
        assert rel_err(got[0][i], expected[0][i]) < BOUND, (config_name, name)
    largest = max(g.abs().max().item() for g in expected[1].values())
    for key, grad in expected[1].items():
        if key.endswith(".k.bias"):  # 0 up to rounding (_check_mixed)
            error = (got[1][key].double() - grad.double()).abs().max().item() / largest
        else:
            error = rel_err(got[1][key], grad)
        assert error < BOUND, (config_name, key, error)


def test_the_scale_of_a_bias_reaches_the_sdpa_call():
    model = _build_key_bias("falcon_alibi")

    def check(gm, inputs):
        (expected,) = gm(*inputs)
        hand_written_to_sdpa(gm, inputs, config=RingDilatedConfig())
        (sdpa,) = _sdpa_nodes(gm)
        assert sdpa.kwargs["scale"] == pytest.approx(D**-0.5) and not sdpa.kwargs["is_causal"]
        assert sdpa.kwargs["attn_mask"].meta["example_value"].dtype == torch.float32
        assert rel_err(gm(*inputs)[0], expected) < BOUND

    _on_graph(model, _inputs(), check)


def _build_key_bias(name: str) -> Spelling:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return KEY_BIAS_SPELLINGS[name]().eval()


# ---- a bug in reading one site ------------------------------------------------------------------


@pytest.mark.parametrize("where", ["_scores_op", "_probs_path"])
def test_an_error_in_reading_a_site_leaves_that_site_alone(monkeypatch, where):
    """An exception inside the pass (a bug) while reading one site leaves that site alone, with the
    error in its reason; the other sites are rewritten and the model is unchanged."""
    from ring_rewrite.passes import hand_written

    original, calls = getattr(hand_written, where), []

    def first_raises(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("a bug")
        return original(*args, **kwargs)

    monkeypatch.setattr(hand_written, where, first_raises)
    model = _mixed(["matmul", "nanogpt"])
    recorder = Capture()
    x, keep = _inputs()
    got = torch.compile(model, backend=recorder, fullgraph=True)(x, keep)
    records = recorder.records
    assert len(records) == 2, records
    (alone,) = [r for r in records if not r.rewritten]
    assert alone.kind == "hand_written" and alone.reason == "hand_written could not read this site: ValueError: a bug"
    assert counters["ring_rewrite"]["hand_written"] == 1
    assert rel_err(got, model(x, keep)) < BOUND
