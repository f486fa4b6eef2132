"""``comm="all_to_all"``: sequence shards exchanged for head shards and back (Note [Heads across
ranks]), against the float64 reference at P = 2 and 4 under inductor, with gradients."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import ring_rewrite
from ring_rewrite.program import Exchange, Gather, build
from ring_rewrite.reference import reference_attention
from ring_rewrite.report import attention_memory_bytes, bytes_sent
from ring_rewrite.site_plan import SitePlan

from conftest import rel_err
from ranks import run_ranks

BOUND = 1e-5  # float32 (docs/semantics.md, Accuracy)
N, D = 64, 8
# (segment_lengths, dilation_rates, is_causal, query heads per rank, kv heads per rank)
CASES = [(None, None, True, 2, 2), ([16, 64], [1, 2], False, 2, 1), ([16, 32, 64], [1, 2, 4], True, 4, 2)]


def _sdpa(q, k, v, *, is_causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1])


def _case(
    rank: int, world: int, compiler: str, layout: str, seg, rates, causal: bool, hq: int, hkv: float, a2a=None,
    sharding="sharded", n=N, mesh=False,
) -> None:  # fmt: skip
    """``hq`` (and ``hkv``) heads per rank of an all-to-all group (of ``a2a`` ranks, or all);
    in replicated mode every rank holds the whole sequence. ``mesh``: the hybrid's group given as
    a 2-D ``(ring, a2a)`` DeviceMesh, which sets ``a2a_ranks``."""
    g = torch.Generator().manual_seed(7)
    group = a2a or world
    q, dout = (torch.randn(2, hq * group, n, D, generator=g, dtype=torch.float64) for _ in range(2))
    kv_heads = round(hkv * group)
    k, v = (torch.randn(2, kv_heads, n, D, generator=g, dtype=torch.float64) for _ in range(2))
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    shared = (hq * group) // kv_heads  # query heads per kv head
    expected = reference_attention(
        whole[0], whole[1].repeat_interleave(shared, 1), whole[2].repeat_interleave(shared, 1),
        segment_lengths=seg, dilation_rates=rates, is_causal=causal,
    )  # fmt: skip
    expected.backward(dout)
    replicated = sharding == "replicated"
    cut = (lambda x: x) if replicated else (lambda x: ring_rewrite.shard(x, 2, layout=layout))  # noqa: E731
    whole_of = (lambda x: x) if replicated else (lambda x: ring_rewrite.unshard(x, 2, layout=layout))  # noqa: E731
    local = [cut(x.float()).requires_grad_() for x in (q, k, v)]
    comm = "all_to_all" if a2a is None else "hybrid"
    options = dict(sharding=sharding, layout=layout, comm=comm, a2a_ranks=a2a, compiler=compiler, timeout=60)
    if mesh:
        options.update(group=init_device_mesh("cpu", (world // a2a, a2a), mesh_dim_names=("ring", "a2a")), a2a_ranks=None)
    if seg is not None:
        options.update(segment_lengths=seg, dilation_rates=rates)
    backend = ring_rewrite.backend(**options)
    torch._dynamo.reset()  # every case compiles with its own backend
    counters.clear()
    out = torch.compile(lambda *x: _sdpa(*x, is_causal=causal), backend=backend)(*local)
    sent_forward = counters["ring_rewrite"]["bytes_sent"]
    out.backward(cut(dout.float()))
    (record,) = backend.records
    assert record.rewritten and record.plan.exchanged and record.plan.comm == comm, record
    assert record.plan.kv_copies == max(1, group // kv_heads), record.plan
    assert bytes_sent(record.plan) == {"forward": sent_forward, "backward": counters["ring_rewrite"]["bytes_sent"] - sent_forward}
    for graph, names in (("forward", ["q", "k", "v", "out"]), ("backward", ["dout", "dq", "dk", "dv"])):
        moved = [s for s in getattr(record, f"{graph}_program").transfers() if isinstance(s, (Exchange, Gather))]
        # Replicated mode takes its heads' shard where it lies and gathers the results.
        assert [s.tensor for s in moved] == (names[1:] if graph == "backward" else names[3:]) if replicated else names
    assert record.plan.pad == (-n) % (2 * world), record.plan  # replicated mode pads to cut evenly
    what = (compiler, layout, seg, rates, causal, world, a2a, sharding, n)
    assert rel_err(whole_of(out.detach()), expected.detach()) < BOUND, what
    for name, x, ref in zip("qkv", local, whole):
        assert rel_err(whole_of(x.grad), ref.grad) < BOUND, (name, *what)


def _layouts(world: int) -> list[tuple[str, tuple]]:
    """Every case in both layouts at P = 2; at P = 4 (its compiles cost twice) each in one."""
    if world == 2:
        return [(layout, case) for layout in ("contiguous", "zigzag") for case in CASES]
    return [(("contiguous", "zigzag")[j % 2], case) for j, case in enumerate(CASES)]


def _cases(rank: int, world: int, compiler: str) -> None:
    for layout, case in _layouts(world):
        _case(rank, world, compiler, layout, *case)
    # One query head a rank, at rate 2 (rank j's head keeps offset j % 2), and one key/value head
    # for them all: copied to every rank (kv_copies = P).
    _case(rank, world, compiler, "zigzag", [16, 64], [1, 2], True, 1, 1 / world)
    _refused(rank, world)


def _refused(rank: int, world: int) -> None:
    """A site the all-to-all cannot carry is an error naming comm='ring', on every rank."""
    torch._dynamo.reset()
    q = torch.randn(1, 2 * world + 1, N // world, D)  # heads the ranks cannot share
    compiled = torch.compile(
        lambda q: F.scaled_dot_product_attention(q, q, q),
        backend=ring_rewrite.backend(sharding="sharded", comm="all_to_all", compiler="aot_eager", timeout=60),
    )
    with pytest.raises(Exception, match="comm='ring'"):
        compiled(q)
    # Replicated mode leaves such a site alone, saying why, as any site it cannot rewrite.
    torch._dynamo.reset()
    backend = ring_rewrite.backend(sharding="replicated", comm="all_to_all", compiler="aot_eager", timeout=60)
    torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend=backend)(torch.randn(1, 2 * world + 1, N, D))
    (record,) = backend.records
    assert not record.rewritten and "comm='ring'" in record.reason, record


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_matches_the_reference_under_inductor(world):
    run_ranks(world, _cases, "inductor")


def test_all_to_all_matches_the_reference_under_aot_eager():
    run_ranks(2, _cases, "aot_eager")


def _plan(**fields) -> SitePlan:
    base = dict(
        batch=1, hq=8, hkv=4, n=256, d=16, dv=16, dtype=torch.float32, scale=0.25, is_causal=True,
        has_mask=False, branches=((256, 1),), world=4, rank=1, sharding="sharded", comm="all_to_all",
    )  # fmt: skip
    return SitePlan.build(**{**base, **fields})


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(hq=6, hkv=6), "6 query heads are not a multiple of 4"),
        (dict(dropout=0.1), "does not carry dropout"),
    ],
    ids=["heads", "dropout"],
)
def test_what_the_all_to_all_cannot_carry_is_an_error(fields, match):
    with pytest.raises(ValueError, match=match):
        _plan(**fields)


def test_an_all_to_all_site_attends_its_heads_over_the_whole_sequence():
    """The inner plan: the whole sequence for H / P heads, every branch local; the site saves
    its exchanged q, k, v beside the inner out and lse, and sends (P - 1) / P of each tensor."""
    plan = _plan(branches=((64, 1), (256, 2)))
    inner = plan.inner
    assert (inner.world, inner.n_local, inner.hq, inner.hkv) == (1, 256, 2, 1)
    assert all(b.is_local for b in plan.branches) and plan.branches == inner.branches
    shard = 64 * 16 * 4  # one head's shard of 64 tokens, float32
    qkv = (8 + 4 + 4) * shard
    assert attention_memory_bytes(plan)["saved"] == qkv + 2 * 256 * (16 * 4 + 4)
    pieces = {"forward": (8 + 4 + 4 + 8) * shard, "backward": (8 + 8 + 4 + 4) * shard}
    # to each of the 3 other ranks its quarter of every tensor, each message with its 8-byte tag
    assert bytes_sent(plan) == {g: 3 * (b // 4 + 4 * 8) for g, b in pieces.items()}


def test_a_key_bias_is_exchanged_with_the_inputs():
    """A masked site's key bias goes to heads with q, k, v (one wide, every query head) and is
    saved as exchanged; the inner plan keeps the mask, the band and the documents."""
    plan = _plan(has_mask=True, band=(-8, 0), documents="eq")
    assert (plan.inner.has_mask, plan.inner.band, plan.inner.documents) == (True, (-8, 0), "eq")
    forward = build(plan, "forward").transfers()
    assert [s.tensor for s in forward] == ["q", "k", "v", "bias", "out"]
    assert forward[3].shape == (1, 8, 64, 1) and forward[3].to == "heads"
    assert [s.tensor for s in build(plan, "backward").transfers()] == ["dout", "dq", "dk", "dv"]
    unmasked = _plan()
    bias = 64 * 8 * 4  # this rank's 64 keys for 8 query heads, float32
    assert bytes_sent(plan)["forward"] - bytes_sent(unmasked)["forward"] == 3 * (bias // 4 + 8)
    assert attention_memory_bytes(plan)["saved"] - attention_memory_bytes(unmasked)["saved"] == bias


def _masked(rank: int, world: int, a2a=None) -> None:
    """Key-padding masks, windows, ALiBi's key bias and packed documents through the exchange,
    each rank holding its shard of the padding, positions or ids (``test_masks``' cases; 4 heads)."""
    from test_masks import SHARDED_DOCUMENTS, _check, _check_documents

    comm = dict(comm="all_to_all" if a2a is None else "hybrid", a2a=a2a)
    dilated = ([16, 64], [1, 2])  # 4 / a2a heads a rank: at 1, odd ranks hold offset 1
    kinds = [
        ("hf_causal", dilated, "zigzag"), ("hf_window", (None, None), "contiguous"),
        ("alibi_key", dilated, "zigzag"), ("two_sided", dilated, "contiguous"),
    ]  # fmt: skip
    few = a2a is not None or world > 2  # P = 4 compiles cost twice: two kinds, one of documents
    for kind, (segs, rates), layout in kinds[:2] if few else kinds:
        _check(kind, segs, rates, "inductor", world=world, rank=rank, sharding="sharded", layout=layout, **comm)
    for name in ("hf-packed",) if few else ("hf-packed", "doc-window", "hf-blocks"):
        build, data = SHARDED_DOCUMENTS[name]
        _check_documents(
            build, data(2, 64), *dilated, "inductor", world=world, rank=rank, n=64, sharding="sharded",
            layout="zigzag", **comm,
        )  # fmt: skip


@pytest.mark.parametrize("world", [2, 4])
def test_masks_and_documents_through_the_all_to_all_match_the_reference(world):
    run_ranks(world, _masked)


# ---- replicated mode -----------------------------------------------------------------------------


def _replicated(rank: int, world: int, a2a) -> None:
    """Every rank holds the whole sequence: it takes its heads' shard where it lies, and the
    results are gathered (no exchange); with GQA, a kv head copied, masks and documents, and a
    length that does not cut into the shards (padded, the padded keys then a key bias)."""
    from test_masks import DOCUMENTS, _check, _check_documents

    for layout, case in (("contiguous", CASES[0]), ("zigzag", CASES[2])):
        _case(rank, world, "inductor", layout, *case, a2a=a2a, sharding="replicated")
    _case(rank, world, "inductor", "zigzag", [16, 64], [1, 2], False, 1, 1 / (a2a or world), a2a=a2a, sharding="replicated")
    _case(rank, world, "inductor", "zigzag", None, None, False, 2, 1, a2a=a2a, sharding="replicated", n=N - 2)
    comm = dict(comm="all_to_all" if a2a is None else "hybrid", a2a=a2a)
    _check("hf_causal", [16, 64], [1, 2], "inductor", world=world, rank=rank, layout="zigzag", **comm)
    _check("two_sided", [12, 60], [1, 2], "inductor", world=world, rank=rank, layout="zigzag", n=N - 4, **comm)
    build, data = DOCUMENTS[0]
    _check_documents(build, data(2, 64), [16, 64], [1, 2], "inductor", world=world, rank=rank, n=64, **comm)


@pytest.mark.parametrize("world, a2a", [(2, None), (4, 2)], ids=["all-to-all", "hybrid"])
def test_replicated_mode_matches_the_reference_under_inductor(world, a2a):
    run_ranks(world, _replicated, a2a)


# ---- the hybrid: all-to-alls in groups, a ring across them ------------------------------------------


def _hybrid(rank: int, world: int, compiler: str) -> None:
    for layout, case in _layouts(world):
        _case(rank, world, compiler, layout, *case, a2a=2)
    _case(rank, world, compiler, "zigzag", [16, 64], [1, 2], True, 1, 1 / 2, a2a=2)  # odd offsets, kv heads copied
    _case(rank, world, compiler, "zigzag", *CASES[2], a2a=2, mesh=True)  # the group as a (ring, a2a) mesh
    _masked(rank, world, a2a=2)
    _mesh_refused(world)


def _mesh_refused(world: int) -> None:
    """A 2-D mesh is a hybrid's (ring, a2a) mesh of consecutive rows, and sets a2a_ranks."""
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("ring", "a2a"))
    assert ring_rewrite.RingDilatedConfig(group=mesh, comm="hybrid").a2a_ranks == 2
    with pytest.raises(ValueError, match=r"a 2-D DeviceMesh is the \(ring, a2a\) mesh of comm='hybrid'"):
        ring_rewrite.RingDilatedConfig(group=mesh, sharding="sharded")
    with pytest.raises(ValueError, match="a2a_ranks=4 but the"):
        ring_rewrite.RingDilatedConfig(group=mesh, comm="hybrid", a2a_ranks=4)
    strided = DeviceMesh("cpu", torch.arange(world).view(2, world // 2).T, mesh_dim_names=("ring", "a2a"))
    with pytest.raises(ValueError, match="rows are consecutive ranks"):
        ring_rewrite.RingDilatedConfig(group=strided, comm="hybrid")


def test_a_two_by_two_hybrid_matches_the_reference_under_inductor():
    run_ranks(4, _hybrid, "inductor")


def _hybrid_in_dp(rank: int, world: int) -> None:
    """A hybrid whose group is the ``(ring, a2a)`` sub-mesh of a ``(dp, ring, a2a)`` mesh: each
    dp replica shards its own sequence over its 4 ranks, and matches its own float64 reference."""
    mesh = init_device_mesh("cpu", (world // 4, 2, 2), mesh_dim_names=("dp", "ring", "a2a"))
    sub = mesh["ring", "a2a"]
    g = torch.Generator().manual_seed(100 + mesh.get_local_rank("dp"))
    q, dout = (torch.randn(2, 4, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    seg, rates = [16, 64], [1, 2]
    expected = reference_attention(
        whole[0], *(x.repeat_interleave(2, 1) for x in whole[1:]), segment_lengths=seg, dilation_rates=rates,
        is_causal=True,
    )  # fmt: skip
    expected.backward(dout)
    local = [ring_rewrite.shard(x.float(), 2, layout="zigzag", group=sub).requires_grad_() for x in (q, k, v)]
    backend = ring_rewrite.backend(
        sharding="sharded", layout="zigzag", comm="hybrid", group=sub, segment_lengths=seg, dilation_rates=rates,
        timeout=60,
    )  # fmt: skip
    out = torch.compile(lambda *x: _sdpa(*x, is_causal=True), backend=backend)(*local)
    out.backward(ring_rewrite.shard(dout.float(), 2, layout="zigzag", group=sub))
    (record,) = backend.records
    assert record.rewritten and (record.plan.comm, record.plan.world, record.plan.a2a) == ("hybrid", 4, 2), record
    whole_of = lambda x: ring_rewrite.unshard(x, 2, layout="zigzag", group=sub)  # noqa: E731
    assert rel_err(whole_of(out.detach()), expected.detach()) < BOUND, rank
    for name, x, ref in zip("qkv", local, whole):
        assert rel_err(whole_of(x.grad), ref.grad) < BOUND, (name, rank)


@pytest.mark.skipif(
    int(os.environ.get("RING_REWRITE_TEST_RANKS", "4")) < 8,
    reason="8 ranks, where the suite runs at most 4: RING_REWRITE_TEST_RANKS=8 runs it (README.md, Support)",
)
def test_a_hybrid_on_a_sub_mesh_of_a_dp_mesh_matches_the_reference_under_inductor():
    run_ranks(8, _hybrid_in_dp)


def test_a_hybrid_site_rings_across_its_all_to_all_groups():
    """P = 8 in all-to-all groups of 2: rank 5 (group 2, second place) exchanges with rank 4,
    and its ring runs over ranks 1, 3, 5, 7 (the second place of every group), as rank 2 of 4
    over the groups' tokens (a quarter of the sequence) for half of the heads."""
    plan = _plan(world=8, rank=5, comm="hybrid", a2a=2, n=512, branches=((64, 1), (512, 2)))
    inner = plan.inner
    assert (plan.comm, inner.world, inner.rank, inner.n_local, inner.hq, inner.hkv) == ("hybrid", 4, 2, 128, 4, 2)
    local, ring = plan.branches
    assert local.is_local and ring.ring == (0, 1, 2, 3) and ring.peers == (1, 3, 5, 7)
    assert (ring.send_to, ring.recv_from) == (7, 3)
    forward = build(plan, "forward").transfers()
    assert [type(s).__name__ for s in forward] == ["Exchange"] * 3 + ["Start"] * 3 + ["Exchange"]
    assert all(s.send_to == 7 and s.recv_from == 3 for s in forward if not isinstance(s, Exchange))
    assert all(s.peers == (4, 5) and str(s).endswith("among 4-5") for s in forward if isinstance(s, Exchange))
    shard = 64 * 16 * 4  # one head's shard of 64 tokens, float32; each exchange sends its half
    assert [s.bytes for s in forward if isinstance(s, Exchange)] == [8 * shard // 2 + 8, 4 * shard // 2 + 8, 4 * shard // 2 + 8, 8 * shard // 2 + 8]
    with pytest.raises(ValueError, match="a2a_ranks must divide the 8 ranks, got 3"):
        _plan(world=8, rank=5, comm="hybrid", a2a=3, n=48 * 8)
    with pytest.raises(ValueError, match="goes with comm='hybrid'"):
        ring_rewrite.RingDilatedConfig(sharding="sharded", comm="all_to_all", a2a_ranks=2)


# ---- faults ------------------------------------------------------------------------------------


FAULT_TIMEOUT = 3.0  # RingDilatedConfig.timeout here, seconds


def _faults(rank: int, world: int, compiler: str, a2a=None) -> None:
    """The exchanges fail as the ring's transfers do (docs/ring.md, Faults): a rank whose block
    raises, or that stalls past the timeout, fails the others within the deadline naming the
    all-to-all (in a hybrid, the exchange or the ring's transfer each waits for); every rank
    then runs a step equal to the float64 reference, nothing left pending."""
    import time

    from ring_rewrite.comm.errors import RingOutOfStep, TransferTimeout
    from ring_rewrite.comm.waiter import _ABANDONED, _PENDING
    from ring_rewrite.testing import InjectedFault, in_block_kernel

    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 2 * world, N, D, generator=g, dtype=torch.float64) for _ in range(4))
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = reference_attention(*whole, is_causal=True)
    expected.backward(dout)
    comm = dict(comm="all_to_all") if a2a is None else dict(comm="hybrid", a2a_ranks=a2a)
    backend = ring_rewrite.backend(sharding="sharded", compiler=compiler, timeout=FAULT_TIMEOUT, **comm)
    torch._dynamo.reset()
    attend = torch.compile(lambda *x: _sdpa(*x, is_causal=True), backend=backend)

    def step():  # float64: its blocks run the block kernel's entry, which in_block_kernel hooks
        local = [ring_rewrite.shard(x, 2).requires_grad_() for x in (q, k, v)]
        out = attend(*local)
        out.backward(ring_rewrite.shard(dout, 2))
        return out, local

    def healthy(what: str) -> None:
        out, local = step()
        assert rel_err(ring_rewrite.unshard(out.detach(), 2), expected.detach()) < BOUND, what
        for x, ref in zip(local, whole):
            assert rel_err(ring_rewrite.unshard(x.grad, 2), ref.grad) < BOUND, what
        assert not _PENDING and not _ABANDONED, what

    def fails(error, match) -> None:
        t0 = time.monotonic()
        with pytest.raises(error, match=match):
            step()
        assert time.monotonic() - t0 < 2 * FAULT_TIMEOUT + 10

    healthy("first step")
    if rank == 1:
        with in_block_kernel(lambda: (_ for _ in ()).throw(InjectedFault("block failed"))):
            fails(InjectedFault, "block failed")
    elif a2a is None:
        fails(TransferTimeout, r"transfer site 0, all-to-all 3 at distance 1 \(tag \d+, call \d+\)")
    else:  # rank 1's group waits for its exchange, the other group for its ring's transfers
        fails((TransferTimeout, RingOutOfStep), "did not finish within the 3 s timeout|out of step")
    healthy("after an exception inside a block")
    if rank == 1:
        # Late, its exchange pairs with the one the others left (and recovery completes); its
        # backward then finds them out of step, or its transfer times out.
        with in_block_kernel(lambda: time.sleep(FAULT_TIMEOUT + 0.5), times=1):
            fails((TransferTimeout, RingOutOfStep), "did not finish within the 3 s timeout|out of step")
    elif a2a is None:
        fails(TransferTimeout, "did not finish within the 3 s timeout")
    else:  # the other group finds rank 1's group out of step at its backward, or times out
        fails((TransferTimeout, RingOutOfStep), "did not finish within the 3 s timeout|out of step")
    healthy("after a late peer")


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
def test_an_exchange_fails_by_name_and_the_next_step_works(compiler):
    run_ranks(2, _faults, compiler)


def test_a_hybrid_fails_by_name_and_the_next_step_works():
    run_ranks(4, _faults, "inductor", 2)


def test_kv_heads_that_do_not_split_are_copied_the_fewest_times():
    """Two key/value heads over 4 ranks: each copied twice, so each rank gets one (its query
    heads' own); six over 4: copied twice (12 = 3 a rank); the exchange sends the copies."""
    assert _plan(hkv=2).kv_copies == 2 and _plan(hkv=2).inner.hkv == 1
    assert _plan(hq=12, hkv=6).kv_copies == 2 and _plan(hq=12, hkv=6).inner.hkv == 3
    assert _plan(hkv=4).kv_copies == 1
    k = next(s for s in build(_plan(hkv=2), "forward").steps if isinstance(s, Exchange) and s.tensor == "k")
    assert k.shape == (1, 4, 64, 16)


def test_the_report_says_what_every_other_option_would_send_and_hold():
    """``with_comm`` builds the plan the other option builds; below its table ``explain()`` gives
    each other option's bytes and memory on this rank, or why the site cannot run so."""
    from ring_rewrite.report import _mib, _other_options

    ring = _plan(comm="ring", hkv=2)
    assert ring.with_comm("all_to_all") == _plan(hkv=2) and ring.with_comm("hybrid", 2) == _plan(hkv=2, comm="hybrid", a2a=2)
    lines = _other_options(ring)
    assert [line.split(" instead")[0] for line in lines] == ["site 0, comm='all_to_all'", "site 0, comm='hybrid', a2a_ranks=2"]
    for line, other in zip(lines, (_plan(hkv=2), _plan(hkv=2, comm="hybrid", a2a=2))):
        sent, mem = bytes_sent(other), attention_memory_bytes(other)
        assert f"MiB sent fwd / bwd {_mib(sent['forward'])} / {_mib(sent['backward'])}" in line, line
        assert f"MiB saved / peak {_mib(mem['saved'])} / {_mib(mem['peak'])}" in line, line
    assert lines[0].endswith("K/V heads x2") and "K/V heads" not in lines[1]  # 2 kv heads split over 2, not 4
    refused = _other_options(_plan(comm="ring", hq=6, hkv=6))
    assert refused[0].startswith("site 0, comm='all_to_all' instead: cannot run (") and "not a multiple of 4" in refused[0]
    assert refused[1].startswith("site 0, comm='hybrid', a2a_ranks=2 instead: MiB sent")
    assert _other_options(_plan(comm="ring", world=1, rank=0)) == []
