"""A training loop as a user writes it, with faults: the loop ``tests/test_faults.py`` and
``fault_soak.py`` run on gloo ranks (docs/ring.md, Faults).

Each step's input derives from the step number; a step that raises is recorded and the loop
goes on with the next one, with no extra or skipped step for the rank that faulted. A step
runs two compiled functions with the same plans (``first`` and ``second``: sharded exact
attention, inductor), then the backward, then a collective of the user's on the ring's own
process group. Every step that completes is checked against the float64 reference for that
step: a rank that paired its step with a peer's other step would be off by far more.

Faults, each on one rank (the *culprit*) unless said otherwise:

* ``stall``: the culprit's block sleeps 0.5x to 3x the timeout (its peers may time out),
* ``sigstop``: the whole culprit process is stopped for 0.5x to 3x the timeout, gloo included,
* ``block``: the culprit's block kernel raises,
* ``between``: the culprit raises between the two calls and goes on,
* ``no_backward``: the culprit skips its backward,
* ``order``: the culprit calls the two compiled functions in the other order (on consecutive
  steps: an order of its own that persists),
* ``no_grad``: the culprit runs the step under ``torch.no_grad()`` (a recompile on it alone),
* ``frozen``: the culprit's ``q`` does not require grad (a recompile on it alone),
* ``slow_recompile``: every rank runs a new length (a recompile everywhere), the culprit
  after sleeping 3x the timeout.

``block``, ``between`` and ``no_backward`` make the culprit leave its step where no transfer of
the ring fails: its peers learn of it only at its next call, so a collective of the user's before
that call would wait for peers that wait for it in the ring (docs/ring.md, Faults); those steps
skip the user's collective.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

FAULTS = (
    "stall", "sigstop", "block", "between", "no_backward", "order", "no_grad", "frozen",
    "slow_recompile",
)  # fmt: skip
_OUTSIDE = ("block", "between", "no_backward")  # the culprit leaves a step outside a transfer
N = 32  # tokens of a step's sequence


def first(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def second(q, k, v):
    return F.scaled_dot_product_attention(q, k, v) * 0.5


def inputs(step: int, n: int = N) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(1, 2, n, 8, generator=g) for _ in range(3)]


def expected(step: int, n: int = N) -> torch.Tensor:
    """The step's whole output, in float64 (``ring_rewrite.reference_attention``)."""
    from ring_rewrite.reference import reference_attention

    q, k, v = (x.double() for x in inputs(step, n))
    return reference_attention(reference_attention(q, k, v, is_causal=True), k, v) * 0.5


def _stop_me(seconds: float) -> None:
    """Stop this whole process (every thread, gloo's included) for ``seconds``."""
    subprocess.Popen(["sh", "-c", f"kill -STOP {os.getpid()}; sleep {seconds}; kill -CONT {os.getpid()}"])
    time.sleep(0.5)  # stopped within it


class FaultyLoop:
    """The loop on one rank: ``step(step, fault, culprit, scale, backward)`` runs one step and
    returns what happened (``"ok"``, ``"wrong <error>"`` or the exception's type and message).
    ``backward=False`` makes the step forward only, on every rank."""

    def __init__(self, rank: int, world: int, timeout: float, compiler: str = "inductor") -> None:
        import ring_rewrite

        self.rank, self.world, self.timeout = rank, world, timeout
        backend = ring_rewrite.backend(compiler=compiler, timeout=timeout, sharding="sharded")
        self.first, self.second = torch.compile(first, backend=backend), torch.compile(second, backend=backend)

    def step(
        self, step: int, fault: str | None = None, culprit: int = 0, scale: float = 1.0, backward: bool = True
    ) -> str:
        import ring_rewrite
        from ring_rewrite.testing import InjectedFault, in_block_kernel

        mine = fault is not None and self.rank == culprit
        n = 2 * N if fault == "slow_recompile" else N
        q, k, v = (ring_rewrite.shard(x, 2).clone().requires_grad_() for x in inputs(step, n))
        outcome = "ok"
        try:
            with contextlib.ExitStack() as stack:
                if mine and fault == "stall":
                    stack.enter_context(in_block_kernel(lambda: time.sleep(scale * self.timeout), times=1))
                if mine and fault == "sigstop":
                    stack.enter_context(in_block_kernel(lambda: _stop_me(scale * self.timeout), times=1))
                if mine and fault == "block":
                    stack.enter_context(in_block_kernel(_raise, times=1))
                if mine and fault == "no_grad":
                    stack.enter_context(torch.no_grad())
                if mine and fault == "frozen":
                    q = q.detach()
                if mine and fault == "slow_recompile":
                    time.sleep(3 * self.timeout)
                if mine and fault == "order":  # its headers name the other function's site
                    out = self.first(self.second(q, k, v), k, v)
                else:
                    x = self.first(q, k, v)
                    if mine and fault == "between":
                        raise InjectedFault("raised between the two calls")
                    out = self.second(x, k, v)
                if backward and torch.is_grad_enabled() and not (mine and fault == "no_backward"):
                    out.sum().backward()
            want = ring_rewrite.shard(expected(step, n), 2)
            error = ((out.double() - want).abs().max() / want.abs().max()).item()
            if not error < 1e-4:
                outcome = f"wrong {error:.2f}"
        except Exception as error:  # noqa: BLE001  (recorded: the loop goes on, as a user's does)
            outcome = f"{type(error).__name__}: {error}"
        if fault not in _OUTSIDE:
            # The user's own collective on the process group the ring was given.
            steps = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(steps, torch.tensor([step]))
            if any(int(s) != step for s in steps):
                outcome += f"; the user's all_gather at step {step} got {[int(s) for s in steps]}"
        return outcome


def _raise():
    from ring_rewrite.testing import InjectedFault

    raise InjectedFault("block failed")
