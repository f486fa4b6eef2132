"""nn.MultiheadAttention / nn.TransformerEncoderLayer are decomposed into SDPA, then rewritten."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import ring_rewrite
from ring_rewrite import RingDilatedConfig, reference_attention
from ring_rewrite.passes import UnsupportedSiteError
from ring_rewrite.passes.decompose_mha import (
    ENCODER_LAYER,
    MHA,
    decompose_attention_modules,
    find_attention_module_sites,
    module_unsupported_reason,
)
from ring_rewrite.passes.find_sdpa import SDPA_TARGETS

from conftest import Capture, rel_err

B, L, E, H = 2, 16, 32, 4
MODULE_TARGETS = (F.multi_head_attention_forward, torch._transformer_encoder_layer_fwd)


def capture(fn, *inputs) -> tuple[torch.fx.GraphModule, list]:
    """The dynamo graph of ``fn``, untouched by any pass, and its inputs (parameters lifted)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    (captured,) = graphs
    return captured


def module_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in MODULE_TARGETS]


def sdpa_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]


def _role(node) -> str | None:
    return node.meta.get("ring_rewrite", {}).get("role")


def _leaf(t):
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().clone().requires_grad_()
    return t


def check_against_eager(model, run, inputs, *, grads=True, left_alone=None, **options):
    """Compiled ``run(model, *inputs)`` equals eager: outputs, and parameter and input gradients.
    Its one decomposed site is rewritten, or left alone with a reason containing ``left_alone``."""
    twin = copy.deepcopy(model)
    be = Capture(compiler="aot_eager", **options)
    compiled = torch.compile(lambda *a: run(twin, *a), backend=be, fullgraph=True)
    eager_in, compiled_in = [_leaf(t) for t in inputs], [_leaf(t) for t in inputs]
    expected, actual = run(model, *eager_in), compiled(*compiled_in)
    assert counters["ring_rewrite"]["decomposed"] == 1, dict(counters["ring_rewrite"])
    (record,) = be.records
    if left_alone is None:
        assert record.rewritten and counters["ring_rewrite"]["rewritten"] == 1, record
    else:
        assert not record.rewritten and left_alone in record.reason, record
    assert rel_err(actual, expected) < 1e-5
    if not grads:
        return
    cotangent = torch.randn_like(expected)
    expected.backward(cotangent)
    actual.backward(cotangent)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert rel_err(q.grad, p.grad) < 1e-5, name
    for i, (a, b) in enumerate(zip(compiled_in, eager_in)):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            assert rel_err(a.grad, b.grad) < 1e-5, f"input {i}"


# ---- nn.MultiheadAttention ------------------------------------------------------------------


def _seq(batch_first: bool, dim: int = E) -> torch.Tensor:
    return torch.randn(B, L, dim) if batch_first else torch.randn(L, B, dim)


def _mha_case(case: str, batch_first: bool):
    """(module kwargs, inputs, run(m, *inputs))."""
    x, y, z = _seq(batch_first), _seq(batch_first), _seq(batch_first)
    if case == "self":
        return {}, [x], lambda m, x: m(x, x, x, need_weights=False)[0]
    if case == "cross":  # key is value: in_proj_weight split into q and packed kv
        return {}, [x, y], lambda m, x, y: m(x, y, y, need_weights=False)[0]
    if case == "split":  # three inputs: in_proj_weight chunked in three
        return {}, [x, y, z], lambda m, x, y, z: m(x, y, z, need_weights=False)[0]
    if case == "separate":  # kdim / vdim != embed_dim: q/k/v_proj_weight
        kv = [_seq(batch_first, 24), _seq(batch_first, 16)]
        run = lambda m, x, k, v: m(x, k, v, need_weights=False)[0]  # noqa: E731
        return {"kdim": 24, "vdim": 16}, [x, *kv], run
    if case == "no_bias":
        return {"bias": False}, [x], lambda m, x: m(x, x, x, need_weights=False)[0]
    if case == "causal":
        mask = nn.Transformer.generate_square_subsequent_mask(L)
        run = lambda m, x: m(x, x, x, need_weights=False, attn_mask=mask, is_causal=True)[0]  # noqa: E731
        return {}, [x], run
    raise AssertionError(case)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("case", ["self", "cross", "split", "separate", "no_bias", "causal"])
