"""What every benchmark here shares: timing, peak memory, gloo ranks, the machine record, output.

Each benchmark is a script (``python benchmarks/<name>.py``) that imports this module, prints a
``tabulate`` table, and writes ``results/<name>.json`` (with :func:`machine`) and, where a plot
helps, ``results/<name>.png``.
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


# ---- time ------------------------------------------------------------------------------------


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> dict[str, Any]:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "times_s": times}


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


def can_measure_memory() -> bool:
    return os.path.exists("/proc/self/clear_refs")


# ---- ranks -----------------------------------------------------------------------------------


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


# ---- the record ------------------------------------------------------------------------------


def machine(threads: int | None = None) -> dict[str, Any]:
    """Where and on what the numbers were taken (read before the run: the commit measured)."""

    def git(*cmd: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True)
        except OSError:
            return None

    head = git("rev-parse", "HEAD")
    dirty = git("diff", "--quiet", "HEAD", "--")  # exit 1 when tracked files differ from HEAD
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": threads,
        "git_commit": head.stdout.strip() if head and head.returncode == 0 else None,
        "git_dirty": dirty.returncode == 1 if dirty else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "NOT met")


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
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
