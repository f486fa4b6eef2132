"""What every benchmark here shares: timing, peak memory, gloo ranks, the float64 check, the
machine record, output.

Each benchmark is a script (``python benchmarks/<name>.py``) that imports this module, prints a
``tabulate`` table, and writes ``results/<name>.json`` (with :func:`machine`) and, where a plot
helps, ``results/<name>.png``. Before it measures an attention, it checks that attention, under the
compiler and at the size and P it measures, against float64 (see "checks" below).
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
MIB = 2**20
GROUP_TIMEOUT = datetime.timedelta(minutes=5)
MMAP_THRESHOLD = 256 * 1024
TOLERANCE = 1e-5  # max rel_err of a float32 output or gradient against the float64 reference
TENSORS = ("out", "dq", "dk", "dv")
REFERENCE_SCORES = 256 * MIB  # bytes of one (B, H, query_chunk, N) float64 block of the reference


# ---- time ------------------------------------------------------------------------------------


def median_time(
    fn: Callable[[], Any], repeats: int, warmup: int = 1, between: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` calls; with
    ``between``, what it returns before each timed call (untimed) under ``"between"``."""
    for _ in range(warmup):
        fn()
    times, seen = [], []
    for _ in range(repeats):
        if between is not None:
            seen.append(between())
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "times_s": times, "between": seen}


def cuda_seconds(fn: Callable[[], Any]) -> float:
    """Seconds of one ``fn()`` on the current CUDA stream, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """This process's float32 ``torch.mm`` rate (GFLOP/s) at the current thread count: the peak
    that attention's useful FLOP/s are compared against."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = median_time(lambda: torch.mm(a, b), repeats, warmup=2)["median_s"]
    return 2 * n**3 / t / 1e9


# ---- memory (Linux) --------------------------------------------------------------------------


def rss() -> dict[str, int]:
    """VmHWM (peak) and VmRSS of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> None:
    """Reset VmHWM to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def malloc_setup() -> bool:
    """Serve allocations of 256 KiB or more with mmap, so that freed tensors leave RSS and a step
    cannot hide its allocations in heap memory an earlier step freed (glibc only)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h; setting either fixes both
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, MMAP_THRESHOLD)
    )


def trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_increase(fn: Callable[[], Any]) -> int:
    """Bytes the process's peak RSS rises above its RSS just before ``fn()`` while it runs."""
    trim()
    reset_peak()
    base = rss()["VmRSS"]
    result = fn()
    peak = rss()["VmHWM"] - base
    del result
    return peak


def allocated_peak(fn: Callable[[], Any]) -> int:
    """Bytes the CPU allocator's live total rises to above its level before ``fn()`` while it
    runs: the running sum of ``torch.profiler``'s memory events. Bytes allocated, written or not
    (RSS counts a page only once written: ``peak_increase`` can read lower)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    del result
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def can_measure_memory() -> bool:
    return os.path.exists("/proc/self/clear_refs")


# ---- ranks -----------------------------------------------------------------------------------


def ring_sent() -> int:
    """Bytes this process's ring sent since the last call (the ``bytes_sent`` counter, then reset)."""
    from torch._dynamo.utils import counters

    sent = counters["ring_rewrite"]["bytes_sent"]
    counters["ring_rewrite"]["bytes_sent"] = 0
    return sent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: Any, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    try:
        result = fn(rank, world, args)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, result)
        if rank == 0:
            Path(out_dir, "ranks.json").write_text(json.dumps(everyone))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[[int, int, Any], dict], world: int, args: Any) -> list[dict]:
    """Run ``fn(rank, world, args)`` on ``world`` spawned gloo ranks; return each rank's dict.

    ``fn`` must be a module-level function (spawn pickles it by name).
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _rank_main, args=(world, free_port(), fn, args, out_dir), nprocs=world, join=True,
            start_method="spawn",
        )  # fmt: skip
        return json.loads(Path(out_dir, "ranks.json").read_text())


# ---- checks against float64 -----------------------------------------------------------------


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max-abs error / max-abs value (docs/semantics.md, Accuracy)."""
    expected = expected.double()
    scale = expected.abs().max().clamp_min(1e-30)
    return ((actual.double() - expected).abs().max() / scale).item()


