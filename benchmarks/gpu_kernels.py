"""The CUDA block kernel candidates, one block at a time: what ``kernels.CUDA_ORDER`` rests on.

A block is what a site's program runs per branch, ring step and head chunk
(``ring_rewrite::block_attention``): ``(B, Hq, L, D)`` queries against ``(B, Hkv, S, D)`` keys,
``B`` the batch times a branch's segments. Each case (dtype, causal or not, GQA or not, head
size, block length) is run by every candidate of ``ring_rewrite.kernels.CUDA_CANDIDATES`` that
serves it, through the CUDA entry as the op calls it (``use_cuda_kernel``):

* checked first: its ``out`` and ``lse``, then its backward given its own ``out`` and ``lse``
  (the merged statistics of a block that is the only one: Note [Backward from the merged
  statistics] in attention.py), against float64 on the GPU (max-abs error over max-abs value;
  bf16 and fp16 within 5e-2, float32 within 1e-4); a candidate that fails, or raises, is
  reported and not timed;
* then timed: forward, and backward, each the median of ``--repeats`` calls between CUDA
  events after warm-up, as useful TFLOP/s (``4 D`` FLOPs per attending pair forward, 2.5x that
  backward).

FlexAttention is timed beside them on the bf16 blocks of head size 64 without GQA (``flex``:
``flex_attention`` compiled, a causal block mask, ``return_lse``; checked the same way). It is
no candidate of the entry: its backward starts from its own output and log-sum-exp, so fed the
merged ones it would first run the block's forward again (the gradient of the merged output
through the block's ``(out, lse)``). Its row says whether that could pay.

    python benchmarks/gpu_kernels.py            # every case, about 30 s on an H100
    python benchmarks/gpu_kernels.py --quick    # bf16 and fp32 only
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
from tabulate import tabulate

import _common
from ring_rewrite import kernels

TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 5e-2, torch.float32: 1e-4}
BWD = 2.5  # backward FLOPs in units of forward FLOPs


def _cases(quick: bool) -> list[dict]:
    """(dtype, causal, kv heads, head size, batch, length): a LongNet branch's block (2048 rows,
    16 segments) in each variant, and one long exact-attention block."""
    dtypes = [torch.bfloat16, torch.float32] if quick else [torch.bfloat16, torch.float16, torch.float32]
    cases = []
    for dtype in dtypes:
        for causal in (True, False):
            for hkv in (8, 2):
                for d in (64, 128):
                    cases.append(dict(dtype=dtype, causal=causal, hkv=hkv, d=d, batch=16, length=2048))
        cases.append(dict(dtype=dtype, causal=True, hkv=8, d=64, batch=1, length=16384))
    return cases


def _reference(q, k, v, dout, scale, causal):
    """out, lse, dq, dk, dv in float64 (the block's exact attention, GQA by repeating heads)."""
    g = q.shape[1] // k.shape[1]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    kk, vv = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)
    s = scale * q64 @ kk.transpose(-1, -2)
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ vv
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return [out.detach(), lse.detach(), *grads]


def _check(name, case, q, k, v, dout, scale) -> dict[str, float]:
    cuda = kernels.KERNELS["cuda"]
    with kernels.use_cuda_kernel(name):
        out, lse = cuda.forward(q, k, v, None, scale, case["causal"])
        grads = cuda.backward(dout, q, k, v, out, lse.float(), None, scale, case["causal"])
    # Batch row 0, kv head 0 and its query heads: the float64 scores of a 16k block stay 2 GiB.
    g = q.shape[1] // k.shape[1]
    got = [x[:1, :g] for x in (out, lse, grads[0])] + [x[:1, :1] for x in grads[1:]]
    expected = _reference(q[:1, :g], k[:1, :1], v[:1, :1], dout[:1, :g], scale, case["causal"])
    return {t: _common.rel_err(a, b) for t, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected)}


