"""Whole models through the backend: a GQA GPT block, MultiheadAttention, TransformerEncoderLayer.

Numerics against the float64 reference (the same model in float64 with its attention
replaced by ``reference_attention``) at P = 1, and against the single-process results on 2 gloo
ranks in replicated and sharded mode (docs/semantics.md, Sharding and Accuracy).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import ring_rewrite
from ring_rewrite import reference_attention

from conftest import rel_err
from ranks import run_ranks

BOUND = 1e-5  # float32 vs float64 reference (docs/semantics.md, Accuracy)
B, E = 2, 32
LONGNET = {"segment_lengths": [16, 32, 64], "dilation_rates": [1, 2, 4]}
RING_DILATED = {"segment_lengths": [16, 64], "dilation_rates": [1, 2]}


# ---- models ----------------------------------------------------------------------------------


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class GPTBlock(nn.Module):
    """Pre-norm causal block with GQA and no position encoding: positions enter through attention
    only, so sharding the sequence does not change the math. ``attend`` is swappable."""

    def __init__(self, dim: int = E, heads: int = 4, kv_heads: int = 2, head_dim: int = 8) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, heads * head_dim)
        # NOTE: no key bias: it adds the same q . b to every score of a row, so its gradient is
        # exactly zero and a relative error on it measures nothing but float32 noise.
        self.k = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * head_dim)
        self.out = nn.Linear(heads * head_dim, dim)
        self.norm2 = nn.RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.attend = causal_sdpa
        with torch.no_grad():  # norms start at ones / zeros: make their gradients tell them apart
            for p in (self.norm1.weight, self.norm2.weight):
                p.uniform_(0.5, 1.5)
            self.norm1.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        a = self.attend(q, k, v).transpose(1, 2).reshape(b, n, self.heads * self.head_dim)
        x = x + self.out(a)
        return x + self.mlp(self.norm2(x))


def reference_gpt(model: GPTBlock, config: dict) -> GPTBlock:
    """A float64 copy of ``model`` whose attention is ``reference_attention`` under ``config``."""
    twin = copy.deepcopy(model).double()
    twin.attend = functools.partial(reference_attention, is_causal=True, **config)
    return twin


def encoder_layer(norm_first: bool = False) -> nn.TransformerEncoderLayer:
    layer = nn.TransformerEncoderLayer(
        d_model=E, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True, norm_first=norm_first
    )
    with torch.no_grad():  # norm1 and norm2 start equal (ones, zeros): tell them apart
        for norm in (layer.norm1, layer.norm2):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_()
    return layer


def reference_mha(m: nn.MultiheadAttention, x: torch.Tensor, config: dict) -> torch.Tensor:
    """Batch-first self-attention of ``m`` (float64 weights) with ``reference_attention``."""
    b, n, e = x.shape
    q, k, v = F.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, dim=-1)
    heads = lambda t: t.view(b, n, m.num_heads, e // m.num_heads).transpose(1, 2)  # noqa: E731
    out = reference_attention(heads(q), heads(k), heads(v), **config)
    return F.linear(out.transpose(1, 2).reshape(b, n, e), m.out_proj.weight, m.out_proj.bias)


def reference_layer(layer: nn.TransformerEncoderLayer, x: torch.Tensor, config: dict):
    """``nn.TransformerEncoderLayer.forward`` (relu, no dropout, no mask) in float64 weights, with
    ``reference_attention``."""
    sa = lambda h: reference_mha(layer.self_attn, h, config)  # noqa: E731
    ff = lambda h: layer.linear2(F.relu(layer.linear1(h)))  # noqa: E731
    if layer.norm_first:
        x = x + sa(layer.norm1(x))
        return x + ff(layer.norm2(x))
    x = layer.norm1(x + sa(x))
    return layer.norm2(x + ff(x))


def _run_module(kind: str, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if kind == "mha":
        return m(x, x, x, need_weights=False)[0]
    return m(x)


def _run_reference(kind: str, m: nn.Module, x: torch.Tensor, config: dict) -> torch.Tensor:
    if kind == "mha":
        return reference_mha(m, x, config)
    return reference_layer(m, x, config)


def _compile(model: nn.Module, options: dict | None = None, *, compiler: str = "aot_eager"):
    options = {**(options or {}), "compiler": compiler}
    return torch.compile(model, backend="ring_dilated", options=options, fullgraph=True)


def _check(model, twin, x, cotangent, compiled_out, expected_out, x_ref) -> None:
    """Outputs, parameter gradients and the input gradient of ``model`` (compiled) vs ``twin``."""
    assert rel_err(compiled_out, expected_out) < BOUND
    compiled_out.backward(cotangent)
    expected_out.backward(cotangent.to(expected_out.dtype))
    assert rel_err(x.grad, x_ref.grad) < BOUND, "input"
    names = [name for name, _ in model.named_parameters()]
    assert names == [name for name, _ in twin.named_parameters()]
    for name, p, q in zip(names, model.parameters(), twin.parameters()):
        assert rel_err(p.grad, q.grad) < BOUND, name


# ---- P = 1: the GPT block ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [64, 50], ids=["N64", "N50"])
def test_gpt_block_dilated_matches_reference(n):
    model = GPTBlock()
    twin = reference_gpt(model, LONGNET)
    x = torch.randn(B, n, E, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    out = _compile(model, LONGNET)(x)
    assert dict(counters["ring_rewrite"]) == {"rewritten": 1}
    _check(model, twin, x, torch.randn_like(out), out, twin(x64), x64)


def test_gpt_block_dilated_is_not_exact_attention():
    """The dilated reference differs from plain SDPA here, so the test above tests dilation."""
    model = GPTBlock()
    x = torch.randn(B, 64, E)
    with torch.no_grad():
        assert rel_err(reference_gpt(model, LONGNET)(x.double()), model(x)) > 1e-2


def test_gpt_block_exact_matches_eager():
    model = GPTBlock()
    twin = copy.deepcopy(model)
    x = torch.randn(B, 64, E, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    out = _compile(model)(x)
    assert dict(counters["ring_rewrite"]) == {"rewritten": 1}
    _check(model, twin, x, torch.randn_like(out), out, twin(x_eager), x_eager)


def test_gpt_block_dilated_inductor_matches_reference():
    """The default compiler: inductor lowers the rewritten graph, forward and backward."""
    config = {"segment_lengths": [8, 32], "dilation_rates": [1, 2]}
    model = GPTBlock()
    twin = reference_gpt(model, config)
    x = torch.randn(1, 32, E, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    out = _compile(model, config, compiler="inductor")(x)
    assert dict(counters["ring_rewrite"]) == {"rewritten": 1}
    _check(model, twin, x, torch.randn_like(out), out, twin(x64), x64)


# ---- P = 1: nn.MultiheadAttention and nn.TransformerEncoderLayer, dilated ----------------------

# Three branches with partial last segments (N = 40), no branch over the whole sequence.
MODULE_CONFIG = {"segment_lengths": [8, 16, 32], "dilation_rates": [1, 2, 4]}
MODULE_N = 40


def _module(kind: str, norm_first: bool) -> nn.Module:
    if kind == "mha":
        return nn.MultiheadAttention(E, 4, batch_first=True)
    return encoder_layer(norm_first)


MODULES = [("mha", False), ("layer", False), ("layer", True)]
MODULE_IDS = ["mha", "layer", "layer_norm_first"]


@pytest.mark.parametrize("kind, norm_first", MODULES, ids=MODULE_IDS)
def test_module_train_dilated_matches_reference(kind, norm_first):
    model = _module(kind, norm_first).train()
    twin = copy.deepcopy(model).double()
    compiled = _compile(lambda x: _run_module(kind, model, x), MODULE_CONFIG)
    x = torch.randn(B, MODULE_N, E, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    out = compiled(x)
    assert counters["ring_rewrite"]["rewritten"] == 1, dict(counters["ring_rewrite"])
    expected = _run_reference(kind, twin, x64, MODULE_CONFIG)
    _check(model, twin, x, torch.randn_like(out), out, expected, x64)


@pytest.mark.parametrize("kind, norm_first", MODULES, ids=MODULE_IDS)
def test_module_eval_no_grad_dilated_matches_reference(kind, norm_first):
    """Eval under no_grad: the encoder layer takes its fused fast path (one node that the backend
    decomposes); the attention is dilated all the same."""
    model = _module(kind, norm_first).eval()
    twin = copy.deepcopy(model).double()
    compiled = _compile(lambda x: _run_module(kind, model, x), MODULE_CONFIG)
    x = torch.randn(B, MODULE_N, E)
    with torch.no_grad():
        out = compiled(x)
        expected = _run_reference(kind, twin, x.double(), MODULE_CONFIG)
        assert rel_err(_run_module(kind, model, x), expected) > 1e-2  # dilation shows
    assert counters["ring_rewrite"]["rewritten"] == 1, dict(counters["ring_rewrite"])
    assert rel_err(out, expected) < BOUND


# ---- P = 2 (gloo): replicated and sharded mode -------------------------------------------------

N_RING = 64


def _model_and_reference(kind: str, config: dict | None, layers: int = 1):
    """Same seed on every rank: ``(model, twin, run)``, the single-process reference being
    ``run(x)`` with gradients in ``twin``; ``layers`` GPT blocks make a stack."""
    torch.manual_seed(0)
    model = GPTBlock() if kind == "gpt" else encoder_layer().train()
    if layers > 1:
        model = nn.Sequential(model, *(GPTBlock() for _ in range(layers - 1)))
    if config is None:  # exact attention: the eager float32 model
        twin = copy.deepcopy(model)
        return model, twin, twin
    if kind == "gpt":
        blocks = [reference_gpt(block, config) for block in (model if layers > 1 else [model])]
        twin = nn.Sequential(*blocks) if layers > 1 else blocks[0]
        return model, twin, twin
    twin = copy.deepcopy(model).double()
    return model, twin, lambda x: reference_layer(twin, x, config)


def _replicated(rank, world, cases):
    for kind, config in cases:
        torch._dynamo.reset()
        counters.clear()
        model, twin, reference = _model_and_reference(kind, config)
        x = torch.randn(B, N_RING, E, requires_grad=True)
        cotangent = torch.randn(B, N_RING, E)
        x_ref = x.detach().to(next(twin.parameters()).dtype).requires_grad_()
        options = {**(config or {}), "sharding": "replicated"}
        out = _compile(model, options)(x)
        assert counters["ring_rewrite"]["rewritten"] == 1, (rank, kind, config)
        try:
            _check(model, twin, x, cotangent, out, reference(x_ref), x_ref)
        except AssertionError as e:
            raise AssertionError(f"rank {rank}, {kind}, {config}: {e}") from e


def test_replicated_models_match_single_process():
    cases = [(kind, config) for kind in ("gpt", "layer") for config in (None, RING_DILATED)]
    run_ranks(2, _replicated, cases)


def _sharded(rank, world, configs):
    import torch.distributed as dist

    for config in configs:
        torch._dynamo.reset()
        counters.clear()
        # Two blocks: their sites share one traced body (Note [One body per plan]).
        model, twin, reference = _model_and_reference("gpt", config, layers=2)
        x_full, cotangent_full = torch.randn(B, N_RING, E), torch.randn(B, N_RING, E)
        x_ref = x_full.to(next(twin.parameters()).dtype, copy=True).requires_grad_()
        expected = reference(x_ref)
        expected.backward(cotangent_full.to(expected.dtype))
        cotangent = ring_rewrite.shard(cotangent_full, 1)

        x = ring_rewrite.shard(x_full, 1).clone().requires_grad_()
        out = _compile(model, {**(config or {}), "sharding": "sharded"})(x)
        assert counters["ring_rewrite"]["rewritten"] == 2, (rank, config)
        assert out.shape == (B, N_RING // world, E)
        out.backward(cotangent)
        errors = {"out": rel_err(out, ring_rewrite.shard(expected.detach(), 1))}
        errors["input"] = rel_err(x.grad, ring_rewrite.shard(x_ref.grad, 1))
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            dist.all_reduce(p.grad)  # the loss is a sum over tokens: the ranks' parts add up
            errors[name] = rel_err(p.grad, q.grad)
        assert max(errors.values()) < BOUND, (rank, config, errors)


def test_sharded_gpt_blocks_match_single_process():
    run_ranks(2, _sharded, [None, RING_DILATED])