def test_mha_matches_eager(case, batch_first):
    """m(x, x, x) is rewritten; m(x, y, y) is cross attention at equal lengths: decomposed,
    then left alone."""
    kwargs, inputs, run = _mha_case(case, batch_first)
    model = nn.MultiheadAttention(E, H, batch_first=batch_first, **kwargs)
    cross = case in ("cross", "split", "separate")  # key/value from other inputs than the query
    check_against_eager(model, run, inputs, left_alone="cross attention: query from " if cross else None)


@pytest.mark.parametrize("batch_first", [True, False])
def test_mha_key_padding_mask_matches_eager(batch_first):
    model = nn.MultiheadAttention(E, H, batch_first=batch_first)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, -5:] = True
    run = lambda m, x, kpm: m(x, x, x, need_weights=False, key_padding_mask=kpm)[0]  # noqa: E731
    check_against_eager(model, run, [_seq(batch_first), kpm])


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_decomposition_alone_matches_eager(dtype):
    """Without the SDPA rewrite the decomposed graph computes what the module does."""
    model = nn.MultiheadAttention(E, H, batch_first=True)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, -4:] = True
    if dtype is not torch.bool:
        kpm = torch.zeros(B, L).masked_fill(kpm, -2.5)  # additive, not only -inf
    x = torch.randn(B, L, E)

    def run(x, kpm):
        return model(x, x, x, need_weights=False, key_padding_mask=kpm)[0]

    def backend(gm, example_inputs):
        assert decompose_attention_modules(gm, example_inputs, config=RingDilatedConfig()) is gm
        assert not module_nodes(gm)
        (sdpa,) = sdpa_nodes(gm)
        assert sdpa.target is torch._C._nn.scaled_dot_product_attention
        assert sdpa.kwargs["attn_mask"].meta["example_value"].shape == (B, 1, 1, L)
        assert sdpa.args[0].meta["example_value"].shape == (B, H, L, E // H)
        return gm.forward

    actual = torch.compile(run, backend=backend, fullgraph=True)(x, kpm)
    assert counters["ring_rewrite"]["decomposed"] == 1
    torch.testing.assert_close(actual, run(x, kpm))


def test_functional_bool_key_padding_mask_matches_eager():
    """Called directly, F.multi_head_attention_forward gets the bool mask (True = ignore)."""
    m = nn.MultiheadAttention(E, H)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, -5:] = True

    def run(m, x, kpm):
        return F.multi_head_attention_forward(
            x, x, x, E, H, m.in_proj_weight, m.in_proj_bias, None, None, False, 0.0,
            m.out_proj.weight, m.out_proj.bias, key_padding_mask=kpm, need_weights=False,
        )[0]

    check_against_eager(m, run, [torch.randn(L, B, E), kpm])


@pytest.mark.parametrize("training", [True, False])
def test_dropout_reaches_sdpa_only_in_training(training):
    """As in torch: SDPA gets dropout_p in training, 0.0 in eval; rewrite_sdpa then decides."""
    m = nn.MultiheadAttention(E, H, dropout=0.25).train(training)
    x = torch.randn(L, B, E)
    gm, inputs = capture(lambda x: m(x, x, x, need_weights=False)[0], x)
    decompose_attention_modules(gm, inputs, config=RingDilatedConfig())
    (sdpa,) = sdpa_nodes(gm)
    assert sdpa.kwargs["dropout_p"] == (0.25 if training else 0.0)


# ---- nn.TransformerEncoderLayer -------------------------------------------------------------


