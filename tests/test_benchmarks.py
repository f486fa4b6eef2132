"""The benchmarks' own pieces that their numbers rest on: the independent eager implementation
and the pair counts behind the GFLOP/s (the timings themselves are not tested)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import rel_err
from ring_rewrite.reference import connection_counts, reference_attention, reference_rows

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu  # noqa: E402
import single_device  # noqa: E402

CONFIGS = [([8, 16, 32, 64], [1, 2, 4, 8]), ([16, 64], [1, 2]), (None, None)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("segments, rates", CONFIGS, ids=["longnet", "two", "exact"])
def test_eager_baseline_is_the_same_function(segments, rates, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 64, 16, requires_grad=True) for _ in range(3))
    seg, rat = (segments, rates) if segments else ([64], [1])
    out = single_device.eager_dilated(q, k, v, seg, rat, causal)
    ref = reference_attention(q, k, v, segment_lengths=segments, dilation_rates=rates, is_causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    errors = [rel_err(a, b) for a, b in zip((out, *grads), (ref, *ref_grads))]
    assert max(errors) < 1e-5, errors


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("segments, rates", CONFIGS, ids=["longnet", "two", "exact"])
def test_pair_counts_match_the_reference_lattice(segments, rates, causal):
    n = 128
    branches = list(zip(segments, rates)) if segments else [(n, 1)]
    counts = connection_counts(n, 8, branches, is_causal=causal)
    per_head = {int(counts[j].sum()) for j in range(8)}
    assert per_head == {single_device.connected_pairs(n, segments, rates, causal)}


def test_scale_rows_match_the_reference():
    """``scale.py`` checks sampled rows with its own float64 rows (output and dq of one query
    position): they must be the reference's rows, and its inputs the same by position."""
    import scale

    n = 4096
    q, k, v, dout = (scale._rows(kind, 0, n).double() for kind in scale._KINDS)
    assert torch.equal(scale._rows("k", 1000, 1003), scale._rows("k", 0, n)[:, :, 1000:1003])
    q.requires_grad_()
    out = reference_attention(
        q, k, v, segment_lengths=scale.SEGMENTS, dilation_rates=scale.RATES, is_causal=True, query_chunk=512
    )
    (dq,) = torch.autograd.grad(out, (q,), dout)
    for p in (0, 1, 77, 2047, 2048, 3001, n - 1):
        rows = scale._reference_rows(p, n)
        torch.testing.assert_close(rows["out"], out[:, :, p].detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(rows["dq"], dq[:, :, p], rtol=1e-10, atol=1e-12)


def test_alibi_baseline_is_the_same_function():
    """``alibi_accuracy.py``'s float32 baseline (the key bias added as it is, in chunks of
    queries) is causal attention with that key bias: in float64 it is the reference."""
    import alibi_accuracy

    torch.manual_seed(0)
    n = 2304  # more than one chunk of queries, the last one short
    q, k, v = (torch.randn(1, alibi_accuracy.HEADS, n, 8, dtype=torch.float64) for _ in range(3))
    ref = reference_attention(q, k, v, is_causal=True, key_bias=alibi_accuracy.key_bias(n).double(), query_chunk=512)
    assert rel_err(alibi_accuracy._causal_key_bias(q, k, v), ref) < 1e-12


def test_decode_setup_and_byte_counts():
    """``decode.py``'s two setups, at P = 1 on a small model: the sharded one (``prefill`` and
    ``generate`` from its ``ShardedCache``) and the whole-cache one generate the same tokens,
    and its byte counts are the caches' (a ``DynamicCache`` of the prompt and every fed token;
    a ``ShardedCache`` adds an int64 position per key)."""
    pytest.importorskip("transformers")
    import decode

    import ring_rewrite

    fields = {"hidden_size": 32, "intermediate_size": 64, "head_dim": 8, "vocab_size": 64}
    segments, rates, n, k = [8, 16], [1, 2], 40, 4
    ids = decode.prompt(n, fields["vocab_size"])
    whole = decode.build_model(fields)
    decode.compile_model(whole, segments=segments, rates=rates, sharded=False, compiler="aot_eager")
    want = decode.generate(whole, ids, k)
    model = decode.build_model(fields)
    decode.compile_model(model, segments=segments, rates=rates, sharded=True, compiler="aot_eager")
    cache = ring_rewrite.prefill(model, ids, layout=decode.LAYOUT, multiple_of=max(rates))
    got = decode.generate(model, ids, k, cache=cache)
    assert got["tokens"] == want["tokens"]
    assert decode.cache_bytes(want["cache"]) == decode.whole_cache_bytes(n + k - 1, fields)
    held = cache.layers[0].keys.shape[2]
    assert decode.cache_bytes(cache) == decode.whole_cache_bytes(held, fields) + 2 * held * 8
    assert decode.gathered_bytes(4, fields) == 2 * 4 * 4 * (8 + 1) * 4


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flex_baseline_is_the_same_function(causal):
    """benchmarks/gpu.py's FlexAttention spelling of LongNet (``score_mod`` adds ``log c``, the
    block mask keeps ``c > 0``), forward on CPU (FlexAttention has no CPU backward), eager (the
    compiled path it takes on the GPU compiles for half a minute here: ``gpu.py --device cpu``
    checks that one)."""
    segments, rates, n = [16, 32, 64, 256], [1, 2, 4, 8], 256
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 16) for _ in range(3))
    out = gpu.flex_longnet(segments, rates, causal, n, 8, "cpu", compiled=False)(q, k, v)
    ref = reference_attention(q, k, v, segment_lengths=segments, dilation_rates=rates, is_causal=causal)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("segments, rates", CONFIGS, ids=["longnet", "two", "exact"])
