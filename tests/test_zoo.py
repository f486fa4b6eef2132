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
import re
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
# NOTE: weights drawn with std 0.2 (transformers' default 0.02 gives near-uniform attention at
# hidden 32, whose query/key gradients are then mostly float32 cancellation: ill-conditioned).
INIT = 0.2
REWRITTEN = None  # an expected outcome: the site is rewritten (else: a substring of its reason)


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
    zero_gradients: str | None = None
    """Parameters whose gradient is 0 up to rounding (a regular expression): the bias of a key
    projection with no rotary embedding after it shifts every score of a row alike, which softmax
    ignores. Their error is measured against the model's largest gradient, not their own."""
    unpatched: int = 0
    """Sites the float64 reference patched into ``F.scaled_dot_product_attention`` does not reach
    (``nn.MultiheadAttention`` calls torch's kernel itself); each must be left alone."""
    plain_calls: tuple[int, ...] = ()
    """Which SDPA calls of one eager forward (in call order) are sites left alone (cross
    attention): the dilated reference runs plain attention there, as the compiled model does."""


def _causal_lm(cls: str, config: str, **fields: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        common = dict(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, initializer_range=INIT,
            attn_implementation="sdpa",
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


def _packed_call(model: torch.nn.Module) -> torch.Tensor:
    """Training on packed sequences: ``position_ids`` that restart at each sequence, no mask, no
    cache (transformers then builds a document mask from the positions)."""
    pos = torch.cat([torch.arange(6), torch.arange(N - 6)]).expand(B, N).clone()
    pos[1] = torch.cat([torch.arange(11), torch.arange(N - 11)])
    return model(_ids(), position_ids=pos, use_cache=False).logits


def _two(path: str, outcome: str | None = REWRITTEN) -> dict[str, str | None]:
    return {path.format(i): outcome for i in range(2)}


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=INIT,
        attn_implementation="sdpa",
    )
    return _seeded(lambda: transformers.GPT2LMHeadModel(cfg))


def _bert() -> torch.nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, initializer_range=INIT, attn_implementation="sdpa",
    )  # fmt: skip
    return _seeded(lambda: transformers.BertModel(cfg))


def _modernbert() -> torch.nn.Module:
    # NOTE: special token ids must lie inside the small vocabulary. A sliding layer's window is
    # ``local_attention // 2`` on each side: ``abs(q_idx - kv_idx) <= 2``, a band of 5 in 16 tokens.
    cfg = transformers.ModernBertConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, local_attention=4, layer_types=["full_attention", "sliding_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, initializer_range=INIT,
        attn_implementation="sdpa",
    )  # fmt: skip
    return _seeded(lambda: transformers.ModernBertModel(cfg))


def _bart() -> torch.nn.Module:
    cfg = transformers.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64, init_std=INIT, attn_implementation="sdpa",
    )  # fmt: skip
    return _seeded(lambda: transformers.BartForConditionalGeneration(cfg))


def _vit() -> torch.nn.Module:
    cfg = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, initializer_range=INIT, attn_implementation="sdpa",
    )  # fmt: skip
    return _seeded(lambda: transformers.ViTModel(cfg))


def _whisper_encoder() -> torch.nn.Module:
    # NOTE: token ids must lie inside the small vocabulary (Padding_idx must be within num_embeddings).
    cfg = transformers.WhisperConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
        max_source_positions=N, max_target_positions=32, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, init_std=INIT, attn_implementation="sdpa",
    )  # fmt: skip
    return _seeded(lambda: transformers.WhisperModel(cfg).get_encoder())


def _paligemma() -> torch.nn.Module:
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16,
        patch_size=8,
    )  # fmt: skip
    text = transformers.GemmaConfig(
        vocab_size=V + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, initializer_range=INIT,
    )  # fmt: skip
    cfg = transformers.PaliGemmaConfig(
        vision_config=vision, text_config=text, image_token_index=V, projection_dim=32, attn_implementation="sdpa"
    )
    return _seeded(lambda: transformers.PaliGemmaForConditionalGeneration(cfg))


def _paligemma_call(model: torch.nn.Module) -> torch.Tensor:
    """Training a prefix LM: 4 image tokens and a prompt (token type 0, bidirectional), then the
    suffix (causal), a different prefix per row: transformers ORs the causal mask with blocks."""
    ids = _ids()
    ids[:, :4] = V  # the image's 2 x 2 patches
    types = torch.zeros(B, N, dtype=torch.long)
    types[0, 9:], types[1, 7:] = 1, 1
    return model(
        input_ids=ids, pixel_values=_randn(B, 3, 16, 16), token_type_ids=types,
        attention_mask=torch.ones(B, N, dtype=torch.long), use_cache=False,
    ).logits  # fmt: skip