def _encoder_layer(norm_first: bool, activation: str) -> nn.TransformerEncoderLayer:
    layer = nn.TransformerEncoderLayer(
        d_model=E, nhead=H, dim_feedforward=64, dropout=0.0, batch_first=True,
        norm_first=norm_first, activation=activation,
    )
    with torch.no_grad():  # norm1 and norm2 start equal (ones, zeros): tell them apart
        for norm in (layer.norm1, layer.norm2):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_()
    return layer


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_train_matches_eager(norm_first, activation):
    model = _encoder_layer(norm_first, activation).train()
    check_against_eager(model, lambda m, x: m(x), [torch.randn(B, L, E)])


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_eval_no_grad_matches_eager(norm_first, activation):
    """Eval under no_grad takes the fast path: one ``_transformer_encoder_layer_fwd`` node."""
    model = _encoder_layer(norm_first, activation).eval()
    x = torch.randn(B, L, E)
    with torch.no_grad():
        gm, _ = capture(lambda x: model(x), x)
        assert [n.target for n in module_nodes(gm)] == [torch._transformer_encoder_layer_fwd]
        torch._dynamo.reset()
        check_against_eager(model, lambda m, x: m(x), [x], grads=False)


def test_encoder_layer_eval_key_padding_mask_matches_eager():
    model = _encoder_layer(False, "relu").eval()
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, -5:] = True
    with torch.no_grad():
        check_against_eager(
            model, lambda m, x, kpm: m(x, src_key_padding_mask=kpm), [torch.randn(B, L, E), kpm],
            grads=False,
        )


def test_encoder_layer_fast_path_float_mask_is_read_as_bool():
    """The fast path ignores a key wherever its float mask is nonzero; the decomposition agrees."""
    model = _encoder_layer(False, "gelu").eval()
    x, mask = torch.randn(B, L, E), torch.zeros(B, L)
    mask[0, 3], mask[1, -2:] = 1.0, float("-inf")
    with torch.no_grad():
        gm, inputs = capture(lambda x, m: model(x, src_key_padding_mask=m), x, mask)
        (expected,) = gm(*inputs)
        decompose_attention_modules(gm, inputs, config=RingDilatedConfig())
        assert not module_nodes(gm)
        torch.testing.assert_close(gm(*inputs)[0], expected)
        torch.testing.assert_close(expected, model(x, src_key_padding_mask=mask))


# ---- the captured graph ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", [MHA, ENCODER_LAYER])
def test_graph_has_no_module_node_and_no_sdpa_left(kind):
    x = torch.randn(B, L, E)
    if kind == MHA:
        mha = nn.MultiheadAttention(E, H, batch_first=True)
        fn = lambda x: mha(x, x, x, need_weights=False)[0]  # noqa: E731
        context = torch.enable_grad()
    else:
        layer = _encoder_layer(True, "relu").eval()
        # NOTE: not the module itself: dynamo drops torch.nn frames from stack traces, so a module
        # compiled directly gives its node an empty stack_trace (location "?").
        fn = lambda x: layer(x)  # noqa: E731
        context = torch.no_grad()
    recorder = Capture()
    with context:
        torch.compile(fn, backend=recorder, fullgraph=True)(x)
    (gm,) = recorder.graphs
    assert not module_nodes(gm)
    assert not sdpa_nodes(gm)
    (apply,) = [
        n for n in gm.graph.nodes if n.target is torch.ops.higher_order.autograd_function_apply
    ]
    (record,) = recorder.records
    assert record.rewritten and record.kind == "sdpa"
    decomposed = [n for n in gm.graph.nodes if _role(n) == "decompose"]
    assert decomposed
    for node in decomposed:
        assert node.meta["ring_rewrite"] == {"site": record.site, "role": "decompose"}
        assert node.meta["stack_trace"] == apply.meta["stack_trace"]
    assert "test_decompose_mha.py" in record.location
    assert counters["ring_rewrite"]["decomposed"] == 1


