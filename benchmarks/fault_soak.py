"""Soak: many small training steps at P = 4 with faults injected at random (docs/semantics.md,
Faults).

Every step runs two compiled variants of one site (causal, then not; replicated exact attention,
a ring of 4 ranks, inductor) and the backward, on one fixed ``(1, 2, 32, 8)`` float32 input. Each
step draws, from a seed every rank shares, whether a fault happens, which, and on which rank:

* ``block``: the rank's block kernel raises (the others time out on its transfer),
* ``late``: the rank stalls in a block for longer than the timeout,
* ``between``: the rank raises between the two calls and goes on (the others, out of step),
* ``variant``: the rank takes the other compiled variant,
* ``no_backward``: the rank skips its backward.

A rank whose fault puts it a call ahead (``between``, ``no_backward``) also runs the one step
that fails out of step on it, so that the ranks' loops stay aligned. A step is *lost* when any
rank raised in it; a fault *recovered* when the next step, if fault-free, is right on every
rank (and no fault-free step is lost). Every step
that raised nowhere is checked against the float64 reference (max-abs error / max-abs value).

Reports steps, faults, faults recovered, steps lost, wrong outputs, the RSS growth from the
first to the last tenth of the run (max over ranks), and the transfers left pending or
abandoned at the end (must be 0). Writes ``results/fault_soak.json``.

    python benchmarks/fault_soak.py             # 1000 steps, 5% of them faulty
    python benchmarks/fault_soak.py --quick     # 100 steps
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, for _common
from _common import RESULTS, TOLERANCE, machine, rel_err, rss, run_ranks, verdict, write_json  # noqa: E402

from ring_rewrite.testing import InjectedFault, in_block_kernel  # noqa: E402

WORLD = 4
TIMEOUT = 2.0
FAULTS = ("block", "late", "between", "variant", "no_backward")
TARGETS = {
    "recovered": "every fault recovers: the next step is right on every rank",
    "pending": "no transfer left pending or abandoned at the end",
    "right": "every step that raised nowhere matches the float64 reference",
}


def _attend(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(1, 2, 32, 8, requires_grad=True) for _ in range(3)]


def _raise():
    raise InjectedFault("block failed")


def _step(attend, fault: str | None, mine: bool) -> torch.Tensor:
    q, k, v = _inputs()
    with contextlib.ExitStack() as stack:
        if mine and fault == "block":
            stack.enter_context(in_block_kernel(_raise, times=1))
        if mine and fault == "late":
            stack.enter_context(in_block_kernel(lambda: time.sleep(TIMEOUT + 0.5), times=1))
        x = attend(q, k, v, not (mine and fault == "variant"))
        if mine and fault == "between":
            raise InjectedFault("raised between the calls")
        out = attend(x, k, v, False)
        if mine and fault == "no_backward":
            return None
        out.sum().backward()
    return torch.cat([out.detach().flatten(), *(t.grad.flatten() for t in (q, k, v))])


def _expected() -> torch.Tensor:
    from ring_rewrite.reference import reference_attention

    q, k, v = (t.detach().double().requires_grad_() for t in _inputs())
    out = reference_attention(reference_attention(q, k, v, is_causal=True), k, v)
    out.sum().backward()
    return torch.cat([out.detach().flatten(), *(t.grad.flatten() for t in (q, k, v))])


def _soak(rank: int, world: int, args: dict) -> dict:
    import ring_rewrite
    from ring_rewrite import p2p

    torch.set_num_threads(1)
    attend = torch.compile(_attend, backend=ring_rewrite.backend(timeout=TIMEOUT))
    expected = _expected()
    draw = random.Random(args["seed"])
    outcomes, errors, memory = [], [], []
    for step in range(args["steps"]):
        fault = draw.choice(FAULTS) if step > 0 and draw.random() < args["rate"] else None
        culprit = draw.randrange(world)
        mine = fault is not None and rank == culprit
        try:
            got = _step(attend, fault, mine)
            outcome = "ok"
            if got is not None:
                errors.append(rel_err(got, expected))
        except Exception as error:  # noqa: BLE001  (recorded)
            outcome = type(error).__name__
        if mine and fault in ("between", "no_backward"):
            try:  # the step it is now a call ahead in: it fails out of step
                _step(attend, None, False)
            except p2p.RingOutOfStep:
                pass
        outcomes.append(outcome)
        memory.append(rss()["VmRSS"])
    tenth = max(1, len(memory) // 10)
    return {
        "outcomes": outcomes,
        "max_error_ok_steps": max(errors, default=0.0),
        "rss_growth": sum(memory[-tenth:]) / tenth - sum(memory[:tenth]) / tenth,
        "left_over": len(p2p._PENDING) + len(p2p._ABANDONED),
        "recovered_transfers": torch._dynamo.utils.counters["ring_rewrite"]["recovered_transfers"],
    }


def _faults(args: dict, world: int) -> list[str | None]:
    draw = random.Random(args["seed"])
    faults = []
    for step in range(args["steps"]):
        fault = draw.choice(FAULTS) if step > 0 and draw.random() < args["rate"] else None
        draw.randrange(world)
        faults.append(fault)
    return faults


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
    faults = _faults(args, WORLD)
    lost = [s for s in range(steps) if any(r["outcomes"][s] != "ok" for r in ranks)]
    faulty = [s for s, f in enumerate(faults) if f is not None]
    # A fault followed by a fault-free step: recovered if that step is right on every rank.
    followed = [s for s in faulty if s + 1 < steps and faults[s + 1] is None]
    recovered = [s for s in followed if all(r["outcomes"][s + 1] == "ok" for r in ranks)]
    unexplained = [s for s in lost if faults[s] is None]
    max_error = max(r["max_error_ok_steps"] for r in ranks)
    left_over = sum(r["left_over"] for r in ranks)
    row = {
        "steps": steps,
        "faults": len(faulty),
        "recovered": f"{len(recovered)} of {len(followed)}",
        "steps lost": len(lost),
        "lost without a fault": len(unexplained),
        "max error (ok steps)": f"{max_error:.1e}",
        "RSS growth MiB (max rank)": f"{max(r['rss_growth'] for r in ranks) / 2**20:.1f}",
        "left pending": left_over,
        "seconds": f"{elapsed:.0f}",
    }
    print(tabulate([row], headers="keys"))
    by_kind = {f: sum(1 for s in faulty if faults[s] == f) for f in FAULTS}
    print("faults by kind:", by_kind)
    met = {
        "recovered": len(recovered) == len(followed) and not unexplained,
        "pending": left_over == 0,
        "right": max_error < TOLERANCE,
    }
    for key, line in TARGETS.items():
        print(f"{line}: {verdict(met[key])}")
    write_json(RESULTS / "fault_soak.json", {
        "machine": machine(threads=1),
        "config": {**args, "world": WORLD, "timeout_s": TIMEOUT, "faults": FAULTS},
        "result": row,
        "faults_by_kind": by_kind,
        "per_rank": [{k: r[k] for k in ("rss_growth", "left_over", "recovered_transfers")} for r in ranks],
        "outcomes": [[r["outcomes"][s] for r in ranks] for s in range(steps)],
        "targets": [{"line": TARGETS[k], "met": met[k]} for k in TARGETS],
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
