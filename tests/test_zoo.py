"""A model zoo: tiny random-init Hugging Face models (built offline from configs: no downloads)
and ``nn.TransformerEncoder``, compiled with ``ring_dilated`` and called as their users call
them. Which attention sites are rewritten and which are left alone (with their reason), and the
logits and every parameter gradient against eager (exact config) or against eager with the
float64 reference in place of SDPA (dilated config), at P = 1 and P = 2 (replicated), plus
``generate()``.

Every model: hidden 32, 2 layers, 4 heads, vocab 64, batch 2, 16 tokens (ViT: 17, its CLS token
and 16 patches), ``attn_implementation="sdpa"``, in eval mode (no dropout; gradients still
flow)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ring_rewrite  # noqa: E402
from conftest import rel_err  # noqa: E402
from ranks import run_ranks  # noqa: E402
from ring_rewrite.reference import reference_attention  # noqa: E402

BOUND = 1e-5
B, N, V = 2, 16, 64
CONFIGS = {"exact": {}, "dilated": {"segment_lengths": [8, 16], "dilation_rates": [1, 2]}}
REWRITTEN = None  # an expected outcome: the site is rewritten (else: a substring of its reason)
CROSS_PENDING = "BART cross attention (q from the decoder, k/v from the encoder, equal lengths) is left alone only once the cross-attention branch is merged"


# ---- inputs ---------------------------------------------------------------------------------------


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, V, (B, N), generator=torch.Generator().manual_seed(seed))


def _left_padding() -> torch.Tensor:
    mask = torch.ones(B, N, dtype=torch.long)
    mask[1, :3] = 0
    return mask


def _right_padding() -> torch.Tensor:
    mask = torch.ones(B, N, dtype=torch.long)
    mask[0, 12:] = 0
    mask[1, 9:] = 0
    return mask


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(2))


# ---- the zoo --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Zoo:
    """A model as its users build and call it, and what the backend should do with its sites."""

    build: Callable[[], torch.nn.Module]
    call: Callable[[torch.nn.Module], torch.Tensor]
    sites: dict[str, str | None]
    """Module path of every attention site -> ``REWRITTEN`` or a substring of the reason it is
    left alone."""
    xfail: dict[str, str] = dataclasses.field(default_factory=dict)
    """Sites whose expected outcome is not today's, and why."""


def _causal_lm(cls: str, config: str, **fields: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        common = dict(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, attn_implementation="sdpa",
        )  # fmt: skip
        cfg = getattr(transformers, config)(**{**common, **fields})
        return _seeded(lambda: getattr(transformers, cls)(cfg))

    return build


def _seeded(make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return make().eval()


def _lm_call(model: torch.nn.Module) -> torch.Tensor:
    """The training call of a causal LM: left padding in one row, no cache."""
    return model(_ids(), attention_mask=_left_padding(), use_cache=False).logits


def _two(path: str, outcome: str | None = REWRITTEN) -> dict[str, str | None]:
    return {path.format(i): outcome for i in range(2)}


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_implementation="sdpa"
    )
    return _seeded(lambda: transformers.GPT2LMHeadModel(cfg))


def _bert() -> torch.nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    return _seeded(lambda: transformers.BertModel(cfg))


def _bart() -> torch.nn.Module:
    cfg = transformers.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    return _seeded(lambda: transformers.BartForConditionalGeneration(cfg))


def _vit() -> torch.nn.Module:
    cfg = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, attn_implementation="sdpa",
    )  # fmt: skip
    return _seeded(lambda: transformers.ViTModel(cfg))


def _whisper_encoder() -> torch.nn.Module:
    # NOTE: token ids must lie inside the small vocabulary (Padding_idx must be within num_embeddings).
    cfg = transformers.WhisperConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
        max_source_positions=N, max_target_positions=32, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, attn_implementation="sdpa",
    )  # fmt: skip
    return _seeded(lambda: transformers.WhisperModel(cfg).get_encoder())


def _nn_encoder() -> torch.nn.Module:
    def make() -> torch.nn.Module:
        layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        return torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    return _seeded(make)


def _key_padding() -> torch.Tensor:
    return _right_padding() == 0  # True: ignore