def test_site_ids_follow_graph_order_after_skipped_sites():
    """Skipped modules take the first ids; each decomposed one gets its SDPA site's id."""
    plain, weighted = nn.MultiheadAttention(E, H), nn.MultiheadAttention(E, H)

    def fn(x):
        a, weights = weighted(x, x, x)  # weights used: left alone, site 0
        return plain(a, a, a)[0] + weights.sum()  # decomposed: its SDPA is site 1

    recorder = Capture()
    torch.compile(fn, backend=recorder, fullgraph=True)(torch.randn(L, B, E))
    skipped, rewritten = recorder.records
    assert (skipped.site, skipped.kind, rewritten.site, rewritten.kind) == (0, MHA, 1, "sdpa")
    (gm,) = recorder.graphs
    sites = {n.meta["ring_rewrite"]["site"] for n in gm.graph.nodes if _role(n) == "decompose"}
    assert sites == {1}


def test_default_need_weights_with_unused_weights_is_decomposed():
    m = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, L, E)
    recorder = Capture()
    actual = torch.compile(lambda x: m(x, x, x)[0], backend=recorder, fullgraph=True)(x)
    torch.testing.assert_close(actual, m(x, x, x)[0], rtol=1e-5, atol=1e-5)
    assert counters["ring_rewrite"]["decomposed"] == 1
    assert [r.rewritten for r in recorder.records] == [True]


# ---- left alone -----------------------------------------------------------------------------


def _left_alone_case(case: str):
    x = torch.randn(B, L, E)
    if case == "weights_used":
        m = nn.MultiheadAttention(E, H, batch_first=True)
        def use_weights(x):
            out, weights = m(x, x, x)
            return out + weights.sum()

        return use_weights, x, "the attention weights (output 1) are used"
    if case == "add_bias_kv":
        m = nn.MultiheadAttention(E, H, batch_first=True, add_bias_kv=True)
        return lambda x: m(x, x, x, need_weights=False)[0], x, "add_bias_kv=True"
    if case == "add_zero_attn":
        m = nn.MultiheadAttention(E, H, batch_first=True, add_zero_attn=True)
        return lambda x: m(x, x, x, need_weights=False)[0], x, "add_zero_attn=True"
    if case == "dense_mask":
        m = nn.MultiheadAttention(E, H, batch_first=True)
        mask = torch.randn(L, L)
        return (lambda x: m(x, x, x, need_weights=False, attn_mask=mask)[0], x,
                f"dense attn_mask of shape {(L, L)} without is_causal")
    if case == "causal_and_padding":
        m = nn.MultiheadAttention(E, H, batch_first=True)
        mask = nn.Transformer.generate_square_subsequent_mask(L)
        kpm = torch.zeros(B, L)  # float like mask: mismatched mask dtypes warn (a graph break)
        return (lambda x: m(x, x, x, need_weights=False, attn_mask=mask, is_causal=True,
                            key_padding_mask=kpm)[0], x, "is_causal=True with a key_padding_mask")
    if case == "encoder_layer_src_mask":
        layer = _encoder_layer(False, "relu").eval()
        mask = nn.Transformer.generate_square_subsequent_mask(L)
        return (lambda x: layer(x, src_mask=mask, is_causal=True), x,
                f"dense mask of shape {(B, H, L, L)} (mask_type=2)")
    raise AssertionError(case)


LEFT_ALONE = ["weights_used", "add_bias_kv", "add_zero_attn", "dense_mask",
              "causal_and_padding", "encoder_layer_src_mask"]


@pytest.mark.parametrize("case", LEFT_ALONE)
def test_unsupported_module_is_left_alone_with_reason(case):
    fn, x, reason = _left_alone_case(case)
    recorder = Capture()
    with torch.no_grad():
        actual = torch.compile(fn, backend=recorder, fullgraph=True)(x)
        torch.testing.assert_close(actual, fn(x))
    (gm,) = recorder.graphs
    assert len(module_nodes(gm)) >= 1
    assert counters["ring_rewrite"]["decomposed"] == 0
    records = [r for r in recorder.records if r.kind in (MHA, ENCODER_LAYER)]
    assert records and all(r.reason.startswith(reason) and not r.rewritten for r in records)
    assert [r.site for r in recorder.records] == list(range(len(recorder.records)))


