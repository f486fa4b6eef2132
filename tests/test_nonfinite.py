"""Non-finite inputs: a NaN, ``+inf`` or ``-inf`` in q, k, v or a float key mask reaches, forward
and backward, exactly the entries it reaches in the float64 function (NaN where it is NaN, each
inf where it is that inf), and the finite entries stay within bound (docs/semantics.md,
Accuracy; Note [Non-finite values]). Every path: our CPU kernel
(blocks read in place and merged there, gathered blocks, the local branches' head chunks,
backward tasks shared by threads), aten's kernel (float64, a mask), the log-sum-exp merges, all
under inductor on one process, and the ring across 2 gloo ranks under inductor (blocks, merges,
the dK/dV sums on their way home, head chunks).

The float64 function is evaluated pair by pair (``_pairs_reference``), not as
``reference_attention`` does it: that one multiplies dense matrices, so where a pair is not
connected (past the diagonal, another segment or lattice, a masked key) its 0 still meets a NaN
or inf: ``0 * inf`` in its backward's ``dS^T Q`` and ``dS K`` and, for an inf in ``v``, in its
forward's ``P V``, softmax's NaN over a NaN row's ``-inf`` entries in its ``dv``, and a mask's
NaN or ``+inf`` added to the ``-inf`` of every pair not connected; SDPA's math
kernel does the same, and its flash kernel within a block. And it marks a row that attends to a
NaN value NaN whole, which zeroes that row's gradients. Where the dense reference is ambiguous so,
the tests assert against the float64 evaluation of the same function over the connected pairs;
``test_pairs_reference_is_reference_attention`` checks that it is ``reference_attention`` wherever
no pair that is not connected is multiplied: finite inputs; the forward, but for an inf in ``v``
and a mask's NaN or ``+inf`` where some pair is not connected; which rows a NaN value makes NaN;
the exact config without ``is_causal`` or a mask, forward and backward, where every pair is
connected (and SDPA there too).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from ranks import run_ranks

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}  # docs/semantics.md, Accuracy
VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
# Where the value goes: (head, position, channel) of q, k or v (k and v: kv head 1, read by query
# heads 2 and 3 under GQA), or the key of the mask. Position 32 starts a segment of every
# dilated config below: under is_causal its first row sees that key alone in the rate-1 branch,
# so a -inf score empties that branch's block of the row (which attends to the other branches).
PLACES = {"q": (1, 37, 3), "k": (1, 32, 3), "v": (1, 37, 3), "mask": 32}
DILATED = ([16, 32, 64], [1, 2, 4])


def _pairs_reference(q, k, v, *, segment_lengths=None, dilation_rates=None, is_causal=False, scale=None,
                     key_bias=None):  # fmt: skip
    """``reference_attention``'s function in float64, each (head, query) row over its connected
    keys only, gathered (docs/semantics.md, The function): a pair that is not connected, a key a
    mask sets to ``-inf`` included (docs/semantics.md, Masks), takes part in no product. As there,
    a row whose every score is ``-inf`` attends to nothing: 0, and no gradient."""
    from ring_rewrite.reference import connection_counts

    b, hq, n, d = q.shape
    scale = d**-0.5 if scale is None else scale
    branches = [(n, 1)] if segment_lengths is None else list(zip(segment_lengths, dilation_rates))
    q, k, v = q.double(), k.double(), v.double()
    k, v = (x.repeat_interleave(hq // x.shape[1], 1) for x in (k, v))
    counts = connection_counts(n, hq, branches, is_causal=is_causal).expand(b, hq, n, n)
    bias = q.new_zeros(b, hq, 1, n) if key_bias is None else key_bias.double().expand(b, hq, 1, n)
    # A zero key, value and bias after the last: where a row's list of keys is padded.
    kx, vx = (torch.cat([x, x.new_zeros(b, hq, 1, x.shape[-1])], 2) for x in (k, v))
    bx = torch.cat([bias[:, :, 0], bias.new_zeros(b, hq, 1)], 2)
    bi, hi = torch.arange(b).view(b, 1, 1, 1), torch.arange(hq).view(1, hq, 1, 1)

    def rows(connected):
        keys = max(int(connected.sum(-1).max()), 1)
        order = connected.double().sort(dim=-1, descending=True, stable=True).indices[..., :keys]
        valid = connected.gather(-1, order)
        idx = torch.where(valid, order, n)
        count = torch.where(valid, counts.gather(-1, order), 1.0)
        s = (q.unsqueeze(3) * kx[bi, hi, idx]).sum(-1) * scale + count.log() + bx[bi, hi, idx]
        return valid, s.masked_fill(~valid, float("-inf")), vx[bi, hi, idx]

    connected = (counts > 0) & (bias != float("-inf"))
    with torch.no_grad():
        live = ~(rows(connected)[1] == float("-inf")).all(-1, keepdim=True)
    valid, s, vg = rows(connected & live)  # a row with nothing to attend: no pair at all
    p = (torch.softmax(s.masked_fill(~live, 0.0), -1) * live).masked_fill(~valid, 0.0)
    return (p.unsqueeze(-1) * vg).sum(-2)


def _forward_backward(fn, q, k, v, dout, *extra):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, *extra)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.to(out.dtype))]


def _expected(q, k, v, dout, mask=None, **function):
    ref = functools.partial(_pairs_reference, key_bias=mask, **function)
    return _forward_backward(ref, *(x.double() for x in (q, k, v, dout)))


def _mismatches(label: str, got, expected, tol: float) -> list[str]:
    """What differs: the entries that are NaN, ``+inf`` or ``-inf`` (each exactly where the
    reference has it: an inf where the reference has NaN is a product that took a nonzero for its
    0), or the finite ones beyond ``tol``."""
    found = []
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        differ = []
        for kind, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
            bad, want = test(g), test(e)
            if not torch.equal(bad, want):
                differ.append(
                    f"{label} {name}: {int(bad.sum())} entries {kind} where the reference has "
                    f"{int(want.sum())} ({int((bad != want).sum())} differ)"
                )
        found += differ
        finite = torch.isfinite(e)
        if not differ and finite.any() and (err := rel_err(g[finite], e[finite])) >= tol:
            found.append(f"{label} {name}: finite entries off by {err:.1e}")
    return found


def _inputs(batch, hq, hkv, n, d, dv, dtype=torch.float32):
    return [torch.randn(*shape, dtype=dtype) for shape in ((batch, hq, n, d), (batch, hkv, n, d),
                                                            (batch, hkv, n, dv), (batch, hq, n, dv))]  # fmt: skip


def _key_mask(batch, n, dtype=torch.float32):
    """A float key mask ``(B, 1, 1, N)``: random, some keys ``-inf``."""
    mask = torch.randn(batch, 1, 1, n, dtype=dtype)
    mask[..., 5::7] = float("-inf")
    return mask


def _cases(q, k, v, mask=None):
    """``(label, q, k, v, mask)`` with one value of ``VALUES`` at ``PLACES``, in each input."""
    for where in ("q", "k", "v") + (("mask",) if mask is not None else ()):
        for name, value in VALUES.items():
            xs = {"q": q.clone(), "k": k.clone(), "v": v.clone(), "mask": None if mask is None else mask.clone()}
            if where == "mask":
                xs["mask"][..., PLACES["mask"]] = value
            else:
                head, pos, channel = PLACES[where]
                xs[where][0, head, pos, channel] = value
            yield f"{name} in {where}", xs["q"], xs["k"], xs["v"], xs["mask"]


# ---- the float64 function -------------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True], ids=["", "mask"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("config", [None, DILATED], ids=["exact", "dilated"])
def test_pairs_reference_is_reference_attention(config, is_causal, masked):
    from ring_rewrite.reference import reference_attention

    seg, rates = config or (None, None)
    function = dict(segment_lengths=seg, dilation_rates=rates, is_causal=is_causal, scale=0.3)
    q, k, v, dout = _inputs(2, 4, 2, 64, 16, 16, torch.float64)
    mask = _key_mask(2, 64, torch.float64) if masked else None

    def dense(q, k, v, mask):
        return reference_attention(q, k, v, key_bias=mask, **function)

    # Finite inputs: the same function.
    got = _expected(q, k, v, dout, mask, **function)
    assert not _mismatches("finite", got, _forward_backward(dense, q, k, v, dout, mask), 1e-12)
    every_pair = config is None and not is_causal and not masked
    problems = []
    for label, *inputs in _cases(q, k, v, mask):
        got = _expected(*inputs[:3], dout, inputs[3], **function)
        want = _forward_backward(dense, *inputs[:3], dout, inputs[3])
        if label == "nan in v":
            # The dense reference: a row attending to a NaN value is NaN whole, its gradients 0.
            assert torch.equal(got[0].isnan().any(-1), want[0].isnan().all(-1)), label
            continue
        if label.endswith("in v") and not every_pair:
            continue  # the dense reference's P V: 0 * inf where a pair is not connected
        if label in ("nan in mask", "+inf in mask") and (config is not None or is_causal):
            continue  # added to the -inf of pairs not connected, it makes them NaN
        if not every_pair:
            got, want = got[:1], want[:1]  # the dense backward reaches pairs not connected
        problems += _mismatches(label, got, want, 1e-12)
        if every_pair:
            sdpa = functools.partial(F.scaled_dot_product_attention, scale=0.3, enable_gqa=True)
            sdpa_got = _forward_backward(sdpa, *inputs[:3], dout)
            problems += [f"SDPA: {p}" for p in _mismatches(label, got, sdpa_got, 1e-12)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("config", [None, DILATED], ids=["exact", "dilated"])
def test_an_inf_key_scoring_minus_inf(config, is_causal):
    """``PLACES``' inf in k scores ``-inf`` in some rows that see it (q's sign), where the key drops
    out: their out is finite, and their dq is NaN (``0 * inf``) in the inf's channel alone. The
    cases below thus check that every path forms that product."""
    seg, rates = config or (None, None)
    function = dict(segment_lengths=seg, dilation_rates=rates, is_causal=is_causal)
    q, k, v, dout = _inputs(1, 4, 2, 64, 16, 16)
    head, pos, channel = PLACES["k"]
    for value in (float("inf"), float("-inf")):
        k1 = k.clone()
        k1[0, head, pos, channel] = value
        out, dq, _, _ = _expected(q, k1, v, dout, **function)
        dropped = out.isfinite().all(-1) & dq.isnan().any(-1)
        assert dropped.any(), value
        assert dq[dropped][:, channel].isnan().all() and dq[dropped].isnan().sum() == dropped.sum(), value


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "key_mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_padding_to_a_bucket_meets_an_inf_key(dtype, masked):
    """A length padded to its bucket (``dynamic=True``, 37 -> 64): the padded queries are zeros,
    and against an infinite key they score ``0 * inf = NaN``. Their rows are dead in the
    backward (Note [Padding to a bucket]), so the bucket computes what the site compiled for the
    length itself does, NaN for NaN: every real row scores the infinite key ``-inf``, so only dq
    holds NaN (``0 * inf`` in that key's channel, Note [Non-finite values]), and dk, dv none."""
    n = 37
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=dtype) for _ in range(3))
    k[0, 1, 5, 3] = float("inf")
    q[0, 1, :, 3] = -q[0, 1, :, 3].abs() - 0.1  # every real row of head 1 scores key 5 at -inf
    keep = torch.ones(1, 1, 1, n, dtype=torch.bool)
    keep[..., -3:] = False

    def attend(q, k, v):
        if masked:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    bucketed = torch.compile(attend, backend="ring_dilated", dynamic=True, fullgraph=True)
    specialised = torch.compile(attend, backend="ring_dilated", dynamic=False, fullgraph=True)
    results = []
    for fn in (bucketed, specialised):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        results.append([out.detach(), *torch.autograd.grad(out, leaves, torch.ones_like(out))])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(got.isfinite(), want.isfinite()), (name, int((~got.isfinite()).sum()))
        finite = want.isfinite()
        assert rel_err(got[finite], want[finite]) < (1e-5 if dtype == torch.float32 else 1e-12), name
        assert finite.all() or name == "dq", name


