"""Single device, forward + backward, float32: the compiled rewrite against eager and dense SDPA.

Inputs ``q, k, v`` of shape ``(1, 8, N, 64)`` float32 (``requires_grad``), causal by default, for
N from 4k to 256k. Four implementations of attention, each timed forward + backward (the median of
``--repeats`` steps after one warm-up step, which compiles ours at every N but the first, where
the check below did):

* ``ours``: ``F.scaled_dot_product_attention`` compiled with the ``ring_dilated`` backend
  (inductor) under a LongNet-like config (segments 2048, 4096, 8192, 16384, rates 1, 2, 4, 8).
* ``eager``: the same function written the straightforward eager way, as the seed project did:
  per branch, gather the dilated rows, attention that returns its log-sum-exp (scores, logsumexp,
  softmax, matmul), scatter back, merge the branches by their log-sum-exps; autograd does the
  backward.
* ``dense``: ``F.scaled_dot_product_attention`` over the whole sequence (eager; the CPU flash
  kernel).
* ``ours exact`` against ``dense``: the rewrite with the default config (exact attention), same N.

Before anything is timed, every implementation that will be is checked, as it is timed (the same
compiled function), at the smallest N timed (the rewrite specialises on N: each N compiles a graph
of its own): its output and q/k/v gradients against float64 ``ring_rewrite.reference.
reference_attention`` (the dilated config for ``ours`` and ``eager``, exact attention for
``dense`` and ``ours exact``), max-abs error over max-abs value; above 1e-5 the benchmark stops.

Useful GFLOP/s count the query-key pairs each function connects (``4 * D`` FLOPs per pair forward,
2.5x that backward, the FlashAttention convention), and are compared with ``torch.mm``'s rate in
the same process and thread count, read before each timed step of every implementation (a
2048-square product, a tenth of a second). ``mm GFLOP/s`` is the run's rate, the median of
every reading, and ``ours % mm`` is against it; ``mm GFLOP/s at N`` and ``ours % mm at N`` are
the readings beside each N's own steps. On a shared machine the readings can scatter by
almost 2x within a run while the attention steps beside them do not move with them (the N whose
readings are the highest need not be the N whose steps are the slowest), so a step's own reading
is no better a reference than the run's. Peak memory: the rise of the CPU allocator's live
total over its level before one forward + backward step (``_common.allocated_peak``: what the
report's estimate counts; inputs excluded). Timings run with glibc's default allocation settings,
as a user's process does (no ``malloc_setup``, which serves every buffer from fresh pages and
would add their page faults to every step).

``--keep-heap`` runs the process with glibc serving every buffer from its heap and keeping
it (``MALLOC_MMAP_MAX_=0``, ``MALLOC_TRIM_THRESHOLD_`` 1 TiB: what jemalloc or tcmalloc, which
CPU training runs often load, do by default): a step's new buffers (out, dq, dk, dv: 2 GiB at
256k) then reuse pages the step before freed instead of fresh ones, whose first touch costs this
VM about 10 us a page at 256k (5 s of a 26 s step). The code's cost and the machine's show apart.

Whether the time per token is flat in N is judged on each N's fastest step (``best s / 16k
tokens``, beside the medians' column): the code's cost with the least of this machine's
interference. A shared machine's slow spells last a minute or two and come and go within a run,
moving single steps by more than the 10 % that flatness allows. So ours is timed in rounds: after
a warm-up step at every N, each round times one step of every N in turn
(``measure_in_rounds``), and a slow spell falls on steps of several N rather than on all of one
N's, as it would were the N timed one after another.

    python benchmarks/single_device.py                 # N = 4k .. 256k, about 25 minutes on 2 cores
    python benchmarks/single_device.py --quick         # N = 4k, 8k: a smoke run
    python benchmarks/single_device.py --seq 16384 32768 --no-causal
    python benchmarks/single_device.py --seq 16384 32768 65536 131072 262144 --keep-heap
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tabulate import tabulate

import _common

BATCH, HEADS, HEAD_DIM = 1, 8, 64
SEGMENTS, RATES = [2048, 4096, 8192, 16384], [1, 2, 4, 8]
EXACT = ("dense", "ours exact")  # the implementations of exact attention; the others are dilated
TARGET_EAGER, TARGET_EXACT = 3.0, 1.2  # >= 3x faster than eager at 32k; exact <= 1.2x SDPA
# Issue 19, item 1: >= 80 % of torch.mm from 16k to 64k, time per token flat within 10 % from 16k
# on, peak at most 6 q-sized tensors.
TARGET_MM, TARGET_FLAT, TARGET_Q_SIZED, FROM_N = 80.0, 1.10, 6.0, 16384
FWD_BWD = 3.5  # forward + backward FLOPs in units of forward FLOPs (backward = 2.5x forward)
KEEP_HEAP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}  # glibc reads them at start


# ---- the straightforward eager implementation ------------------------------------------------


def _branch_eager(q, k, v, w: int, r: int, causal: bool, scale: float):
    """One branch: output (B, H, N, Dv) and lse (B, H, N), -inf off the branch's lattice."""
    b, h, n, _ = q.shape
    w = min(w, n)
    nseg, dv = n // w, v.shape[-1]
    # head = hh * r + o, position = segment * w + i * r + o: the lattice of offset o is [.., o, .., o]
    split = lambda x: x.view(b, h // r, r, nseg, w // r, r, x.shape[-1])  # noqa: E731
    qs, ks, vs = split(q), split(k), split(v)
    out = q.new_zeros(b, h // r, r, nseg, w // r, r, dv)
    lse = q.new_full((b, h // r, r, nseg, w // r, r), float("-inf"))
    pos = torch.arange(w // r, device=q.device)
    for o in range(r):  # head j uses offset j mod r (LongNet)
        qo, ko, vo = qs[:, :, o, :, :, o], ks[:, :, o, :, :, o], vs[:, :, o, :, :, o]
        scores = scale * qo @ ko.transpose(-1, -2)
        if causal:
            scores = scores.masked_fill(pos.view(-1, 1) < pos.view(1, -1), float("-inf"))
        lse_o = torch.logsumexp(scores, dim=-1)
        out[:, :, o, :, :, o] = torch.exp(scores - lse_o.unsqueeze(-1)) @ vo
        lse[:, :, o, :, :, o] = lse_o
    return out.view(b, h, n, dv), lse.view(b, h, n)


def eager_dilated(q, k, v, segments: Sequence[int], rates: Sequence[int], causal: bool):
    """LongNet dilated attention, eager: every branch, then the log-sum-exp merge."""
    scale = q.shape[-1] ** -0.5
    outs, lses = zip(*(_branch_eager(q, k, v, w, r, causal, scale) for w, r in zip(segments, rates)))
    lse = torch.stack(lses)
    total = torch.logsumexp(lse, dim=0)
    weights = torch.exp(lse - total).nan_to_num(0.0)  # rows no branch reaches (none here) give 0
    return (weights.unsqueeze(-1) * torch.stack(outs)).sum(0)


# ---- pairs and FLOPs -------------------------------------------------------------------------


def connected_pairs(n: int, segments: Sequence[int] | None, rates: Sequence[int] | None, causal: bool) -> int:
    """Query-key pairs per head that the function attends over, summed over branches."""
    branches = [(n, 1)] if segments is None else list(zip(segments, rates))
    total = 0
    for w, r in branches:
        w = min(w, n)
        m = w // r  # lattice rows per segment and offset; every head has one offset
        per_segment = m * (m + 1) // 2 if causal else m * m
        total += (n // w) * per_segment
    return total


def fwd_bwd_flops(pairs: int) -> float:
    return FWD_BWD * 4 * HEAD_DIM * pairs * HEADS * BATCH


# ---- one measurement -------------------------------------------------------------------------


def _step(fn: Callable, q, k, v, grad_out) -> None:
    out = fn(q, k, v)
    torch.autograd.grad(out, (q, k, v), grad_out)


def inputs(n: int) -> tuple[torch.Tensor, ...]:
    """q, k, v (requiring grad) and grad_out of N = n."""
    q, k, v, grad_out = _common.sequence_inputs((BATCH, HEADS, n, HEAD_DIM))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad_out


def _mm() -> float:
    """torch.mm's rate, measured before each timed step: the peak its FLOP/s are compared with."""
    return _common.matmul_gflops(repeats=3)


def _result(times: list[float], mm: list[float], peak: int) -> dict:
    return {
        "fwd_bwd_s": statistics.median(times), "best_s": min(times), "times_s": times,
        "mm_gflops": statistics.median(mm), "mm_all": mm, "peak_bytes": peak,
    }  # fmt: skip


def measure(fn: Callable, n: int, repeats: int) -> dict:
    q, k, v, grad_out = inputs(n)
    timing = _common.median_time(lambda: _step(fn, q, k, v, grad_out), repeats, warmup=1, between=_mm)
    peak = _common.allocated_peak(lambda: _step(fn, q, k, v, grad_out))
    return _result(timing["times_s"], timing["between"], peak)


def measure_in_rounds(fn: Callable, ns: Sequence[int], repeats: int) -> dict[int, dict]:
    """``measure`` of ``fn`` at every N of ``ns``, each after one warm-up step, timed in
    ``repeats`` rounds of one step per N: a slow spell of the machine (a minute or two) then
    falls on steps of several N, not on every step of one."""
    steps = {}
    for n in ns:
        q, k, v, grad_out = inputs(n)
        steps[n] = functools.partial(_step, fn, q, k, v, grad_out)
        steps[n]()
    times, mm = {n: [] for n in ns}, {n: [] for n in ns}
    for _ in range(repeats):
        for n in ns:
            timing = _common.median_time(steps[n], 1, warmup=0, between=_mm)
            times[n] += timing["times_s"]
            mm[n] += timing["between"]
    return {n: _result(times[n], mm[n], _common.allocated_peak(steps[n])) for n in ns}


def check(impls: dict[str, Callable], n: int, causal: bool) -> dict[str, dict[str, float]]:
    """Each implementation's out, dq, dk, dv at N = n (its first call there: this compiles ours)
    against float64 ``reference_attention``: the dilated config, or exact attention for
    ``EXACT``. Rel. errors by implementation and tensor."""
    q, k, v, grad_out = inputs(n)
    errors = {}
    for dilated in (True, False):
        options = {"segment_lengths": SEGMENTS, "dilation_rates": RATES} if dilated else {}
        expected = _common.reference(q, k, v, grad_out, is_causal=causal, **options)
        for name, fn in impls.items():
            if (name not in EXACT) == dilated:
                errors[name] = _common.errors(_common.forward_backward(fn, q, k, v, grad_out), expected)
    return errors


def compiled_sdpa(causal: bool, **options) -> tuple[Callable, Any]:
    """SDPA compiled with the rewrite (inductor), and its backend (whose records hold each N's
    plan)."""
    import ring_rewrite

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    backend = ring_rewrite.backend(compiler="inductor", **options)
    # NOTE: dynamic=False: one static graph per N, as a model of one sequence length compiles.
    # Dynamo would otherwise make N a symbol at the second N, and the rewrite would pad each call
    # to its length bucket (passes/bucket_lengths.py): copies of q, k, v and the gradients that a
    # fixed-length model never makes (about 5 q-sized tensors more at the peak).
    return torch.compile(attend, backend=backend, fullgraph=True, dynamic=False), backend


def estimated_peak(backend, n: int) -> float | None:
    """The report's estimate of the site's peak at N = n (``report.attention_memory_bytes``), in
    q-sized tensors."""
    from ring_rewrite.report import attention_memory_bytes

    plans = [r.plan for r in backend.records if r.plan is not None and r.plan.n == n]
    return attention_memory_bytes(plans[-1])["peak"] / (BATCH * HEADS * n * HEAD_DIM * 4) if plans else None


# ---- the run ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536, 131072, 262144])
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dense-max", type=int, default=32768, help="largest N for dense SDPA and ours exact")
    parser.add_argument("--eager-max", type=int, default=32768, help="largest N for the eager version (its memory is O(N w))")
    parser.add_argument("--quick", action="store_true", help="N = 4096, 8192, 2 repeats")
    parser.add_argument("--keep-heap", action="store_true", help="glibc keeps freed memory for the next step (no fresh pages)")
    parser.add_argument("--out", type=_common.Path, default=_common.RESULTS / "single_device.json")
    opts = parser.parse_args(argv)
    keep_heap = all(os.environ.get(key) == value for key, value in KEEP_HEAP.items())
    if opts.keep_heap and not keep_heap:  # start again with glibc told so
        args = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *args], {**os.environ, **KEEP_HEAP})
    if opts.quick:
        opts.seq, opts.repeats = [4096, 8192], 2
    torch.set_num_threads(opts.threads)
    # One graph per N and config (the rewrite specialises on the sequence length).
    torch._dynamo.config.recompile_limit = max(8, 2 * len(opts.seq) + 2)
    causal = opts.causal
    machine = _common.machine(opts.threads)
    peak = _common.matmul_gflops()
    print(
        f"q, k, v ({BATCH}, {HEADS}, N, {HEAD_DIM}) float32, {'causal' if causal else 'not causal'}, "
        f"forward + backward, {opts.threads} threads, median of {opts.repeats} after a warm-up"
        f"{'; glibc keeps its heap' if keep_heap else ''}\n"
        f"dilated config: segments {SEGMENTS}, rates {RATES}; torch.mm here: {peak:.0f} GFLOP/s (again before each step)\n",
        flush=True,
    )

    ours, ours_backend = compiled_sdpa(causal, segment_lengths=SEGMENTS, dilation_rates=RATES)
    ours_exact, _ = compiled_sdpa(causal)
    eager = lambda q, k, v: eager_dilated(q, k, v, SEGMENTS, RATES, causal)  # noqa: E731
    dense = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    impls = {"ours": (ours, None), "eager": (eager, opts.eager_max), "dense": (dense, opts.dense_max),
             "ours exact": (ours_exact, opts.dense_max)}  # fmt: skip

    n_check = min(opts.seq)  # every implementation timed at all is timed there
    timed = {name: fn for name, (fn, limit) in impls.items() if limit is None or n_check <= limit}
    errors = check(timed, n_check, causal)
    worst = ", ".join(f"{name} {max(e.values()):.1e}" for name, e in errors.items())
    print(
        f"checked at N = {n_check} (the smallest N timed) against float64 reference_attention, "
        f"out/dq/dk/dv, max rel. error: {worst}",
        flush=True,
    )
    bad = {name: {t: x for t, x in e.items() if not x <= _common.TOLERANCE} for name, e in errors.items()}
    failed = {name: e for name, e in bad.items() if e}
    if failed:
        print(f"above {_common.TOLERANCE:g}, stopping before timing: {failed}")
        return 1
    rows, raw, measured = [], [], {}
    ours = measure_in_rounds(impls["ours"][0], opts.seq, opts.repeats)
    for n in opts.seq:
        got = measured[n] = {}
        for name, (fn, limit) in impls.items():
            if limit is not None and n > limit:
                continue
            got[name] = ours[n] if name == "ours" else measure(fn, n, opts.repeats)
            pairs = connected_pairs(n, None if name in ("dense", "ours exact") else SEGMENTS, RATES, causal)
            got[name]["gflops"] = fwd_bwd_flops(pairs) / got[name]["fwd_bwd_s"] / 1e9
            raw.append({"N": n, "impl": name, "pairs_per_head": pairs, **got[name]})
            print(f"  N={n} {name}: {got[name]['fwd_bwd_s']:.3f} s", flush=True)
    # torch.mm's rate in this run: the median of every reading (one before each timed step).
    mm = statistics.median(x for got in measured.values() for g in got.values() for x in g["mm_all"])
    for n, got in measured.items():
        ratio = lambda a, b: got[a]["fwd_bwd_s"] / got[b]["fwd_bwd_s"] if a in got and b in got else None  # noqa: E731
        rows.append({
            "N": n,
            "ours s": got["ours"]["fwd_bwd_s"],
            "eager s": got.get("eager", {}).get("fwd_bwd_s"),
            "dense s": got.get("dense", {}).get("fwd_bwd_s"),
            "ours exact s": got.get("ours exact", {}).get("fwd_bwd_s"),
            "eager / ours": ratio("eager", "ours"),
            "dense / ours": ratio("dense", "ours"),
            "ours exact / dense": ratio("ours exact", "dense"),
            "ours GFLOP/s": got["ours"]["gflops"],
            "mm GFLOP/s": mm,
            "ours % mm": 100 * got["ours"]["gflops"] / mm,
            "dense % mm": 100 * got["dense"]["gflops"] / mm if "dense" in got else None,
            "mm GFLOP/s at N": got["ours"]["mm_gflops"],
            "ours % mm at N": 100 * got["ours"]["gflops"] / got["ours"]["mm_gflops"],
            "ours s / 16k tokens": got["ours"]["fwd_bwd_s"] * 16384 / n,
            "best s / 16k tokens": got["ours"]["best_s"] * 16384 / n,
            "ours MiB": got["ours"].get("peak_bytes", 0) / _common.MIB or None,
            "ours q-sized": got["ours"].get("peak_bytes", 0) / (BATCH * HEADS * n * HEAD_DIM * 4) or None,
            "estimate q-sized": estimated_peak(ours_backend, n),
            "eager MiB": got.get("eager", {}).get("peak_bytes", 0) / _common.MIB or None,
            "dense MiB": got.get("dense", {}).get("peak_bytes", 0) / _common.MIB or None,
        })  # fmt: skip
    print()
    print(tabulate(rows, headers="keys", floatfmt=".3g", missingval="-"))

    targets = _targets(rows)
    print()
    for line, met in targets.items():
        print(f"target: {line}: {_common.verdict(met)}")
    _common.write_json(opts.out, {
        "benchmark": "single_device",
        "machine": machine,
        "setup": {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32",
                  "causal": causal, "segment_lengths": SEGMENTS, "dilation_rates": RATES,
                  "repeats": opts.repeats, "mm_gflops_first": peak, "mm_gflops": mm, "keep_heap": keep_heap,
                  "check": {"N": n_check, "why": "the smallest N timed (each N compiles its own graph)",
                            "reference": "ring_rewrite.reference.reference_attention, float64",
                            "tolerance": _common.TOLERANCE, "rel_err": errors},
                  "memory": "allocator's peak over its level before one forward+backward (torch.profiler)"},
        "targets": [{"line": line, "met": met} for line, met in targets.items()],
        "rows": rows,
        "raw": raw,
    })  # fmt: skip
    _plot(rows, opts.out.with_suffix(".png"))
    return 0


def _targets(rows: list[dict]) -> dict[str, bool | None]:
    at = {row["N"]: row for row in rows}
    eager32 = at.get(32768, {}).get("eager / ours")
    exact = [row["ours exact / dense"] for row in rows if row["ours exact / dense"] is not None]
    dilated = [row["dense / ours"] for n, row in at.items() if n >= 16384 and row["dense / ours"] is not None]
    growing = all(b > a for a, b in zip(dilated, dilated[1:]))
    mm = [row["ours % mm"] for n, row in at.items() if FROM_N <= n <= 65536]
    per_token = [row["best s / 16k tokens"] for n, row in at.items() if n >= FROM_N]
    q_sized = [row["ours q-sized"] for n, row in at.items() if n >= FROM_N and row["ours q-sized"] is not None]
    return {
        f"ours >= {TARGET_EAGER:g}x faster than eager at N = 32k": None if eager32 is None else eager32 >= TARGET_EAGER,
        f"ours exact within {TARGET_EXACT:g}x of SDPA": max(exact) <= TARGET_EXACT if exact else None,
        "dilated faster than dense SDPA from N = 16k on, the lead growing with N": (
            all(x > 1 for x in dilated) and growing if dilated else None
        ),
        f"ours >= {TARGET_MM:g} % of torch.mm, N = 16k to 64k": min(mm) >= TARGET_MM if mm else None,
        f"time per token (best step) flat within {TARGET_FLAT - 1:.0%} from N = 16k": (
            max(per_token) <= TARGET_FLAT * min(per_token) if len(per_token) > 1 else None
        ),
        f"peak at most {TARGET_Q_SIZED:g} q-sized tensors from N = 16k": (
            max(q_sized) <= TARGET_Q_SIZED if q_sized else None
        ),
    }  # fmt: skip


def _plot(rows: list[dict], path) -> None:
    plt = _common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("ours s", "o-"), ("eager s", "s--"), ("dense s", "^:"), ("ours exact s", "v-.")):
        pts = [(row["N"], row[key]) for row in rows if row[key] is not None]
        if pts:
            left.plot(*zip(*pts), style, label=key[:-2])
    left.set(xscale="log", yscale="log", xlabel="N", ylabel="forward + backward, s", title="time")
    left.legend()
    for key in ("ours % mm", "dense % mm"):
        pts = [(row["N"], row[key]) for row in rows if row[key] is not None]
        if pts:
            right.plot(*zip(*pts), "o-", label=key.replace(" % mm", ""))
    right.set(xscale="log", xlabel="N", ylabel="% of torch.mm", title="useful FLOP/s against this run's torch.mm")
    right.legend()
    _common.save_plot(fig, path)


if __name__ == "__main__":
    sys.exit(main())
