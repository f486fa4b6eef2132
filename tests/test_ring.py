"""The ring across gloo ranks: numerics against the float64 reference (docs/semantics.md,
Accuracy)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from ranks import run_ranks

BOUND = 1e-5


def _case(rank, world, case, compiler):
    import ring_rewrite
    from ring_rewrite.reference import reference_attention
    from ring_rewrite.report import bytes_sent
    from torch._dynamo.utils import counters

    segs, rates, causal, sharding, layout, hq, hkv, n, *masked = case
    torch.manual_seed(0)
    q = torch.randn(2, hq, n, 16, requires_grad=True)
    k = torch.randn(2, hkv, n, 16, requires_grad=True)
    v = torch.randn(2, hkv, n, 16, requires_grad=True)
    grad_out = torch.randn(2, hq, n, 16)
    mask = _key_padding(masked[0], hq, n) if masked else None
    ref = reference_attention(
        q, k, v, segment_lengths=segs, dilation_rates=rates, is_causal=causal, key_bias=mask
    )
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out.double())

    def attend(q, k, v, mask=None):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=hq != hkv
        )

    options = dict(
        segment_lengths=segs, dilation_rates=rates, sharding=sharding, layout=layout,
        compiler=compiler,
    )  # fmt: skip
    torch._dynamo.reset()
    backend = ring_rewrite.backend(**options)
    compiled = torch.compile(attend, backend=backend, fullgraph=True)
    if sharding == "replicated":
        inputs, expected, dout = (q, k, v), [ref, *ref_grads], grad_out
    else:
        cut = lambda x: ring_rewrite.shard(x.detach(), 2, layout=layout)  # noqa: E731
        inputs = tuple(cut(x).requires_grad_() for x in (q, k, v))
        expected, dout = [cut(x) for x in (ref, *ref_grads)], cut(grad_out)
        if mask is not None:
            mask = ring_rewrite.shard(mask, 3, layout=layout)  # the keys of this rank's shard
    sent = counters["ring_rewrite"]
    sent["bytes_sent"] = 0
    out = compiled(*inputs) if mask is None else compiled(*inputs, mask)
    forward_bytes, sent["bytes_sent"] = sent["bytes_sent"], 0
    grads = torch.autograd.grad(out, inputs, dout)
    errors = [rel_err(a, b) for a, b in zip((out, *grads), expected)]
    assert max(errors) < BOUND, (rank, case, errors)
    # The report's plan is what the P2P ops counted: bytes per rank as planned.
    (record,) = backend.records
    planned = bytes_sent(record.plan)
    assert (forward_bytes, sent["bytes_sent"]) == (planned["forward"], planned["backward"])
    return record.plan


def _key_padding(kind: str, hq: int, n: int) -> torch.Tensor:
    """A key-padding mask over the global sequence: ``"bool"`` keeps ``(2, 1, 1, N)`` keys
    (batch 0 drops its last quarter, batch 1 a stride of keys), ``"float"`` adds a ``(1, Hq, 1,
    N)`` bias with some ``-inf``."""
    if kind == "bool":
        keep = torch.ones(2, 1, 1, n, dtype=torch.bool)
        keep[0, ..., 3 * n // 4 :] = False
        keep[1, ..., 1::5] = False
        return keep
    bias = torch.randn(1, hq, 1, n)
    bias[..., 2::7] = float("-inf")
    return bias


def _cases(rank, world, cases, compiler, chunk_bytes=None):
    if chunk_bytes is not None:
        from ring_rewrite import site_plan

        site_plan.RING_CHUNK_BYTES = chunk_bytes  # this rank's process only
        site_plan.LOCAL_CHUNK_BYTES = chunk_bytes
    for case in cases:
        plan = _case(rank, world, case, compiler)
        if chunk_bytes is not None:
            rings = [b for b in plan.branches if not b.is_local]
            assert rings and all(plan.head_chunks(b) > 1 for b in rings), case
            if chunk_bytes == 1:
                assert all(plan.head_chunks(b) == b.layout.kv_heads for b in rings), case
                # and the local branches' backward one kv head at a time, after the rings', but
                # where they run in place (Note [Local branches in place]: no chunks)
                chunks = 1 if plan.local_in_place else plan.hkv
                assert plan.hkv > 1 and len(plan.local_chunks()) == chunks, case


# (segment_lengths, dilation_rates, causal, sharding, layout, Hq, Hkv, N)
CASES_P2 = [
    (None, None, True, "replicated", "contiguous", 4, 2, 64),
    (None, None, False, "sharded", "zigzag", 4, 4, 64),
    ([16, 64], [1, 2], True, "replicated", "zigzag", 4, 2, 64),
    ([8, 32, 64], [1, 2, 4], False, "sharded", "contiguous", 4, 4, 64),
    ([8, 32, 64], [1, 2, 4], True, "sharded", "zigzag", 8, 2, 64),
    ([16, 64], [1, 2], False, "replicated", "zigzag", 4, 2, 64, "bool"),  # the mask travels
    (None, None, False, "sharded", "contiguous", 4, 4, 64, "float"),
    # Lengths the ranks cannot share as they are: replicated mode pads (Note [Padding the
    # sequence]): 50 -> 64, 96 -> 192 (segments of 32 and 96 fit no shard of 48), 40 -> 64.
    ([16, 64], [1, 2], True, "replicated", "contiguous", 4, 2, 50),
    ([32, 96], [1, 3], True, "replicated", "contiguous", 6, 6, 96),
    ([8, 32], [1, 2], False, "replicated", "contiguous", 4, 4, 40, "bool"),
    # A rate longer than any shard within 4x padding: whole on every rank (Note [Whole on every
    # rank] in passes/rewrite_sdpa.py), no transfer.
    ([16, 1024], [1, 1024], True, "replicated", "contiguous", 2, 2, 100),
]
CASES_P4 = [
    ([8, 32], [1, 2], True, "sharded", "contiguous", 4, 2, 64),  # w < shard: local; w > shard: sub-ring
    ([16, 32], [1, 2], True, "replicated", "contiguous", 4, 4, 64),  # w == shard: local
    ([16, 64], [1, 4], False, "replicated", "zigzag", 4, 2, 64),  # zigzag sub-ring + full ring
    (None, None, True, "sharded", "zigzag", 4, 2, 64),
    ([8, 32, 64], [1, 2, 4], True, "replicated", "zigzag", 4, 4, 64),
    ([8, 32, 64], [1, 2, 4], False, "sharded", "contiguous", 4, 2, 64, "bool"),
    (None, None, False, "replicated", "zigzag", 4, 2, 60),  # padded to 64, the padding masked
]


CHECK = "RING_REWRITE_CHECK_TRANSFERS"


# Inductor is what users run (the default), as they run it; aot_eager is the second column, run
# with every message fingerprinted (Note [Buffers in flight]), as are the head chunks below.
@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
@pytest.mark.parametrize("world, cases", [(2, CASES_P2), (4, CASES_P4)], ids=["P2", "P4"])
def test_ring_matches_reference(world, cases, compiler, monkeypatch):
    monkeypatch.setenv(CHECK, "1" if compiler == "aot_eager" else "0")  # read by the ranks
    run_ranks(world, _cases, cases, compiler)


@pytest.mark.parametrize(
    "world, cases, chunk_bytes", [(2, [CASES_P2[3], CASES_P2[5]], 1), (4, CASES_P4[2:3], 2048)], ids=["P2", "P4"]
)
def test_ring_in_head_chunks_matches_reference(world, cases, chunk_bytes, monkeypatch):
    # Ring branches in head chunks (Note [Head chunks]): at P = 2 as many as the dilated kv heads
    # allow, and with a key mask the local branches' backward in one chunk per kv head (Note
    # [Head chunks of local branches]; without, they run in place); at P = 4 two per ring branch
    # (4 KiB and 8 KiB messages), which compiles in half the time.
    monkeypatch.setenv(CHECK, "1")
    run_ranks(world, _cases, cases, "inductor", chunk_bytes)


def _float64(rank, world):
    """Float64 inputs give float64 accuracy at every P (merges and gradient sums in
    float64, ``numerics.stat_dtype``)."""
    import ring_rewrite
    from ring_rewrite.reference import reference_attention

    for segs, rates, causal, sharding in (
        (None, None, True, "replicated"),
        ([8, 32, 64], [1, 2, 4], False, "sharded"),
    ):
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 4, 64, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
        dout = torch.randn(2, 4, 64, 8, dtype=torch.float64)
        ref = reference_attention(q, k, v, segment_lengths=segs, dilation_rates=rates, is_causal=causal)
        expected = [ref, *torch.autograd.grad(ref, (q, k, v), dout)]
        inputs = (q, k, v)
        if sharding == "sharded":
            inputs = [ring_rewrite.shard(x.detach(), 2).requires_grad_() for x in inputs]
            expected, dout = [ring_rewrite.shard(x, 2) for x in expected], ring_rewrite.shard(dout, 2)
        backend = ring_rewrite.backend(segment_lengths=segs, dilation_rates=rates, sharding=sharding)
        attend = torch.compile(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), backend=backend
        )
        out = attend(*inputs)
        got = [out, *torch.autograd.grad(out, inputs, dout)]
        errors = [rel_err(a, b) for a, b in zip(got, expected)]
        assert max(errors) < 1e-12, (rank, segs, errors)
    # A batch of 0 gives empty results, as SDPA does.
    attend = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend=ring_rewrite.backend())
    q = torch.randn(0, 4, 64, 8, requires_grad=True)
    out = attend(q)
    (grad,) = torch.autograd.grad(out, q, torch.ones_like(out))
    assert out.shape == grad.shape == q.shape


@pytest.mark.parametrize("world", [2, 4])
def test_float64_and_empty_inputs(world, monkeypatch):
    monkeypatch.setenv(CHECK, "1")  # fingerprints of float64 and of empty messages too
    run_ranks(world, _float64)


def _disagree(rank, world, what):
    import ring_rewrite  # noqa: F401

    n = 64 if rank == 0 or what != "length" else 128
    segs = [16, 32] if rank == 0 or what != "config" else [16, 64]
    q = torch.randn(1, 2, n, 8)
    options = {"segment_lengths": segs, "dilation_rates": [1, 2], "compiler": "aot_eager"}
    compiled = torch.compile(
        lambda q: F.scaled_dot_product_attention(q, q, q), backend="ring_dilated", options=options
    )
    with pytest.raises(Exception, match="ranks disagree") as info:
        compiled(q)
    message = str(info.value)
    if what == "length":
        expected = "n=64 on rank 0 but n=128 on rank 1"
    else:
        expected = "branches=[(16, 1, 1), (32, 2, 1)] on rank 0 but branches=[(16, 1, 1), (64, 2, 2)]"
    assert expected in message, message


@pytest.mark.parametrize("what", ["length", "config"])
def test_ranks_that_disagree_fail_with_a_clear_error(what):
    run_ranks(2, _disagree, what)


def _token(site=0, call=0, timeout=20.0):
    """A call's token as ``site_token`` makes it, without the header (comm/calls.py): (site, call id,
    group call, timeout in ms, variant)."""
    return torch.tensor([site, 1000 + call, call, int(timeout * 1000), 0])


def _mixed_gathers(rank, world):
    from ring_rewrite.comm import calls, waiter
    from ring_rewrite.comm.errors import TransferTimeout

    group = torch.distributed.group.WORLD.group_name
    x = torch.full((3,), float(rank), dtype=torch.bfloat16)
    out, _ = torch.ops.ring_rewrite.all_gather_seq(x, _token(), group, world, 7)
    assert out.tolist() == [[0.0] * 3, [1.0] * 3]
    with pytest.raises(RuntimeError, match="mixed transfers: tags \\[7, 8\\]"):
        torch.ops.ring_rewrite.all_gather_seq(x, _token(), group, world, 7 + rank)
    # The same tag in another call is another transfer: the messages never pair; each rank's
    # gather times out naming itself, and the next call's header recovers both.
    with pytest.raises(TransferTimeout, match=f"gather at distance 1 .*call {rank + 1}\\) did not finish"):
        torch.ops.ring_rewrite.all_gather_seq(x, _token(call=rank + 1, timeout=1.0), group, world, 7)
    calls.site_token(0, group, 0, 20_000)
    assert not waiter._PENDING


def test_gathers_in_different_orders_fail_loudly():
    run_ranks(2, _mixed_gathers)


def _different_data(rank, world):
    import ring_rewrite  # noqa: F401

    torch.manual_seed(rank)  # data-parallel style: every rank has its own batch
    q = torch.randn(1, 2, 32, 8)
    compiled = torch.compile(
        lambda q: F.scaled_dot_product_attention(q, q, q),
        backend="ring_dilated",
        options={"compiler": "aot_eager"},
    )
    with pytest.raises(Exception, match="needs the same full sequence on every rank"):
        compiled(q)


def test_replicated_mode_refuses_different_sequences_per_rank():
    run_ranks(2, _different_data)


def _shift(rank, world):
    from ring_rewrite.comm.calls import site_token

    ops = torch.ops.ring_rewrite
    group = torch.distributed.group.WORLD.group_name
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    x, w = torch.full((4,), float(rank + 1)), torch.full((2, 3), -float(rank))
    # Two transfers in flight at once under the same tag in two site calls (the token carries
    # the call), finished in the other order (the backward's dK/dV do so).
    site3, site4 = (site_token(site, group, 0, 20_000) for site in (3, 4))
    assert (site3[0].item(), site4[0].item()) == (3, 4) and site4[2] == site3[2] + 1
    site3 = ops.ring_shift_start([x], site3, group, nxt, prv, 11)
    site4 = ops.ring_shift_start([x, w], site4, group, prv, nxt, 11)
    (b, c), site4 = (lambda got: (got[:2], got[2]))(ops.ring_shift_wait([x, w], site4, 11, []))
    (a,), site3 = (lambda got: (got[:1], got[1]))(ops.ring_shift_wait([x], site3, 11, [x]))
    assert a.tolist() == [float(prv + 1)] * 4 and b.tolist() == [float(nxt + 1)] * 4
    assert c.tolist() == [[-float(nxt)] * 3] * 2
    with pytest.raises(RuntimeError, match=r"site 3, branch 0, step 11, .* is not pending"):
        ops.ring_shift_wait([x], site3, 11, [])


def test_shift_start_and_wait_pair_by_tag():
    run_ranks(3, _shift)


def _freed_by_the_caller(rank, world):
    from torch.profiler import ProfilerActivity, profile

    from ring_rewrite.comm.calls import site_token

    ops = torch.ops.ring_rewrite
    group = torch.distributed.group.WORLD.group_name
    peer = 1 - rank
    # The call's header is exchanged before the profiler starts: gloo's worker thread drops its
    # all_gather (and the header's few bytes) just after waking the caller, sometimes once the
    # profiler has stopped. The transfers below use no worker thread.
    opened = site_token(0, group, 0, 20_000)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        token = opened
        for step in range(3):
            x = torch.full((1 << 18,), float(10 * rank + step))
            token = ops.ring_shift_start([x], token, group, peer, peer, step)
            (got,), token = (lambda out: (out[:1], out[1]))(ops.ring_shift_wait([x], token, step, [x]))
            assert got[0].item() == 10 * peer + step
            del x, got
        del token
    del opened
    # Every byte the transfers allocated was freed by this thread once the last reference here
    # went: no helper thread (the waiter, gloo's) keeps a finished transfer's tensors.
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert sum(e.nbytes() for e in events if e.nbytes() > 0) >= 3 * (1 << 20)
    assert sum(e.nbytes() for e in events) == 0


def test_a_transfers_buffers_are_freed_by_the_caller():
    run_ranks(2, _freed_by_the_caller)


class _StreamWork:
    """A CUDA work as the transport sees one: ``wait()`` orders the caller's stream, and counts."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def wait(self, timeout=None) -> bool:
        self.calls.append(threading.get_ident())
        return True


