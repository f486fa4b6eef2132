"""One GPU, forward + backward: the compiled rewrite against FlexAttention, eager and dense flash.

Inputs ``q, k, v`` of shape ``(1, 8, N, 64)`` (random normal, ``requires_grad``, fresh at every
N), causal, bf16 and fp32, N from 32k to 1M. The function is ``single_device.py``'s LongNet
config (segments 2048, 4096, 8192, 16384, rates 1, 2, 4, 8), written four ways, each timed
forward + backward:

* ``ours``: ``F.scaled_dot_product_attention`` compiled with the ``ring_dilated`` backend
  (inductor), its blocks on the CUDA kernels ``kernels.CUDA_ORDER`` picks; and ``ours[name]``,
  the same compiled function with every block it serves on candidate ``name``
  (``kernels.use_cuda_kernel``: the choice is made at run time, nothing recompiles).
* ``flex``: ``flex_attention`` (compiled) with the LongNet function as FlexAttention spells it:
  a ``score_mod`` adding ``log c(j, p, t)``, ``c`` the number of branches that connect query
  ``p`` and key ``t`` for head ``j``, and a block mask where ``c > 0`` and ``t <= p``. It skips
  blocks no branch reaches, and computes every pair of a block that one reaches.
* ``eager``: ``single_device.eager_dilated`` (gather, attention with its log-sum-exp, scatter,
  merge; autograd backward), up to its first N that runs out of memory.
* ``dense``: exact causal attention, ``F.scaled_dot_product_attention`` on the flash backend
  (bf16; fp32 has no flash kernel, so the memory-efficient one, which SDPA picks there), up to
  ``--dense-max``: the rate an attention kernel on this GPU is held to.

Checked before timed, every variant at every N and dtype it is timed at, on its first call
there: its output and dq on four windows of 32 query rows (the first, at N/3, at 2N/3, the last)
against float64 ``ring_rewrite.reference.reference_rows`` on the GPU (exact attention for
``dense``), max-abs error over max-abs value, within 5e-2 in bf16 and 2e-3 in fp32 (flex's
Triton products may run in TF32); eager within 1e-1 in bf16 (its log-sum-exps are bf16). A
row's dq depends on that row alone, so the windows check it exactly; dK and dV do not
(``tests/test_cuda.py`` checks ours' in full against float64 at small N). A variant that fails
its check is reported and not timed, one that raises is recorded (a variant out of memory is not
tried at larger N), the others go on, and the script exits 1.

Reported: the first call (host clock; it compiles ours and flex at each N and dtype), the median
of ``--repeats`` steps between CUDA events after one warm-up step, useful TFLOP/s (the pairs the
function connects, ``n (n + 1) / 2`` for dense: ``4 D`` FLOPs a pair forward, 2.5x that
backward), ``% flash`` (that rate over dense's at the same N and dtype), and the peak memory of
a step above what it started with, in q-sized tensors. Targets (issue 44), at 128k bf16 (else
the largest N ours was timed at): ours at least 2x faster than flex, at least 60 % of dense
flash's rate, peak at most 6 q-sized tensors.

    python benchmarks/gpu.py                 # bf16 and fp32, N = 32k .. 1M
    python benchmarks/gpu.py --quick         # bf16 at 32k and 128k, fp32 at 32k, 5 repeats: ~3 min
    python benchmarks/gpu.py --seq 131072 --dtype bf16 --profile
    python benchmarks/gpu.py --device cpu --seq 4096 --quick   # a smoke run of the script on CPU

On CPU (a smoke run) nothing is timed by CUDA events and flex is only checked, forward alone:
FlexAttention has no backward on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
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
# eager keeps its log-sum-exps in the input dtype: bf16's spacing of 1/16 near 8 moves its merge
# weights by up to ~6 % (5.5e-2 at 4k on CPU).
EAGER_TOLERANCE = {torch.bfloat16: 1e-1, torch.float32: 2e-3}
WINDOW = 32  # query rows per checked window
FULL = [1 << s for s in range(15, 21)]  # 32k .. 1M
QUICK = {"bf16": [32768, 131072], "fp32": [32768]}
TARGET_FLEX, TARGET_FLASH, TARGET_Q_SIZED, TARGET_N = 2.0, 60.0, 6.0, 131072


# ---- the variants ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of computing attention, as timed."""

    name: str
    make: Callable[[], Callable]  # built in its cell: flex's block mask is per N, and may not fit
    exact: bool = False  # exact attention (dense), else the LongNet function
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    backward: bool = True  # False: checked forward only, not timed (flex on CPU)
    tolerance: dict = dataclasses.field(default_factory=lambda: TOLERANCE)  # by dtype


