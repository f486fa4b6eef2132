"""The CPU block kernel (``ring_rewrite/cpu_kernel.py``, ``csrc/flash_cpu.c``) against float64.

Shapes cross its tiles (query tiles of 8 to 64 rows, by the target's vectors; 256 keys):
lengths below, at and past them, ``L != S`` both ways (causal is top-left), GQA, ``d != dv``,
head dims that are no multiple of a vector (the kernel pads them), strided and dilated inputs. The backward is
checked as the ring uses it: each block's share from the *merged* ``out`` and ``lse`` sums to
the whole gradient, and a row whose ``lse`` is ``+inf`` gives nothing.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ring_rewrite import cpu_kernel, kernels

aten = torch.ops.aten


def _reference(q, k, v, scale, is_causal):
    """Float64 ``(out, lse)``, GQA by head groups, causal top-left."""
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), float("-inf"))
    lse = s.logsumexp(-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def _inputs(b, hq, hkv, length, keys, d, dv, layout="contiguous", seed=0):
    g = torch.Generator().manual_seed(seed)
    if layout == "dilated":  # every third row of a longer sequence: row stride 3 d
        q = torch.randn(b, hq, 3 * length, d, generator=g)[:, :, ::3]
        k = torch.randn(b, hkv, 3 * keys, d, generator=g)[:, :, ::3]
        v = torch.randn(b, hkv, 3 * keys, dv, generator=g)[:, :, ::3]
    else:
        q = torch.randn(b, hq, length, d, generator=g)
        k = torch.randn(b, hkv, keys, d, generator=g)
        v = torch.randn(b, hkv, keys, dv, generator=g)
        if layout == "heads inside":  # (B, L, H, D) memory, as SDPA's inputs often come
            q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    return q, k, v


CASES = [
    # b, hq, hkv, L, S, d, dv, causal
    (2, 2, 2, 1, 1, 8, 8, True),
    (1, 2, 2, 63, 63, 16, 16, True),
    (2, 4, 2, 64, 64, 32, 32, True),
    (1, 2, 1, 200, 530, 16, 24, False),
    (1, 2, 2, 530, 200, 16, 16, True),  # L > S: the last rows see every key
    (1, 3, 3, 100, 600, 8, 8, True),  # S > L: keys past the last row get no gradient
    (2, 2, 2, 700, 700, 64, 64, True),
    (1, 4, 2, 257, 257, 24, 16, False),
    (1, 3, 1, 130, 130, 17, 5, True),  # d, dv no multiple of any vector width
    (1, 2, 2, 2100, 2100, 64, 64, True),  # key tiles of 256 in full, a query tile cut short
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}h{}/{}L{}S{}d{}/{}{}".format(*c[:7], "c" if c[7] else ""))
@pytest.mark.parametrize("layout", ["contiguous", "heads inside", "dilated"])
def test_forward_and_backward_against_float64(case, layout):
    b, hq, hkv, length, keys, d, dv, causal = case
    q, k, v = _inputs(b, hq, hkv, length, keys, d, dv, layout)
    dout = torch.randn(b, hq, length, dv, generator=torch.Generator().manual_seed(1))
    scale = d**-0.5
    assert cpu_kernel.serves(q, k, v, bias=None)
    out, lse = cpu_kernel.forward(q, k, v, scale, causal)
    assert out.is_contiguous() and out.dtype == lse.dtype == torch.float32
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = _reference(qr, kr, vr, scale, causal)
    torch.testing.assert_close(out.double(), ref_out.detach(), rtol=0, atol=2e-6)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=0, atol=2e-6)

    grads = cpu_kernel.backward(dout, q, k, v, out, lse, scale, causal)
    expected = torch.autograd.grad(ref_out, (qr, kr, vr), dout.double())
    for got, want, like in zip(grads, expected, (q, k, v)):
        assert got.is_contiguous() and got.shape == like.shape
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("causal", [True, False])
def test_block_shares_from_merged_statistics_sum_to_the_whole_gradient(causal):
    """Keys split in two blocks, as ring steps split them: each block's backward, given the
    merged ``out`` and ``lse``, is its exact share (the first block causal, the second full)."""
    q, k, v = _inputs(2, 4, 2, 300, 600, 32, 32)
    dout = torch.randn(2, 4, 300, 32, generator=torch.Generator().manual_seed(2))
    scale = 32**-0.5
    first, second = slice(0, 300), slice(300, 600)
    o1, l1 = cpu_kernel.forward(q, k[:, :, first], v[:, :, first], scale, causal)
    o2, l2 = cpu_kernel.forward(q, k[:, :, second], v[:, :, second], scale, False)
    lse = torch.logaddexp(l1, l2)
    out = (o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1)).contiguous()
    dq1, dk1, dv1 = cpu_kernel.backward(dout, q, k[:, :, first], v[:, :, first], out, lse, scale, causal)
    dq2, dk2, dv2 = cpu_kernel.backward(dout, q, k[:, :, second], v[:, :, second], out, lse, scale, False)

    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    s = (qr @ kr.repeat_interleave(2, 1).transpose(-1, -2)) * scale
    if causal:  # row i sees keys 0..i of the first block, every key of the second
        above = torch.ones(300, 300, dtype=torch.bool).triu(1)
        s[..., first] = s[..., first].masked_fill(above, float("-inf"))
    ref = torch.softmax(s, -1) @ vr.repeat_interleave(2, 1)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=0, atol=2e-6)
    want = torch.autograd.grad(ref, (qr, kr, vr), dout.double())
    for got, w in zip((dq1 + dq2, torch.cat([dk1, dk2], 2), torch.cat([dv1, dv2], 2)), want):
        torch.testing.assert_close(got.double(), w, rtol=0, atol=1e-5 * max(1.0, w.abs().max().item()))


def test_a_row_with_nothing_to_attend_gives_no_gradient():
    q, k, v = _inputs(1, 2, 2, 70, 70, 16, 16)
    out, lse = cpu_kernel.forward(q, k, v, 0.25, True)
    lse[:, 1, 5:40] = float("inf")
    dout = torch.randn_like(out)
    dq, dk, dv = cpu_kernel.backward(dout, q, k, v, out, lse, 0.25, True)
    assert dq[:, 1, 5:40].eq(0).all()
    kept = dout.clone()
    kept[:, 1, 5:40] = 0  # the same rows' upstream gradient gone: dk, dv must not change
    _, dk_kept, dv_kept = cpu_kernel.backward(kept, q, k, v, out, lse, 0.25, True)
    torch.testing.assert_close(dk, dk_kept, rtol=0, atol=1e-6)
    torch.testing.assert_close(dv, dv_kept, rtol=0, atol=1e-6)


def test_the_same_on_one_thread_or_two():
    q, k, v = _inputs(2, 4, 2, 300, 300, 32, 32)
    dout = torch.randn(2, 4, 300, 32, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out, lse = cpu_kernel.forward(q, k, v, 0.2, True)
            results.append((out, lse, *cpu_kernel.backward(dout, q, k, v, out, lse, 0.2, True)))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        torch.testing.assert_close(one, two, rtol=0, atol=1e-6)


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize(
    "case",
    [
        (1, 2, 1, 700, 700, 32, 16, True),  # one (batch, kv head): every thread shares it
        (1, 6, 3, 300, 530, 16, 16, False),  # three: whole ones first, then the rest shared
        (5, 1, 1, 257, 257, 8, 8, True),
        (1, 2, 2, 40, 20, 8, 8, True),  # fewer query tiles than threads
    ],
    ids=lambda c: "b{}h{}/{}L{}S{}d{}/{}{}".format(*c[:7], "c" if c[7] else ""),
)
def test_backward_with_fewer_kv_heads_than_threads(case, threads):
    """The backward's tasks are (batch, kv head); where they do not fill every thread, the
    threads share one, each taking a slice of the query tiles that see a key tile and summing
    its dK, dV with the others (``head_task``)."""
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        test_forward_and_backward_against_float64(case, "dilated")
    finally:
        torch.set_num_threads(saved)


def test_what_it_serves_and_what_runs_aten():
    q, k, v = _inputs(1, 2, 2, 16, 16, 8, 8)
    assert cpu_kernel.serves(q, k, v, bias=None)
    assert not cpu_kernel.serves(q, k, v, bias=torch.zeros(1, 1, 1, 16))
    assert not cpu_kernel.serves(q.double(), k.double(), v.double(), bias=None)
    assert not cpu_kernel.serves(q[:, :, :0], k, v, bias=None)


def test_without_a_compiler_blocks_run_aten_with_a_warning(monkeypatch):
    q, k, v = _inputs(1, 4, 2, 100, 100, 16, 16)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    cpu_kernel._library.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not cpu_kernel.serves(q, k, v, bias=None)
        assert any("CPU block kernel is not available" in str(w.message) for w in caught)
        out, lse = kernels.KERNELS["cpu"].forward(q, k, v, None, 0.25, True)
        ref_out, ref_lse = _reference(q, k, v, 0.25, True)
        torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=2e-6)
    finally:
        monkeypatch.undo()
        cpu_kernel._library.cache_clear()
    assert cpu_kernel.serves(q, k, v, bias=None)  # built again with the compiler back
