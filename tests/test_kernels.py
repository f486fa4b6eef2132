"""The block kernel table (``ring_rewrite/kernels.py``).

The CPU entry's numerics are tested through the ops (``test_ops.py``) and the ring. The CUDA
entry's are tested by ``test_cuda.py`` on a GPU; here, without one, only its shapes are checked,
on meta tensors (Note [The CUDA kernels]).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from ring_rewrite import kernels
from ring_rewrite.site_plan import SitePlan

from conftest import Capture


def test_the_table_names_what_runs_where():
    assert set(kernels.KERNELS) == {"cpu", "cuda"}
    assert kernels.KERNELS["cpu"].tested and kernels.KERNELS["cuda"].tested
    assert kernels.block_kernel(torch.device("cpu")) is kernels.KERNELS["cpu"]
    with pytest.raises(NotImplementedError, match="no kernel for device 'xpu'.*has cpu, cuda"):
        kernels.block_kernel("xpu")


@pytest.mark.parametrize(
    "device, dtype, reason",
    [
        ("cpu", torch.float64, None),
        ("cpu", torch.int32, "dtypes torch.int32/.*need one of float16, bfloat16, float32, float64"),
        ("meta", torch.float32, "device 'meta': no block kernel"),
    ],
)
def test_kernel_unsupported_reason(device, dtype, reason):
    q = torch.empty(1, 2, 8, 4, device=device, dtype=dtype)
    got = kernels.kernel_unsupported_reason(q, q, q)
    if reason is None:
        assert got is None
    else:
        assert re.search(reason, got), got


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, torch.float32), (torch.float64, torch.float64)])
def test_a_plan_computes_in_what_its_device_kernel_says(dtype, expected):
    plan = SitePlan.build(
        batch=1, hq=2, hkv=2, n=16, d=4, dv=4, dtype=dtype, scale=0.5, is_causal=True,
        has_mask=False, branches=((16, 1),),
    )  # fmt: skip
    assert plan.device == "cpu" and plan.compute_dtype == expected
    cuda = SitePlan.build(
        batch=1, hq=2, hkv=2, n=16, d=4, dv=4, dtype=dtype, device="cuda", scale=0.5,
        is_causal=True, has_mask=False, branches=((16, 1),),
    )  # fmt: skip
    assert cuda.compute_dtype == dtype


def test_a_site_on_a_device_without_kernel_is_left_alone_with_the_reason():
    def attend(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    recorder = Capture()
    torch.compile(attend, backend=recorder)(torch.empty(1, 2, 8, 4, device="meta"))
    (record,) = recorder.records
    assert not record.rewritten
    assert record.reason == "device 'meta': no block kernel (ring_rewrite/kernels.py has cpu, cuda)"


@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("d, dv", [(16, 16), (12, 20)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("candidate", list(kernels.CUDA_CANDIDATES))
def test_cuda_entry_shapes_on_meta_tensors(candidate, is_causal, hkv, d, dv, with_bias):
    """Each CUDA candidate's shapes and dtypes; flash and cuDNN serve no bias, nor a causal block
    that is not square (their causal masks align differently from ours there)."""
    b, hq, length, s = 2, 4, 40, 24
    q = torch.empty(b, hq, length, d, device="meta", dtype=torch.bfloat16)
    k = torch.empty(b, hkv, s, d, device="meta", dtype=torch.bfloat16)
    v = torch.empty(b, hkv, s, dv, device="meta", dtype=torch.bfloat16)
    bias = torch.empty(b, hq, 1, s, device="meta", dtype=torch.bfloat16) if with_bias else None
    cuda = kernels.KERNELS["cuda"]
    if candidate != "efficient":
        serves = kernels.CUDA_CANDIDATES[candidate].serves(q, k, v, bias, is_causal)
        assert serves == (bias is None and not is_causal)
    with kernels.use_cuda_kernel(candidate):
        out, lse = cuda.forward(q, k, v, bias, 0.3, is_causal)
    assert (out.shape, out.dtype) == ((b, hq, length, dv), q.dtype)
    assert (lse.shape, lse.dtype) == ((b, hq, length), torch.float32)
    with kernels.use_cuda_kernel(candidate):
        grads = cuda.backward(torch.empty_like(out), q, k, v, out, lse, bias, 0.3, is_causal)
    assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (q, k, v)]
    assert all(g.is_contiguous() for g in grads)
