"""Padding to a length bucket costs nothing: a step at a length between powers of two, compiled
once per bucket, against the same step compiled for exactly that length.

    python benchmarks/lengths.py            # N = 4,097 .. 8,192, exact and LongNet configs, both sites
    python benchmarks/lengths.py --quick    # N = 257 .. 512: a smoke run
    python benchmarks/lengths.py --lengths 32769 40000 49152 56000 65536 --configs longnet   # past 32k

One site on ``(1, 8, N, 64)`` float32, forward and backward, inductor, one process: ``causal``,
``F.scaled_dot_product_attention(q, k, v, is_causal=True)``, or ``padded``, a dense causal mask
with the last ``N / 16`` keys masked, built from a keep-mask ``(1, N)`` as transformers builds
one for a row of a padded batch. Per config and site two compiled functions:

* ``bucketed``: ``dynamic=True``, the length a symbol; the ``length_buckets`` pass pads it to its
  power-of-two bucket (the mask rebuilt at the bucket), and the site's blocks compute only the
  real rows, exact attention at the real length (Note [Padding to a bucket]): one graph per
  bucket;
* ``specialised``: ``dynamic=False``, one graph per length, no padding.

At each length the two run interleaved, a warm-up step each (the specialised one compiles there)
then ``REPEATS`` timed steps, medians; and dense SDPA, eager (aten's CPU flash kernel), for the
plot (up to ``--dense-max``). The peak RSS rise of one step of each is measured after the timed steps (glibc serving buffers of 256 KiB or more by ``mmap``, so that freed tensors leave RSS). Check: the bucketed
output and gradients equal the specialised ones within 1e-5 (the same function in float32).
Targets: a bucketed step's time and peak rise within ``TARGET`` of the specialised one's at every
length. Graphs: the frames dynamo compiled for each function over all lengths.

``--ranks 4``: the same on 4 gloo ranks in sharded mode, zigzag, exact attention. The whole
batch, ``inputs_embeds (1, N, 3 * 8 * 64)`` (q, k and v side by side) and the ``attention_mask``
of a row padded by ``N / 16`` tokens, is cut by ``shard_batch``: ``buckets="shards"`` for the
bucketed function (each rank's shard, a symbol: the site is planned for its bucket and runs
at the shard's real length: Note [Padding shards to a bucket]), ``buckets=False`` for the
specialised one;
the site is the ``padded`` one (a dense causal mask with the shard's key mask, as transformers
builds it). Each step runs between barriers; rank 0's medians; the peak rise is the largest of
any rank's. The LongNet config reads positions (its segments) and is not padded per shard: in
sharded mode ``shard_batch(buckets=True)`` pads it whole, computed. ``--sharding replicated``:
every rank takes the whole batch (the default mode), the bucketed site cuts its shard from the
real positions (Note [Padding shards to a bucket]).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, for _common
from _common import (  # noqa: E402
    MIB,
    RESULTS,
    MMAP_THRESHOLD,
    can_measure_memory,
    machine,
    malloc_setup,
    peak_increase,
    pyplot,
    rel_err,
    run_ranks,
    save_plot,
    verdict,
    write_json,
)

import ring_rewrite  # noqa: E402,F401  (registers the backend)

HEADS, HEAD_DIM = 8, 64
THREADS = 2
REPEATS = 3
TARGET = 1.15
LENGTHS = [4097, 5000, 6144, 7000, 8192]
QUICK_LENGTHS = [257, 300, 384, 450, 512]
CONFIGS = {  # name: (segment_lengths, dilation_rates); None is exact attention
    "exact": None,
    "longnet": ([1024, 4096, 16384], [1, 4, 16]),
}
MASKS = ("causal", "padded")  # is_causal; or a dense causal mask with the keys of a padded row masked
PADDED = 16  # a padded row's last N / PADDED keys are masked
QUICK_DIVISOR = 32  # --quick: LongNet segments 32, 128, 512


def _site(q, k, v, keep=None):
    """Causal attention; with ``keep (B, N)``, the keys it masks masked too, by a dense mask as
    transformers builds one for a padded batch."""
    if keep is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal[None, None] & keep[:, None, None, :])


def _functions(config):
    """The bucketed and the specialised compiled site of ``config``: distinct code objects, so
    that dynamo keeps their graphs apart."""
    options = {} if config is None else {"segment_lengths": config[0], "dilation_rates": config[1]}

    def bucketed(*args):
        return _site(*args)

    def specialised(*args):
        return _site(*args)

    return {
        "bucketed": torch.compile(bucketed, backend="ring_dilated", options=options, dynamic=True),
        "specialised": torch.compile(specialised, backend="ring_dilated", options=options, dynamic=False),
    }


def _inputs(n: int, padded: bool, seed: int = 0):
    """``q, k, v`` (leaves), ``dout`` and, ``padded``, the keep-mask ``(1, n)`` of a row padded
    by ``n // PADDED`` tokens."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, HEADS, n, HEAD_DIM, generator=g) for _ in range(4))
    keep = []
    if padded:
        keep = [torch.ones(1, n, dtype=torch.bool)]
        keep[0][:, n - n // PADDED :] = False
    return [x.requires_grad_() for x in (q, k, v)], dout, keep


def _step(fn, leaves, dout, keep):
    out = fn(*leaves, *keep)
    grads = torch.autograd.grad(out, leaves, dout)
    return [out.detach(), *grads]


def measure(n: int, padded: bool, functions: dict, graphs: dict, dense: bool = True) -> dict:
    """One length: time, peak rise and the check, bucketed against specialised, and (``dense``)
    dense SDPA."""
    steps = {**functions, **({"dense SDPA": _site} if dense else {})}
    # NOTE: inputs of their own for each function (the same values): dynamo marks the inputs of
    # a dynamic=True call dynamic, and the specialised function would then compile them so too.
    inputs = {name: _inputs(n, padded) for name in steps}
    results, times = {}, {name: [] for name in steps}
    for name, fn in steps.items():  # the warm-up step: the specialised one compiles here
        before = counters["frames"]["ok"]
        results[name] = _step(fn, *inputs[name])
        if name in graphs:
            graphs[name] += counters["frames"]["ok"] - before
    for _ in range(REPEATS):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            _step(fn, *inputs[name])
            times[name].append(time.perf_counter() - t0)
    peaks = {name: peak_increase(lambda fn=fn, name=name: _step(fn, *inputs[name])) for name, fn in functions.items()}
    return _row({"N": n, "bucket": 1 << (n - 1).bit_length()}, results, times, peaks)


def _row(where: dict, results: dict, times: dict, peaks: dict) -> dict:
    """One length's row: ``where`` it ran, then time, peak rise and the check, bucketed against
    specialised (and dense SDPA's time, where it ran)."""
    check = max(rel_err(a, b) for a, b in zip(results["bucketed"], results["specialised"]))
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        **where,
        "bucketed s": median["bucketed"],
        "specialised s": median["specialised"],
        "dense SDPA s": median.get("dense SDPA"),
        "time ratio": median["bucketed"] / median["specialised"],
        "bucketed peak MiB": peaks["bucketed"] / MIB,
        "specialised peak MiB": peaks["specialised"] / MIB,
        "peak ratio": peaks["bucketed"] / max(peaks["specialised"], 1),
        "check": check,
        "times_s": times,
    }


