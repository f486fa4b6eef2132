"""Faults on gloo ranks (docs/semantics.md, Faults): every fault is an error that names itself
within its deadline, on every rank, and the ranks then run the next step correctly.

One spawn of 3 ranks runs the scenarios in turn. A training step calls two compiled variants of
one site (causal, then not) and runs the backward; after each fault every rank runs a healthy
step, checked against the float64 reference, with nothing left pending. A rank that dies gets a
spawn of its own.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import rel_err
from ranks import run_ranks
from ring_rewrite.testing import InjectedFault, in_block_kernel

TIMEOUT = 3.0  # RingDilatedConfig.timeout here, seconds
# A fault surfaces within a transfer's deadline, or twice that for a call's header (where it is
# shortened to that), plus the time the ranks take to get there on a loaded machine.
WITHIN = 2 * TIMEOUT + 10
WORLD = 3


def _attend(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(1, 2, 24, 8, requires_grad=True) for _ in range(3)]


def _step(attend, q, k, v, *, raise_between=False, backward=True, first_causal=True):
    x = attend(q, k, v, first_causal)
    if raise_between:
        raise InjectedFault("raised between two attention calls")
    out = attend(x, k, v, False)
    if backward:
        out.sum().backward()
    return out


def _healthy(attend, what):
    """A step on every rank: right (against the float64 reference), nothing left pending."""
    from ring_rewrite.comm.waiter import _ABANDONED, _PENDING
    from ring_rewrite.reference import reference_attention

    q, k, v = _inputs()
    out = _step(attend, q, k, v)
    grads = [x.grad for x in (q, k, v)]
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    x = reference_attention(q, k, v, is_causal=True)
    ref = reference_attention(x, k.double(), v.double())
    ref.sum().backward()
    assert rel_err(out, ref) < 1e-5, what
    for got, x in zip(grads, (q, k, v)):
        assert rel_err(got, x.grad) < 1e-5, what
    assert not _PENDING and not _ABANDONED, what


def _fails(error, match, fn):
    """``fn()`` raises ``error`` matching ``match``, within ``WITHIN`` seconds (no hang)."""
    t0 = time.monotonic()
    with pytest.raises(error, match=match) as info:
        fn()
    elapsed = time.monotonic() - t0
    assert elapsed < WITHIN, f"{elapsed:.1f} s to fail with: {info.value}"
    return str(info.value)


def _raise(what):
    def fault():
        raise InjectedFault(what)

    return fault


def _scenarios(rank, world, compiler):
    import ring_rewrite
    from ring_rewrite.comm import calls
    from ring_rewrite.comm.errors import RingOutOfStep, TransferTimeout
    from ring_rewrite.comm.groups import ring_group

    attend = torch.compile(_attend, backend=ring_rewrite.backend(compiler=compiler, timeout=TIMEOUT))
    # Compiles both variants, forward and backward. The first call of a graph waits for peers
    # that still compile, whatever the timeout.
    _healthy(attend, "first step")

    # An exception inside a block (rank 1): the others time out on the transfer rank 1 never
    # made, naming it and rank 1.
    q, k, v = _inputs()
    if rank == 1:
        with in_block_kernel(_raise("block failed")):
            _fails(InjectedFault, "block failed", lambda: _step(attend, q, k, v))
    else:
        message = _fails(TransferTimeout, r"transfer site 0, (branch 0, step|gather)", lambda: _step(attend, q, k, v))
        assert re.search(r"\(tag \d+, call \d+\).*to rank \d.*from rank \d", message), message
    _healthy(attend, "after an exception inside a block")

    # A peer that does not arrive in time (rank 1 stalls in a block for longer than the
    # timeout): the others time out naming it; rank 1, late, times out too.
    q, k, v = _inputs()
    if rank == 1:
        with in_block_kernel(lambda: time.sleep(TIMEOUT + 0.5), times=1):
            _fails(TransferTimeout, "did not finish within the 3 s timeout", lambda: _step(attend, q, k, v))
    else:
        _fails(TransferTimeout, "did not finish within the 3 s timeout", lambda: _step(attend, q, k, v))
    _healthy(attend, "after a late peer")

    # A rank raises between two calls and goes on: the others' second call meets its next
    # step's first call. They raise (the step they are in was left); rank 1 waits for them,
    # and its next step is everyone's next step.
    q, k, v = _inputs()
    if rank == 1:
        _fails(InjectedFault, "between", lambda: _step(attend, q, k, v, raise_between=True))
    else:
        message = _fails(RingOutOfStep, "out of step", lambda: _step(attend, q, k, v))
        assert "rank 1: call" in message and "graph variant" in message, message
    _healthy(attend, "after a rank raised between calls")

    # Another branch: rank 2 takes the other compiled variant. Caught at the header, before
    # any transfer.
    q, k, v = _inputs()
    _fails(RingOutOfStep, "graph variant", lambda: _step(attend, q, k, v, first_causal=rank != 2))
    _healthy(attend, "after ranks took different variants")

    # A rank skips its backward: the others' backward meets its next forward. They raise;
    # rank 0 waits for them.
    q, k, v = _inputs()
    if rank == 0:
        _step(attend, q, k, v, backward=False)
    else:
        _fails(RingOutOfStep, "backward", lambda: _step(attend, q, k, v))
    _healthy(attend, "after a rank skipped its backward")

    # A rank skips a whole step: the others' last step waits for it in a header, which times
    # out (after HEADER_TIMEOUT, shortened here); the group is then unusable, and says so at once.
    calls.HEADER_TIMEOUT = 2 * TIMEOUT
    if rank == 0:
        time.sleep(2 * TIMEOUT + 2)
        # Completes the others' abandoned header, so that gloo can shut down.
        header = torch.zeros(8, dtype=torch.int64)
        dist.all_gather([torch.empty_like(header) for _ in range(world)], header, group=ring_group(dist.group.WORLD))
    else:
        _fails(TransferTimeout, r"header of site 0 \(forward\)", lambda: _healthy(attend, "skipped"))
        _fails(RuntimeError, "can no longer be used", lambda: _healthy(attend, "broken"))
    dist.barrier()


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
def test_faults_name_themselves_and_the_next_step_works(compiler):
    run_ranks(WORLD, _scenarios, compiler)


def _dies(rank, world):
    import ring_rewrite

    attend = torch.compile(_attend, backend=ring_rewrite.backend(compiler="aot_eager", timeout=TIMEOUT))
    _healthy(attend, "first step")
    q, k, v = _inputs()
    if rank == 1:
        with in_block_kernel(lambda: os._exit(0)):
            _step(attend, q, k, v)
    _fails(RuntimeError, "site 0", lambda: _step(attend, q, k, v))
    _fails(RuntimeError, "site 0", lambda: _step(attend, q, k, v))
    # NOTE: the group is unusable now, and a survivor's helper thread may still be waiting for a
    # message the others will never send: tearing gloo down under it can abort the process.
    # A job restarts here (torchrun); the test leaves as such a rank would.
    os._exit(0)


def test_a_rank_that_dies_fails_the_others_by_name():
    run_ranks(WORLD, _dies)
