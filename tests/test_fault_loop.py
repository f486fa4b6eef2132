"""A user's training loop through every fault (docs/ring.md, Faults): each step's input derives
from its number, a step that raises is skipped, and no rank runs an extra step. Every step
without a fault completes and is right on every rank (so the ranks are in step again after
each fault), no completed step is wrong, every fault that must raise everywhere does, and the
user's own collective on the ring's group always gets what its peers sent.

One spawn per world size, inductor, the faults of ``benchmarks/faulty_loop.py`` in turn.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import faulty_loop  # noqa: E402
from faulty_loop import FaultyLoop  # noqa: E402

TIMEOUT = 2.0
# (fault, culprit, scale): the culprit is taken modulo the world size.
PLAN = [
    ("stall", 1, 0.5), ("stall", 1, 3.0), ("sigstop", 0, 1.5), ("block", 1, 1.0),
    ("between", 1, 1.0), ("no_backward", 0, 1.0), ("order", 1, 1.0), ("no_grad", 1, 1.0),
    ("frozen", 0, 1.0), ("slow_recompile", 0, 1.0), ("sigstop", 1, 3.0),
]  # fmt: skip
# Where errors name the two compiled functions' sites: the line of each one's SDPA call.
SITES = [f"faulty_loop.py:{f.__code__.co_firstlineno + 1}" for f in (faulty_loop.first, faulty_loop.second)]
# Faults after which every rank raised, whatever the timing.
EVERYWHERE = {"order", "no_grad", "frozen"}


def _loop(rank, world):
    from ring_rewrite import p2p

    loop = FaultyLoop(rank, world, TIMEOUT)
    outcomes = [loop.step(0)]  # compiles
    for i, (fault, culprit, scale) in enumerate(PLAN):
        outcomes.append(loop.step(1 + 2 * i, fault, culprit % world, scale))
        outcomes.append(loop.step(2 + 2 * i))
    left = len(p2p._PENDING) + len(p2p._ABANDONED)
    everyone = [None] * world
    dist.all_gather_object(everyone, (outcomes, left))
    if rank == 0:
        _check(everyone, world)


def _check(everyone, world):
    problems = []
    for step in range(len(everyone[0][0])):
        row = [outcomes[step] for outcomes, _ in everyone]
        fault = PLAN[(step - 1) // 2][0] if step % 2 else None
        if any(o.startswith("wrong") or "user's all_gather" in o for o in row):
            problems.append(f"step {step} ({fault}): {row}")
        elif fault is None and any(o != "ok" for o in row):
            problems.append(f"step {step}, fault-free after {PLAN[step // 2 - 1][0] if step else 'none'}: {row}")
        elif fault in EVERYWHERE and not all("RingOutOfStep" in o for o in row):
            problems.append(f"step {step} ({fault}) did not raise RingOutOfStep everywhere: {row}")
        elif fault == "order" and not all(all(site in o for site in SITES) for o in row):
            problems.append(f"step {step} (order): the error names not both sites: {row}")
    problems += [f"rank {r}: {left} transfers left" for r, (_, left) in enumerate(everyone) if left]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", [2, 4])
def test_a_training_loop_stays_in_step_through_faults(world):
    run_ranks(world, _loop)