# ---- merges --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_keeps_a_nan_row(dtype):
    """A partial whose lse is NaN makes its rows NaN, out and lse, whatever the others hold; one
    whose lse is ``-inf`` holds nothing (its out is ignored); all ``-inf``: 0 and ``-inf``."""
    from ring_rewrite.merge import merge_partials

    outs = [torch.randn(3, 4, dtype=dtype) for _ in range(3)]
    lses = [torch.randn(3, dtype=dtype) for _ in range(3)]
    lses[1][0] = float("nan")  # row 0: a NaN partial among finite ones
    lses[0][1] = lses[1][1] = float("-inf")  # row 1: two empty partials and a NaN one
    lses[2][1] = float("nan")
    outs[0][1] = float("nan")  # what an empty partial holds does not matter
    for lse in lses:
        lse[2] = float("-inf")  # row 2: nothing anywhere
    out, lse = merge_partials(outs, lses)
    assert out[:2].isnan().all() and lse[:2].isnan().all()
    assert torch.equal(out[2], torch.zeros(4, dtype=dtype)) and lse[2] == float("-inf")


# ---- block kernels ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["ours", "aten-float64", "aten-mask"])
def test_block_kernels(path):
    """Each block kernel alone, as a site calls it (``ring_rewrite::block_attention`` and its
    backward with the block's out and lse): a block of two key tiles and a partial query tile
    (272 rows), GQA, ``d != dv``, causal and not; 3 threads on 2 * 2 backward tasks, so that one
    of ``flash_cpu.c``'s tasks is shared by the threads."""
    from ring_rewrite import cpu_kernel

    dtype = torch.float64 if path == "aten-float64" else torch.float32
    q, k, v, dout = _inputs(2, 4, 2, 272, 8, 12, dtype)
    mask = _key_mask(2, 272) if path == "aten-mask" else None
    assert cpu_kernel.serves(q, k, v, bias=mask) == (path == "ours")
    ops = torch.ops.ring_rewrite
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    problems = []
    try:
        for is_causal in (False, True):
            for label, q1, k1, v1, m1 in _cases(q, k, v, mask):
                out, lse = ops.block_attention(q1, k1, v1, m1, 0.3, is_causal)
                grads = ops.block_attention_backward(dout, q1, k1, v1, out, lse, m1, 0.3, is_causal)
                expected = _expected(q1, k1, v1, dout, m1, is_causal=is_causal, scale=0.3)
                problems += _mismatches(f"causal={is_causal} {label}", [out, *grads], expected, TOL[dtype])
    finally:
        torch.set_num_threads(threads)
    assert not problems, "\n".join(problems)


