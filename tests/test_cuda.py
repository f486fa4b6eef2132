"""The CUDA block kernel (``ring_rewrite/kernels.py``) end to end on one GPU (docs/semantics.md,
Accuracy).

``test_numerics.py``'s checks, cut to what the CUDA entry changes, with the inputs on
``cuda`` at P = 1 (one GPU runs no ring of processes). The float64 reference runs on the CPU.
Skipped without a CUDA device: the CPU CI never runs it. Each test prints its errors (``-s``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ranks import run_ranks
from ring_rewrite import kernels
from ring_rewrite.reference import connection_counts
from test_numerics import CONFIGS, SHAPES, TOL, _assert_rewritten, _compile, _errors, _forward_backward
from test_numerics import _inputs, _mask, _reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

DEVICE = "cuda"

CUDA_CONFIGS = {name: CONFIGS[name] for name in ("exact", "longnet", "rate8")}
CUDA_SHAPES = {name: SHAPES[name] for name in ("mha_n100", "gqa8x2_n37", "d!=dv_scale_n64")}


def _on_device(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.to(DEVICE) for x in xs]


def _cpu(got):
    out, grads = got
    return out.cpu(), [g.cpu() for g in grads]


def _run(config, compiler, q, k, v, dout, mask=None, **kwargs):
    """The compiled site's output and q/k/v gradients on the GPU, checked rewritten, on the CPU."""
    fn = _compile(config, compiler, **kwargs)
    got = _forward_backward(fn, *_on_device(q, k, v, dout), None if mask is None else mask.to(DEVICE))
    _assert_rewritten()
    assert all(x.device.type == DEVICE for x in (got[0], *got[1]))
    return _cpu(got)


def _report(name: str, errors: dict[str, float]) -> None:
    print(f"\n{name}: " + " ".join(f"{k}={v:.3g}" for k, v in errors.items()), end="")


# ---- key-padding masks ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bool", "empty_row"])
@pytest.mark.parametrize("config", [CONFIGS["exact"], CONFIGS["longnet"]], ids=["exact", "longnet"])
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_key_padding_mask(compiler, config, kind, request):
    batch, hq, hkv, n, d = 2, 4, 2, 50, 8
    q, k, v = _inputs(batch, hq, hkv, n, d, d)
    dout = torch.randn(batch, hq, n, d)
    mask = _mask(kind, batch, hq, n)
    got = _run(config, compiler, q, k, v, dout, mask, enable_gqa=True)
    errors = _errors(got, _reference(config, q, k, v, dout, mask=mask))
    _report(request.node.name, errors)
    assert max(errors.values()) < TOL, errors
    if kind == "empty_row":
        out, (dq, dk, dv) = got
        assert (out[1] == 0).all(), "a batch row with every key masked outputs 0"
        assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()


# ---- bf16 / fp16 ------------------------------------------------------------------------------