ZOO: dict[str, Zoo] = {
    "llama": Zoo(
        _causal_lm("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2),
        _lm_call, _two("model.layers.{}.self_attn"),
    ),
    "mistral": Zoo(
        _causal_lm("MistralForCausalLM", "MistralConfig", num_key_value_heads=2, sliding_window=4),
        _lm_call, _two("model.layers.{}.self_attn"),
    ),
    "qwen2": Zoo(
        _causal_lm("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2),
        _lm_call, _two("model.layers.{}.self_attn"),
    ),
    "gpt2": Zoo(_gpt2, _lm_call, _two("transformer.h.{}.attn")),
    "gpt_neox": Zoo(
        _causal_lm("GPTNeoXForCausalLM", "GPTNeoXConfig"), _lm_call, _two("gpt_neox.layers.{}.attention")
    ),
    "phi3": Zoo(
        _causal_lm("Phi3ForCausalLM", "Phi3Config", num_key_value_heads=2, pad_token_id=0),
        _lm_call, _two("model.layers.{}.self_attn"),
    ),
    "gemma3": Zoo(  # layer 0 slides (window 4 < 16 tokens), layer 1 is full
        _causal_lm(
            "Gemma3ForCausalLM", "Gemma3TextConfig", num_key_value_heads=2, head_dim=8, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
        _lm_call, _two("model.layers.{}.self_attn"),
    ),  # fmt: skip
    "bert": Zoo(
        _bert, lambda m: m(_ids(), attention_mask=_right_padding()).last_hidden_state,
        _two("encoder.layer.{}.attention.self"),
    ),
    "bart": Zoo(
        _bart,
        lambda m: m(
            input_ids=_ids(), attention_mask=_right_padding(), decoder_input_ids=_ids(3), use_cache=False
        ).logits,
        {
            **_two("model.encoder.layers.{}.self_attn"),
            **_two("model.decoder.layers.{}.self_attn"),
            **_two("model.decoder.layers.{}.encoder_attn", "cross attention"),
        },
        xfail=_two("model.decoder.layers.{}.encoder_attn", CROSS_PENDING),
    ),
    "vit": Zoo(
        _vit, lambda m: m(pixel_values=_randn(B, 3, 32, 32)).last_hidden_state,
        _two("encoder.layer.{}.attention.attention"),
    ),
    "whisper_encoder": Zoo(
        _whisper_encoder, lambda m: m(_randn(B, 8, 2 * N)).last_hidden_state, _two("layers.{}.self_attn")
    ),
    "nn_transformer_encoder": Zoo(
        _nn_encoder, lambda m: m(_randn(B, N, 32), src_key_padding_mask=_key_padding()),
        _two("layers.{}.self_attn"),
    ),
}


# ---- running a model ------------------------------------------------------------------------------


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _forward_backward(
    model: torch.nn.Module, call: Callable, runner: Callable | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``call(runner)`` (``runner``: the model, or the model compiled), and the gradient of every
    parameter of the model under a simple loss."""
    for p in model.parameters():
        p.grad = None
    out = call(model if runner is None else runner)
    _loss(out).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _compiled(name: str, **config: Any) -> tuple[Any, tuple[torch.Tensor, dict[str, torch.Tensor]], list]:
    """The model compiled with ``ring_rewrite.backend(**config)``: its output, gradients and site
    records (``.location`` 'model.layers.0.self_attn (sdpa_attention.py:182)', ``.rewritten``,
    ``.reason``, ``.plan``)."""
    zoo = ZOO[name]
    model = zoo.build()
    torch._dynamo.reset()
    backend = ring_rewrite.backend(**config)
    result = _forward_backward(model, zoo.call, torch.compile(model, backend=backend))
    return model, result, list(backend.records)


def _reference_sdpa(config: dict[str, Any], calls: list[int]) -> Callable:
    """``F.scaled_dot_product_attention`` replaced by the float64 reference of SPEC §2 under
    ``config``, cast back to the input's dtype (the dense mask, bool or float, is its key bias)."""

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert dropout_p == 0.0
        calls.append(1)
        out = reference_attention(
            q, k, v, segment_lengths=config.get("segment_lengths"),
            dilation_rates=config.get("dilation_rates"), is_causal=is_causal, scale=scale,
            key_bias=attn_mask,
        )  # fmt: skip
        return out.to(q.dtype)

    return sdpa


def _expected(name: str, config: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Eager: plain SDPA for the exact config, the float64 reference for a dilated one.

    NOTE: transformers' sdpa_attention.py looks ``torch.nn.functional.scaled_dot_product_attention``
    up at call time, so patching the module attribute reaches every HF attention layer.
    """
    zoo = ZOO[name]
    model = zoo.build()
    if not config:
        return _forward_backward(model, zoo.call)
    calls: list[int] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", _reference_sdpa(config, calls))
        result = _forward_backward(model, zoo.call)
    assert len(calls) == len(zoo.sites), f"the reference ran at {len(calls)} of {len(zoo.sites)} sites"
    return result


def _errors(got, expected) -> dict[str, float]:
    (out, grads), (ref, ref_grads) = got, expected
    assert grads.keys() == ref_grads.keys(), sorted(grads.keys() ^ ref_grads.keys())
    return {"output": rel_err(out, ref), **{n: rel_err(grads[n], ref_grads[n]) for n in ref_grads}}


def _worst(errors: dict[str, float]) -> tuple[str, float]:
    return max(errors.items(), key=lambda item: item[1])


def _path(record) -> str:
    return record.location.split(" (")[0]


def _outcomes(records) -> dict[str, str | None]:
    """Module path -> REWRITTEN or the reason the site was left alone."""
    paths = [_path(r) for r in records]
    assert len(set(paths)) == len(paths), f"a site was compiled twice: {paths}"
    return {_path(r): REWRITTEN if r.rewritten else r.reason for r in records}


def _matches(outcome: str | None, expected: str | None) -> bool:
    if expected is REWRITTEN:
        return outcome is REWRITTEN
    return outcome is not REWRITTEN and expected in outcome


_RUNS: dict[tuple[str, str], tuple[dict[str, float], dict[str, str | None]]] = {}


def _exact_aot_eager(name: str) -> tuple[dict[str, float], dict[str, str | None]]:
    """The exact config under aot_eager, run once per model: errors against eager and the sites'
    outcomes (shared by the numerics test and the per-site tests)."""
    if (name, "aot_eager") not in _RUNS:
        expected = _expected(name, {})
        _, got, records = _compiled(name, compiler="aot_eager")
        _RUNS[name, "aot_eager"] = (_errors(got, expected), _outcomes(records))
    return _RUNS[name, "aot_eager"]


# ---- sites ----------------------------------------------------------------------------------------


def _site_params() -> list:
    return [
        pytest.param(
            name, path, expected, id=f"{name}-{path}",
            marks=[pytest.mark.xfail(strict=False, reason=zoo.xfail[path])] if path in zoo.xfail else [],
        )
        for name, zoo in ZOO.items()
        for path, expected in zoo.sites.items()
    ]  # fmt: skip


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_attention_site_is_found(name):
    _, outcomes = _exact_aot_eager(name)
    assert sorted(outcomes) == sorted(ZOO[name].sites), outcomes


@pytest.mark.parametrize("name, path, expected", _site_params())
def test_site_outcome(name, path, expected):
    _, outcomes = _exact_aot_eager(name)
    assert path in outcomes, f"no attention site at {path}: {outcomes}"
    want = "rewritten" if expected is REWRITTEN else f"left alone ({expected!r} in the reason)"
    got = "rewritten" if outcomes[path] is REWRITTEN else f"left alone: {outcomes[path]}"
    assert _matches(outcomes[path], expected), f"{name} {path}: expected {want}, {got}"


# ---- numerics at P = 1 ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ZOO))
def test_exact_matches_eager_aot_eager(name):
    errors, _ = _exact_aot_eager(name)
    assert _worst(errors)[1] < BOUND, (name, _worst(errors))


def _check(name: str, config_name: str, compiler: str) -> None:
    config = CONFIGS[config_name]
    expected = _expected(name, config)
    _, got, records = _compiled(name, compiler=compiler, **config)
    outcomes = _outcomes(records)
    wrong = {p: o for p, o in outcomes.items() if not _matches(o, ZOO[name].sites[p])}
    assert not wrong, wrong
    errors = _errors(got, expected)
    assert _worst(errors)[1] < BOUND, (name, config_name, compiler, _worst(errors))


@pytest.mark.parametrize(
    "name, config_name, compiler",
    [
        ("llama", "exact", "inductor"),
        ("mistral", "exact", "inductor"),
        ("bert", "exact", "inductor"),
        ("llama", "dilated", "aot_eager"),
        ("bert", "dilated", "aot_eager"),
    ],
)
def test_matches_eager_or_reference(name, config_name, compiler):
    _check(name, config_name, compiler)


# ---- P = 2, replicated ----------------------------------------------------------------------------


def _rank(rank: int, world: int, name: str, config_name: str, compiler: str) -> None:
    _check(name, config_name, compiler)


@pytest.mark.parametrize(
    "name, config_name, compiler",
    [("llama", "dilated", "inductor"), ("mistral", "exact", "inductor"), ("bert", "dilated", "inductor")],
)
def test_two_ranks_replicated_match(name, config_name, compiler):
    run_ranks(2, _rank, name, config_name, compiler)


# ---- generate -------------------------------------------------------------------------------------


def test_llama_generate_matches_eager():
    """Greedy ``generate`` of 4 tokens, left padding, ``model.forward`` compiled (exact config):
    the same token ids as eager, and never a RecompileLimitError (one prefill graph, then decode
    graphs as the cache grows)."""
    build = _causal_lm(
        "LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    model = build()
    ids = _ids()
    ids[1, :3] = 0
    kwargs = dict(attention_mask=_left_padding(), max_new_tokens=4, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **kwargs)
    backend = ring_rewrite.backend(compiler="aot_eager")
    model.forward = torch.compile(model.forward, backend=backend)
    try:
        got = model.generate(ids, **kwargs)
    except ring_rewrite.RecompileLimitError as error:
        pytest.fail(f"generate hit the recompile limit: {error}")
    assert torch.equal(got, expected), (got, expected)
    prefill = [r for r in backend.records if r.shapes["query"][2] == N]
    assert [(_path(r), r.rewritten) for r in prefill] == [(f"model.layers.{i}.self_attn", True) for i in range(2)]