# ---- one device, compiled ----------------------------------------------------------------------

# name -> (segment_lengths and dilation_rates or None, n, is_causal, dtype, masked, chunk bytes)
SINGLE = {
    # flash_cpu.c reads the blocks in place and merges each branch into the running out and lse
    "exact-full": (None, 64, False, torch.float32, False, None),
    "exact-causal": (None, 64, True, torch.float32, False, None),
    "dilated-full": (DILATED, 64, False, torch.float32, False, None),
    "dilated-causal": (DILATED, 64, True, torch.float32, False, None),
    # a partial last segment: gathered blocks, the backward in one head chunk per kv head
    "gathered-chunks": (([16, 32], [1, 2]), 56, True, torch.float32, False, 1),
    # aten's kernel
    "float64-causal": (DILATED, 64, True, torch.float64, False, None),
    "mask": (DILATED, 64, False, torch.float32, True, None),
}


@pytest.mark.parametrize("variant", SINGLE.values(), ids=SINGLE.keys())
def test_one_device(variant, monkeypatch):
    import ring_rewrite
    from ring_rewrite import site_plan

    config, n, is_causal, dtype, masked, chunk_bytes = variant
    if chunk_bytes is not None:
        monkeypatch.setattr(site_plan, "LOCAL_CHUNK_BYTES", chunk_bytes)
    seg, rates = config or (None, None)
    backend = ring_rewrite.backend(segment_lengths=seg, dilation_rates=rates)

    def attend(q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)

    fn = torch.compile(attend, backend=backend, fullgraph=True)
    q, k, v, dout = _inputs(1, 4, 2, n, 16, 16, dtype)
    mask = _key_mask(1, n, dtype) if masked else None
    function = dict(segment_lengths=seg, dilation_rates=rates, is_causal=is_causal)
    problems = []
    for label, *inputs in _cases(q, k, v, mask):
        got = _forward_backward(fn, *inputs[:3], dout, *inputs[3:] if masked else ())
        problems += _mismatches(label, got, _expected(*inputs[:3], dout, inputs[3], **function), TOL[dtype])
    (record,) = backend.records  # one graph for every case
    plan = record.plan
    assert plan.local_in_place == (dtype == torch.float32 and not masked and n == 64)
    if chunk_bytes is not None:
        assert len(plan.local_chunks()) == plan.hkv == 2
    assert not problems, "\n".join(problems)