def _time(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` between CUDA events, after three warm-up calls."""
    for _ in range(3):
        fn()
    return statistics.median(_common.cuda_seconds(fn) for _ in range(repeats))


def _measure(name, case, q, k, v, dout, scale, repeats) -> dict:
    cuda = kernels.KERNELS["cuda"]
    with kernels.use_cuda_kernel(name):
        out, lse = cuda.forward(q, k, v, None, scale, case["causal"])
        lse = lse.float()
        fwd = _time(lambda: cuda.forward(q, k, v, None, scale, case["causal"]), repeats)
        bwd = _time(lambda: cuda.backward(dout, q, k, v, out, lse, None, scale, case["causal"]), repeats)
    return _rates(case, fwd, bwd)


def _rates(case: dict, fwd: float, bwd: float) -> dict:
    n = case["length"]
    pairs = n * (n + 1) // 2 if case["causal"] else n * n
    flops = 4 * case["d"] * pairs * case["batch"] * 8
    return {"fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3, "fwd_tflops": flops / fwd / 1e12,
            "bwd_tflops": BWD * flops / bwd / 1e12}  # fmt: skip


def _flex(case: dict):
    """``(q, k, v, scale) -> (out, lse)`` of FlexAttention for the blocks of ``case``."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n, gqa = case["length"], case["hkv"] != 8
    mask = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, n, n, device="cuda") if case["causal"] else None
    run = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v, scale: run(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa, return_lse=True)


def _flex_row(case: dict, q, k, v, dout, scale, repeats: int) -> dict:
    attend = _flex(case)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out, lse = attend(*leaves, scale)
    grads = torch.autograd.grad(out, leaves, dout)
    g = q.shape[1] // k.shape[1]
    got = [x[:1, :g] for x in (out, lse, grads[0])] + [x[:1, :1] for x in grads[1:]]
    expected = _reference(q[:1, :g], k[:1, :1], v[:1, :1], dout[:1, :g], scale, case["causal"])
    errors = {t: _common.rel_err(a, b) for t, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected)}
    row = {"errors": errors, "ok": max(errors.values()) <= TOLERANCE[case["dtype"]]}
    if row["ok"]:
        with torch.no_grad():
            fwd = _time(lambda: attend(q, k, v, scale), repeats)

        def backward():
            out, _ = attend(*leaves, scale)
            torch.autograd.grad(out, leaves, dout)

        bwd = _time(backward, repeats) - fwd
        row.update(_rates(case, fwd, bwd))
    return row


def _run_case(case: dict, repeats: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, n, d, dtype = case["batch"], case["length"], case["d"], case["dtype"]
    q, dout = (torch.randn(b, 8, n, d, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, case["hkv"], n, d, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    scale = 1 / math.sqrt(d)
    rows = []
    for name, candidate in kernels.CUDA_CANDIDATES.items():
        if not candidate.serves(q, k, v, None, case["causal"]):
            continue
        row = {**case, "dtype": str(dtype).removeprefix("torch."), "kernel": name}
        try:
            row["errors"] = _check(name, case, q, k, v, dout, scale)
            row["ok"] = max(row["errors"].values()) <= TOLERANCE[dtype]
            if row["ok"]:
                row.update(_measure(name, case, q, k, v, dout, scale, repeats))
        except Exception as error:  # noqa: BLE001  (reported: the candidate does not serve it)
            row["ok"], row["error"] = False, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        print(_line(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    if dtype == torch.bfloat16 and d == 64 and case["hkv"] == 8:
        row = {**case, "dtype": "bfloat16", "kernel": "flex"}
        try:
            row.update(_flex_row(case, q, k, v, dout, scale, repeats))
        except Exception as error:  # noqa: BLE001  (reported)
            row["ok"], row["error"] = False, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        print(_line(row), flush=True)
        rows.append(row)
    return rows


def _line(row: dict) -> str:
    what = f"{row['dtype']} causal={row['causal']} hkv={row['hkv']} d={row['d']} {row['batch']}x{row['length']}"
    if "error" in row:
        return f"{what} {row['kernel']}: {row['error']}"
    errors = " ".join(f"{t}={e:.1e}" for t, e in row["errors"].items())
    if not row["ok"]:
        return f"{what} {row['kernel']}: FAILED check ({errors})"
    return (f"{what} {row['kernel']}: fwd {row['fwd_ms']:.3f} ms {row['fwd_tflops']:.0f} TFLOP/s, "
            f"bwd {row['bwd_ms']:.3f} ms {row['bwd_tflops']:.0f} TFLOP/s ({errors})")  # fmt: skip


def _table(rows: list[dict]) -> str:
    head = ["dtype", "causal", "hkv", "d", "block", "kernel", "fwd TFLOP/s", "bwd TFLOP/s", "fwd+bwd ms", "check"]
    body = []
    for r in rows:
        timed = "fwd_ms" in r
        body.append([
            r["dtype"], r["causal"], r["hkv"], r["d"], f"{r['batch']}x{r['length']}", r["kernel"],
            f"{r['fwd_tflops']:.0f}" if timed else "", f"{r['bwd_tflops']:.0f}" if timed else "",
            f"{r['fwd_ms'] + r['bwd_ms']:.3f}" if timed else "",
            "ok" if r["ok"] else r.get("error", "FAILED")[:40],
        ])  # fmt: skip
    return tabulate(body, head)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="bf16 and fp32 cases only")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=_common.RESULTS, help="folder of gpu_kernels.json")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernels.py needs a CUDA device")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    torch._dynamo.config.recompile_limit = 16  # flex: one graph per case and grad mode
    rows = [row for case in _cases(opts.quick) for row in _run_case(case, opts.repeats)]
    print(_table(rows))
    record = {"machine": _common.machine(), "gpu": torch.cuda.get_device_name(),
              "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "rows": rows}  # fmt: skip
    _common.write_json(opts.out / "gpu_kernels.json", record)
    return 0 if all(r["ok"] for r in rows if r["kernel"] != "flex") else 1


if __name__ == "__main__":
    sys.exit(main())