def _stream_transport(rank, world):
    from ring_rewrite.comm import calls, groups, transfers
    from ring_rewrite.comm.waiter import _PENDING, _WAITER

    ops = torch.ops.ring_rewrite
    group = torch.distributed.group.WORLD.group_name
    posted, waited, waiter_jobs = [], [], []

    def batch_isend_irecv(p2p_ops):
        posted.append([(op.op.__name__, op.peer, op.tag, op.tensor) for op in p2p_ops])
        return [_StreamWork(waited)]

    def waiter(works, timeout):
        waiter_jobs.append([w for w in works if not w.done])

    # Transfers of these (CPU) tensors made to take the CUDA path; the fake group moves nothing.
    transfers._on_stream = lambda x: True
    transfers.dist.batch_isend_irecv = batch_isend_irecv
    _WAITER.wait = waiter
    x = torch.randn(8)
    token = ops.ring_shift_start([x], calls.site_token(0, group, 0, 20_000), group, 0, 0, 5)
    (calls,) = posted
    assert [(name, peer) for name, peer, _, _ in calls] == [("isend", 0), ("irecv", 0)]
    assert calls[0][3] is x  # sent in place: no copy
    # Nothing waits at the start; the pending transfer holds what NCCL reads and writes.
    assert waited == []
    (pending,) = _PENDING.values()
    assert pending.sent[0] is x and pending.received[0] is calls[1][3]
    got, _ = ops.ring_shift_wait([x], token, 5, [])
    # The wait: each work's wait() once, on the calling thread; nothing handed to the waiter thread.
    assert waited == [threading.get_ident()]
    assert all(job == [] for job in waiter_jobs)
    assert not _PENDING
    # The ring's group beside an NCCL group: gloo for the CPU traffic, NCCL for the GPU's.
    groups.dist.get_backend = lambda g=None: "nccl"
    torch.cuda.current_device = lambda: 3
    assert groups._ring_backend(torch.distributed.group.WORLD) == {
        "backend": "cpu:gloo,cuda:nccl", "device_id": torch.device("cuda", 3)
    }


