"""Distributed exact ring attention, forward + backward: ours against torch's own ring, same inputs.

Every rank holds its shard of one global ``q, k, v`` of shape ``(1, 8, N, 64)`` float32
(``requires_grad``), built from a fixed seed; P gloo ranks are spawned on this machine, each with
``torch.set_num_threads(1)``. Two implementations of exact attention, causal and not:

* ``ours``: ``F.scaled_dot_product_attention`` compiled with ``ring_rewrite.backend(
  sharding="sharded", layout=...)`` (inductor by default), ``fullgraph=True``. Causal runs use
  ``layout="zigzag"`` (rank r holds chunks r and 2P-1-r of 2P: the load-balanced layout) and
  ``"contiguous"`` (rank r holds tokens ``[rN/P, (r+1)N/P)``); non-causal runs use contiguous.
* ``torch``: torch's context-parallel ring, ``_templated_ring_attention`` and
  ``_templated_ring_attention_backward`` (``torch.distributed.tensor.experimental.
  _context_parallel._attention``) around the CPU flash kernels, wrapped in an
  ``autograd.Function`` and run eagerly, as torch runs it (its public ``context_parallel`` fails on
  CPU: no sharding rule for the CPU flash op). Variants: K/V rotated by all-gather or all-to-all
  (``_cp_options.rotate_method``; its backward always sends dK/dV by all-to-all), its head-tail
  load balancer on (inputs in head-tail order, which is our zigzag) or off (contiguous). Torch
  refuses the load balancer without a causal mask; those rows say so.

Each variant is first checked on every rank: its output and q/k/v gradients against float64
``F.scaled_dot_product_attention`` over the whole sequence (one process, no ring), max-abs error
over max-abs value of the rank's shard; above 1e-5 the benchmark aborts. This first step also
compiles ours. Then ``--repeats`` forwards and ``--repeats`` forward + backward steps after one
warm-up call each, every repeat entered together after a ``dist.barrier()``; the variants take
turns (one repeat of each, then the next round), so that other load on the machine falls on all
of them alike. A repeat's time is the slowest rank's; the table shows the median over repeats,
and each ratio to torch's best variant is the median over rounds of the ratio within a round
(the machine's slow and fast spells cancel). Last, the forward + backward's peak memory: the rise
of the process's peak RSS over its RSS just before the step (inputs excluded; glibc serves large
allocations with mmap so freed tensors leave RSS), max over ranks.

    python benchmarks/torch_ring.py                   # N = 8192, P = 2 and 4, causal and not
    python benchmarks/torch_ring.py --quick           # N = 2048, 2 repeats: a smoke run
    python benchmarks/torch_ring.py --ranks 2 --compiler aot_eager
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch.distributed.tensor.experimental._context_parallel import _attention as cp

import _common
import ring_rewrite

BATCH, HEADS, HEAD_DIM = 1, 8, 64
SEQ_DIM = 2
SEED = 0
TARGET = 1.0  # ours / torch's best, forward + backward, at P = 2
ROTATES = {"allgather": cp._RotateMethod.ALL_GATHER, "alltoall": cp._RotateMethod.ALL_TO_ALL}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One implementation of distributed exact attention and how the sequence is cut."""

    impl: str  # "ours" or "torch"
    layout: str  # "contiguous" or "zigzag" (= torch's head-tail order)
    rotate: str | None = None  # torch: how K/V travel, a key of ROTATES
    load_balance: bool = False  # torch: its head-tail load balancer

    @property
    def name(self) -> str:
        if self.impl == "ours":
            return f"ours {self.layout}"
        return f"torch {self.rotate}" + (" +balance" if self.load_balance else "")


def variants(causal: bool) -> list[Variant]:
    layouts = ["zigzag", "contiguous"] if causal else ["contiguous"]
    ours = [Variant("ours", layout) for layout in layouts]
    torch_ = [
        Variant("torch", "zigzag" if balance else "contiguous", rotate, balance)
        for balance in (True, False) for rotate in ROTATES
    ]  # fmt: skip
    return ours + torch_


def headline(causal: bool) -> Variant:
    """The variant of ours the target is about: the load-balanced layout when causal."""
    return Variant("ours", "zigzag" if causal else "contiguous")


# ---- inputs and the reference ----------------------------------------------------------------


def global_inputs(n: int) -> list[torch.Tensor]:
    """q, k, v, grad_out of the whole sequence, the same on every rank."""
    return _common.sequence_inputs((BATCH, HEADS, n, HEAD_DIM), SEED)