def test_reference_rows_are_the_references_rows(segments, rates, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 64, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    k2, v2 = k[:, ::4].detach(), v[:, ::4].detach()  # GQA: 2 kv heads
    ref = reference_attention(q, k2, v2, segment_lengths=segments, dilation_rates=rates, is_causal=causal)
    dout = torch.randn_like(ref)
    (dq,) = torch.autograd.grad(ref, (q,), dout)
    for start in (0, 21, 48):
        rows = slice(start, start + 16)
        q_rows = q.detach()[:, :, rows].requires_grad_()
        got = reference_rows(q_rows, k2, v2, start, segment_lengths=segments, dilation_rates=rates, is_causal=causal)
        (got_dq,) = torch.autograd.grad(got, (q_rows,), dout[:, :, rows])
        assert torch.allclose(got, ref[:, :, rows], atol=1e-12) and torch.allclose(got_dq, dq[:, :, rows], atol=1e-12)


def _raise(error: Exception):
    def attend(q, k, v):
        raise error

    return attend


def test_gpu_cells_are_isolated_and_checked_before_timed():
    """``gpu.run_cell`` on CPU: a right variant is checked and timed; a wrong one fails its check
    and is not timed; one that raises, or runs out of memory, is recorded and nothing raises."""
    import argparse

    opts = argparse.Namespace(device="cpu", repeats=1)
    cells = {
        "eager": lambda: gpu.eager,
        "wrong": lambda: lambda q, k, v: q + 0 * (k + v),
        "raises": lambda: _raise(ValueError("bad\nsecond line")),
        "oom": lambda: _raise(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate")),
    }
    rows = {name: gpu.run_cell(gpu.Variant(name, make), 64, torch.float32, opts) for name, make in cells.items()}
    assert rows["eager"]["ok"] and max(rows["eager"]["errors"].values()) < 1e-5 and rows["eager"]["median_s"] > 0
    assert not rows["wrong"]["ok"] and "median_s" not in rows["wrong"]
    assert rows["raises"]["raised"] == "ValueError: bad" and not rows["raises"]["oom"]
    assert rows["oom"]["raised"] == "OOM" and rows["oom"]["oom"]
    gpu.add_shares(list(rows.values()))
    assert "FAILED check" in gpu.table(list(rows.values()))


def test_gpu_sizes_and_targets():
    """``--quick`` sizes (fp32 at the smallest N only), and the targets read at 128k bf16, else
    at the largest N ours was timed at, n/a where a number is missing."""
    import argparse

    quick = argparse.Namespace(seq=None, quick=True)
    assert gpu.sizes(quick, "bf16") == [32768, 131072] and gpu.sizes(quick, "fp32") == [32768]
    assert gpu.sizes(argparse.Namespace(seq=[8192, 4096], quick=True), "fp32") == [4096]

    def row(variant, n, median_s, exact=False, peak=4.0):
        return {"variant": variant, "n": n, "dtype": "bfloat16", "exact": exact, "ok": True,
                "median_s": median_s, "tflops": 1 / median_s, "peak_q_sized": peak}  # fmt: skip

    rows = [row("ours", 32768, 1.0), row("flex", 32768, 3.0), row("dense (flash)", 32768, 0.5, exact=True),
            row("ours", 65536, 2.0, peak=7.0)]  # fmt: skip
    gpu.add_shares(rows)
    speedup, share, peak = gpu.targets(rows)
    assert "N=65536" in speedup["line"] and speedup["met"] is None  # flex not timed there
    assert share["met"] is None and peak["value"] == 7.0 and peak["met"] is False
    rows.append(row("flex", 131072, 5.0))
    rows.append(row("ours", 131072, 2.0))
    rows.append(row("dense (flash)", 131072, 1.0, exact=True))
    gpu.add_shares(rows)
    speedup, share, peak = gpu.targets(rows)
    assert speedup["value"] == 2.5 and speedup["met"] and share["value"] == 50.0 and share["met"] is False


def test_comm_options_plan_rows_name_the_option_that_moves_least():
    """``comm_options.py``'s plan table: over 8 and 32 ranks the all-to-all moves less than the
    ring and any hybrid; 64 heads cannot be split over 128 or 512 ranks, and the hybrid in groups
    of 64 sends least there, less than the ring."""
    import comm_options

    rows = {(r["N"], r["P"]): r for r in comm_options._plan_rows()}
    for (n, world), row in rows.items():
        if world <= 32:
            assert row["all-to-all GiB"] < min(row["ring GiB"], row["hybrid GiB"]), row
            assert row["sends least"] == "comm='all_to_all'", row
        else:
            assert row["all-to-all GiB"] is None and row["best hybrid"] == "a2a_ranks=64", row
            assert row["hybrid GiB"] < row["ring GiB"] and row["sends least"] == "comm='hybrid', a2a_ranks=64", row
