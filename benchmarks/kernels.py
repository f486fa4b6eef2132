"""The CPU block kernel candidates, one block at a time, against aten's and ``torch.mm``: what the
choice of ``ring_rewrite/cpu_choice.py`` rests on (Note [Choosing the CPU block kernel]).

A block is what a site's program runs per branch, ring step and head chunk
(``ring_rewrite::block_attention``): ``(B, 8, L, D)`` float32 queries against ``(B, Hkv, L, D)``
keys and values, ``B = (2048 / L)^2`` below 2048 rows (a branch's small blocks come as many
segments, and a call of a few milliseconds would time the scheduler's interruptions), else 1.
Each case (block length L from 512 to 4096, causal or not, head size 64 or 128, ``Hkv`` 8 or 2:
GQA) is run by every candidate alone, as the CPU entry calls it: aten's
``_scaled_dot_product_flash_attention_for_cpu`` (``kernels._ATEN``) and each build of ours this
CPU has (``cpu_kernel.candidates()``: the target's, AVX2 on an AVX-512 CPU, 6 x 2 register tiles,
128-key tiles):

* checked first, at the case's shape: out and lse of query head 0, and its dq and its share of kv
  head 0's dk and dv (the other heads' output gradients zero), of every batch row, against
  float64; a candidate above
  1e-5 (max-abs error over max-abs value) is reported and not timed;
* then timed round robin: each round reads ``torch.mm``'s rate (one 2048-square product) and runs
  every candidate's forward and backward once, the order rotated; medians of ``--rounds`` rounds
  after a warm-up round. Useful GFLOP/s count ``4 D`` FLOPs per attending pair forward, 2.5x that
  backward; ``% mm`` is against the median of the case's ``torch.mm`` readings.

Last, each case's class is decided as the ops decide it (``cpu_kernel.choose``: read from this
machine's cache, or measured now), and the target line says whether what the choice runs, its
forward's forward time plus its backward's backward time, is within 10 % of this run's fastest
forward plus fastest backward, every case.

    python benchmarks/kernels.py            # 32 cases, about 25 minutes on 2 shared cores
    python benchmarks/kernels.py --quick    # L = 512 and 2048, head size 64: 8 cases
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

import _common
from ring_rewrite import cpu_choice, cpu_kernel, kernels

HEADS = 8
BWD = 2.5  # backward FLOPs in units of forward FLOPs
WITHIN = 1.10  # the target: the chosen kernel within this factor of the fastest


def _cases(lengths: list[int], dims: list[int]) -> list[dict]:
    return [
        dict(length=n, causal=causal, d=d, hkv=hkv)
        for n in lengths for d in dims for causal in (True, False) for hkv in (HEADS, 2)
    ]  # fmt: skip


def _batch(length: int) -> int:
    return max(1, (2048 // length) ** 2)


def _inputs(case: dict) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    n, d, hkv, b = case["length"], case["d"], case["hkv"], _batch(case["length"])
    shapes = [(b, HEADS, n, d), (b, hkv, n, d), (b, hkv, n, d), (b, HEADS, n, d)]
    return tuple(torch.randn(shape, generator=g) for shape in shapes)


def _reference(q, k, v, dout, scale: float, causal: bool) -> list[torch.Tensor]:
    """out, lse, dq of query head 0 and dk, dv of kv head 0 given dout on query head 0 alone, in
    float64."""
    return cpu_choice.float64_block(*(x[:, :1] for x in (q, k, v, dout)), scale, causal)


def _check(candidate: cpu_choice.Candidate, case: dict, inputs, expected) -> dict[str, float]:
    q, k, v, dout = inputs
    scale, causal = case["d"] ** -0.5, case["causal"]
    one = torch.zeros_like(dout)
    one[:, :1] = dout[:, :1]  # only query head 0 sends gradients: kv head 0's dk, dv are its share
    out, lse = candidate.forward(q, k, v, scale, causal)
    dq, dk, dv = candidate.backward(one, q, k, v, out, lse, scale, causal)
    got = [out[:, :1], lse[:, :1], dq[:, :1], dk[:, :1], dv[:, :1]]
    return {t: _common.rel_err(a, b) for t, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected)}


def _mm_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    t0 = time.perf_counter()
    torch.mm(a, b)
    return time.perf_counter() - t0


def _run_case(case: dict, candidates: dict[str, cpu_choice.Candidate], rounds: int) -> list[dict]:
    inputs = _inputs(case)
    q, k, v, dout = inputs
    scale, causal = case["d"] ** -0.5, case["causal"]
    expected = _reference(q, k, v, dout, scale, causal)
    rows = {}
    for name, candidate in candidates.items():
        errors = _check(candidate, case, inputs, expected)
        rows[name] = {**case, "kernel": name, "errors": errors, "ok": max(errors.values()) <= _common.TOLERANCE}
    timed = [name for name in candidates if rows[name]["ok"]]
    out, lse = candidates["aten"].forward(q, k, v, scale, causal)  # every backward reads these
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    mm: list[float] = []
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in timed}
    for r in range(rounds + 1):  # round 0: the warm-up
        seconds = _mm_seconds(a, b)
        if r:
            mm.append(2 * 2048**3 / seconds / 1e9)
        for name in timed[r % len(timed) :] + timed[: r % len(timed)]:
            t0 = time.perf_counter()
            candidates[name].forward(q, k, v, scale, causal)
            t1 = time.perf_counter()
            candidates[name].backward(dout, q, k, v, out, lse, scale, causal)
            if r:
                times[name].append((t1 - t0, time.perf_counter() - t1))
    n = case["length"]
    flops = 4 * case["d"] * (n * (n + 1) // 2 if causal else n * n) * HEADS * _batch(n)
    rate = statistics.median(mm)
    for name in timed:
        fwd = statistics.median(f for f, _ in times[name])
        bwd = statistics.median(b for _, b in times[name])
        rows[name].update(
            fwd_ms=fwd * 1e3, bwd_ms=bwd * 1e3, fwd_pct_mm=100 * flops / fwd / 1e9 / rate,
            bwd_pct_mm=100 * BWD * flops / bwd / 1e9 / rate, mm_gflops=rate, mm_readings=mm,
            times_s=times[name],
        )  # fmt: skip
    for name in timed:
        aten = rows["aten"]
        if "fwd_ms" in aten:
            rows[name]["vs_aten"] = (aten["fwd_ms"] + aten["bwd_ms"]) / (rows[name]["fwd_ms"] + rows[name]["bwd_ms"])
    for part in ("fwd", "bwd"):
        best = min(timed, key=lambda name: rows[name][f"{part}_ms"])
        rows[best][f"fastest_{part}"] = True
    return list(rows.values())


def _decide(case: dict, rows: list[dict]) -> dict:
    """What the ops run for ``case``'s class, and whether its forward and backward times add up to
    within ``WITHIN`` of this run's fastest forward and fastest backward."""
    n, d = case["length"], case["d"]
    cls = cpu_choice.BlockClass.of(HEADS, case["hkv"], n, n, d, d, case["causal"])
    decision = cpu_kernel.choose(cls, kernels._ATEN)
    by_name = {r["kernel"]: r for r in rows if "fwd_ms" in r}
    best = min(r["fwd_ms"] for r in by_name.values()) + min(r["bwd_ms"] for r in by_name.values())
    ran = by_name.get(decision.forward, {}).get("fwd_ms", float("inf"))
    ran += by_name.get(decision.backward, {}).get("bwd_ms", float("inf"))
    return {"class": cls.key, "forward": decision.forward, "backward": decision.backward, "why": decision.why,
            "chosen_over_fastest": ran / best, "within": ran <= WITHIN * best}  # fmt: skip