# ---- the ring, 2 ranks ---------------------------------------------------------------------------

# (segment_lengths, dilation_rates, is_causal, layout, masked, ring chunk bytes)
RING = {
    "exact-causal": (None, None, True, "contiguous", False, None),
    "dilated-causal-zigzag-chunks": ([16, 64], [1, 2], True, "zigzag", False, 1),
    "exact-mask": (None, None, False, "contiguous", True, None),
}


def _ring_cases(rank, world):
    import ring_rewrite
    from ring_rewrite import site_plan

    problems = []
    for name, (seg, rates, is_causal, layout, masked, chunk_bytes) in RING.items():
        site_plan.RING_CHUNK_BYTES = chunk_bytes or (1 << 20)  # this rank's process only
        torch._dynamo.reset()
        torch.manual_seed(0)
        backend = ring_rewrite.backend(segment_lengths=seg, dilation_rates=rates, layout=layout)

        def attend(q, k, v, mask=None):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)

        fn = torch.compile(attend, backend=backend, fullgraph=True)
        q, k, v, dout = _inputs(1, 4, 2, 64, 16, 16)
        mask = _key_mask(1, 64) if masked else None
        function = dict(segment_lengths=seg, dilation_rates=rates, is_causal=is_causal)
        for label, *inputs in _cases(q, k, v, mask):
            got = _forward_backward(fn, *inputs[:3], dout, *inputs[3:] if masked else ())
            expected = _expected(*inputs[:3], dout, inputs[3], **function)
            problems += _mismatches(f"rank {rank} {name} {label}", got, expected, TOL[torch.float32])
        (record,) = backend.records
        rings = [b for b in record.plan.branches if not b.is_local]
        assert rings, name
        if chunk_bytes is not None:
            assert all(record.plan.head_chunks(b) > 1 for b in rings), name
    assert not problems, "\n".join(problems)


def test_ring():
    """Under inductor, with gradients, every case of every config in one spawn of 2 ranks."""
    run_ranks(2, _ring_cases)