@pytest.mark.parametrize("case", ["add_bias_kv", "dense_mask"])
def test_pass_returns_graph_unchanged_when_nothing_is_supported(case):
    fn, x, reason = _left_alone_case(case)
    gm, inputs = capture(fn, x)
    code = gm.code
    (site,) = find_attention_module_sites(gm)
    assert module_unsupported_reason(site).startswith(reason)
    assert decompose_attention_modules(gm, inputs, config=RingDilatedConfig()) is gm
    assert gm.code == code
    assert [r.reason for r in gm.meta["ring_rewrite_sites"]] == [module_unsupported_reason(site)]


def test_strict_raises_on_unsupported_module():
    fn, x, _ = _left_alone_case("add_zero_attn")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(fn, backend=ring_rewrite.backend(compiler="eager", strict=True))(x)
    assert isinstance(info.value.inner_exception, UnsupportedSiteError)
    assert "add_zero_attn=True" in str(info.value.inner_exception)


def test_sharded_mode_refuses_to_leave_a_module_alone():
    """Sharded, a module left alone would attend within the local shard only."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    fn, x, _ = _left_alone_case("add_bias_kv")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
            torch.compile(fn, backend=ring_rewrite.backend(compiler="eager", sharding="sharded"))(x)
    finally:
        dist.destroy_process_group()
    assert isinstance(info.value.inner_exception, UnsupportedSiteError)
    message = str(info.value.inner_exception)
    assert "sharded mode cannot leave it alone: add_bias_kv=True" in message


# ---- dilated ---------------------------------------------------------------------------------


def _reference_mha(m: nn.MultiheadAttention, x: torch.Tensor, **config) -> torch.Tensor:
    """Batch-first MHA in float64 whose attention is ``reference_attention``."""
    b, n, e = x.shape
    q, k, v = F.linear(x.double(), m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1)
    heads = lambda t: t.view(b, n, m.num_heads, e // m.num_heads).transpose(1, 2)  # noqa: E731
    out = reference_attention(heads(q), heads(k), heads(v), **config)
    return F.linear(out.transpose(1, 2).reshape(b, n, e), m.out_proj.weight, m.out_proj.bias)


@pytest.mark.parametrize("is_causal", [False, True])
def test_dilated_mha_matches_reference(is_causal):
    config = {"segment_lengths": [8, 16], "dilation_rates": [1, 2]}
    model = nn.MultiheadAttention(E, H, batch_first=True)
    reference = copy.deepcopy(model).double()
    mask = nn.Transformer.generate_square_subsequent_mask(L) if is_causal else None
    compiled = torch.compile(
        lambda x: model(x, x, x, need_weights=False, attn_mask=mask, is_causal=is_causal)[0],
        backend="ring_dilated", options={"compiler": "aot_eager", **config},
    )
    x = torch.randn(B, L, E, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    actual, expected = compiled(x), _reference_mha(reference, x64, is_causal=is_causal, **config)
    assert counters["ring_rewrite"]["rewritten"] == 1
    assert rel_err(actual, expected) < 1e-5
    cotangent = torch.randn_like(actual)
    actual.backward(cotangent)
    expected.backward(cotangent.double())
    assert rel_err(x.grad, x64.grad) < 1e-5
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-5, name


def test_chained_modules_are_bound_after_the_previous_decomposition():
    """The second of two chained module nodes reads the first's decomposed output."""
    first, second = nn.MultiheadAttention(E, H), nn.MultiheadAttention(E, H)

    def chained(x):
        a = first(x, x, x, need_weights=False)[0]
        return second(a, a, a, need_weights=False)[0]

    x = torch.randn(L, B, E)
    out = torch.compile(chained, backend=ring_rewrite.backend(compiler="eager"), fullgraph=True)(x)
    torch.testing.assert_close(out, chained(x), rtol=1e-5, atol=1e-5)
    assert counters["ring_rewrite"]["decomposed"] == 2