def _sdpa_same_function(config, q, k, v, dout, *, is_causal):
    """``(out, (dq, dk, dv))`` of plain SDPA in the inputs' dtype on their device, computing the
    function of ``config`` (the dense form, as ``_same_function_sdpa`` in test_numerics.py).

    CUDA's fused kernels take an additive mask only in the inputs' dtype, where ``log c`` would be
    rounded (log 2 to 0.691 in bf16) and the baseline made worse. So each branch gets its own copy
    of the keys, its connections a bool mask: softmax over the copies is softmax with the bias
    ``log c``, exactly. K/V heads are spelled out per query head, so no GQA support is asked of
    the fused kernels: one of them serves SDPA, not its math path (which upcasts half inputs).
    The copies' gradients are summed in float32 and rounded once, as a fused kernel would.
    """
    hq, hkv, n = q.shape[1], k.shape[1], q.shape[2]
    branches = [(n, 1)] if config is None else list(zip(*config))
    m, g = len(branches), hq // hkv
    kk, vv = (x.repeat_interleave(g, 1).repeat(1, 1, m, 1) for x in (k, v))
    mask = None
    if config is not None:
        conn = [connection_counts(n, hq, [b], is_causal=is_causal, device=q.device) > 0 for b in branches]
        mask = torch.cat(conn, -1).unsqueeze(0)
    leaves = [x.detach().clone().requires_grad_() for x in (q, kk, vv)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=is_causal and config is None)
    dq, dkk, dvv = torch.autograd.grad(out, leaves, dout)

    def fold(grad):  # (B, Hq, m*N, C) -> (B, Hkv, N, C): the copies summed
        return grad.float().unflatten(2, (m, n)).sum(2).unflatten(1, (hkv, g)).sum(2).to(grad.dtype)

    return _cpu((out.detach(), [dq, fold(dkk), fold(dvv)]))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("config", [CONFIGS["exact"], CONFIGS["longnet"]], ids=["exact", "longnet"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("candidate", kernels.cuda_candidates(torch.bfloat16))
def test_half_no_worse_than_sdpa(candidate, dtype, config, is_causal, request):
    """In bf16 / fp16, error vs the float64 reference <= 2x that of SDPA in the same dtype on the
    GPU computing the same function on the same inputs, output and gradients (docs/semantics.md,
    Accuracy), with each CUDA block kernel that serves half inputs (GQA, head size 16)."""
    batch, hq, hkv, n, d = 2, 4, 2, 100, 16
    q, k, v = _inputs(batch, hq, hkv, n, d, d, dtype=dtype)
    dout = torch.randn(batch, hq, n, d, dtype=dtype)
    with kernels.use_cuda_kernel(candidate):
        got = _run(config, "inductor", q, k, v, dout, is_causal=is_causal, enable_gqa=True)
    assert got[0].dtype == dtype and all(g.dtype == dtype for g in got[1])
    expected = _reference(config, q, k, v, dout, is_causal=is_causal)
    ours = _errors(got, expected)
    theirs = _errors(_sdpa_same_function(config, *_on_device(q, k, v, dout), is_causal=is_causal), expected)
    _report(request.node.name, {**ours, **{f"sdpa_{k}": v for k, v in theirs.items()}})
    for name in ours:
        assert ours[name] <= 2 * theirs[name], (name, ours[name], theirs[name])


# ---- float32 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", CUDA_SHAPES.values(), ids=CUDA_SHAPES.keys())
@pytest.mark.parametrize("config", CUDA_CONFIGS.values(), ids=CUDA_CONFIGS.keys())
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_float32_matches_reference(compiler, config, shape, is_causal, request):
    batch, hq, hkv, n, d, dv, scale = shape
    q, k, v = _inputs(batch, hq, hkv, n, d, dv)
    dout = torch.randn(batch, hq, n, dv)
    kwargs = dict(is_causal=is_causal, scale=scale, enable_gqa=hq != hkv)
    got = _run(config, compiler, q, k, v, dout, **kwargs)
    errors = _errors(got, _reference(config, q, k, v, dout, is_causal=is_causal, scale=scale))
    _report(request.node.name, errors)
    assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("shape", ["mha_n100", "gqa8x2_n37"])
def test_local_branches_in_head_chunks(compiler, shape, monkeypatch, request):
    """The local branches' backward one kv head at a time (Note [Head chunks of local branches]):
    its ordering and in-place writes on the GPU."""
    from ring_rewrite import site_plan

    monkeypatch.setattr(site_plan, "LOCAL_CHUNK_BYTES", 1)
    batch, hq, hkv, n, d, dv, scale = SHAPES[shape]
    q, k, v = _inputs(batch, hq, hkv, n, d, dv)
    dout = torch.randn(batch, hq, n, dv)
    got = _run(CONFIGS["longnet"], compiler, q, k, v, dout, is_causal=True, enable_gqa=hq != hkv)
    errors = _errors(got, _reference(CONFIGS["longnet"], q, k, v, dout, is_causal=True))
    _report(request.node.name, errors)
    assert max(errors.values()) < TOL, errors


# ---- the ring's transfers over NCCL (Note [The CUDA transport] in comm/transfers.py) -----------


def _nccl_to_itself(rank, world):
    from ring_rewrite.comm import calls, groups, tags, waiter

    torch.cuda.set_device(0)
    ops = torch.ops.ring_rewrite
    group = groups.ring_group(dist.group.WORLD)  # gloo beside NCCL
    name = group.group_name
    token = calls.site_token(0, name, 0, 60_000)  # the call's header, int64 on the CPU: over gloo
    x = torch.randn(1 << 20, device=DEVICE)
    y = torch.randn(64, 48, device=DEVICE, dtype=torch.bfloat16)
    expected = [x.clone(), y.clone()]
    tag = tags.transfer_tag(0, tags.KV, 1)
    token = ops.ring_shift_start([x, y], token, name, 0, 0, tag)
    busy = torch.randn(4096, 4096, device=DEVICE)
    busy = busy @ busy  # compute the transfer overlaps
    *got, token = ops.ring_shift_wait([x, y], token, tag, [busy])
    ops.close_call(token, name, [])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert waiter._WAITER._thread is None  # no helper thread waited on a CUDA work
    assert not waiter._PENDING


@pytest.mark.skipif(not dist.is_nccl_available(), reason="no NCCL")
def test_a_transfer_over_nccl_to_its_own_rank():
    """One GPU runs no ring of several processes (NCCL refuses two ranks on one GPU): a rank
    sends to itself, through the ring's group and ops."""
    run_ranks(1, _nccl_to_itself, backend="nccl")