def test_cuda_transfers_wait_on_the_callers_stream_and_hold_their_buffers():
    """Note [The CUDA transport], its calls on the fake process group."""
    run_ranks(1, _stream_transport, backend="fake")


def _wait_on_a_copy(rank, world):
    from ring_rewrite.comm.calls import site_token

    ops = torch.ops.ring_rewrite
    group = torch.distributed.group.WORLD.group_name
    x = torch.full((4,), float(rank))
    token = ops.ring_shift_start([x], site_token(0, group, 0, 20_000), group, 1 - rank, 1 - rank, 5)
    # The wait given another buffer than the start sent (what Note [Buffers in flight] keeps
    # inductor from doing) raises.
    with pytest.raises(RuntimeError, match="tensor 0 reached the wait in another buffer"):
        ops.ring_shift_wait([x.clone()], token, 5, [])


def test_a_wait_on_another_buffer_than_was_sent_raises():
    run_ranks(2, _wait_on_a_copy)


def _fail_mid_step(rank, world):
    from ring_rewrite.comm.calls import site_token
    from ring_rewrite.comm.waiter import _ABANDONED, _PENDING

    ops = torch.ops.ring_rewrite
    group = torch.distributed.group.WORLD.group_name
    peer = 1 - rank
    for call in range(2):
        # A call that raises between a start and its wait (the compute it overlaps failed)...
        x = torch.full((4,), float(10 * call + rank))
        token = ops.ring_shift_start([x], site_token(2, group, 0, 20_000), group, peer, peer, 7)
        if call == 0:
            assert len(_PENDING) == 1
            continue
        # ...leaves nothing behind that breaks the next call of the site: its header recovers it.
        (got, _) = ops.ring_shift_wait([x], token, 7, [])
        assert got.tolist() == [float(10 + peer)] * 4
    assert not _PENDING and not _ABANDONED


