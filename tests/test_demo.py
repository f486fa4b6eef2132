"""The training demo (examples/train_longnet.py) end to end, small: gloo ranks under torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ring_rewrite.reference import reference_attention

ROOT = Path(__file__).resolve().parents[1]
# 1024 tokens in zigzag chunks of 1024 / 2P: at P = 4 the (128, 1) branch is local, (512, 2) a
# sub-ring of all 4 ranks' chunks, (1024, 4) the full ring.
SMALL = ["--seq", "1024", "--segments", "128", "512", "1024", "--rates", "1", "2", "4",
         "--steps", "2"]  # fmt: skip


def run_demo(tmp_path: Path, *extra: str, ranks: int = 4) -> subprocess.CompletedProcess:
    demo = ROOT / "examples" / "train_longnet.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(ranks), str(demo), *SMALL, "--out", str(tmp_path / "loss.png"), *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)


def test_demo_trains_and_reports(tmp_path):
    # As users run it: inductor, 4 ranks; the first step's loss, logits and every parameter's
    # gradient against the float64 single-process model.
    proc = run_demo(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "ring_rewrite: 2 of 2 attention sites rewritten (per rank)" in out
    assert "4 / sharded / zigzag" in out  # the report's plan: 4 ranks, sharded, zigzag
    assert "compiler inductor" in out
    assert "first-step check vs one process with float64 reference attention" in out
    assert "grads   max-abs rel. difference" in out
    verdict = next(line.strip() for line in out.splitlines() if line.strip().startswith(("OK:", "FAIL:")))
    assert verdict == "OK: bound 1e-05 (float32)", verdict
    for step in ("step 1/2", "step 2/2"):
        assert step in out
    for row in ("loss first -> last", "tokens/s (all ranks, steps 2+)", "peak RSS MiB per rank", "wall time"):
        assert row in out
    png = tmp_path / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_on_a_dp_cp_mesh_with_fsdp(tmp_path):
    # 2 data-parallel replicas x rings of 2 ranks, FSDP2: each replica checked on its own samples.
    proc = run_demo(tmp_path, "--dp", "2", "--dp-mode", "fsdp", "--compiler", "aot_eager")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "4 ranks (gloo, cpu) = 2 data-parallel replicas x rings of 2" in out
    assert "gradients averaged over all 4 ranks by FSDP2 (fully_shard)" in out
    assert "2 / sharded / zigzag  0 (0-1)" in out  # rank 0's ring is its cp group, ranks 0 and 1
    losses = re.findall(r"loss \(replica (\d)\)\s+sharded over 2 ranks ([\d.]+)", out)
    assert [d for d, _ in losses] == ["0", "1"] and losses[0][1] != losses[1][1], out  # own samples
    assert "grads   max-abs rel. difference" in out and "vs the mean of 2 replicas'" in out
    assert "OK: bound 1e-05 (float32)" in out
    assert "step 2/2" in out


def test_demo_exits_nonzero_when_the_first_step_is_off(tmp_path):
    # A bound no float32 run meets: the check must fail on every rank before any training step.
    proc = run_demo(tmp_path, "--check-bound", "1e-15", "--compiler", "aot_eager", ranks=2)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "FAIL: bound 1e-15 (float32)" in out
    assert "not training" in out
    assert "step 1/2" not in out
    assert not (tmp_path / "loss.png").exists()


def test_demo_help_says_cuda_is_untested():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_longnet.py"), "--help"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0
    assert "untested" in proc.stdout


# The demo's float64 check runs reference_attention in query chunks (16k tokens would not fit
# densely): the chunked form must be the dense function, values and gradients.
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("key_bias", [None, "bool", "float"])
@pytest.mark.parametrize(
    "segments, rates", [([8, 32, 64], [1, 2, 4]), ([16, 96], [1, 8]), ([12, 40], [2, 4])]
)  # the last has no rate 1: rows off every lattice give 0
def test_chunked_reference_is_the_dense_one(is_causal, key_bias, segments, rates):
    gen = torch.Generator().manual_seed(0)
    n = 90  # not a multiple of the chunk, nor of the segments
    q, k, v = (torch.randn(2, h, n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for h in (4, 2, 2))  # fmt: skip
    bias = {None: None, "bool": torch.rand(2, 1, 1, n, generator=gen) > 0.3,
            "float": torch.randn(2, 1, 1, n, generator=gen, dtype=torch.float64)}[key_bias]  # fmt: skip
    config = dict(segment_lengths=segments, dilation_rates=rates, is_causal=is_causal, key_bias=bias)
    dense = reference_attention(q, k, v, **config)
    chunked = reference_attention(q, k, v, query_chunk=17, **config)
    torch.testing.assert_close(chunked, dense, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(dense.square().sum(), (q, k, v))
    chunked_grads = torch.autograd.grad(chunked.square().sum(), (q, k, v))
    for got, want in zip(chunked_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