@functools.cache
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_longnet(segments, rates, causal: bool, n: int, heads: int, device, *, compiled: bool = True) -> Callable:
    """The LongNet function as one ``flex_attention`` call: ``score_mod`` adds ``log c`` and the
    block mask keeps the pairs with ``c > 0`` (and ``t <= p`` when causal). ``compiled=False``:
    flex's eager path, which builds the whole score matrix (small N on CPU only)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    branches = list(zip(segments, rates))

    def count(h, q_idx, kv_idx):  # c(h, p, t): the branches connecting p and t for head h
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

    # _compile: the mask is reduced to blocks without building the N x N matrix.
    mask = create_block_mask(mask_mod, None, heads, n, n, device=device, _compile=compiled)
    run = _compiled_flex() if compiled else flex_attention

    def attend(q, k, v):
        return run(q, k, v, score_mod=score_mod, block_mask=mask)

    return attend


def dense(dtype: torch.dtype, device) -> tuple[Callable, str]:
    """Exact causal SDPA on flash (bf16) or memory-efficient (fp32) kernels; on CPU its default."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device == "cpu":
        backend, label = None, "dense (SDPA)"
    elif dtype == torch.float32:
        backend, label = SDPBackend.EFFICIENT_ATTENTION, "dense (efficient)"
    else:
        backend, label = SDPBackend.FLASH_ATTENTION, "dense (flash)"

    def attend(q, k, v):  # the backward runs the kernel the forward chose
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return attend, label


def eager(q, k, v):
    return single_device.eager_dilated(q, k, v, SEGMENTS, RATES, True)


def variants(dtype: torch.dtype, n: int, ours: Callable, opts) -> list[Variant]:
    """Every variant timed at one N and dtype, in the order they run."""
    from ring_rewrite import kernels

    cuda = opts.device != "cpu"
    out = [Variant("ours", lambda: ours)]
    for name in kernels.cuda_candidates(dtype) if cuda else ():
        out.append(Variant(f"ours[{name}]", lambda: ours, context=functools.partial(kernels.use_cuda_kernel, name)))
    flex = functools.partial(flex_longnet, SEGMENTS, RATES, True, n, HEADS, opts.device)
    out.append(Variant("flex", flex, backward=cuda))
    out.append(Variant("eager", lambda: eager, tolerance=EAGER_TOLERANCE))
    if n <= opts.dense_max:
        attend, label = dense(dtype, opts.device)
        out.append(Variant(label, lambda: attend, exact=True))
    return out


# ---- checks ----------------------------------------------------------------------------------


