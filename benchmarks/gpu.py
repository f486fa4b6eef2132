"""One GPU, forward + backward: the compiled rewrite against FlexAttention, eager and dense flash.

Inputs ``q, k, v`` of shape ``(1, 8, N, 64)`` (``requires_grad``), causal, bf16 and fp32, N from
32k up. The function is ``single_device.py``'s LongNet config (segments 2048, 4096, 8192, 16384,
rates 1, 2, 4, 8), written four ways, each timed forward + backward:

* ``ours``: ``F.scaled_dot_product_attention`` compiled with the ``ring_dilated`` backend
  (inductor), its blocks on the CUDA kernels ``kernels.CUDA_ORDER`` picks; and ``ours[name]``,
  the same compiled function with every block it serves on candidate ``name``
  (``kernels.use_cuda_kernel``: the choice is made at run time, nothing recompiles).
* ``flex``: ``flex_attention`` (compiled) with the LongNet function as FlexAttention spells it:
  a ``score_mod`` adding ``log c(j, p, t)``, ``c`` the number of branches that connect query
  ``p`` and key ``t`` for head ``j``, and a block mask where ``c > 0`` and ``t <= p``. It skips
  blocks no branch reaches, and computes every pair of a block that one reaches.
* ``eager``: ``single_device.eager_dilated`` (gather, attention with its log-sum-exp, scatter,
  merge; autograd backward), until it runs out of memory.
* ``dense``: exact causal attention, ``F.scaled_dot_product_attention`` on the flash backend
  (bf16; fp32 has no flash kernel, so SDPA's own choice): the rate an attention kernel on this
  GPU is held to.

Checked before timed, every variant at every N and dtype it is timed at: its output and dq on
four windows of 32 query rows (the first, at N/3, at 2N/3, the last) against float64
``ring_rewrite.reference.reference_rows`` on the GPU (exact attention for ``dense``), max-abs
error over max-abs value, within 5e-2 in bf16 and 2e-3 in fp32 (flex's Triton products may run
in TF32). A row's dq depends on that row alone, so the windows check it exactly; dK and dV do not
(``tests/test_cuda.py`` checks ours' in full against float64 at small N). A variant that fails
its check, or raises, is reported and not timed, and the script exits 1.

Reported: the check's seconds (the first call at that N, compiling ours and flex, and the
float64 rows), the median of ``--repeats`` steps between CUDA
events, useful TFLOP/s (the pairs the function connects: ``4 D`` FLOPs a pair forward, 2.5x
that backward), ``% flash`` (that rate over dense flash's at the same N and dtype), and the peak
memory of a step above what it started with, in q-sized tensors. Targets (issue 44), at 128k
bf16: ours at least 2x faster than flex, at least 60 % of dense flash's rate, peak at most 6
q-sized tensors.

    python benchmarks/gpu.py                 # bf16 and fp32, N = 32k .. 1M
    python benchmarks/gpu.py --quick         # bf16 at 32k and 128k, fp32 at 32k
    python benchmarks/gpu.py --seq 131072 --dtype bf16 --profile
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

import _common
import single_device
from single_device import BATCH, FWD_BWD, HEAD_DIM, HEADS, RATES, SEGMENTS

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCE = {torch.bfloat16: 5e-2, torch.float32: 2e-3}
WINDOW = 32
TARGET_FLEX, TARGET_FLASH, TARGET_Q_SIZED, TARGET_N = 2.0, 60.0, 6.0, 131072


# ---- the variants ----------------------------------------------------------------------------


def flex_longnet(segments, rates, causal: bool, n: int, heads: int, device) -> Callable:
    """The LongNet function as one ``flex_attention`` call: ``score_mod`` adds ``log c`` and the
    block mask keeps the pairs with ``c > 0`` (and ``t <= p`` when causal)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    branches = list(zip(segments, rates))

    def count(h, q_idx, kv_idx):
        c = torch.zeros_like(q_idx, dtype=torch.float32)
        for w, r in branches:
            o = h % r
            same = (q_idx // w == kv_idx // w) & (q_idx % r == o) & (kv_idx % r == o)
            c = c + same.to(torch.float32)
        return c

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + torch.log(count(h, q_idx, kv_idx))

    def mask_mod(b, h, q_idx, kv_idx):
        keep = count(h, q_idx, kv_idx) > 0
        return keep & (kv_idx <= q_idx) if causal else keep

    mask = create_block_mask(mask_mod, None, heads, n, n, device=device, _compile=device != "cpu")
    run = torch.compile(flex_attention, dynamic=False) if device != "cpu" else flex_attention

    def attend(q, k, v):
        return run(q, k, v, score_mod=score_mod, block_mask=mask)

    return attend


def dense(dtype: torch.dtype) -> tuple[Callable, str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if dtype == torch.float32:
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), "dense (SDPA)"

    def attend(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return attend, "dense (flash)"


def eager(q, k, v):
    return single_device.eager_dilated(q, k, v, SEGMENTS, RATES, True)


# ---- checks ----------------------------------------------------------------------------------


def _windows(n: int) -> list[int]:
    return sorted({0, n // 3, 2 * n // 3, n - WINDOW})


def check(fn: Callable, exact: bool, q, k, v, dout) -> float:
    """Max rel. error of ``fn``'s out and dq on the row windows against float64."""
    from ring_rewrite.reference import reference_rows

    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    (dq,) = torch.autograd.grad(out, (q,), dout)
    options = {} if exact else {"segment_lengths": SEGMENTS, "dilation_rates": RATES}
    worst = 0.0
    k64, v64 = k.detach().double(), v.detach().double()
    for start in _windows(q.shape[2]):
        rows = slice(start, start + WINDOW)
        q64 = q.detach()[:, :, rows].double().requires_grad_()
        ref = reference_rows(q64, k64, v64, start, is_causal=True, **options)
        (ref_dq,) = torch.autograd.grad(ref, (q64,), dout[:, :, rows].double())
        worst = max(worst, _common.rel_err(out[:, :, rows], ref), _common.rel_err(dq[:, :, rows], ref_dq))
    return worst


# ---- one measurement -------------------------------------------------------------------------


def inputs(n: int, dtype: torch.dtype, device) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(n)
    shape = (BATCH, HEADS, n, HEAD_DIM)
    q, k, v, dout = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(4))
    return [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout]


def _step(fn, q, k, v, dout) -> None:
    out = fn(q, k, v)
    torch.autograd.grad(out, (q, k, v), dout)


def _sync(device) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def measure(fn: Callable, q, k, v, dout, repeats: int, device) -> dict:
    """The median step (CUDA events) after a warm-up step, the peak in q-sized tensors."""
    _step(fn, q, k, v, dout)
    times = []
    for _ in range(repeats):
        if device == "cpu":
            t0 = time.perf_counter()
            _step(fn, q, k, v, dout)
            times.append(time.perf_counter() - t0)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _step(fn, q, k, v, dout)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    peak = None
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(fn, q, k, v, dout)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / (q.numel() * q.element_size())
    return {"median_s": statistics.median(times), "times_s": times, "peak_q_sized": peak}


def _flops(n: int, exact: bool) -> float:
    pairs = n * (n + 1) // 2 if exact else single_device.connected_pairs(n, SEGMENTS, RATES, True)
    return FWD_BWD * 4 * HEAD_DIM * HEADS * BATCH * pairs


def _free(device) -> None:
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)


def run_cell(name: str, fn: Callable, exact: bool, n: int, dtype, opts) -> dict:
    """Check, then time, one variant at one N and dtype; never raises."""
    row = {"variant": name, "n": n, "dtype": str(dtype).removeprefix("torch.")}
    try:
        q, k, v, dout = inputs(n, dtype, opts.device)
        _sync(opts.device)
        t0 = time.perf_counter()
        row["error"] = check(fn, exact, q, k, v, dout)
        row["check_s"] = time.perf_counter() - t0
        row["ok"] = row["error"] <= TOLERANCE[dtype]
        if row["ok"]:
            row.update(measure(fn, q, k, v, dout, opts.repeats, opts.device))
            row["tflops"] = _flops(n, exact) / row["median_s"] / 1e12
    except Exception as error:  # noqa: BLE001  (recorded; the other variants go on)
        row["ok"], row["oom"] = False, _is_oom(error)
        row["raised"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
        if not row["oom"]:
            traceback.print_exc()
    _free(opts.device)
    print(_progress(row), flush=True)
    return row


def _progress(row: dict) -> str:
    what = f"{row['dtype']} N={row['n']} {row['variant']}"
    if "raised" in row:
        return f"{what}: {row['raised']}"
    if not row["ok"]:
        return f"{what}: FAILED check (error {row['error']:.2e})"
    return (f"{what}: check {row['check_s']:.1f} s, {row['median_s'] * 1e3:.2f} ms, "
            f"{row['tflops']:.1f} TFLOP/s, peak {row['peak_q_sized'] or 0:.2f} q, error {row['error']:.1e}")  # fmt: skip


# ---- the run ---------------------------------------------------------------------------------


def variants(dtype, n: int, ours: Callable, opts) -> list[tuple[str, Callable, bool, Callable | None]]:
    """(name, function, exact, the context it runs in) at one N and dtype."""
    from ring_rewrite import kernels

    out = [("ours", ours, False, None)]
    if opts.device != "cpu":
        for name in kernels.cuda_candidates(dtype):
            out.append((f"ours[{name}]", ours, False, lambda name=name: kernels.use_cuda_kernel(name)))
        out.append(("flex", flex_longnet(SEGMENTS, RATES, True, n, HEADS, opts.device), False, None))
    out.append(("eager", eager, False, None))
    attend, label = dense(dtype)
    out.append((label, attend, True, None))
    return out


def run(opts, ours: Callable) -> list[dict]:
    rows, dead = [], set()
    for dtype_name in opts.dtype:
        dtype = DTYPES[dtype_name]
        for n in opts.seq if not opts.quick or dtype == torch.bfloat16 else opts.seq[:1]:
            for name, fn, exact, context in variants(dtype, n, ours, opts):
                if (dtype_name, name) in dead:
                    continue
                if context is None:
                    row = run_cell(name, fn, exact, n, dtype, opts)
                else:
                    with context():
                        row = run_cell(name, fn, exact, n, dtype, opts)
                if row.get("oom"):
                    dead.add((dtype_name, name))  # a larger N does not fit either
                rows.append(row)
    return rows


def _flash_name(dtype: str) -> str:
    return "dense (flash)" if dtype == "bfloat16" else "dense (SDPA)"


def add_shares(rows: list[dict]) -> None:
    rates = {(r["dtype"], r["n"]): r.get("tflops") for r in rows if r["variant"] == _flash_name(r["dtype"])}
    for r in rows:
        flash = rates.get((r["dtype"], r["n"]))
        r["pct_flash"] = 100 * r["tflops"] / flash if flash and r.get("tflops") else None


def table(rows: list[dict]) -> str:
    head = ["dtype", "N", "variant", "check s", "median ms", "useful TFLOP/s", "% flash", "peak q-sized", "check"]
    body = []
    for r in rows:
        timed = "median_s" in r
        check_cell = r.get("raised", "")[:48] or f"{r['error']:.1e}" + ("" if r["ok"] else " FAILED")
        body.append([
            r["dtype"], r["n"], r["variant"], f"{r['check_s']:.1f}" if "check_s" in r else "",
            f"{r['median_s'] * 1e3:.2f}" if timed else "", f"{r['tflops']:.1f}" if timed else "",
            f"{r['pct_flash']:.0f}" if r.get("pct_flash") else "",
            f"{r['peak_q_sized']:.2f}" if r.get("peak_q_sized") is not None else "", check_cell,
        ])  # fmt: skip
    return tabulate(body, head)


def verdicts(rows: list[dict]) -> dict[str, dict]:
    """The targets at 128k bf16, or at the largest N where ours and flex both ran."""
    def at(variant, n):
        return next((r for r in rows if r["dtype"] == "bfloat16" and r["variant"] == variant and r["n"] == n
                     and "median_s" in r), None)  # fmt: skip

    ns = [r["n"] for r in rows if at("ours", r["n"]) and at("flex", r["n"])]
    n = TARGET_N if TARGET_N in ns else max(ns, default=None)
    if n is None:
        return {}
    ours, flex = at("ours", n), at("flex", n)
    speedup = flex["median_s"] / ours["median_s"]
    return {
        f"ours >= {TARGET_FLEX:g}x faster than flex at N={n}": {"value": speedup, "met": speedup >= TARGET_FLEX},
        f"ours >= {TARGET_FLASH:g} % of dense flash's rate at N={n}": {
            "value": ours.get("pct_flash"),
            "met": None if ours.get("pct_flash") is None else ours["pct_flash"] >= TARGET_FLASH},
        f"ours peak <= {TARGET_Q_SIZED:g} q-sized at N={n}": {
            "value": ours["peak_q_sized"],
            "met": None if ours["peak_q_sized"] is None else ours["peak_q_sized"] <= TARGET_Q_SIZED},
    }  # fmt: skip


def profile(ours: Callable, n: int, dtype, device) -> None:
    """The CUDA kernels of one step of ours, by total time (where its time goes)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    q, k, v, dout = inputs(n, dtype, device)
    _step(ours, q, k, v, dout)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(ours, q, k, v, dout)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=18, max_name_column_width=70))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[1 << s for s in range(15, 21)])
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="bf16 at 32k and 128k, fp32 at 32k, 5 repeats")
    parser.add_argument("--profile", action="store_true", help="then the CUDA kernels of ours at the largest N")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (flex skipped)")
    parser.add_argument("--out", type=Path, default=_common.RESULTS, help="folder of gpu.json")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.seq, opts.repeats = [32768, 131072], 5
    if opts.device != "cpu" and not torch.cuda.is_available():
        print("gpu.py needs a CUDA device (--device cpu for a smoke run)")
        return 2
    torch._dynamo.config.recompile_limit = 4 * len(opts.seq) + 8  # ours and flex: one graph per N and dtype
    gpu = torch.cuda.get_device_name() if opts.device != "cpu" else "none"
    print(f"{gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    ours, _ = single_device.compiled_sdpa(True, segment_lengths=SEGMENTS, dilation_rates=RATES)
    rows = run(opts, ours)
    add_shares(rows)
    print(table(rows))
    results = verdicts(rows)
    for what, result in results.items():
        value = "n/a" if result["value"] is None else f"{result['value']:.2f}"
        print(f"{what}: {value} ({_common.verdict(result['met'])})")
    if opts.profile and opts.device != "cpu":
        profile(ours, max(opts.seq), DTYPES[opts.dtype[0]], opts.device)
    record = {"machine": _common.machine(), "gpu": gpu, "cuda": torch.version.cuda,
              "rows": rows, "targets": results}  # fmt: skip
    _common.write_json(opts.out / "gpu.json", record)
    return 0 if all(r["ok"] or r.get("oom") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