def _sharded_functions(sharding: str):
    """The bucketed and the specialised site of ``measure_sharded``, exact attention across the
    ranks, zigzag: ``(embeds (1, s, 3 * H * D), keep (1, s)) -> out (1, H, s, D)``."""
    backend = ring_rewrite.backend(sharding=sharding, layout="zigzag", timeout=600.0)

    def site(embeds, keep):
        q, k, v = embeds.unflatten(2, (3, HEADS, HEAD_DIM)).permute(2, 0, 3, 1, 4)
        return _site(q, k, v, keep.bool())

    def bucketed(*args):
        return site(*args)

    def specialised(*args):
        return site(*args)

    return {
        "bucketed": torch.compile(bucketed, backend=backend, dynamic=True),
        "specialised": torch.compile(specialised, backend=backend, dynamic=False),
    }


def _sharded_inputs(n: int, buckets) -> tuple:
    """This rank's ``[embeds]`` (a leaf), ``dout`` and ``[keep]`` of ``n`` tokens, cut by
    ``shard_batch`` (``buckets`` None: the whole batch, replicated mode's)."""
    g = torch.Generator().manual_seed(n)
    keep = torch.ones(1, n, dtype=torch.long)
    keep[:, n - n // PADDED :] = 0
    whole = {"inputs_embeds": torch.randn(1, n, 3 * HEADS * HEAD_DIM, generator=g), "attention_mask": keep}
    batch = whole if buckets is None else ring_rewrite.shard_batch(whole, layout="zigzag", buckets=buckets)
    embeds = batch["inputs_embeds"].requires_grad_()
    dout = torch.randn(1, HEADS, embeds.shape[1], HEAD_DIM, generator=g)
    return [embeds], dout, [batch["attention_mask"]]


def _on_rank(rank: int, world: int, args: tuple[list[int], str]) -> dict:
    """``measure_sharded`` of every length (``args``: the lengths and the sharding) on this rank;
    rank 0's results."""
    lengths, sharding = args
    malloc_setup()
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(lengths))
    functions = _sharded_functions(sharding)
    graphs = dict.fromkeys(functions, 0)
    runs = [measure_sharded(n, functions, graphs, sharding) for n in lengths]
    return {"runs": runs, "graphs": graphs}