def _table(rows: list[dict], decisions: list[dict]) -> str:
    head = ["B x L", "causal", "d", "hkv", "kernel", "fwd ms", "bwd ms", "fwd % mm", "bwd % mm", "aten / it", "chosen",
            "check"]  # fmt: skip
    chosen = {}
    for d in decisions:
        chosen[(d["case"]["length"], d["case"]["causal"], d["case"]["d"], d["case"]["hkv"], d["forward"])] = "fwd"
        key = (d["case"]["length"], d["case"]["causal"], d["case"]["d"], d["case"]["hkv"], d["backward"])
        chosen[key] = "fwd+bwd" if chosen.get(key) == "fwd" else "bwd"
    body = []
    for r in rows:
        timed = "fwd_ms" in r
        fastest = "*" if r.get("fastest_fwd") else "", "*" if r.get("fastest_bwd") else ""
        body.append([
            f"{_batch(r['length'])} x {r['length']}", r["causal"], r["d"], r["hkv"], r["kernel"],
            f"{r['fwd_ms']:.1f}{fastest[0]}" if timed else "", f"{r['bwd_ms']:.1f}{fastest[1]}" if timed else "",
            f"{r['fwd_pct_mm']:.0f}" if timed else "", f"{r['bwd_pct_mm']:.0f}" if timed else "",
            f"{r['vs_aten']:.2f}" if "vs_aten" in r else "",
            chosen.get((r["length"], r["causal"], r["d"], r["hkv"], r["kernel"]), ""),
            f"{max(r['errors'].values()):.1e}" if r["ok"] else "FAILED",
        ])  # fmt: skip
    return tabulate(body, head)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="L = 512 and 2048, head size 64, 3 rounds")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: all)")
    parser.add_argument("--out", type=Path, default=_common.RESULTS, help="folder of kernels.json")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.lengths, opts.dims, opts.rounds = [512, 2048], [64], 3
    if opts.threads:
        torch.set_num_threads(opts.threads)
    record = {"machine": _common.machine(torch.get_num_threads())}
    print(_common.described(record["machine"]), flush=True)
    candidates = {**cpu_kernel.candidates(), **kernels._ATEN}
    print(f"candidates: {', '.join(candidates)}", flush=True)
    rows, decisions = [], []
    with torch.no_grad():
        for case in _cases(opts.lengths, opts.dims):
            got = _run_case(case, candidates, opts.rounds)
            for r in got:
                what = f"L={r['length']} causal={r['causal']} d={r['d']} hkv={r['hkv']} {r['kernel']}"
                print(f"{what}: fwd {r['fwd_ms']:.1f} ms, bwd {r['bwd_ms']:.1f} ms" if "fwd_ms" in r else
                      f"{what}: FAILED check {r['errors']}", flush=True)  # fmt: skip
            rows += got
        for case in _cases(opts.lengths, opts.dims):  # after the timing, which it would disturb
            decisions.append({"case": case, **_decide(case, [r for r in rows if all(r[k] == case[k] for k in case)])})
    print(tabulate([[d["class"], d["forward"], d["backward"], d["why"], f"{d['chosen_over_fastest']:.2f}"]
                    for d in decisions], ["class", "forward", "backward", "why", "chosen / fastest"]))  # fmt: skip
    print(_table(rows, decisions))
    met = all(d["within"] for d in decisions)
    line = f"what the choice runs within {WITHIN - 1:.0%} of the fastest candidates (forward + backward), every case"
    print(f"{line}: {_common.verdict(met)}")
    record.update(rows=rows, decisions=decisions, rounds=opts.rounds, targets=[{"line": line, "met": met}])
    _common.write_json(opts.out / "kernels.json", record)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
