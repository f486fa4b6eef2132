"""Per-rank peak memory and bytes sent of one rewritten attention site, P = 1, 2, 4
(docs/semantics.md, Memory and communication).

One function calling ``F.scaled_dot_product_attention`` on ``q, k, v`` of shape
``(1, 8, N/P, 64)`` float32, causal, is compiled with the ``ring_dilated`` backend in sharded mode
(each rank holds only its shard) and run forward + backward once to compile, once to check, then
once measured. For each P, P gloo ranks are spawned on this machine.

Check: every rank cuts its shard (``ring_rewrite.shard``, the layout measured) of one global
``q, k, v, grad_out`` built from a fixed seed, the inputs of the measured step too. The output and
q/k/v gradients of all ranks together are compared with float64 ``ring_rewrite.reference.
reference_attention`` over the whole sequence (computed once, in the parent): max-abs error over
max-abs value, the errors all-reduced so that every rank raises if one is above 1e-5. The check's
tensors are freed before the measured step.

Memory: the increase of the process's peak RSS (VmHWM) over its RSS just before the measured
step, after resetting the peak (``/proc/self/clear_refs``). The inputs (q, k, v, grad_out) exist
before the step, so the increase is the attention's activation memory: saved tensors, outputs,
gradients and workspace. glibc is told to serve every allocation of 256 KiB or more with mmap
(``mallopt``), so freed tensors go back to the OS and a step cannot hide its allocations in heap
memory freed by the warm-up. One more step counts the bytes the CPU allocator holds at its peak
(``_common.allocated_peak``, ``torch.profiler``'s memory events), which is what the report's
estimate counts: a page of an allocated buffer counts in RSS only once written.

Bytes sent: ``torch._dynamo.utils.counters["ring_rewrite"]["bytes_sent"]``, read and reset around
the forward and around the backward.

Writes ``results/ring_memory.json`` (``results/ring_memory_longnet.json`` with ``--config
longnet``; ``--out`` to change) and, beside it with the same stem, a PNG of the peak per rank
against P with the ideal 1/P line.

    python benchmarks/ring_memory.py                    # exact attention, N = 16384
    python benchmarks/ring_memory.py --config longnet   # segments [N/8, N/4, N/2], rates [1, 2, 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, for _common
from _common import (  # noqa: E402
    ring_sent,
    MIB,
    allocated_peak,
    MMAP_THRESHOLD,
    RESULTS,
    TOLERANCE,
    can_measure_memory,
    forward_backward,
    local,
    machine,
    malloc_setup,
    pyplot,
    reference,
    require,
    reset_peak,
    ring_errors,
    rss,
    run_ranks,
    save_plot,
    sequence_inputs,
    trim,
    verdict,
    write_json,
)

BATCH, HEADS, HEAD_DIM = 1, 8, 64
SEED = 0
TARGET = 0.35  # attention memory at P=4 <= 0.35x of P=1


# ---- measuring, inside one rank --------------------------------------------------------------


def _step(compiled, q, k, v, grad_out) -> dict:
    """One forward + backward; memory relative to the RSS just before it."""
    trim()
    dist.barrier()  # NOTE: outside the ring: every rank starts the step together
    ring_sent()
    reset_peak()
    base = rss()["VmRSS"]
    t0 = time.perf_counter()
    out = compiled(q, k, v)
    t1 = time.perf_counter()
    after_fwd = rss()
    sent_fwd = ring_sent()
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    t2 = time.perf_counter()
    after_bwd = rss()
    sent_bwd = ring_sent()
    result = {
        "peak_fwd_bytes": after_fwd["VmHWM"] - base,
        "retained_after_fwd_bytes": after_fwd["VmRSS"] - base,
        "peak_bytes": after_bwd["VmHWM"] - base,
        "retained_after_bwd_bytes": after_bwd["VmRSS"] - base,
        "sent_fwd_bytes": sent_fwd,
        "sent_bwd_bytes": sent_bwd,
        "time_fwd_s": t1 - t0,
        "time_bwd_s": t2 - t1,
    }
    del out, grads
    return result


def _rank(rank: int, world: int, args: dict) -> dict:
    """One rank's measurement (``run_ranks`` has joined the gloo group)."""
    malloc_fixed = malloc_setup()
    torch.set_num_threads(1)
    import ring_rewrite
    from ring_rewrite.report import attention_memory_bytes, bytes_sent

    causal, layout = True, args["layout"]
    whole = sequence_inputs((BATCH, HEADS, args["seq"], HEAD_DIM), SEED)
    q, k, v, grad_out = (local(x, layout) for x in whole)
    del whole  # only the shards stay
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    input_bytes = sum(x.numel() * x.element_size() for x in (q, k, v, grad_out))

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    options = {"sharding": "sharded", "layout": layout, "compiler": args["compiler"]}
    if args["segment_lengths"] is not None:
        options.update(segment_lengths=args["segment_lengths"], dilation_rates=args["dilation_rates"])
    # The backend object is the registered "ring_dilated" backend with these options; it
    # also keeps the site's plan, for the report's own memory and bytes estimates.
    backend = ring_rewrite.backend(**options)
    compiled = torch.compile(attend, backend=backend, fullgraph=True)

    t0 = time.perf_counter()
    warm = _step(compiled, q, k, v, grad_out)  # compiles forward and backward
    warmup_s = time.perf_counter() - t0
    errors = ring_errors(forward_backward(compiled, q, k, v, grad_out), args["reference"], layout)
    require(errors, f"P = {world}, rank {rank}")
    result = _step(compiled, q, k, v, grad_out)  # trims first: the check's tensors are gone
    allocated = allocated_peak(lambda: _step(compiled, q, k, v, grad_out))
    (site,) = backend.records
    estimate, predicted = attention_memory_bytes(site.plan), bytes_sent(site.plan)
    result.update(
        rank=rank, input_bytes=input_bytes, warmup_s=warmup_s, warmup_peak_bytes=warm["peak_bytes"],
        allocated_bytes=allocated,
        malloc_mmap_forced=malloc_fixed, rel_err=errors,
        report_saved_bytes=estimate["saved"],
        report_peak_bytes=estimate["peak"],
        report_sent_fwd_bytes=predicted["forward"], report_sent_bwd_bytes=predicted["backward"],
    )  # fmt: skip
    return result