def test_a_call_that_failed_mid_step_does_not_break_the_next():
    run_ranks(2, _fail_mid_step)


def _written_in_flight(rank, world):
    from ring_rewrite.comm import transfers
    from ring_rewrite.comm.calls import site_token
    from ring_rewrite.comm.tags import KV, transfer_tag

    assert transfers.checking_transfers()
    ops = torch.ops.ring_rewrite
    group = torch.distributed.group.WORLD.group_name
    x = torch.full((1 << 12,), float(rank))
    tag = transfer_tag(2, KV, 3)
    token = ops.ring_shift_start([x], site_token(1, group, 0, 20_000), group, 1 - rank, 1 - rank, tag)
    if rank == 0:
        torch.distributed.barrier()  # rank 1 has what rank 0 sent; its send is not waited for
        x.add_(1)  # what inductor's memory planner did to a buffer in flight
        with pytest.raises(RuntimeError, match="site 1, branch 2, step 3, K/V, .* written while in flight"):
            ops.ring_shift_wait([x], token, tag, [])
    else:
        ops.ring_shift_wait([x], token, tag, [])
        torch.distributed.barrier()
    # A message that is not what its sender fingerprinted (mis-paired, or written before gloo
    # read it) fails at the receiver.
    fingerprint = transfers._fingerprint
    if rank == 0:
        transfers._fingerprint = lambda t: torch.zeros(2, dtype=torch.int64)
    token = ops.ring_shift_start([x], site_token(1, group, 0, 20_000), group, 1 - rank, 1 - rank, 9)
    transfers._fingerprint = fingerprint
    expected = "differs from what that rank sent" if rank == 1 else "written while in flight"
    with pytest.raises(RuntimeError, match=expected):
        ops.ring_shift_wait([x], token, 9, [])
    torch.distributed.barrier()  # neither rank leaves while the other still reads


