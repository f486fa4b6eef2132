"""Run every benchmark, one process each, then print every target with met / not met.

    python benchmarks/run_all.py                      # everything (about 80 minutes on 2 cores)
    python benchmarks/run_all.py --quick              # small sizes: a smoke run of each script
    python benchmarks/run_all.py --only torch_ring ring_memory

Each benchmark writes ``results/<name>.json`` (and a PNG); this script reads them back and
writes ``results/summary.json``. Each can also run alone: ``python benchmarks/<script>.py``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from tabulate import tabulate

import _common

# name: (script, its arguments, the JSON it writes)
BENCHMARKS = {
    "kernels": ("kernels.py", [], "kernels.json"),
    "single_device": ("single_device.py", [], "single_device.json"),
    "torch_ring": ("torch_ring.py", [], "torch_ring.json"),
    "ring_memory": ("ring_memory.py", [], "ring_memory.json"),
    "ring_memory_longnet": ("ring_memory.py", ["--config", "longnet"], "ring_memory_longnet.json"),
    "ring_comm": ("ring_comm.py", [], "ring_comm.json"),
    "compile_cost": ("compile_cost.py", [], "compile_cost.json"),
    "compile_cost_site": ("compile_cost.py", ["--site"], "compile_cost_site.json"),
    "fault_soak": ("fault_soak.py", [], "fault_soak.json"),
    "scale": ("scale.py", [], "scale.json"),
    "overlap": ("overlap.py", [], "overlap.json"),
    "alibi_accuracy": ("alibi_accuracy.py", [], "alibi_accuracy.json"),
    "decode": ("decode.py", [], "decode.json"),
    "lengths": ("lengths.py", [], "lengths.json"),
    "lengths_sharded": ("lengths.py", ["--ranks", "4"], "lengths_sharded.json"),
    "lengths_replicated": ("lengths.py", ["--ranks", "4", "--sharding", "replicated"], "lengths_replicated.json"),
    "comm_options": ("comm_options.py", [], "comm_options.json"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run these only")
    parser.add_argument("--quick", action="store_true", help="pass --quick to each benchmark")
    opts = parser.parse_args(argv)
    names = opts.only or list(BENCHMARKS)
    here = _common.Path(__file__).resolve().parent
    failed = []
    for name in names:
        script, args, _ = BENCHMARKS[name]
        cmd = [sys.executable, str(here / script), *args, *(["--quick"] if opts.quick else [])]
        print(f"\n==== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        if subprocess.run(cmd, cwd=_common.ROOT).returncode != 0:
            failed.append(name)
        print(f"==== {name}: {time.perf_counter() - t0:.0f} s", flush=True)

    rows = []
    for name in names:
        path = _common.RESULTS / BENCHMARKS[name][2]
        if name in failed or not path.exists():
            rows.append({"benchmark": name, "target": "(did not run)", "result": "-"})
            continue
        record = json.loads(path.read_text())
        for target in record.get("targets", []):
            rows.append({"benchmark": name, "target": target["line"], "result": _common.verdict(target["met"])})
    print("\n" + tabulate(rows, headers="keys"))
    _common.write_json(_common.RESULTS / "summary.json", {
        "machine": _common.machine(), "quick": opts.quick, "failed": failed, "targets": rows,
    })  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
