"""Dropout inside rewritten attention (docs/semantics.md, Dropout; Note [Dropout in blocks]
in kernels.py).

Each call drops probabilities of the merged softmax: with ``c`` the branches that connect query
``p`` to key ``t``, each of the ``c`` entries is kept with probability ``1 - p`` and scaled by
``1 / (1 - p)``. Values ``[v | I]`` make the output show the probabilities it used, so one call
is checked exactly (that sample's function, forward and gradients, in float64) and many calls
statistically (the mean against the undropped probabilities and output, the fraction dropped).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from ranks import run_ranks

P_DROP = 0.25
D = 8
DRAWS = 100


def _attend(causal, gqa):
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=P_DROP, is_causal=causal, enable_gqa=gqa)

    return attend


def _inputs(hq, hkv, n, width=None):
    """``q, k`` and values ``[v | I]`` (B = 2), ``I`` the ``n`` keys' identity in ``width``
    channels (``n`` by default): the output's channels ``D .. D + n`` are the probabilities the
    call used."""
    width = width or n
    q, k, v = (torch.randn(2, h, n, D, dtype=torch.float64) for h in (hq, hkv, hkv))
    eye = torch.eye(n, width, dtype=torch.float64).expand(2, hkv, n, width)
    return q, k, torch.cat([v, eye], -1), torch.randn(2, hq, n, D + width, dtype=torch.float64)


def _expected(config, q, k, v, causal):
    """The undropped probabilities ``(B, Hq, N, N)`` and output, and the connection counts."""
    from ring_rewrite.reference import connection_counts, reference_attention

    segs, rates = config
    branches = list(zip(segs, rates)) if segs else [(q.shape[2], 1)]
    out = reference_attention(q, k, v, segment_lengths=segs, dilation_rates=rates, is_causal=causal)
    counts = connection_counts(q.shape[2], q.shape[1], branches, is_causal=causal)
    return out, counts


def _sample_function(config, q, k, v, causal, used, counts):
    """The function one call computed, in float64: the undropped probabilities times that call's
    keep factors (read off ``used``, snapped to ``kept / (c (1 - p))``), then the values."""
    from ring_rewrite.reference import reference_attention

    segs, rates = config
    n, hkv = q.shape[2], k.shape[1]
    eye = torch.eye(n, dtype=torch.float64).expand(*k.shape[:2], n, n)
    probs = reference_attention(q, k, eye, segment_lengths=segs, dilation_rates=rates, is_causal=causal)
    c = counts.clamp_min(1)
    kept = torch.where(probs > 0, used / probs.detach() * c * (1 - P_DROP), 0.0).round()
    assert ((kept >= 0) & (kept <= counts)).all()
    factor = kept / (c * (1 - P_DROP))
    weights = (probs * factor).unflatten(1, (hkv, -1))
    return (weights @ v.unsqueeze(2)).flatten(1, 2)


def _check(attend, config, causal, hq, hkv, n, *, cut=None, gather=None, draws=DRAWS, width=None):
    """One call checked exactly against its sample function, then ``draws`` calls against the
    expectation. ``cut`` takes this rank's tokens (sharded mode), ``gather`` puts the rows of
    every rank back together; ``width``: the channels of the values' identity (``_inputs``)."""
    cut = cut or (lambda x: x)
    gather = gather or (lambda x: x)
    q, k, v, dout = _inputs(hq, hkv, n, width)
    probs_at = slice(D, D + n)
    inputs = [cut(x).float().requires_grad_() for x in (q, k, v)]
    out = attend(*inputs)
    grads = torch.autograd.grad(out, inputs, cut(dout).float())
    used = gather(out.detach().double()[..., probs_at])
    expected_out, counts = _expected(config, q, k, v, causal)

    # 1. The sample: this call's output and gradients are those of the function it drew.
    q64, k64, v64 = (x.clone().requires_grad_() for x in (q, k, v))
    sample = _sample_function(config, q64, k64, v64, causal, used, counts)
    sample_grads = torch.autograd.grad(sample, (q64, k64, v64), dout)
    errors = [rel_err(a, cut(b)) for a, b in zip((out, *grads), (sample, *sample_grads))]
    assert max(errors) < 1e-5, errors

    # 2. Statistics over calls: each entry of the probabilities has mean P (undropped) and
    # variance P^2 p / (c (1 - p)); the output's mean is the undropped output.
    total = torch.zeros_like(expected_out)
    squares = torch.zeros_like(expected_out)
    dropped = entries = 0
    connected = counts > 0
    for _ in range(draws):
        got = gather(attend(*inputs).detach().double())  # with grad: the graph compiled above
        total += got
        squares += got**2
        dropped += ((got[..., probs_at] == 0) & connected).sum().item()
        entries += got.shape[0] * connected.sum().item()
    mean = total / draws
    probs = expected_out[..., probs_at]
    sd = (probs**2 * P_DROP / ((1 - P_DROP) * counts.clamp_min(1))).sqrt() / draws**0.5
    z = ((mean[..., probs_at] - probs) / sd)[sd > 0]
    assert z.abs().max() < 6 and 0.8 < (z**2).mean() < 1.2, (z.abs().max(), (z**2).mean())
    assert (mean[..., probs_at][sd == 0] == probs[sd == 0]).all()  # never a probability where none is
    out_sd = (squares / draws - mean**2).clamp_min(0).sqrt()[..., :D] / draws**0.5
    z_out = (mean[..., :D] - expected_out[..., :D]) / out_sd.clamp_min(1e-12)
    assert z_out.abs().max() < 6, z_out.abs().max()
    # The fraction dropped: an entry with c connections reads 0 when all c drop (p^c).
    expected_fraction = (P_DROP ** counts[connected]).mean().item()
    fraction = dropped / entries
    bound = 5 * (expected_fraction * (1 - expected_fraction) / entries) ** 0.5
    assert abs(fraction - expected_fraction) < bound, (fraction, expected_fraction)