def sequence_inputs(shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    """q, k, v, grad_out of the whole sequence from ``seed``: the same in every process."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(4)]


def local(x: torch.Tensor, layout: str) -> torch.Tensor:
    """This rank's shard of a whole-sequence ``(B, H, N, D)`` tensor, as its own contiguous tensor."""
    import ring_rewrite

    return ring_rewrite.shard(x, 2, layout=layout).clone(memory_format=torch.contiguous_format)


def forward_backward(attend: Callable[..., torch.Tensor], q, k, v, grad_out) -> dict[str, torch.Tensor]:
    """``out, dq, dk, dv`` of ``attend(q, k, v)`` for the output gradient ``grad_out`` (``q, k, v``
    require grad)."""
    out = attend(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return dict(zip(TENSORS, (out.detach(), *grads)))


def reference(q, k, v, grad_out, **options: Any) -> dict[str, torch.Tensor]:
    """:func:`forward_backward` of ``ring_rewrite.reference.reference_attention(q, k, v,
    **options)`` in float64 (``options``: ``segment_lengths``, ``dilation_rates``, ``is_causal``).

    The queries go ``query_chunk`` at a time, forward and backward, so that one block of scores
    stays within ``REFERENCE_SCORES`` bytes whatever N.
    """
    from ring_rewrite.reference import reference_attention

    b, h, n, _ = q.shape
    chunk = max(1, REFERENCE_SCORES // (8 * b * h * n))
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    attend = lambda q, k, v: reference_attention(q, k, v, query_chunk=chunk, **options)  # noqa: E731
    return forward_backward(attend, q, k, v, grad_out.double())


def errors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """:func:`rel_err` of each of ``got``'s tensors against ``expected``'s."""
    return {name: rel_err(x, expected[name]) for name, x in got.items()}


def ring_errors(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], layout: str
) -> dict[str, float]:
    """:func:`rel_err` over the whole sequence of all ranks' ``out, dq, dk, dv`` (this rank's
    shards in ``got``) against ``expected``, the whole sequence's. Each rank reads only its shard
    of ``expected``; the max-abs errors and values are all-reduced, so every rank gets the same
    errors."""
    import torch.distributed as dist

    import ring_rewrite

    stats = []
    for name, x in got.items():
        y = ring_rewrite.shard(expected[name], 2, layout=layout)
        stats.append(torch.stack([(x.double() - y).abs().max(), y.abs().max()]))
    stats = torch.stack(stats).nan_to_num(nan=float("inf"))
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {name: (err / scale.clamp_min(1e-30)).item() for name, (err, scale) in zip(got, stats)}


def require(errors: dict[str, float], what: str) -> None:
    """Raise if an error is above ``TOLERANCE`` (or NaN)."""
    bad = {name: e for name, e in errors.items() if not e <= TOLERANCE}
    if bad:
        raise AssertionError(f"{what}: rel. error against float64 {bad} > {TOLERANCE}")


# ---- the record ------------------------------------------------------------------------------


# The vector ISAs a CPU kernel's speed depends on, as /proc/cpuinfo names them (recorded if present).
ISAS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "avx2", "fma", "avx", "sse4_2", "asimd", "sve")


def machine(threads: int | None = None) -> dict[str, Any]:
    """Where and on what the numbers were taken (read before the run: the commit measured)."""

    def git(*cmd: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True)
        except OSError:
            return None

    head = git("rev-parse", "HEAD")
    dirty = git("diff", "--quiet", "HEAD", "--")  # exit 1 when tracked files differ from HEAD
    cpu, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        cpu, flags = info.get("model name"), set(info.get("flags", "").split())
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "isa": [isa for isa in ISAS if isa in flags],
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": threads,
        "git_commit": head.stdout.strip() if head and head.returncode == 0 else None,
        "git_dirty": dirty.returncode == 1 if dirty else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "NOT met")


def described(record: dict[str, Any]) -> str:
    """One line naming the CPU a ``machine()`` record was taken on, for the tables."""
    threads = f", {record['threads']} threads" if record.get("threads") else ""
    return f"CPU: {record.get('cpu')} ({' '.join(record.get('isa') or []) or 'no vector ISA read'}){threads}, torch {record.get('torch')}"


def write_json(path: Path, record: dict[str, Any]) -> None:
    """Write ``record``; where it holds a ``machine`` record, the CPU it names is printed with the table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    if isinstance(record.get("machine"), dict):
        print(described(record["machine"]))
    print(f"wrote {_shown(path)}")


def save_plot(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {_shown(path)}")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