def measure_sharded(n: int, functions: dict, graphs: dict, sharding: str) -> dict:
    """One length on every rank: time, peak rise and the check, bucketed against specialised."""
    buckets = {"bucketed": "shards", "specialised": False} if sharding == "sharded" else dict.fromkeys(functions)
    inputs = {name: _sharded_inputs(n, buckets[name]) for name in functions}
    results, times = {}, {name: [] for name in functions}

    def step(name):
        dist.barrier()
        t0 = time.perf_counter()
        result = _step(functions[name], *inputs[name])
        dist.barrier()
        return result, time.perf_counter() - t0

    for name in functions:  # the warm-up step: the specialised one compiles here
        before = counters["frames"]["ok"]
        results[name] = step(name)[0]
        graphs[name] += counters["frames"]["ok"] - before
    for _ in range(REPEATS):
        for name in functions:
            times[name].append(step(name)[1])
    peaks = {}
    for name in functions:
        rise = torch.tensor(peak_increase(lambda name=name: step(name)), dtype=torch.float64)
        dist.all_reduce(rise, op=dist.ReduceOp.MAX)
        peaks[name] = rise.item()
    pieces = 2 * dist.get_world_size()  # zigzag's parts: a replicated rank's shard of its real positions
    shard = results["specialised"][0].shape[2] if sharding == "sharded" else -(-n // pieces) * 2
    return _row({"N": n, "shard": shard, "bucket": 1 << (shard - 1).bit_length()}, results, times, peaks)


def _plot(rows: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4))
    for ax, (name, runs) in zip(axes if len(rows) > 1 else [axes], rows.items()):
        for key, label in (("bucketed s", "ours, bucketed"), ("specialised s", "ours, specialised"),
                           ("dense SDPA s", "dense SDPA (eager)")):  # fmt: skip
            points = [(r["N"], r[key]) for r in runs if r[key] is not None]
            ax.plot([n for n, _ in points], [t for _, t in points], marker="o", label=label)
        ax.set_title(f"{name}: (1, {HEADS}, N, {HEAD_DIM}) float32, forward + backward", fontsize=9)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("seconds per step")
        ax.legend()
    save_plot(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", help=f"sequence lengths (default {LENGTHS})")
    parser.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS}, segments / {QUICK_DIVISOR}")
    parser.add_argument("--masks", nargs="+", choices=MASKS, default=list(MASKS), help="the sites: is_causal, a padded row's dense mask")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--dense-max", type=int, default=16384, help="dense SDPA (the plot's third line) up to this N")
    parser.add_argument("--ranks", type=int, default=1, help="gloo ranks: more than 1 runs zigzag, exact attention")
    parser.add_argument("--sharding", choices=["sharded", "replicated"], default="sharded", help="with --ranks: the mode")
    parser.add_argument("--out", type=Path, help="the JSON (default results/lengths.json, lengths_<sharding>.json with --ranks)")
    opts = parser.parse_args(argv)
    opts.out = opts.out or RESULTS / ("lengths.json" if opts.ranks == 1 else f"lengths_{opts.sharding}.json")
    if not can_measure_memory():
        parser.error("measuring peak RSS needs Linux (/proc/self/clear_refs and VmHWM)")
    lengths = opts.lengths or (QUICK_LENGTHS if opts.quick else LENGTHS)
    configs = {
        name: None if c is None else ([w // QUICK_DIVISOR for w in c[0]] if opts.quick else c[0], c[1])
        for name, c in CONFIGS.items()
        if name in opts.configs
    }
    malloc_fixed = malloc_setup()  # freed tensors leave RSS: a step's peak is its own
    torch.set_num_threads(THREADS)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(lengths))
    os.environ.setdefault("RING_REWRITE_CPU_KERNEL", "ours")  # no kernel measurement inside a timed step
    record_machine = machine(threads=THREADS)
    runs, graphs = {}, {}
    if opts.ranks > 1:
        configs = {"exact": None}
        name = f"exact, padded, {opts.ranks} ranks {opts.sharding}"
        print(f"{name}: {'shard_batch, ' if opts.sharding == 'sharded' else ''}zigzag", flush=True)
        result = run_ranks(_on_rank, opts.ranks, (lengths, opts.sharding))[0]
        runs[name], graphs[name] = result["runs"], result["graphs"]
    for config_name, config in configs.items() if opts.ranks == 1 else ():
        for mask in opts.masks:
            name = f"{config_name}, {mask}"
            print(f"{name}: {config or 'exact attention'}", flush=True)
            torch._dynamo.reset()  # the functions' code objects are the same for every site
            functions = _functions(config)
            graphs[name] = dict.fromkeys(functions, 0)
            runs[name] = [measure(n, mask == "padded", functions, graphs[name], n <= opts.dense_max) for n in lengths]
    table = [
        {"config": name, **{k: v for k, v in r.items() if k != "times_s"}} for name, rs in runs.items() for r in rs
    ]
    print()
    print(tabulate(table, headers="keys", floatfmt=".3g"))
    where = f"one process, {THREADS} threads" if opts.ranks == 1 else f"{opts.ranks} gloo ranks, 1 thread each, rank 0's"
    print(
        f"\n{where}; medians of {REPEATS} steps (forward + backward), interleaved; "
        "peak: RSS high-water rise of one step; check: bucketed vs specialised, max-abs error over max-abs value"
    )
    for name, g in graphs.items():
        print(f"graphs compiled, {name}: bucketed {g['bucketed']}, specialised {g['specialised']}")
    checked = all(r["check"] <= 1e-5 for rs in runs.values() for r in rs)
    time_met = all(r["time ratio"] <= TARGET for rs in runs.values() for r in rs)
    peak_met = all(r["peak ratio"] <= TARGET for rs in runs.values() for r in rs)
    where = "one process"
    if opts.ranks > 1:
        cut = "sharded through shard_batch" if opts.sharding == "sharded" else "replicated"
        where = f"{opts.ranks} gloo ranks, {cut}, exact attention"
    lines = [
        (f"{where}: a bucketed step's time within {TARGET}x of the step compiled for its length, every length", time_met),
        (f"{where}: its peak RSS rise within {TARGET}x", peak_met),
    ]
    print()
    for line, met in lines:
        print(f"target: {line}: {verdict(met)}")
    record = {
        "benchmark": "lengths",
        "ranks": opts.ranks,
        "sharding": opts.sharding if opts.ranks > 1 else None,
        "machine": record_machine,
        "shape": {"heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32", "is_causal": True, "padded": f"N // {PADDED} keys"},
        "configs": {name: c for name, c in configs.items()},
        "runs": runs,
        "graphs": graphs,
        "malloc_mmap_forced": malloc_fixed,
        "malloc_mmap_threshold_bytes": MMAP_THRESHOLD,
        "targets": [{"line": line, "met": met} for line, met in lines],
        "checked": checked,
    }
    write_json(opts.out, record)
    _plot(runs, opts.out.with_suffix(".png"))
    return 0 if checked else 1


if __name__ == "__main__":
    sys.exit(main())