CONFIGS = {"exact": (None, None), "dilated": ([8, 16, 32], [1, 2, 4])}


@pytest.mark.parametrize(
    "config, compiler",
    [(CONFIGS["exact"], "inductor"), (CONFIGS["dilated"], "inductor"), (CONFIGS["dilated"], "aot_eager")],
    ids=["exact-inductor", "dilated-inductor", "dilated-aot_eager"],
)
def test_dropout_on_one_rank(config, compiler):
    import ring_rewrite

    segs, rates = config
    causal = segs is None
    backend = ring_rewrite.backend(segment_lengths=segs, dilation_rates=rates, compiler=compiler)
    attend = torch.compile(_attend(causal, gqa=True), backend=backend, fullgraph=True)
    _check(attend, config, causal, 4, 2, 32)
    assert backend.records and all(r.plan.dropout == P_DROP for r in backend.records)


def _on_ranks(rank, world):
    import ring_rewrite
    import torch.distributed as dist

    def gather(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        stacked = torch.stack(parts)
        return ring_rewrite.layout.assemble(stacked, 2, x.shape[2], world=world, layout="zigzag")

    config = ([8, 32], [1, 2])
    for sharding in ("sharded", "replicated"):
        torch.manual_seed(0)
        backend = ring_rewrite.backend(
            segment_lengths=config[0], dilation_rates=config[1], sharding=sharding, layout="zigzag"
        )
        attend = torch.compile(_attend(True, gqa=False), backend=backend, fullgraph=True)
        if sharding == "sharded":
            cut = lambda x: ring_rewrite.shard(x, 2, layout="zigzag")  # noqa: E731
            _check(attend, config, True, 4, 4, 32, cut=cut, gather=gather, draws=50)
        else:
            _check(attend, config, True, 4, 4, 32, draws=50)


def test_dropout_across_ranks():
    """P = 2 under the default compiler, both sharding modes: each rank draws for its own rows."""
    run_ranks(2, _on_ranks)


def _bucket_check(attend, backend, hq, hkv, *, world=1, cut=None, gather=None, draws=DRAWS, config=CONFIGS["exact"]):
    """``attend`` compiled with dynamic shapes at 20 and then 24 positions: one graph for the
    bucket of 32, run at the real length (``SitePlan.bucketed``), each call's dropout that of
    the function it drew."""
    for n in (20, 24):
        _check(attend, config, True, hq, hkv, n, cut=cut, gather=gather, draws=draws, width=32)
    # One graph (dynamo may trace it twice): the bucket's, compiled at the first length.
    for record in backend.records:
        assert record.plan.bucketed and record.plan.dropout == P_DROP and record.plan.n == 32, record.reason
        assert record.reason.startswith("a bucket of 32: reads"), record.reason
        shard = 20 // world if cut else 20  # sharded: a shard's positions
        assert f"compiled at {shard} positions" in record.reason, record.reason


@pytest.mark.parametrize("config", ["exact", "dilated"])
def test_dropout_at_a_length_in_a_bucket_runs_at_the_real_length(config):
    """One process, inductor: the dilated config's rate-1 branch cut into whole segments and the
    last one's rows, its dilated branches cut to the real rows, each call drawing its own stream."""
    import ring_rewrite

    segs, rates = CONFIGS[config]
    backend = ring_rewrite.backend(segment_lengths=segs, dilation_rates=rates, compiler="inductor")
    attend = torch.compile(_attend(True, gqa=True), backend=backend, fullgraph=True, dynamic=True)
    _bucket_check(attend, backend, 4, 2, config=CONFIGS[config])


def _bucket_on_ranks(rank, world):
    import ring_rewrite
    import torch.distributed as dist

    def gather(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return ring_rewrite.layout.assemble(torch.stack(parts), 2, x.shape[2], world=world, layout="zigzag")

    for sharding in ("sharded", "replicated"):
        torch.manual_seed(0)
        torch._dynamo.reset()
        backend = ring_rewrite.backend(sharding=sharding, layout="zigzag")
        attend = torch.compile(_attend(True, gqa=False), backend=backend, fullgraph=True, dynamic=True)
        if sharding == "sharded":
            cut = lambda x: ring_rewrite.shard(x, 2, layout="zigzag")  # noqa: E731
            _bucket_check(attend, backend, 4, 4, world=world, cut=cut, gather=gather, draws=50)
        else:
            _bucket_check(attend, backend, 4, 4, world=world, draws=50)


def test_dropout_in_a_bucket_across_ranks_runs_at_the_real_length():
    """P = 2, zigzag: sharded, each rank's shard a symbol, and replicated, the sequence's length
    a symbol; the bucket's plan run at the real rows."""
    run_ranks(2, _bucket_on_ranks)