def _nn_encoder() -> torch.nn.Module:
    def make() -> torch.nn.Module:
        layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        return torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    return _seeded(make)


def _nn_transformer() -> torch.nn.Module:
    return _seeded(
        lambda: torch.nn.Transformer(
            32, 4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64, dropout=0.0, batch_first=True
        )
    )


def _nn_transformer_call(model: torch.nn.Module) -> torch.Tensor:
    """Encoder-decoder training: a causal target mask (with ``tgt_is_causal=True``: without it
    torch's mask detection breaks the graph) and source padding for both attentions to it."""
    mask = torch.nn.Transformer.generate_square_subsequent_mask(N)
    pad = _key_padding()
    return model(
        _randn(B, N, 32), _randn(B, N, 32) * 0.5, tgt_mask=mask, tgt_is_causal=True,
        src_key_padding_mask=pad, memory_key_padding_mask=pad,
    )  # fmt: skip


def _key_padding() -> torch.Tensor:
    return _right_padding() == 0  # True: ignore


ZOO: dict[str, Zoo] = {
    "llama": Zoo(
        _causal_lm("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2),
        _lm_call, _two("model.layers.{}.self_attn"),
    ),
    "llama_packed": Zoo(
        _causal_lm("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2),
        _packed_call, _two("model.layers.{}.self_attn"),
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
    "falcon_multi_query": Zoo(  # one key/value head, no enable_gqa: SDPA broadcasts it; rotary, no ALiBi
        _causal_lm(
            "FalconForCausalLM", "FalconConfig", multi_query=True, new_decoder_architecture=False, alibi=False,
            ffn_hidden_size=64,
        ),
        _lm_call, _two("transformer.h.{}.self_attention"),
    ),  # fmt: skip
    # ALiBi folded into a float mask, masked_fill(slope_h * t / sqrt(d), ~allowed, finfo.min), padded
    # on the right: with left padding a row would have no key allowed, where SDPA gives the mean of
    # the values to a finfo.min fill and the rewrite 0 (docs/semantics.md, Accuracy).
    "falcon_alibi": Zoo(
        _causal_lm(
            "FalconForCausalLM", "FalconConfig", alibi=True, multi_query=False, new_decoder_architecture=False,
            ffn_hidden_size=64,
        ),
        lambda m: m(_ids(), attention_mask=_right_padding(), use_cache=False).logits,
        _two("transformer.h.{}.self_attention"),
    ),  # fmt: skip
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
        _two("encoder.layer.{}.attention.self"), zero_gradients=r"\.key\.bias$",
    ),
    "modernbert": Zoo(  # layer 0 is global, layer 1 slides: a two-sided band |t - p| <= 2
        _modernbert, lambda m: m(_ids(), attention_mask=_right_padding()).last_hidden_state, _two("layers.{}.attn")
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
        zero_gradients=r"\.k_proj\.bias$",
        plain_calls=(3, 5),  # encoder 0, 1; then each decoder layer's self, cross attention
    ),
    "vit": Zoo(
        _vit, lambda m: m(pixel_values=_randn(B, 3, 32, 32)).last_hidden_state,
        _two("layers.{}.attention"), zero_gradients=r"\.k_proj\.bias$",
    ),
    "whisper_encoder": Zoo(
        _whisper_encoder, lambda m: m(_randn(B, 8, 2 * N)).last_hidden_state, _two("layers.{}.self_attn")
    ),
    "paligemma": Zoo(
        _paligemma, _paligemma_call,
        {
            "vision_tower.encoder.layers.0.self_attn": REWRITTEN,
            "vision_tower.head.attention": "cross attention",  # a learned probe queries the patches
            **_two("language_model.layers.{}.self_attn"),
        },
        zero_gradients=r"vision_tower\.encoder\..*\.k_proj\.bias$",
        unpatched=1,  # the head is an nn.MultiheadAttention
    ),
    "nn_transformer": Zoo(
        _nn_transformer, _nn_transformer_call,
        {
            **_two("encoder.layers.{}.self_attn"),
            **_two("decoder.layers.{}.self_attn"),
            **_two("decoder.layers.{}.multihead_attn", "cross attention"),
        },
        plain_calls=(3, 5),  # encoder 0, 1; then each decoder layer's self, cross attention
    ),
    "nn_transformer_encoder": Zoo(
        _nn_encoder, lambda m: m(_randn(B, N, 32), src_key_padding_mask=_key_padding()),
        _two("layers.{}.self_attn"),
    ),
}


# ---- running a model ------------------------------------------------------------------------------


def _loss(out: torch.Tensor) -> torch.Tensor:
    """A fixed random weighting of the output (not ``square().mean()``, which a final LayerNorm
    makes nearly constant)."""
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    return (out.float() * weights).mean()


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


def _compiled(name: str, **config: Any) -> tuple[tuple[torch.Tensor, dict[str, torch.Tensor]], list]:
    """The model compiled with ``ring_rewrite.backend(**config)``: its output, gradients and site
    records (``.location`` like 'model.layers.0.self_attn (sdpa_attention.py:182)',
    ``.rewritten``, ``.reason``, ``.plan``)."""
    zoo = ZOO[name]
    model = zoo.build()
    torch._dynamo.reset()
    backend = ring_rewrite.backend(**config)
    result = _forward_backward(model, zoo.call, torch.compile(model, backend=backend))
    return result, list(backend.records)


def _reference_sdpa(config: dict[str, Any], calls: list[int], plain: tuple[int, ...]) -> Callable:
    """``F.scaled_dot_product_attention`` replaced by the float64 reference under
    ``config``, cast back to the input's dtype (the dense mask, bool or float, is its key bias);
    plain attention (the reference's exact config) at the calls ``plain`` names."""

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert dropout_p == 0.0
        exact = len(calls) in plain
        calls.append(1)
        if attn_mask is not None and attn_mask.is_floating_point():  # a finfo.min fill masks as -inf does
            attn_mask = attn_mask.masked_fill(attn_mask <= torch.finfo(attn_mask.dtype).min / 2, float("-inf"))
        out = reference_attention(
            q, k, v, segment_lengths=None if exact else config.get("segment_lengths"),
            dilation_rates=None if exact else config.get("dilation_rates"), is_causal=is_causal, scale=scale,
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
        patch.setattr(
            torch.nn.functional, "scaled_dot_product_attention", _reference_sdpa(config, calls, zoo.plain_calls)
        )
        result = _forward_backward(model, zoo.call)
    reached = len(zoo.sites) - zoo.unpatched
    assert len(calls) == reached, f"the reference ran at {len(calls)} of {reached} sites"
    return result


def _errors(name: str, got, expected) -> dict[str, float]:
    """rel_err of the output and of every parameter's gradient; a parameter with no gradient on
    one side (the pooler of BertModel / ViTModel, not in the loss: AOT autograd gives it zeros,
    eager None) counts as zeros there."""
    (out, grads), (ref, ref_grads) = got, expected
    largest = max(g.abs().max().item() for g in ref_grads.values())
    errors = {"output": rel_err(out, ref)}
    zero_gradients = ZOO[name].zero_gradients
    for param in grads.keys() | ref_grads.keys():
        zeros = torch.zeros_like(grads.get(param, ref_grads.get(param)))
        a, b = grads.get(param, zeros), ref_grads.get(param, zeros)
        zero = zero_gradients is not None and re.search(zero_gradients, param)
        errors[param] = (a - b).abs().max().item() / largest if zero else rel_err(a, b)
    return errors


def _worst(errors: dict[str, float]) -> tuple[str, float]:
    return max(errors.items(), key=lambda item: item[1])


def _path(record, paths) -> str:
    """The expected module path the record's location names (its module part is that path, or
    ends with it: dynamo names the root differently when a model's forward is wrapped), else the
    module part itself."""
    module = record.location.split(" (")[0]
    found = [p for p in paths if module == p or module.endswith("." + p)]
    return found[0] if len(found) == 1 else module


def _outcomes(records, paths) -> dict[str, str | None]:
    """Module path -> REWRITTEN or the reason the site was left alone."""
    named = [_path(r, paths) for r in records]
    assert len(set(named)) == len(named), f"a site was compiled twice: {[r.location for r in records]}"
    return {p: REWRITTEN if r.rewritten else r.reason for p, r in zip(named, records)}


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
        got, records = _compiled(name, compiler="aot_eager")
        _RUNS[name, "aot_eager"] = (_errors(name, got, expected), _outcomes(records, ZOO[name].sites))
    return _RUNS[name, "aot_eager"]


# ---- sites ----------------------------------------------------------------------------------------


def _site_params() -> list:
    return [
        pytest.param(name, path, expected, id=f"{name}-{path}")
        for name, zoo in ZOO.items()
        for path, expected in zoo.sites.items()
    ]


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
    got, records = _compiled(name, compiler=compiler, **config)
    outcomes = _outcomes(records, ZOO[name].sites)
    wrong = {p: o for p, o in outcomes.items() if not _matches(o, ZOO[name].sites[p])}
    assert not wrong, wrong
    errors = _errors(name, got, expected)
    assert _worst(errors)[1] < BOUND, (name, config_name, compiler, _worst(errors))


@pytest.mark.parametrize(
    "name, config_name, compiler",
    [
        ("llama", "exact", "inductor"),
        ("mistral", "exact", "inductor"),
        ("bert", "exact", "inductor"),
    ],
)
def test_matches_eager_inductor(name, config_name, compiler):
    _check(name, config_name, compiler)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_dilated_matches_reference_aot_eager(name):
    _check(name, "dilated", "aot_eager")


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
    """Greedy ``generate`` past dynamo's recompile limit, left padding, ``model.forward``
    compiled (exact config): the same token ids as eager, never a RecompileLimitError, and every
    decode step rewritten (one graph for every cache length after the first step; the dilated
    config is tests/test_decode.py's)."""
    tokens = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = _causal_lm("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2, **tokens)()
    ids = _ids()
    ids[1, :3] = 0
    steps = torch._dynamo.config.recompile_limit + 4
    kwargs = dict(
        attention_mask=_left_padding(), max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0
    )
    expected = model.generate(ids, **kwargs)
    backend = ring_rewrite.backend(compiler="aot_eager")
    model.forward = torch.compile(model.forward, backend=backend)
    try:
        got = model.generate(ids, **kwargs)
    except ring_rewrite.RecompileLimitError as error:
        pytest.fail(f"generate hit the recompile limit: {error}")
    assert torch.equal(got, expected), (got, expected)
    prefill = [r for r in backend.records if r.shapes["query"][2] == N]
    paths = [f"model.layers.{i}.self_attn" for i in range(2)]
    assert [(_path(r, paths), r.rewritten) for r in prefill] == [(p, True) for p in paths], backend.records
    decode = [r for r in backend.records if r.decode]
    assert len(decode) == 2 * len(paths) and all(r.rewritten for r in backend.records), backend.records


# ---- P = 2, sharded: the training recipe --------------------------------------------------------

SHARDED = {
    # A padding mask (left padding in one row): a band and a key bias.
    "llama": lambda: {"input_ids": _ids(), "attention_mask": _left_padding()},
    # No mask and no cache: transformers builds documents from the positions, one per row.
    "gpt2": lambda: {"input_ids": _ids()},
}


def _sharded_recipes(rank: int, world: int, compiler: str) -> None:
    for name in sorted(SHARDED):
        _sharded_recipe(rank, name, compiler)


def _sharded_recipe(rank: int, name: str, compiler: str) -> None:
    """``shard_batch``, the sharded backend, the model's own loss, gradients summed over the
    ranks: the loss and every gradient of the whole batch with the float64 reference."""
    torch._dynamo.reset()
    config = CONFIGS["dilated"]
    whole = SHARDED[name]()
    keep = whole.get("attention_mask", torch.ones(B, N, dtype=torch.long))
    whole["labels"] = whole["input_ids"].masked_fill(keep == 0, -100)

    def loss(model, batch, runner=None):
        out = (model if runner is None else runner)(**batch, use_cache=False).loss
        out.backward()
        return out.detach(), {n: p.grad for n, p in model.named_parameters()}

    calls: list[int] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", _reference_sdpa(config, calls, ()))
        expected = loss(ZOO[name].build(), whole)
    model = ZOO[name].build()
    backend = ring_rewrite.backend(sharding="sharded", layout="zigzag", compiler=compiler, **config)
    batch = ring_rewrite.shard_batch(whole, layout="zigzag")
    got_loss, grads = loss(model, batch, torch.compile(model, backend=backend))
    torch.distributed.all_reduce(got_loss)
    for g in grads.values():
        torch.distributed.all_reduce(g)  # each rank's gradient covers the loss of its own tokens
    assert all(r.rewritten for r in backend.records) and len(backend.records) == len(ZOO[name].sites)
    errors = _errors(name, (got_loss, grads), expected)
    assert _worst(errors)[1] < BOUND, (rank, name, _worst(errors))


def test_two_ranks_sharded_recipe_matches_reference():
    run_ranks(2, _sharded_recipes, "inductor")  # one pair of processes for every family


def _sharded_lengths(rank: int, world: int, sharding: str) -> None:
    """Batches padded to their longest row: in sharded mode cut by
    ``shard_batch(buckets="shards")``, after the first length each rank's shard a symbol the graph
    pads to its bucket; in replicated mode the whole batch, the sequence's length the symbol, each
    rank's shard cut from its real positions. Either way none of the padding is computed (Note
    [Padding shards to a bucket]), and loss and gradients equal the float64 reference's at every
    length, in two graphs."""
    model = ZOO["llama"].build()
    backend = ring_rewrite.backend(sharding=sharding, layout="zigzag", compiler="inductor")
    compiled = torch.compile(model, backend=backend)
    sharded = sharding == "sharded"
    # Sharded: shards of 20 (static), then 26, 18 (34 padded to 36) and 30, bucket 32; replicated:
    # 40, then 53, 37 and 61 (not multiples of the 4 parts), bucket 64.
    for n in (40, 52, 34, 60) if sharded else (40, 53, 37, 61):
        ids = torch.randint(3, V, (B, n), generator=torch.Generator().manual_seed(n))
        mask = torch.ones(B, n, dtype=torch.long)
        mask[1, n - 7 :] = 0  # right padding of the shorter row
        whole = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

        def loss(runner, batch):
            model.zero_grad()
            out = runner(**batch, use_cache=False).loss
            out.backward()
            return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.nn.functional, "scaled_dot_product_attention", _reference_sdpa({}, [], ()))
            expected = loss(model, whole)
        if sharded:
            got_loss, grads = loss(compiled, ring_rewrite.shard_batch(whole, layout="zigzag", buckets="shards"))
            torch.distributed.all_reduce(got_loss)
            for g in grads.values():
                torch.distributed.all_reduce(g)
        else:
            got_loss, grads = loss(compiled, whole)
        errors = _errors("llama", (got_loss, grads), expected)
        assert _worst(errors)[1] < BOUND, (rank, n, _worst(errors))
    shapes = [r.shapes["query"][2] for r in backend.records]
    first, bucket = (20, 32) if sharded else (40, 64)
    assert shapes == [first] * len(ZOO["llama"].sites) + [bucket] * len(ZOO["llama"].sites), shapes
    assert all(r.reason.startswith("a bucket of 64: reads, sends and computes the real rows only") for r in backend.records[-1:])


@pytest.mark.parametrize("sharding", ["sharded", "replicated"])
def test_two_ranks_lengths_share_a_graph_per_bucket(sharding):
    run_ranks(2, _sharded_lengths, sharding)


# ---- a new length every batch ---------------------------------------------------------------------


def test_batches_padded_to_their_longest_row_compile_one_graph_per_bucket():
    """Batches as ``DataCollatorWithPadding`` makes them (a new length each, past dynamo's
    recompile limit): the transformers mask of each is read at its symbolic length and built at
    its bucket, so lengths share graphs, never reach the limit, and match the reference."""
    config = CONFIGS["dilated"]
    model = ZOO["llama"].build()
    backend = ring_rewrite.backend(compiler="aot_eager", **config)
    compiled = torch.compile(model, backend=backend)
    lengths = (16, 24, 40, 28, 32, 20, 36, 48, 56, 12)  # more than the limit of 8
    assert len(lengths) > torch._dynamo.config.recompile_limit
    for n in lengths:
        ids = torch.randint(3, V, (B, n), generator=torch.Generator().manual_seed(n))
        mask = torch.ones(B, n, dtype=torch.long)
        mask[1, n - 5 :] = 0  # right padding of the shorter row
        call = lambda m: m(ids, attention_mask=mask, use_cache=False).logits  # noqa: E731
        got = call(compiled)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.nn.functional, "scaled_dot_product_attention", _reference_sdpa(config, [], ()))
            expected = call(model)
        assert rel_err(got, expected) < BOUND, n
    # 16 (static, the first call), then buckets 32, 64 and, for 12, 16: four graphs.
    graphs = len(backend.records) // 2  # two sites a graph
    assert graphs == 4 and all(r.rewritten for r in backend.records), [r.shapes["query"] for r in backend.records]