def test_checked_transfers_catch_a_buffer_written_in_flight(monkeypatch):
    monkeypatch.setenv(CHECK, "1")
    run_ranks(2, _written_in_flight)


def _dynamic_lengths(rank, world):
    """Replicated mode compiles one graph per bucket of lengths (passes/bucket_lengths.py),
    padded inside and, here, padded again to what the ranks can share; a dilated config in
    sharded mode one per length (its shards hold fixed positions)."""
    import ring_rewrite
    from ring_rewrite.reference import reference_attention

    config = dict(segment_lengths=[16, 64], dilation_rates=[1, 2])
    for sharding, lengths, graphs in (("replicated", (40, 48, 60, 33), 2), ("sharded", (32, 64), 2)):
        torch._dynamo.reset()
        backend = ring_rewrite.backend(**config, sharding=sharding, layout="zigzag")
        attend = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), backend=backend)
        for n in lengths:
            torch.manual_seed(n)
            q, k, v = (torch.randn(1, 4, n, 8, requires_grad=True) for _ in range(3))
            ref = reference_attention(q, k, v, **config)
            expected = [ref, *torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))]
            inputs = (q, k, v)
            if sharding == "sharded":
                cut = lambda x: ring_rewrite.shard(x.detach(), 2, layout="zigzag")  # noqa: E731
                inputs = tuple(cut(x).requires_grad_() for x in inputs)
                expected = [cut(x) for x in expected]
            out = attend(*inputs)
            got = [out, *torch.autograd.grad(out, inputs, torch.ones_like(out))]
            errors = [rel_err(a, b) for a, b in zip(got, expected)]
            assert max(errors) < BOUND, (rank, sharding, n, errors)
        assert len(backend.records) == graphs, (sharding, [r.plan.n for r in backend.records])