def reference(n: int, causal: bool) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv of dense attention over the whole sequence, in float64."""
    q, k, v, dout = (x.double() for x in global_inputs(n))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return dict(zip(_common.TENSORS, (out.detach(), *grads)))


# ---- the two implementations -----------------------------------------------------------------


@contextlib.contextmanager
def cp_options(rotate: str, load_balance: bool) -> Iterator[None]:
    """Set torch's module-global context-parallel options for one call."""
    opts = cp._cp_options
    saved = opts.rotate_method, opts.enable_load_balance
    opts.rotate_method, opts.enable_load_balance = ROTATES[rotate], load_balance
    try:
        yield
    finally:
        opts.rotate_method, opts.enable_load_balance = saved


class TorchRing(torch.autograd.Function):
    """torch's ring attention around the CPU flash kernels, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, rotate: str, load_balance: bool):
        group = dist.group.WORLD
        with cp_options(rotate, load_balance):
            out, lse = cp._templated_ring_attention(
                group, SEQ_DIM, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                q, k, v, is_causal=causal, dropout_p=0.0,
            )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = causal, rotate, load_balance
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, rotate, load_balance = ctx.options
        with cp_options(rotate, load_balance):
            dq, dk, dv = cp._templated_ring_attention_backward(
                dist.group.WORLD, SEQ_DIM,
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                dout, "grad_out", q, k, v, out, lse, is_causal=causal, dropout_p=0.0,
            )  # fmt: skip
        return dq, dk, dv, None, None, None


def attention(variant: Variant, causal: bool, compiler: str) -> Callable[..., torch.Tensor]:
    """``attend(q, k, v) -> out`` on this rank's shards."""
    if variant.impl == "torch":
        return lambda q, k, v: TorchRing.apply(q, k, v, causal, variant.rotate, variant.load_balance)
    backend = ring_rewrite.backend(sharding="sharded", layout=variant.layout, compiler=compiler)
    return torch.compile(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        backend=backend, fullgraph=True,
    )  # fmt: skip


# ---- measuring, inside one rank --------------------------------------------------------------


def time_once(fn: Callable[[], Any]) -> float:
    gc.collect()
    dist.barrier()  # NOTE: outside the timed call, never inside the ring: the ranks start together
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclasses.dataclass
class Prepared:
    """A variant checked on this rank and ready to time."""

    record: dict[str, Any]
    attend: Callable[..., torch.Tensor] | None = None
    step: Callable[[], Any] | None = None
    qkv: tuple[torch.Tensor, ...] = ()


def prepare(variant: Variant, causal: bool, inputs: list[torch.Tensor], ref: dict, opts: dict) -> Prepared:
    """Check one variant on this rank against the reference (its first step, which also
    compiles ours' forward and backward)."""
    q, k, v, dout = (_common.local(x, variant.layout) for x in inputs)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    attend = attention(variant, causal, opts["compiler"])

    def step() -> tuple[torch.Tensor, ...]:
        out = attend(q, k, v)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))

    record: dict[str, Any] = {"variant": variant.name, "causal": causal}
    t0 = time.perf_counter()
    try:
        first = step()
    except RuntimeError as e:
        if variant.impl == "ours":
            raise
        return Prepared({**record, "refused": f"{type(e).__name__}: {e}"})  # before any collective
    record["first_step_s"] = time.perf_counter() - t0
    expected = {name: _common.local(ref[name], variant.layout) for name in _common.TENSORS}
    errors = _common.errors(dict(zip(_common.TENSORS, first)), expected)
    _common.require(errors, f"{variant.name}, causal={causal}, rank {dist.get_rank()}")
    record.update(rel_err=errors, fwd_s=[], fwd_bwd_s=[])
    return Prepared(record, attend, step, (q, k, v))


def measure(prepared: list[Prepared], repeats: int) -> None:
    """Time every variant round-robin (one repeat of each in turn, so that load on the machine
    falls on all of them alike), then measure each one's forward + backward peak memory."""
    ready = [p for p in prepared if p.step is not None]
    for key, fn in (("fwd_s", lambda p: p.attend(*p.qkv)), ("fwd_bwd_s", lambda p: p.step())):
        for p in ready:
            fn(p)  # warm-up
        for _ in range(repeats):
            for p in ready:
                p.record[key].append(time_once(lambda: fn(p)))
    for p in ready:
        dist.barrier()
        p.record["peak_bytes"] = _common.peak_increase(p.step)


def rank_main(rank: int, world: int, opts: dict) -> dict:
    malloc_fixed = _common.malloc_setup()
    torch.set_num_threads(1)
    inputs = global_inputs(opts["seq"])
    runs = []
    for causal in (True, False):
        prepared = [prepare(v, causal, inputs, opts["reference"][causal], opts) for v in variants(causal)]
        measure(prepared, opts["repeats"])
        runs += [p.record for p in prepared]
    return {"rank": rank, "malloc_mmap_forced": malloc_fixed, "runs": runs}


# ---- driving, in the parent ------------------------------------------------------------------