# ---- driving, in the parent ------------------------------------------------------------------


def _config(name: str, n: int, segments, rates):
    if segments is not None:
        return list(segments), list(rates)
    if name == "exact":
        return None, None
    # LongNet-style: segments N/8, N/4, N/2 with rates 1, 2, 4 ([2048, 4096, 8192] at N = 16384).
    return [n // 8, n // 4, n // 2], [1, 2, 4]


def _default_out(config: str, overridden: bool) -> Path:
    """results/ring_memory.json, ring_memory_longnet.json, or ring_memory_custom.json (segments
    given on the command line): the runs do not overwrite each other."""
    stem = "ring_memory" + ("_custom" if overridden else "" if config == "exact" else f"_{config}")
    return RESULTS / f"{stem}.json"


def _plot(rows: list[dict], title: str, path: Path) -> None:
    """Peak per rank against P, with the ideal 1/P line through the smallest P measured."""
    plt = pyplot()
    ps = [r["P"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ps, [r["fwd+bwd peak MiB"] for r in rows], "o-", label="fwd+bwd peak (max over ranks)")
    ax.plot(ps, [r["fwd peak MiB"] for r in rows], "s-", label="fwd peak")
    ax.plot(ps, [r["report est. MiB"] for r in rows], "x--", label="report estimate")
    p0, peak0 = ps[0], rows[0]["fwd+bwd peak MiB"]
    ax.plot(ps, [peak0 * p0 / p for p in ps], ":", color="gray", label=f"ideal: 1/P from P={p0}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(ps, [str(p) for p in ps])
    ax.set_xlabel("P (ranks)")
    ax.yaxis.set_major_formatter(lambda y, _: f"{y:g}")
    ax.set_ylabel("MiB per rank")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_plot(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16384, help="global sequence length N")
    parser.add_argument("--config", choices=["exact", "longnet"], default="exact")
    parser.add_argument("--segment-lengths", type=int, nargs="+", help="override --config's segments")
    parser.add_argument("--dilation-rates", type=int, nargs="+", help="with --segment-lengths")
    parser.add_argument("--compiler", choices=["aot_eager", "inductor"], default="aot_eager")
    parser.add_argument("--layout", choices=["contiguous", "zigzag"], default="contiguous")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="values of P")
    parser.add_argument("--quick", action="store_true", help="N = 4096: a smoke run")
    parser.add_argument(
        "--out", type=Path,
        help="JSON path; the PNG goes beside it (default results/ring_memory.json, "
        "results/ring_memory_longnet.json with --config longnet)",
    )  # fmt: skip
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.seq = 4096
    if not can_measure_memory():
        parser.error("measuring peak RSS needs Linux (/proc/self/clear_refs and VmHWM)")
    if (opts.segment_lengths is None) != (opts.dilation_rates is None):
        parser.error("--segment-lengths and --dilation-rates go together")
    out = opts.out or _default_out(opts.config, opts.segment_lengths is not None)
    segments, rates = _config(opts.config, opts.seq, opts.segment_lengths, opts.dilation_rates)
    args = {
        "seq": opts.seq, "layout": opts.layout, "compiler": opts.compiler,
        "segment_lengths": segments, "dilation_rates": rates,
    }  # fmt: skip
    from ring_rewrite.layout import layout_of

    for world in opts.ranks:
        pieces = world * layout_of(opts.layout).parts
        if opts.seq % pieces:
            parser.error(f"N = {opts.seq} is not divisible by {pieces} (P = {world}, layout {opts.layout})")

    config = "exact" if segments is None else f"segments {segments}, rates {rates}"
    print(
        f"ring_dilated, one causal SDPA site, q/k/v ({BATCH}, {HEADS}, N/P, {HEAD_DIM}) float32, "
        f"N = {opts.seq}, {config}, sharded/{opts.layout}, compiler {opts.compiler}\n"
        f"each rank is its own process with torch.set_num_threads(1) (P = 1 too, for comparability); "
        f"{os.cpu_count()} cores shared by all ranks, gloo on loopback\n",
        flush=True,
    )
    record_machine = machine(threads=1)  # before the run: the commit measured
    t0 = time.perf_counter()
    whole = sequence_inputs((BATCH, HEADS, opts.seq, HEAD_DIM), SEED)
    expected = reference(*whole, is_causal=True, segment_lengths=segments, dilation_rates=rates)
    print(f"  float64 reference: {time.perf_counter() - t0:.1f} s", flush=True)
    runs = {}
    for world in opts.ranks:
        t0 = time.perf_counter()
        runs[world] = run_ranks(_rank, world, {**args, "reference": expected})
        print(f"  P={world}: done in {time.perf_counter() - t0:.1f} s", flush=True)

    base = max(r["peak_bytes"] for r in runs[1]) if 1 in runs else None
    rows = []
    for world, ranks in runs.items():
        peak = max(r["peak_bytes"] for r in ranks)
        rows.append({
            "P": world,
            "N": opts.seq,
            "N/P": opts.seq // world,
            "inputs MiB": ranks[0]["input_bytes"] / MIB,
            "fwd peak MiB": max(r["peak_fwd_bytes"] for r in ranks) / MIB,
            "held after fwd MiB": max(r["retained_after_fwd_bytes"] for r in ranks) / MIB,
            "fwd+bwd peak MiB": peak / MIB,
            "peak / q size": peak / (ranks[0]["input_bytes"] / 4),
            "ratio to P=1": peak / base if base else None,
            "allocated MiB": max(r["allocated_bytes"] for r in ranks) / MIB,
            "report est. MiB": max(r["report_peak_bytes"] for r in ranks) / MIB,
            "sent fwd MiB": max(r["sent_fwd_bytes"] for r in ranks) / MIB,
            "sent bwd MiB": max(r["sent_bwd_bytes"] for r in ranks) / MIB,
            "fwd s": max(r["time_fwd_s"] for r in ranks),
            "bwd s": max(r["time_bwd_s"] for r in ranks),
            "max rel err": max(ranks[0]["rel_err"].values()),
        })  # fmt: skip
    print()
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    predicted = all(
        r["sent_fwd_bytes"] == r["report_sent_fwd_bytes"] and r["sent_bwd_bytes"] == r["report_sent_bwd_bytes"]
        for ranks in runs.values() for r in ranks
    )  # fmt: skip
    print(
        "\npeak = increase of peak RSS over RSS before the step, max over ranks (inputs q, k, v, "
        "grad_out not included);\nsent = bytes this rank sent, max over ranks; times are of 1 "
        "step on oversubscribed cores, not a speed measurement;\n"
        "held after fwd = RSS increase when the forward returns (output + what is saved for backward);\n"
        "peak / q size = peak in units of one local q tensor; allocated = the CPU allocator's peak "
        "over one more step, max over ranks;\nreport est. = the rewrite report's estimate: its 'MiB "
        "saved / peak' peak (it counts allocations)\n"
        "max rel err = out, dq, dk, dv of all ranks against float64 reference_attention over the whole "
        f"sequence, checked before the measured step (bound {TOLERANCE:g})\n"
        f"bytes sent equal the report's prediction on every rank: {'yes' if predicted else 'NO'}"
    )

    met = None
    if 1 in runs and 4 in runs:
        ratio = next(r["ratio to P=1"] for r in rows if r["P"] == 4)
        met = ratio <= TARGET
        print(f"\ntarget: attention memory at P=4 <= {TARGET}x of P=1: {ratio:.3f}x -> {verdict(met)}")

    record = {
        "benchmark": "ring_memory",
        "machine": record_machine,
        "setup": {
            **args, "batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32",
            "causal": True, "sharding": "sharded", "config": opts.config,
            "malloc_mmap_threshold_bytes": MMAP_THRESHOLD,
            "memory": "VmHWM increase over VmRSS before the measured forward+backward",
            "seed": SEED, "tolerance": TOLERANCE,
            "check": "out, dq, dk, dv of the ranks' shards against float64 reference_attention over "
                     "the whole sequence, before the measured step",
        },  # fmt: skip
        "targets": [{"line": f"attention memory at P=4 <= {TARGET}x of P=1", "met": met}],
        "bytes_sent_match_report": predicted,
        "rows": rows,
        "ranks": {str(world): ranks for world, ranks in runs.items()},
    }
    print()
    write_json(out, record)
    _plot(rows, f"ring_dilated peak memory per rank, N = {opts.seq}, {config}", out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
