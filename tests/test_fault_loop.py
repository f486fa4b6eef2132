"""A user's training loop through every fault (docs/ring.md, Faults): each step's input derives
from its number, a step that raises is skipped, and no rank runs an extra step. Every step
without a fault completes and is right on every rank (so the ranks are in step again after
each fault), no completed step is wrong, every fault that must raise everywhere does, and the
user's own collective on the ring's group always gets what its peers sent.

One spawn per world size, inductor: the two compiled functions called in the other order on
one rank from the first step after the compile on, with the backward; then the faults of
``benchmarks/faulty_loop.py`` in turn; then the swapped order again in a forward-only loop.
Then, on headers alone, which ranks wait and which raise when the ranks' headers differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ranks import run_ranks
from ring_rewrite.comm.calls import _header
from ring_rewrite.comm.state import BACKWARD, CALL, FAILED, FORWARD, _GroupState
from ring_rewrite.comm.waiter import _ABANDONED, _PENDING

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
# One rank calls the two functions in the other order on consecutive steps, where the ranks
# have not yet seen a step follow the last one (the first steps, the first forward-only steps).
SWAPPED = [("order", 1, 1.0)] * 3
FAULT_FREE = (None, 0, 1.0)
# Each step's (fault, culprit, scale, backward): step 0 compiles.
STEPS = [
    (*FAULT_FREE, True),
    *((*fault, True) for fault in SWAPPED), (*FAULT_FREE, True),
    *((*x, True) for fault in PLAN for x in (fault, FAULT_FREE)),
    (*FAULT_FREE, False), *((*fault, False) for fault in SWAPPED), (*FAULT_FREE, False),
    (*FAULT_FREE, True),
]  # fmt: skip
# Where errors name the two compiled functions' sites: the line of each one's SDPA call.
SITES = [f"faulty_loop.py:{f.__code__.co_firstlineno + 1}" for f in (faulty_loop.first, faulty_loop.second)]
# Faults after which every rank raised, whatever the timing.
EVERYWHERE = {"order", "no_grad", "frozen"}


def _loop(rank, world):
    loop = FaultyLoop(rank, world, TIMEOUT)
    outcomes = [
        loop.step(step, fault, culprit % world, scale, backward)
        for step, (fault, culprit, scale, backward) in enumerate(STEPS)
    ]
    left = len(_PENDING) + len(_ABANDONED)
    everyone = [None] * world
    dist.all_gather_object(everyone, (outcomes, left))
    if rank == 0:
        _check(everyone)


def _check(everyone):
    problems = []
    for step, (fault, _, _, backward) in enumerate(STEPS):
        row = [outcomes[step] for outcomes, _ in everyone]
        what = f"step {step} ({fault or 'fault-free'}{'' if backward else ', forward only'})"
        if any(o.startswith("wrong") or "user's all_gather" in o for o in row):
            problems.append(f"{what}: {row}")
        elif fault is None and any(o != "ok" for o in row):
            problems.append(f"{what}, after {STEPS[step - 1][0] if step else 'the compile'}: {row}")
        elif fault in EVERYWHERE and not all("RingOutOfStep" in o for o in row):
            problems.append(f"{what} did not raise RingOutOfStep everywhere: {row}")
        elif fault == "order" and not all(all(site in o for site in SITES) for o in row):
            problems.append(f"{what}: the error names not both sites: {row}")
    problems += [f"rank {r}: {left} transfers left" for r, (_, left) in enumerate(everyone) if left]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", [2, 4])
def test_a_training_loop_stays_in_step_through_faults(world):
    run_ranks(world, _loop)


# Calls as headers key them, (site, direction, graph variant): two compiled functions A and B
# (and C), forward and backward.
A, B, C = ((0, FORWARD, variant) for variant in (1, 2, 3))
A_BACK, B_BACK = ((0, BACKWARD, variant) for variant in (1, 2))


def _headers(*calls):
    """One header per rank at the same call: a key, or ``("failed", key)`` (``_announce``)."""
    rows = []
    for call in calls:
        kind, key = (FAILED, call[1]) if call[0] == "failed" else (CALL, call)
        rows.append(_header(_GroupState(call=7), kind, *key))
    return torch.stack(rows)


@pytest.mark.parametrize(
    "history, headers, waiting",
    [
        # One rank calls the functions in the other order: no rank left a step, every rank raises.
        pytest.param([A, B], (A, B), [], id="swapped after one forward-only step"),
        pytest.param([A, B, B_BACK, A_BACK], (A, B), [], id="swapped after one training step"),
        pytest.param(
            [A, B, B_BACK, A_BACK, A, B], (A, B), [], id="swapped in the first forward-only step"
        ),
        pytest.param([A, B, C, None, B], (C, A), [], id="three swapped, a call agreed after one that differed"),
        pytest.param([A, B], (A, B, B, B), [], id="swapped at P = 4"),
        # A rank left the step and began the next one: it waits, the others raise.
        pytest.param([A], (B, A), [1], id="raised between the calls"),
        pytest.param([A], (B, A, B, B), [1], id="raised between the calls at P = 4"),
        pytest.param([A, B], (A, B_BACK), [0], id="skipped its backward"),
        pytest.param([A, B], (("failed", B), A), [1], id="a peer announced a failed call"),
        # The last call closes a step: every rank raises.
        pytest.param([A, B, A, B], (A, B), [], id="swapped after two steps"),
    ],
)
def test_who_waits_when_headers_differ(history, headers, waiting):
    """``_GroupState.waiting`` on headers alone, after the calls every rank opened together
    (``None``: a round whose headers differed)."""
    state = _GroupState()
    for key in history:
        if key is None:
            state.diverged(_headers(A, B))
        else:
            state.learn(key, closed=True)
    assert state.waiting(_headers(*headers)) == waiting
