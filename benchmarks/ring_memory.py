"""Per-rank peak memory and bytes sent of one rewritten attention site, P = 1, 2, 4 (SPEC §3).

One function calling ``F.scaled_dot_product_attention`` on ``q, k, v`` of shape
``(1, 8, N/P, 64)`` float32, causal, is compiled with the ``ring_dilated`` backend in sharded mode
(each rank creates only its local shard) and run forward + backward once to compile, then once
measured. For each P, P gloo ranks are spawned on this machine.

Memory: the increase of the process's peak RSS (VmHWM) over its RSS just before the measured
step, after resetting the peak (``/proc/self/clear_refs``). The inputs (q, k, v, grad_out) exist
before the step, so the increase is the attention's activation memory: saved tensors, outputs,
gradients and workspace. glibc is told to serve every allocation of 256 KiB or more with mmap
(``mallopt``), so freed tensors go back to the OS and a step cannot hide its allocations in heap
memory freed by the warm-up.

Bytes sent: ``torch._dynamo.utils.counters["ring_rewrite"]["bytes_sent"]``, read and reset around
the forward and around the backward.

    python benchmarks/ring_memory.py                    # exact attention, N = 16384
    python benchmarks/ring_memory.py --config longnet   # segments [N/8, N/4, N/2], rates [1, 2, 4]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
GROUP_TIMEOUT = datetime.timedelta(minutes=5)
BATCH, HEADS, HEAD_DIM = 1, 8, 64
MMAP_THRESHOLD = 256 * 1024
TARGET = 0.35  # SPEC target: attention memory at P=4 <= 0.35x of P=1
MIB = 2**20


# ---- measuring, inside one rank --------------------------------------------------------------


def _status() -> dict[str, int]:
    """VmHWM and VmRSS of this process in bytes (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _malloc_setup() -> bool:
    """Serve large allocations with mmap so that freed memory leaves RSS (glibc only)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h; setting either fixes both (no dynamic threshold)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, MMAP_THRESHOLD)
    )


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _bytes_sent() -> int:
    from torch._dynamo.utils import counters

    sent = counters["ring_rewrite"]["bytes_sent"]
    counters["ring_rewrite"]["bytes_sent"] = 0
    return sent


def _step(compiled, q, k, v, grad_out) -> dict:
    """One forward + backward; memory relative to the RSS just before it."""
    _trim()
    dist.barrier()  # NOTE: outside the ring: every rank starts the step together
    _bytes_sent()
    _reset_peak()
    base = _status()["VmRSS"]
    t0 = time.perf_counter()
    out = compiled(q, k, v)
    t1 = time.perf_counter()
    after_fwd = _status()
    sent_fwd = _bytes_sent()
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    t2 = time.perf_counter()
    after_bwd = _status()
    sent_bwd = _bytes_sent()
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


def _rank(rank: int, world: int, port: int, args: dict, out_dir: str) -> None:
    malloc_fixed = _malloc_setup()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    try:
        import ring_rewrite
        from ring_rewrite.report import attention_memory_bytes, bytes_sent

        n, causal = args["seq"], True
        n_local = n // world
        torch.manual_seed(rank)
        shape = (BATCH, HEADS, n_local, HEAD_DIM)
        q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
        grad_out = torch.randn(shape)
        input_bytes = sum(x.numel() * x.element_size() for x in (q, k, v, grad_out))

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        options = {"sharding": "sharded", "layout": args["layout"], "compiler": args["compiler"]}
        if args["segment_lengths"] is not None:
            options.update(segment_lengths=args["segment_lengths"], dilation_rates=args["dilation_rates"])
        # The backend object is the registered "ring_dilated" backend with these options; it
        # also keeps the site's plan, for the report's own memory and bytes estimates.
        backend = ring_rewrite.backend(**options)
        compiled = torch.compile(attend, backend=backend, fullgraph=True)

        t0 = time.perf_counter()
        warm = _step(compiled, q, k, v, grad_out)  # compiles forward and backward
        warmup_s = time.perf_counter() - t0
        result = _step(compiled, q, k, v, grad_out)
        (site,) = backend.records
        estimate, predicted = attention_memory_bytes(site.plan), bytes_sent(site.plan)
        result.update(
            rank=rank, input_bytes=input_bytes, warmup_s=warmup_s, warmup_peak_bytes=warm["peak_bytes"],
            malloc_mmap_forced=malloc_fixed,
            report_saved_bytes=estimate["saved"],
            report_peak_bytes=estimate["peak"],
            report_sent_fwd_bytes=predicted["forward"], report_sent_bwd_bytes=predicted["backward"],
        )  # fmt: skip
        everyone: list = [None] * world
        dist.all_gather_object(everyone, result)
        if rank == 0:
            Path(out_dir, f"p{world}.json").write_text(json.dumps(everyone))
    finally:
        dist.destroy_process_group()


# ---- driving, in the parent ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, args: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _rank, args=(world, _free_port(), args, out_dir), nprocs=world, join=True,
            start_method="spawn",
        )  # fmt: skip
        return json.loads(Path(out_dir, f"p{world}.json").read_text())


def _machine() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    try:
        # 1 when tracked files differ from HEAD (git diff does not write the index).
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT).returncode == 1
    except OSError:
        dirty = None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads_per_rank": 1,
        "git_commit": commit,
        "git_dirty": dirty,
    }


def _config(name: str, n: int, segments, rates):
    if segments is not None:
        return list(segments), list(rates)
    if name == "exact":
        return None, None
    # LongNet-style: segments N/8, N/4, N/2 with rates 1, 2, 4 ([2048, 4096, 8192] at N = 16384).
    return [n // 8, n // 4, n // 2], [1, 2, 4]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16384, help="global sequence length N")
    parser.add_argument("--config", choices=["exact", "longnet"], default="exact")
    parser.add_argument("--segment-lengths", type=int, nargs="+", help="override --config's segments")
    parser.add_argument("--dilation-rates", type=int, nargs="+", help="with --segment-lengths")
    parser.add_argument("--compiler", choices=["aot_eager", "inductor"], default="aot_eager")
    parser.add_argument("--layout", choices=["contiguous", "zigzag"], default="contiguous")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="values of P")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "ring_memory.json")
    opts = parser.parse_args(argv)
    if not os.path.exists("/proc/self/clear_refs"):
        parser.error("measuring peak RSS needs Linux (/proc/self/clear_refs and VmHWM)")
    if (opts.segment_lengths is None) != (opts.dilation_rates is None):
        parser.error("--segment-lengths and --dilation-rates go together")
    segments, rates = _config(opts.config, opts.seq, opts.segment_lengths, opts.dilation_rates)
    args = {
        "seq": opts.seq, "layout": opts.layout, "compiler": opts.compiler,
        "segment_lengths": segments, "dilation_rates": rates,
    }  # fmt: skip

    config = "exact" if segments is None else f"segments {segments}, rates {rates}"
    print(
        f"ring_dilated, one causal SDPA site, q/k/v ({BATCH}, {HEADS}, N/P, {HEAD_DIM}) float32, "
        f"N = {opts.seq}, {config}, sharded/{opts.layout}, compiler {opts.compiler}\n"
        f"each rank is its own process with torch.set_num_threads(1) (P = 1 too, for comparability); "
        f"{os.cpu_count()} cores shared by all ranks, gloo on loopback\n",
        flush=True,
    )
    machine = _machine()  # before the run: the commit measured
    runs = {}
    for world in opts.ranks:
        if opts.seq % world:
            parser.error(f"N = {opts.seq} is not divisible by P = {world}")
        t0 = time.perf_counter()
        runs[world] = _run(world, args)
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
            "report est. MiB": max(r["report_peak_bytes"] for r in ranks) / MIB,
            "sent fwd MiB": max(r["sent_fwd_bytes"] for r in ranks) / MIB,
            "sent bwd MiB": max(r["sent_bwd_bytes"] for r in ranks) / MIB,
            "fwd s": max(r["time_fwd_s"] for r in ranks),
            "bwd s": max(r["time_bwd_s"] for r in ranks),
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
        "peak / q size = peak in units of one local q tensor; report est. = the rewrite report's "
        "estimate: its 'MiB saved / peak' peak\n"
        f"bytes sent equal the report's prediction on every rank: {'yes' if predicted else 'NO'}"
    )

    verdict = None
    if 1 in runs and 4 in runs:
        ratio = next(r["ratio to P=1"] for r in rows if r["P"] == 4)
        verdict = ratio <= TARGET
        print(
            f"\nSPEC target: attention memory at P=4 <= {TARGET}x of P=1: "
            f"{ratio:.3f}x -> {'met' if verdict else 'NOT met'}"
        )

    opts.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "ring_memory",
        "machine": machine,
        "setup": {
            **args, "batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32",
            "causal": True, "sharding": "sharded", "config": opts.config,
            "malloc_mmap_threshold_bytes": MMAP_THRESHOLD,
            "memory": "VmHWM increase over VmRSS before the measured forward+backward",
        },  # fmt: skip
        "target": {"line": f"attention memory at P=4 <= {TARGET}x of P=1", "met": verdict},
        "bytes_sent_match_report": predicted,
        "rows": rows,
        "ranks": {str(world): ranks for world, ranks in runs.items()},
    }
    opts.out.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {opts.out.relative_to(ROOT) if opts.out.is_relative_to(ROOT) else opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
