"""Soak: a training loop of many small steps at P = 4 with faults injected at random
(docs/ring.md, Faults).

The loop is ``faulty_loop.FaultyLoop``'s, as a user writes one: each step's input derives from
the step number, a step that raises is skipped, no rank runs an extra step or is realigned by
hand, and each step ends with a collective of the user's on the ring's process group. Each step
draws, from a seed every rank shares, whether a fault happens, which (``faulty_loop.FAULTS``:
stalls and whole-process stops of 0.5x to 3x the timeout among them), on which rank and how long.
Sharded exact attention, inductor, two compiled functions a step, and the backward.

Reports faults, steps completed on every rank, steps refused (raised somewhere), silently wrong
steps (completed and not equal to the float64 reference for that step: target 0), fault-free
steps that did not complete everywhere (target 0: the ranks were out of step), the RSS growth
from the first to the last tenth of the run (max over ranks), and the transfers left pending or
abandoned at the end (target 0). Writes ``results/fault_soak.json``.

    python benchmarks/fault_soak.py             # 1000 steps, 5% of them faulty
    python benchmarks/fault_soak.py --quick     # 100 steps
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, for _common
from _common import RESULTS, machine, rss, run_ranks, verdict, write_json  # noqa: E402
from faulty_loop import FAULTS, FaultyLoop  # noqa: E402

WORLD = 4
TIMEOUT = 2.0
TARGETS = {
    "right": "no completed step differs from the float64 reference for that step",
    "in_step": "every fault-free step completes on every rank",
    "pending": "no transfer left pending or abandoned at the end",
}


def _soak(rank: int, world: int, args: dict) -> dict:
    from ring_rewrite.comm.waiter import _ABANDONED, _PENDING

    torch.set_num_threads(1)
    loop = FaultyLoop(rank, world, TIMEOUT)
    loop.step(0)
    outcomes, memory = [], []
    for step, (fault, culprit, scale) in enumerate(_faults(args, world)):
        outcomes.append(loop.step(1 + step, fault, culprit, scale)[:300])
        memory.append(rss()["VmRSS"])
    tenth = max(1, len(memory) // 10)
    return {
        "outcomes": outcomes,
        "rss_growth": sum(memory[-tenth:]) / tenth - sum(memory[:tenth]) / tenth,
        "left_over": len(_PENDING) + len(_ABANDONED),
        "recovered_transfers": torch._dynamo.utils.counters["ring_rewrite"]["recovered_transfers"],
    }


def _faults(args: dict, world: int) -> list[tuple[str | None, int, float]]:
    """Each step's ``(fault or None, culprit rank, scale)``, the same on every rank."""
    draw = random.Random(args["seed"])
    plan = []
    for step in range(args["steps"]):
        fault = draw.choice(FAULTS) if draw.random() < args["rate"] else None
        fault = None if step == args["steps"] - 1 else fault  # the last step leaves nothing pending
        plan.append((fault, draw.randrange(world), draw.uniform(0.5, 3.0)))
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=0.05, help="fraction of faulty steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="100 steps")
    opts = parser.parse_args(argv)
    steps = 100 if opts.quick else opts.steps
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = {"steps": steps, "rate": opts.rate, "seed": opts.seed}
    t0 = time.perf_counter()
    ranks = run_ranks(_soak, WORLD, args)
    elapsed = time.perf_counter() - t0
    faults = [fault for fault, _, _ in _faults(args, WORLD)]
    rows = [[r["outcomes"][s] for r in ranks] for s in range(steps)]
    completed = [s for s, row in enumerate(rows) if all(o == "ok" for o in row)]
    wrong = [s for s, row in enumerate(rows) if any(o.startswith("wrong") or "user's" in o for o in row)]
    out_of_step = [s for s, row in enumerate(rows) if faults[s] is None and s not in completed]
    left_over = sum(r["left_over"] for r in ranks)
    row = {
        "steps": steps,
        "faults": sum(f is not None for f in faults),
        "completed": len(completed),
        "refused": steps - len(completed),
        "silently wrong": len(wrong),
        "fault-free not completed": len(out_of_step),
        "RSS growth MiB (max rank)": f"{max(r['rss_growth'] for r in ranks) / 2**20:.1f}",
        "left pending": left_over,
        "seconds": f"{elapsed:.0f}",
    }
    print(tabulate([row], headers="keys"))
    by_kind = {f: faults.count(f) for f in FAULTS}
    print("faults by kind:", by_kind)
    met = {"right": not wrong, "in_step": not out_of_step, "pending": left_over == 0}
    for key, line in TARGETS.items():
        print(f"{line}: {verdict(met[key])}")
    write_json(RESULTS / "fault_soak.json", {
        "machine": machine(threads=1),
        "config": {**args, "world": WORLD, "timeout_s": TIMEOUT, "faults": FAULTS},
        "result": row,
        "faults_by_kind": by_kind,
        "per_rank": [{k: r[k] for k in ("rss_growth", "left_over", "recovered_transfers")} for r in ranks],
        "outcomes": rows,
        "problems": {s: rows[s] for s in sorted(set(wrong) | set(out_of_step))},
        "targets": [{"line": TARGETS[k], "met": met[k]} for k in TARGETS],
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