def rows(world: int, ranks: list[dict]) -> list[dict]:
    """One table row per (causal, variant). A repeat's time is the slowest rank's (the ranks
    start together and wait for each other); the table shows the median over repeats, and each
    ratio to torch's best variant is the median over repeats of the ratio within the same round,
    so that a slow spell of the machine, which falls on both, cancels out."""
    out = []
    for i, run in enumerate(ranks[0]["runs"]):
        per_rank = [r["runs"][i] for r in ranks]
        row: dict[str, Any] = {"P": world, "causal": run["causal"], "variant": run["variant"]}
        if "refused" in run:
            out.append({**row, "refused": run["refused"]})
            continue
        for key in ("fwd_s", "fwd_bwd_s"):
            row[key] = [max(times) for times in zip(*(r[key] for r in per_rank))]
        row.update(
            fwd_ms=1e3 * statistics.median(row["fwd_s"]),
            fwd_bwd_ms=1e3 * statistics.median(row["fwd_bwd_s"]),
            peak_mib=max(r["peak_bytes"] for r in per_rank) / _common.MIB,
            rel_err=max(e for r in per_rank for e in r["rel_err"].values()),
        )  # fmt: skip
        out.append(row)

    def paired(a: list[float], b: list[float]) -> list[float]:
        return [x / y for x, y in zip(a, b)]

    for causal in (True, False):
        group = [r for r in out if r["causal"] == causal and "refused" not in r]
        timed = [r for r in group if r["variant"].startswith("torch")]
        best = min(timed, key=lambda r: r["fwd_bwd_ms"])
        best_fwd = min(timed, key=lambda r: r["fwd_ms"])
        for r in group:
            rounds = paired(r["fwd_bwd_s"], best["fwd_bwd_s"])
            r.update(best_torch=best["variant"], vs_best_torch=statistics.median(rounds),
                     vs_best_torch_quartiles=quartiles(rounds),
                     fwd_vs_best_torch=statistics.median(paired(r["fwd_s"], best_fwd["fwd_s"])))  # fmt: skip
    return out