def _windows(n: int) -> list[int]:
    return sorted({0, n // 3, 2 * n // 3, max(0, n - WINDOW)})


def check(out, dq, exact: bool, q, k, v, dout) -> dict[str, float]:
    """Rel. errors of ``out`` and ``dq`` (None: not checked) on the row windows against
    float64 ``reference_rows``, the worst window's of each."""
    from ring_rewrite.reference import reference_rows

    options = {} if exact else {"segment_lengths": SEGMENTS, "dilation_rates": RATES}
    k, v = k.detach(), v.detach()
    errors = {"out": 0.0} if dq is None else {"out": 0.0, "dq": 0.0}
    for start in _windows(q.shape[2]):
        rows = slice(start, start + WINDOW)
        q64 = q.detach()[:, :, rows].double().requires_grad_(dq is not None)
        ref = reference_rows(q64, k, v, start, is_causal=True, **options)
        errors["out"] = max(errors["out"], _common.rel_err(out[:, :, rows], ref.detach()))
        if dq is not None:
            (ref_dq,) = torch.autograd.grad(ref, (q64,), dout[:, :, rows].double())
            errors["dq"] = max(errors["dq"], _common.rel_err(dq[:, :, rows], ref_dq))
    return errors


# ---- one cell: a variant at one N and dtype --------------------------------------------------


def inputs(n: int, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """q, k, v (requiring grad) and the output gradient, random normal, seeded by N."""
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


def _time_step(fn, q, k, v, dout, device) -> float:
    """Seconds of one forward + backward step: CUDA events, or the host clock on CPU."""
    if device == "cpu":
        t0 = time.perf_counter()
        _step(fn, q, k, v, dout)
        return time.perf_counter() - t0
    return _common.cuda_seconds(lambda: _step(fn, q, k, v, dout))


def _peak(fn, q, k, v, dout) -> float:
    """The rise of CUDA's allocated bytes over one step, in q-sized tensors."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _step(fn, q, k, v, dout)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / (q.numel() * q.element_size())


def _flops(n: int, exact: bool) -> float:
    pairs = n * (n + 1) // 2 if exact else single_device.connected_pairs(n, SEGMENTS, RATES, True)
    return FWD_BWD * 4 * HEAD_DIM * HEADS * BATCH * pairs


def _cell(row: dict, variant: Variant, n: int, dtype, opts) -> None:
    """Build, first call (timed, checked), then time ``variant``; fills ``row`` as it goes."""
    q, k, v, dout = inputs(n, dtype, opts.device)
    fn = variant.make()
    _sync(opts.device)
    t0 = time.perf_counter()
    if variant.backward:
        out = fn(q, k, v)
        dq = torch.autograd.grad(out, (q, k, v), dout)[0]
    else:
        out, dq = fn(q.detach(), k.detach(), v.detach()), None
    _sync(opts.device)
    row["first_call_s"] = time.perf_counter() - t0
    row["errors"] = check(out.detach(), dq, variant.exact, q, k, v, dout)
    del out, dq
    row["tolerance"] = variant.tolerance[dtype]
    row["ok"] = all(e <= row["tolerance"] for e in row["errors"].values())  # NaN fails too
    if not variant.backward:
        row["note"] = "no backward on CPU: forward checked, not timed"
    if not row["ok"] or not variant.backward:
        return
    _step(fn, q, k, v, dout)  # warm-up
    times = [_time_step(fn, q, k, v, dout, opts.device) for _ in range(opts.repeats)]
    row.update(median_s=statistics.median(times), times_s=times)
    row["tflops"] = _flops(n, variant.exact) / row["median_s"] / 1e12
    row["peak_q_sized"] = _peak(fn, q, k, v, dout) if opts.device != "cpu" else None


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)


def _free(device) -> None:
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()


def run_cell(variant: Variant, n: int, dtype, opts) -> dict:
    """One variant at one N and dtype: checked, then timed; never raises."""
    row = {"variant": variant.name, "n": n, "dtype": str(dtype).removeprefix("torch."), "exact": variant.exact}
    print(f"{row['dtype']} N={n} {variant.name} ...", flush=True)
    try:
        with variant.context():
            _cell(row, variant, n, dtype, opts)
    except Exception as error:  # noqa: BLE001  (recorded; the other variants go on)
        row["ok"], row["oom"] = False, _is_oom(error)
        first_line = (str(error).strip() or "?").splitlines()[0][:200]
        row["raised"] = "OOM" if row["oom"] else f"{type(error).__name__}: {first_line}"
        if not row["oom"]:
            traceback.print_exc()
    _free(opts.device)  # the cell's tensors are gone with its frame (and the exception's)
    print(f"  {_status(row)}", flush=True)
    return row


def _status(row: dict) -> str:
    if "raised" in row:
        return row["raised"]
    errors = ", ".join(f"{name} {e:.1e}" for name, e in row["errors"].items())
    if not row["ok"]:
        return f"FAILED check ({errors})"
    if "median_s" not in row:
        return f"{errors}; {row.get('note', 'not timed')}"
    peak = "" if row["peak_q_sized"] is None else f", peak {row['peak_q_sized']:.2f} q-sized"
    return (f"first call {row['first_call_s']:.1f} s, {row['median_s'] * 1e3:.2f} ms, "
            f"{row['tflops']:.1f} TFLOP/s{peak}; error {errors}")  # fmt: skip


# ---- the run ---------------------------------------------------------------------------------


def sizes(opts, dtype_name: str) -> list[int]:
    """The N timed in one dtype: ``--seq`` (in ``--quick``, only its smallest in fp32), else
    the quick or full sizes."""
    if opts.seq:
        return sorted(opts.seq)[:1] if opts.quick and dtype_name != "bf16" else sorted(opts.seq)
    return QUICK[dtype_name] if opts.quick else FULL


def run(opts, ours: Callable) -> list[dict]:
    rows, dead = [], set()  # dead: (dtype, variant) out of memory at a smaller N
    for dtype_name in opts.dtype:
        dtype = DTYPES[dtype_name]
        for n in sizes(opts, dtype_name):
            for variant in variants(dtype, n, ours, opts):
                if (dtype_name, variant.name) in dead:
                    continue
                row = run_cell(variant, n, dtype, opts)
                if row.get("oom"):
                    dead.add((dtype_name, variant.name))
                rows.append(row)
    return rows


def add_shares(rows: list[dict]) -> None:
    """``pct_flash``: each row's useful rate over dense's at its N and dtype (where dense ran)."""
    dense_rates = {(r["dtype"], r["n"]): r.get("tflops") for r in rows if r["exact"]}
    for r in rows:
        flash = dense_rates.get((r["dtype"], r["n"]))
        r["pct_flash"] = 100 * r["tflops"] / flash if flash and r.get("tflops") else None


def table(rows: list[dict]) -> str:
    head = ["N", "variant", "first call s", "median ms", "useful TFLOP/s", "% flash", "peak q-sized", "check error"]
    fmt = lambda x, spec: "" if x is None else format(x, spec)  # noqa: E731
    body = []
    for r in rows:
        errors = r.get("errors", {})
        worst = fmt(max(errors.values()), ".1e") if errors else ""
        status = r.get("raised") or (f"FAILED check ({worst})" if not r["ok"] else worst)
        if r.get("note"):
            status += f" ({r['note']})"
        median = r["median_s"] * 1e3 if "median_s" in r else None
        body.append([r["n"], r["variant"], fmt(r.get("first_call_s"), ".1f"), fmt(median, ".2f"),
                     fmt(r.get("tflops"), ".3g"), fmt(r.get("pct_flash"), ".0f"),
                     fmt(r.get("peak_q_sized"), ".2f"), status])  # fmt: skip
    return tabulate(body, head)


def targets(rows: list[dict]) -> list[dict]:
    """The targets at 128k bf16, or at the largest N ours was timed at in bf16 (n/a where a
    number is missing)."""
    timed = {(r["variant"], r["n"]): r for r in rows if r["dtype"] == "bfloat16" and "median_s" in r}
    ns = [n for name, n in timed if name == "ours"]
    n = TARGET_N if TARGET_N in ns else max(ns, default=None)
    ours, flex = timed.get(("ours", n)), timed.get(("flex", n))
    speedup = flex["median_s"] / ours["median_s"] if ours and flex else None
    share = ours and ours["pct_flash"]
    peak = ours and ours["peak_q_sized"]
    at = f"bf16 N={n}" if n else "bf16 (ours not timed)"
    return [
        {"line": f"ours >= {TARGET_FLEX:g}x faster than flex, {at}", "value": speedup,
         "met": None if speedup is None else speedup >= TARGET_FLEX},
        {"line": f"ours >= {TARGET_FLASH:g} % of dense flash's useful rate, {at}", "value": share,
         "met": None if share is None else share >= TARGET_FLASH},
        {"line": f"ours peak <= {TARGET_Q_SIZED:g} q-sized tensors, {at}", "value": peak,
         "met": None if peak is None else peak <= TARGET_Q_SIZED},
    ]  # fmt: skip


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
    parser.add_argument("--seq", type=int, nargs="+", help="N to time (default: 32k .. 1M; --quick: see below)")
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--repeats", type=int, help="timed steps per cell (default 10; --quick 5)")
    parser.add_argument("--quick", action="store_true", help="bf16 at 32k and 128k, fp32 at 32k, 5 repeats")
    parser.add_argument("--dense-max", type=int, default=262144, help="largest N for dense (O(N^2) time)")
    parser.add_argument("--profile", action="store_true", help="then the CUDA kernels of ours at the largest N")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    parser.add_argument("--out", type=Path, default=_common.RESULTS, help="folder of gpu.json")
    opts = parser.parse_args(argv)
    opts.repeats = opts.repeats or (5 if opts.quick else 10)
    if opts.device != "cpu" and not torch.cuda.is_available():
        print("gpu.py needs a CUDA device (--device cpu for a smoke run)")
        return 2
    # ours compiles one graph per N and dtype, flex one per N, dtype and block mask.
    torch._dynamo.config.recompile_limit = 64
    gpu = torch.cuda.get_device_name() if opts.device != "cpu" else "none (CPU smoke run)"
    print(f"{gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}; causal, (1, {HEADS}, N, {HEAD_DIM}), "
          f"segments {SEGMENTS}, rates {RATES}; median of {opts.repeats}", flush=True)  # fmt: skip
    ours, _ = single_device.compiled_sdpa(True, segment_lengths=SEGMENTS, dilation_rates=RATES)
    rows = run(opts, ours)
    add_shares(rows)
    for dtype_name in opts.dtype:
        dtype_rows = [r for r in rows if r["dtype"] == str(DTYPES[dtype_name]).removeprefix("torch.")]
        print(f"\n{dtype_name}, forward + backward\n{table(dtype_rows)}")
    results = targets(rows)
    print()
    for target in results:
        value = "" if target["value"] is None else f": {target['value']:.2f}"
        print(f"{target['line']}{value} ({_common.verdict(target['met'])})")
    if opts.profile and opts.device != "cpu":
        try:
            profile(ours, max(r["n"] for r in rows), DTYPES[opts.dtype[0]], opts.device)
        except Exception:  # noqa: BLE001  (the numbers above stand without it)
            traceback.print_exc()
    record = {
        "machine": _common.machine(), "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
        "setup": {"shape": [BATCH, HEADS, "N", HEAD_DIM], "causal": True, "segments": SEGMENTS, "rates": RATES,
                  "repeats": opts.repeats, "quick": opts.quick, "tolerance": {str(k): v for k, v in TOLERANCE.items()}},
        "rows": rows, "targets": results,
    }  # fmt: skip
    _common.write_json(opts.out / "gpu.json", record)
    failed = [f"{r['dtype']} N={r['n']} {r['variant']}" for r in rows if not r["ok"] and not r.get("oom")]
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