def test_dynamic_lengths_across_ranks():
    run_ranks(2, _dynamic_lengths)


# ---- sharded mode: a bucket's plan, run at each shard's real length ------------------------------


def _spy_blocks_and_sends() -> tuple[list, list]:
    """Lists that fill with the (query rows, key rows) of every block call, forward and
    backward, and the shape of every tensor a ring transfer sends."""
    import ring_rewrite.comm.transfers as transfers
    import ring_rewrite.ops as ops

    seen, sent = [], []
    for name, at in (("_block_forward", 0), ("_block_backward", 1)):  # where q and k are

        def spy(*args, _fn=getattr(ops, name), _at=at, **kwargs):
            q, k = (kwargs["q"], kwargs["k"]) if "q" in kwargs else args[_at : _at + 2]
            seen.append((q.shape[2], k.shape[2]))
            return _fn(*args, **kwargs)

        setattr(ops, name, spy)

    def start(group_name, token, xs, *args, _fn=transfers._start):
        sent.extend(tuple(x.shape) for x in xs)
        return _fn(group_name, token, xs, *args)

    transfers._start = start
    return seen, sent


def _sharded_buckets(rank, world, compiler, cases):
    """Exact attention in sharded mode at shard lengths 10 (static), then 12 and 14 (the shard a
    symbol: bucket 16 planned; Note [Padding shards to a bucket]): equal to the float64
    reference, forward and gradients, in two graphs, and every block, forward and backward,
    computes the real rows and keys of its parts only, and every transfer sends them only."""
    import ring_rewrite
    from ring_rewrite.reference import reference_attention

    seen, sent = _spy_blocks_and_sends()
    for layout, causal, masked in cases:
        torch._dynamo.reset()
        backend = ring_rewrite.backend(sharding="sharded", layout=layout, compiler=compiler)
        attend = torch.compile(
            lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal), backend=backend
        )
        for s in (10, 12, 14):
            n, g = world * s, torch.Generator().manual_seed(s)
            q, k, v, dout = (torch.randn(2, 4, n, 8, generator=g) for _ in range(4))
            keep = (torch.rand(2, 1, 1, n, generator=g) > 0.3) | (torch.arange(n) == 0)
            leaves = [x.double().requires_grad_() for x in (q, k, v)]
            ref = reference_attention(*leaves, is_causal=causal, key_bias=keep if masked else None)
            expected = [ref, *torch.autograd.grad(ref, leaves, dout.double())]
            cut = lambda x, dim=2: ring_rewrite.shard(x, dim, layout=layout)  # noqa: E731
            inputs = [cut(x).requires_grad_() for x in (q, k, v)]
            seen.clear()
            sent.clear()
            out = attend(*inputs, cut(keep, 3) if masked else None)
            got = [out, *torch.autograd.grad(out, inputs, cut(dout))]
            errors = [rel_err(a, cut(b)) for a, b in zip(got, expected)]
            assert max(errors) < BOUND, (rank, layout, causal, masked, s, errors)
            # Each part's real rows (s / 2 a part with zigzag), never the bucket's 16 (8).
            parts = 2 if layout == "zigzag" else 1
            assert seen and all(max(rows) <= s and max(rows) % (s // parts) == 0 for rows in seen), (s, seen)
            # K/V, dK/dV (B, H, rows, D) and a key bias (B, H, 1, keys): the shard's real rows.
            assert sent and {x[3] if x[2] == 1 else x[2] for x in sent} == {s}, (s, sent)
        records = backend.records
        assert len(records) == 2 and records[1].plan.n == world * 16, [r.plan.n for r in records]
        assert records[1].reason.startswith(f"a bucket of {world * 16}: reads, sends and computes the real rows only")


@pytest.mark.parametrize(
    "world, compiler, cases",
    [
        (2, "inductor", [("zigzag", True, False), ("contiguous", False, True)]),
        (2, "aot_eager", [("contiguous", True, False), ("zigzag", False, True)]),
        (4, "inductor", [("zigzag", True, False)]),
    ],
    ids=["P2-inductor", "P2-aot_eager", "P4-inductor"],
)
def test_sharded_lengths_run_at_the_shards_real_length(world, compiler, cases):
    run_ranks(world, _sharded_buckets, compiler, cases)


def _replicated_buckets(rank, world, compiler, cases):
    """Exact attention in replicated mode at lengths 20 (static), then 23, 29 and 32 (a symbol:
    bucket 32 planned): each rank takes its shard of the real positions, cut into ``2P`` parts
    (zigzag) of ``ceil(N / 2P)``, the last ones past ``N`` padding (Note [Padding shards to a
    bucket]): equal to the float64 reference, forward and gradients, in two graphs, and every
    block computes, every transfer sends, those rows only."""
    import ring_rewrite
    from ring_rewrite.reference import reference_attention

    seen, sent = _spy_blocks_and_sends()
    for layout, causal, masked in cases:
        torch._dynamo.reset()
        backend = ring_rewrite.backend(layout=layout, compiler=compiler)
        attend = torch.compile(
            lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal), backend=backend
        )
        parts = 2 if layout == "zigzag" else 1
        for n in (20, 23, 29, 32):
            g = torch.Generator().manual_seed(n)
            q, k, v, dout = (torch.randn(2, 4, n, 8, generator=g) for _ in range(4))
            keep = (torch.rand(2, 1, 1, n, generator=g) > 0.3) | (torch.arange(n) == 0)
            leaves = [x.double().requires_grad_() for x in (q, k, v)]
            ref = reference_attention(*leaves, is_causal=causal, key_bias=keep if masked else None)
            expected = [ref, *torch.autograd.grad(ref, leaves, dout.double())]
            inputs = [x.clone().requires_grad_() for x in (q, k, v)]
            seen.clear()
            sent.clear()
            out = attend(*inputs, keep if masked else None)
            got = [out, *torch.autograd.grad(out, inputs, dout)]
            errors = [rel_err(a, b) for a, b in zip(got, expected)]
            assert max(errors) < BOUND, (rank, layout, causal, masked, n, errors)
            each = -(-n // (world * parts))  # a part's rows; the bucket's: 32 / (world * parts)
            assert seen and {max(rows) for rows in seen} == {each * parts}, (n, seen)
            assert sent and {x[3] if x[2] == 1 else x[2] for x in sent} == {each * parts}, (n, sent)
        records = backend.records
        assert len(records) == 2 and records[1].plan.n == 32, [r.plan.n for r in records]
        assert records[1].reason.startswith("a bucket of 32: reads, sends and computes the real rows only")


@pytest.mark.parametrize(
    "compiler, cases",
    [
        ("inductor", [("zigzag", True, False), ("contiguous", False, True)]),
        ("aot_eager", [("contiguous", True, False), ("zigzag", False, True)]),
    ],
)
def test_replicated_lengths_run_at_the_real_length(compiler, cases):
    run_ranks(2, _replicated_buckets, compiler, cases)


def _unequal_shards(rank, world):
    """One graph serves every length of a bucket: ranks whose shards (sharded mode) or
    sequences (replicated mode) differ raise on every rank, naming the lengths, and the next
    call in step goes on."""
    import ring_rewrite

    for sharding, lengths in (("sharded", (10, 12, 14)), ("replicated", (20, 23, 29))):
        torch._dynamo.reset()
        attend = torch.compile(
            lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
            backend=ring_rewrite.backend(sharding=sharding, compiler="aot_eager"),
        )
        first, n, other = lengths
        for s in (first, n):
            attend(torch.ones(1, 2, s, 8))
        with pytest.raises(ValueError, match=rf"of different lengths \(rank 0: {n}, rank 1: {other} real positions"):
            attend(torch.ones(1, 2, other if rank else n, 8))
        assert attend(torch.ones(1, 2, other, 8)).shape == (1, 2, other, 8)


def test_ranks_with_unequal_shards_of_one_bucket_raise():
    run_ranks(2, _unequal_shards)