def quartiles(xs: list[float]) -> tuple[float, float]:
    """The first and third quartile: the spread of the per-round ratios around their median."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q3


def table(all_rows: list[dict]) -> str:
    shown = [
        {
            "P": r["P"], "causal": r["causal"],
            "variant": r["variant"] + (" (refused)" if "refused" in r else ""),
            "fwd ms": r.get("fwd_ms"), "fwd+bwd ms": r.get("fwd_bwd_ms"), "peak MiB": r.get("peak_mib"),
            "fwd+bwd / best torch": r.get("vs_best_torch"), "fwd / best torch": r.get("fwd_vs_best_torch"),
            "max rel err": r.get("rel_err"),
        }
        for r in all_rows
    ]  # fmt: skip
    formats = ("", "", "", ".0f", ".0f", ".1f", ".3f", ".3f", ".2g")
    return tabulate(shown, headers="keys", floatfmt=formats, missingval="-")


def target(all_rows: list[dict]) -> tuple[bool | None, dict[str, dict]]:
    """ours / torch's best, forward + backward, at P = 2, causal and not: the median over rounds
    (which the target judges) and the quartiles of the rounds."""
    ratios = {}
    for causal in (True, False):
        name = headline(causal).name
        ours = [r for r in all_rows if r["P"] == 2 and r["causal"] == causal and r["variant"] == name]
        if ours:
            ratios["causal" if causal else "non-causal"] = {
                "median": ours[0]["vs_best_torch"], "quartiles": ours[0]["vs_best_torch_quartiles"]
            }
    if len(ratios) < 2:
        return None, ratios
    return all(x["median"] <= TARGET for x in ratios.values()), ratios


def plot(all_rows: list[dict], worlds: list[int], path: Path) -> None:
    plt = _common.pyplot()
    fig, axes = plt.subplots(len(worlds), 2, figsize=(11, 3.2 * len(worlds)), squeeze=False)
    for ax_row, world in zip(axes, worlds):
        for ax, causal in zip(ax_row, (True, False)):
            group = [r for r in all_rows if r["P"] == world and r["causal"] == causal]
            names = [r["variant"] for r in group]
            values = [r.get("fwd_bwd_ms", 0.0) for r in group]
            colors = ["tab:blue" if n.startswith("ours") else "tab:gray" for n in names]
            bars = ax.barh(names, values, color=colors)
            for bar, r in zip(bars, group):
                label = "refused" if "refused" in r else f"{r['fwd_bwd_ms']:.0f}"
                middle = bar.get_y() + bar.get_height() / 2
                ax.text(bar.get_width(), middle, f" {label}", va="center", fontsize=8)
            ax.invert_yaxis()
            ax.set_title(f"P = {world}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("forward + backward, ms (median; slowest rank)")
            ax.margins(x=0.15)
    n = all_rows[0]["N"]
    fig.suptitle(f"exact ring attention, q/k/v ({BATCH}, {HEADS}, N, {HEAD_DIM}) float32, N = {n}")
    fig.tight_layout()
    _common.save_plot(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, help="global sequence length N (default 8192; 2048 with --quick)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="values of P")
    parser.add_argument("--repeats", type=int, help="timed repeats (default 11; 2 with --quick)")
    parser.add_argument("--compiler", choices=["inductor", "aot_eager"], default="inductor", help="for ours")
    parser.add_argument("--quick", action="store_true", help="a smoke run: N = 2048, 2 repeats")
    parser.add_argument("--out", type=Path, default=_common.RESULTS / "torch_ring.json")
    opts = parser.parse_args(argv)
    seq = opts.seq or (2048 if opts.quick else 8192)
    repeats = opts.repeats or (2 if opts.quick else 11)
    if not _common.can_measure_memory():
        parser.error("measuring peak RSS needs Linux (/proc/self/clear_refs and VmHWM)")
    for world in opts.ranks:
        if world < 2 or seq % (2 * world):
            parser.error(f"P = {world}: need P >= 2 and N = {seq} divisible by 2P (zigzag chunks)")

    print(
        f"exact ring attention, q/k/v ({BATCH}, {HEADS}, N/P, {HEAD_DIM}) float32, N = {seq}, forward and "
        f"forward + backward, median of {repeats}\nours: ring_rewrite, sharded, compiler {opts.compiler}; "
        "torch: _templated_ring_attention(_backward) with the CPU flash kernels, eager\n"
        f"each rank is a process with torch.set_num_threads(1); {os.cpu_count()} cores shared by all P ranks "
        "(more ranks than cores: times of a shared machine, not speeds), gloo on loopback\n",
        flush=True,
    )
    machine = _common.machine(threads=1)  # before the run: the commit measured
    t0 = time.perf_counter()
    refs = {causal: reference(seq, causal) for causal in (True, False)}
    print(f"  float64 reference: {time.perf_counter() - t0:.1f} s", flush=True)
    args = {"seq": seq, "repeats": repeats, "compiler": opts.compiler, "reference": refs}
    all_rows, per_rank = [], {}
    for world in opts.ranks:
        t0 = time.perf_counter()
        per_rank[world] = _common.run_ranks(rank_main, world, args)
        all_rows += [{**r, "N": seq} for r in rows(world, per_rank[world])]
        print(f"  P = {world}: {time.perf_counter() - t0:.1f} s", flush=True)

    print()
    print(table(all_rows))
    refusals = sorted({r["refused"] for r in all_rows if "refused" in r})
    print(
        "\ntimes: median over repeats of the slowest rank's time; peak: rise of peak RSS over RSS "
        "before one forward + backward (inputs excluded), max over ranks;\n/ best torch: median over "
        "repeats of this row's time over the fastest torch variant's in the same round (same P and "
        "mask); max rel err: out, dq, dk, dv against float64, max over ranks\n+balance: torch's "
        "head-tail load balancer (inputs in our zigzag order); without it torch's inputs are contiguous"
    )
    for message in refusals:
        print(f"refused by torch: {message}")
    met, ratios = target(all_rows)
    shown = ", ".join(
        f"{k} {v['median']:.3f}x (rounds' quartiles {v['quartiles'][0]:.3f} to {v['quartiles'][1]:.3f})"
        for k, v in ratios.items()
    )
    print(
        f"\ntarget: ours / torch <= {TARGET} for forward+backward at P = 2, causal and not: "
        f"{shown} -> {_common.verdict(met)}"
    )

    record = {
        "benchmark": "torch_ring",
        "machine": machine,
        "setup": {
            "seq": seq, "batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32",
            "repeats": repeats, "compiler": opts.compiler, "ranks": opts.ranks, "seed": SEED,
            "tolerance": _common.TOLERANCE, "ours": "ring_rewrite.backend(sharding='sharded', layout=...)",
            "torch": "_templated_ring_attention(_backward), CPU flash kernels, eager",
            "reference": "float64 F.scaled_dot_product_attention over the whole sequence",
            "memory": "VmHWM increase over VmRSS before one forward+backward",
        },  # fmt: skip
        "targets": [{"line": f"ours / torch <= {TARGET} for forward+backward at P = 2, causal and not",
                     "ours": {"causal": headline(True).name, "non-causal": headline(False).name},
                     "ratios": ratios, "met": met}],  # fmt: skip
        "rows": all_rows,
        "ranks": {str(world): ranks for world, ranks in per_rank.items()},
    }
    _common.write_json(opts.out, record)
    plot(all_rows, opts.ranks, opts.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
