"""The ``ring_rewrite`` custom ops: ``block_attention`` and ``block_attention_backward``, and the
ones that order and add a site's gradient sums (``after``, ``write_heads``, ``add_rows``,
``undilate_add``).

Checked against a dense float64 computation of one block of attention: softmax and log-sum-exp
of ``scale * q k^T + bias`` with top-left causal masking and GQA by head groups; a row whose every
key is masked has ``lse = -inf`` and output 0.
"""

from __future__ import annotations

import pytest
import torch

from conftest import rel_err

block_attention = torch.ops.ring_rewrite.block_attention
block_attention_backward = torch.ops.ring_rewrite.block_attention_backward

NEG_INF = float("-inf")

# (hq, hkv, d, dv, l, s): GQA with D > Dv, no GQA with D < Dv and a rectangular block.
SHAPES = {
    "gqa_d>dv": (4, 2, 8, 6, 7, 7),
    "mha_d<dv_rect": (2, 2, 4, 8, 5, 9),
}
BIASES = ("none", "key_padding", "dense")


def _inputs(shape, *, batch=2, dtype=torch.float32):
    hq, hkv, d, dv, l, s = shape
    q = torch.randn(batch, hq, l, d, dtype=dtype)
    k = torch.randn(batch, hkv, s, d, dtype=dtype)
    v = torch.randn(batch, hkv, s, dv, dtype=dtype)
    return q, k, v


def _bias(kind: str, shape, *, batch=2, dtype=torch.float32):
    """An additive bias with masked keys, including rows where every key is masked."""
    hq, _, _, _, l, s = shape
    if kind == "none":
        return None
    if kind == "key_padding":
        bias = torch.randn(batch, 1, 1, s, dtype=dtype)
        bias[0, ..., :2] = NEG_INF  # leading keys: under causal, the first rows see nothing
        bias[0, ..., -1] = NEG_INF
        bias[1] = NEG_INF  # batch row 1 attends to nothing at all
        return bias
    assert kind == "dense"
    bias = torch.randn(batch, hq, l, s, dtype=dtype)
    bias[torch.rand(batch, hq, l, s) < 0.3] = NEG_INF
    bias[0, 1, 2] = NEG_INF  # one fully masked row
    bias[1, 0, :, 0] = NEG_INF  # causal: row 0 of this head sees nothing
    return bias


def _dense(q, k, v, bias, scale, is_causal):
    """Float64 ``(out, lse)`` of one block, differentiable (also through fully masked rows)."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = scale * q @ k.transpose(-1, -2)
    if bias is not None:
        scores = scores + bias.double()
    if is_causal:
        l, s = scores.shape[-2:]
        keep = torch.ones(l, s, dtype=torch.bool).tril()  # top-left: row i sees keys 0..i
        scores = scores.masked_fill(~keep, NEG_INF)
    live = scores.amax(-1, keepdim=True) > NEG_INF
    safe = torch.where(live, scores, 0.0)
    lse = torch.where(live.squeeze(-1), torch.logsumexp(safe, -1), NEG_INF)
    out = torch.softmax(safe, -1) * live @ v
    return out, lse


def _check_lse(lse, expected):
    dead = expected == NEG_INF
    assert torch.equal(lse == NEG_INF, dead), "lse must be -inf exactly on rows with no key"
    assert torch.isfinite(lse[~dead]).all()
    assert rel_err(lse[~dead], expected[~dead]) < 1e-5


# ---- opcheck ---------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("bias_kind", ["none", "key_padding"])
def test_opcheck_block_attention(bias_kind, is_causal):
    shape = SHAPES["gqa_d>dv"]
    q, k, v = (t.requires_grad_() for t in _inputs(shape))
    bias = _bias(bias_kind, shape)
    torch.library.opcheck(block_attention, (q, k, v, bias, 0.3, is_causal))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("bias_kind", ["none", "key_padding"])
def test_opcheck_block_attention_backward(bias_kind, is_causal):
    shape = SHAPES["gqa_d>dv"]
    q, k, v = _inputs(shape)
    bias = _bias(bias_kind, shape)
    out, lse = block_attention(q, k, v, bias, 0.3, is_causal)
    dout = torch.randn_like(out)
    torch.library.opcheck(
        block_attention_backward, (dout, q, k, v, out, lse, bias, 0.3, is_causal)
    )


def test_after_is_a_contiguous_copy_once_its_deps_exist():
    x = torch.randn(3, 4).t()  # not contiguous: the copy is, as its fake says
    got = torch.ops.ring_rewrite.after(x, [torch.randn(2)])
    assert torch.equal(got, x) and got.is_contiguous() and got.data_ptr() != x.data_ptr()
    torch.library.opcheck(torch.ops.ring_rewrite.after, (x, [torch.randn(2)]))


def test_write_heads_writes_its_heads_in_place_and_nothing_else():
    total = torch.zeros(2, 6, 5, 3)
    x = torch.randn(2, 2, 5, 3)
    torch.ops.ring_rewrite.write_heads(total, x, 3)
    assert torch.equal(total[:, 3:5], x)
    assert not total[:, :3].any() and not total[:, 5:].any()
    torch.library.opcheck(torch.ops.ring_rewrite.write_heads, (torch.zeros(2, 6, 5, 3), x, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rows_adds_at_its_rows_into_a_copy(dtype):
    x = torch.randn(2, 3, 4, 5, dtype=dtype)
    got = torch.ops.ring_rewrite.add_rows(None, x, 2, 7, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 7, 5)
    assert torch.equal(got[:, :, 2:6], x.float()) and not got[:, :, :2].any() and not got[:, :, 6:].any()
    total = torch.randn(2, 3, 7, 5, dtype=torch.float64)
    before = total.clone()
    got = torch.ops.ring_rewrite.add_rows(total, x, 3, 7, torch.float64)
    want = before.clone()
    want[:, :, 3:7] += x.double()
    assert torch.equal(got, want) and torch.equal(total, before)  # the running sum is not touched
    torch.library.opcheck(torch.ops.ring_rewrite.add_rows, (total, x, 3, 7, torch.float64))
    torch.library.opcheck(torch.ops.ring_rewrite.add_rows, (None, x, 0, 4, torch.float32))


def test_dilate_is_the_layouts_gather():
    from ring_rewrite.dilation import BranchLayout

    fields = [8, 4, 20, 2, 4, 2, 2]  # w, r, n (not a multiple of w), batch, hq, hkv, head0
    x, k = torch.randn(2, 4, 20, 5), torch.randn(2, 2, 20, 5)
    layout = BranchLayout(*fields)
    got = torch.ops.ring_rewrite.dilate(x, fields, False, True, float("-inf"), torch.float64)
    assert torch.equal(got, layout.gather(x, rows=True, fill=float("-inf"), dtype=torch.float64))
    got = torch.ops.ring_rewrite.dilate(k, fields, True, False, 0.0, torch.float32)
    assert torch.equal(got, layout.dilate_kv(k))
    torch.library.opcheck(torch.ops.ring_rewrite.dilate, (x, fields, False, True, 0.0, torch.float32))
    torch.library.opcheck(torch.ops.ring_rewrite.dilate, (k, fields, True, False, 0.0, torch.float64))


def test_undilate_add_is_the_layouts_scatter_add_in_place():
    from ring_rewrite.dilation import BranchLayout

    fields = [8, 4, 20, 2, 4, 2, 2]  # w, r, n (not a multiple of w), batch, hq, hkv, head0
    layout = BranchLayout(*fields)
    for kv, rows in ((False, True), (True, False)):
        heads = layout.hkv if kv else layout.hq
        y = torch.randn(layout.gathered_shape(2, 5, kv=kv, rows=rows))
        # The layout's heads at ``start`` of a total with more heads (a head chunk's, written
        # into the site's gradient): the heads around them are not touched.
        for start, around in ((0, 0), (3, 5)):
            total = torch.randn(2, heads + around, 20, 5, dtype=torch.float64)
            for zero in (False, True):
                want = total.clone()
                mine = want.narrow(1, start, heads)
                if zero:
                    mine.zero_()
                layout.scatter_add(mine, y, kv=kv, rows=rows)
                torch.ops.ring_rewrite.undilate_add(total, y, fields, kv, rows, zero, start)
                assert torch.equal(total, want)
                args = (torch.randn(2, heads + around, 20, 5), y, fields, kv, rows, zero, start)
                torch.library.opcheck(torch.ops.ring_rewrite.undilate_add, args)


# (w, r, n, batch, hq, hkv, head0): segments as batches at rate 1 (GQA, the branch that writes);
# kv heads shared by the query heads of an offset (g = 2 = r); one kv head per query head with
# head offsets from 1 (g = 2 < r = 4); one segment; two query heads of a kv head on the same
# rows (g = 3 > r = 2: not in place, gathered).
IN_PLACE_LAYOUTS = [
    [8, 1, 32, 2, 4, 2, 0], [16, 2, 32, 2, 4, 2, 0], [16, 4, 32, 1, 4, 2, 1], [32, 2, 32, 1, 3, 3, 0],
    [8, 2, 32, 1, 6, 2, 0],
]  # fmt: skip


def _site_rows(batch: int, n: int, heads: int, channels: int, dtype=torch.float32) -> torch.Tensor:
    """``(B, H, n, C)`` with the heads inside the rows, as a model's projections give it."""
    return torch.randn(batch, n, heads, channels, dtype=dtype).transpose(1, 2)


_LAYOUT_IDS = lambda f: "w{}r{}b{}h{}kv{}o{}".format(*f[:2], *f[3:])  # noqa: E731


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("fields", IN_PLACE_LAYOUTS, ids=_LAYOUT_IDS)
def test_dilated_block_attention_merges_a_branch_in_place(fields, is_causal):
    """A local branch's blocks read where the rows lie, their results merged into the site's
    running out and lse in place (Note [Local branches in place]): at the
    branch's rows, attention over both key sets (float64, aten's kernel on the gathered rows,
    merged by ``logaddexp``); rows whose lse is ``-inf`` held nothing and take the branch's;
    every other position is untouched. With ``write`` (rate 1) every position is written."""
    from ring_rewrite.dilation import BranchLayout

    layout = BranchLayout(*fields)
    b, n, hq, hkv = layout.batch, layout.n, layout.hq, layout.hkv
    q, k, v = _site_rows(b, n, hq, 8), _site_rows(b, n, hkv, 8), _site_rows(b, n, hkv, 6)
    out, lse = _site_rows(b, n, hq, 6), 2 * torch.randn(b, hq, n)
    lse[..., ::5], out[..., ::5, :] = float("-inf"), float("nan")  # rows that hold nothing yet
    gathered = [layout.gather(x.double(), kv=kv) for x, kv in ((q, False), (k, True), (v, True))]
    got_out, got_lse = block_attention(*gathered, None, 0.35, is_causal)
    held_out, held_lse = layout.gather(out.double()), layout.gather(lse.double().unsqueeze(-1)).squeeze(-1)
    both = torch.logaddexp(held_lse, got_lse)
    held_out = torch.where(held_lse.isneginf().unsqueeze(-1), 0.0, held_out)  # what a NaN row holds
    merged = (held_lse - both).exp().unsqueeze(-1) * held_out + (got_lse - both).exp().unsqueeze(-1) * got_out
    want_out, want_lse = out.double(), lse.double()  # copies
    layout.scatter(want_out, merged)
    layout.scatter(want_lse.unsqueeze(-1), both.unsqueeze(-1))
    # In place in float32 (flash_cpu.c, where the layout allows) and gathered in float64.
    for dtype in (torch.float32, torch.float64):
        o, l = out.to(dtype, copy=True), lse.to(dtype, copy=True)
        args = (q.to(dtype), k.to(dtype), v.to(dtype), fields, 0.35, is_causal)
        torch.ops.ring_rewrite.dilated_block_attention(o, l, *args, False)
        empty = want_lse.isneginf()  # rows this branch does not reach, which held nothing
        assert torch.equal(l.isneginf(), empty) and torch.equal(o.isnan(), want_out.isnan()), dtype
        assert rel_err(o[~empty], want_out[~empty]) < 1e-5 and rel_err(l[~empty], want_lse[~empty]) < 1e-6, dtype
        if layout.r == 1:  # every position written, nothing read
            o, l = torch.full_like(o, float("nan")), torch.full_like(l, float("nan"))
            torch.ops.ring_rewrite.dilated_block_attention(o, l, *args, True)
            assert rel_err(o, _undilated(layout, got_out, o)) < 1e-5
            assert rel_err(l, _undilated(layout, got_lse.unsqueeze(-1), l.unsqueeze(-1)).squeeze(-1)) < 1e-6
    args = (out.clone(), lse.clone(), q, k, v, fields, 0.35, is_causal, False)
    torch.library.opcheck(torch.ops.ring_rewrite.dilated_block_attention, args)


def _undilated(layout, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``rows`` (gathered query rows) at their positions of a float64 tensor shaped ``like``, NaN
    elsewhere."""
    total = torch.full(like.shape, float("nan"), dtype=torch.float64)
    layout.scatter(total, rows)
    return total


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("fields", IN_PLACE_LAYOUTS, ids=_LAYOUT_IDS)
def test_dilated_block_backward_adds_a_branchs_gradients_in_place(fields, is_causal):
    """A local branch's backward read where its rows lie and added into the site's gradients
    (Note [Local branches in place]) is the gathered one (float64, aten's
    kernel, ``BranchLayout.scatter_add``), on inputs laid out ``(B, N, H, D)`` as a model's
    projections are; with ``write`` (rate 1) the totals are written. Rows whose lse is infinite
    add nothing."""
    from ring_rewrite import cpu_kernel
    from ring_rewrite.dilation import BranchLayout

    layout = BranchLayout(*fields)
    b, n, hq, hkv, d, dv = layout.batch, layout.n, layout.hq, layout.hkv, 8, 6
    q, k, v = _site_rows(b, n, hq, d), _site_rows(b, n, hkv, d), _site_rows(b, n, hkv, dv)
    dout, out = _site_rows(b, n, hq, dv), _site_rows(b, n, hq, dv)
    lse = 2 + 2 * torch.rand(b, hq, n)  # any lse: the formula, not one softmax
    lse[..., ::5], lse[..., 1::7] = float("-inf"), float("inf")  # rows with nothing to attend
    for write in (False, True) if layout.r == 1 else (False,):
        totals = [torch.randn(b, hq, n, d), torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, dv)]
        want = [t.double() for t in totals]
        ins = [x.double() for x in (dout, q, k, v, out, lse)]
        assert not cpu_kernel.serves(*ins, bias=None)  # float64: gathered, aten's kernel
        torch.ops.ring_rewrite.dilated_block_backward(*want, *ins, fields, 0.35, is_causal, write)
        args = (dout, q, k, v, out, lse, fields, 0.35, is_causal, write)
        torch.ops.ring_rewrite.dilated_block_backward(*totals, *args)
        for got, expected in zip(totals, want):
            assert rel_err(got, expected) < 1e-5
        if write:  # every position written, none added to
            fresh = [torch.full_like(t, float("nan")) for t in totals]
            torch.ops.ring_rewrite.dilated_block_backward(*fresh, *args)
            assert all(torch.equal(a, c) for a, c in zip(fresh, totals))
    assert layout.in_place == (fields != IN_PLACE_LAYOUTS[-1])
    args = ([torch.zeros_like(t) for t in totals], dout, q, k, v, out, lse, fields, 0.35, is_causal, False)
    torch.library.opcheck(torch.ops.ring_rewrite.dilated_block_backward, (*args[0], *args[1:]))


# ---- forward -----------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("bias_kind", BIASES)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_forward_matches_dense(shape, bias_kind, is_causal):
    q, k, v = _inputs(shape)
    bias = _bias(bias_kind, shape)
    scale = 0.37
    out, lse = block_attention(q, k, v, bias, scale, is_causal)
    ref_out, ref_lse = _dense(q, k, v, bias, scale, is_causal)

    assert out.dtype == q.dtype and out.shape == ref_out.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert not out.isnan().any()
    _check_lse(lse, ref_lse)
    assert rel_err(out, ref_out) < 1e-5
    dead = ref_lse == NEG_INF
    if bias_kind != "none":
        assert dead.any(), "the bias is meant to mask some rows completely"
    assert (out[dead] == 0).all(), "rows with no key must output exactly 0"


# ---- registered autograd (dout and dlse paths) -------------------------------------------------


@pytest.mark.parametrize("uses", ["out", "lse", "both"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("bias_kind", BIASES)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_autograd_matches_dense(shape, bias_kind, is_causal, uses):
    q, k, v = _inputs(shape)
    bias = _bias(bias_kind, shape)
    scale = 0.37
    w = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])
    u = torch.randn(q.shape[:-1])

    def loss(out, lse):
        # lse is only used on rows that attend to something (it is -inf elsewhere).
        total = 0.0
        if uses in ("out", "both"):
            total = total + (out * w.to(out.dtype)).sum()
        if uses in ("lse", "both"):
            total = total + (torch.where(lse > NEG_INF, lse, 0.0) * u.to(lse.dtype)).sum()
        return total

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(loss(*block_attention(*leaves, bias, scale, is_causal)), leaves)

    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    # v does not enter lse: its float64 gradient is then zero.
    expected = torch.autograd.grad(
        loss(*_dense(*leaves64, bias, scale, is_causal)), leaves64, materialize_grads=True
    )

    for name, got, want in zip("qkv", grads, expected):
        assert got.shape == want.shape and got.dtype == torch.float32, name
        assert torch.isfinite(got).all(), name
        assert rel_err(got, want) < 1e-5, name


# ---- backward kernel on rows with infinite lse -------------------------------------------------


@pytest.mark.parametrize("inf", [float("inf"), NEG_INF], ids=["+inf", "-inf"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("bias_kind", ["none", "key_padding"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_backward_infinite_lse_rows_contribute_nothing(shape, bias_kind, is_causal, inf):
    q, k, v = _inputs(shape)
    bias = _bias(bias_kind, shape)
    scale = 0.37
    out, lse = block_attention(q, k, v, bias, scale, is_causal)
    dout = torch.randn_like(out)
    rows = torch.rand(lse.shape) < 0.4  # rows whose merged lse says "contributes nothing"
    rows[0, 0, 1] = True

    dq, dk, dv = block_attention_backward(
        dout, q, k, v, out, lse.masked_fill(rows, inf), bias, scale, is_causal
    )
    # Expected: the same backward with those rows' upstream gradient set to zero.
    dq0, dk0, dv0 = block_attention_backward(
        dout.masked_fill(rows.unsqueeze(-1), 0.0), q, k, v, out, lse, bias, scale, is_causal
    )
    for got in (dq, dk, dv):
        assert torch.isfinite(got).all()
    assert (dq[rows] == 0).all()
    torch.testing.assert_close(dq, dq0.masked_fill(rows.unsqueeze(-1), 0.0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dk, dk0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dv, dv0, rtol=1e-5, atol=1e-6)


# ---- layouts -------------------------------------------------------------------------------------


def _last_dim_strided(t: torch.Tensor) -> torch.Tensor:
    """The same values with last-dim stride != 1 (e.g. ``x.transpose(-1, -2)`` of a user tensor)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_unit_last_dim_stride(which):
    shape = (4, 2, 8, 8, 7, 7)  # D == Dv: no zero padding that would copy the strided input
    q, k, v = _inputs(shape)
    args = {"q": q, "k": k, "v": v}
    args[which] = _last_dim_strided(args[which])
    leaves = [args[n].requires_grad_() for n in "qkv"]
    out, lse = block_attention(*leaves, None, 0.37, False)
    grads = torch.autograd.grad(out.square().sum(), leaves)

    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = _dense(*leaves64, None, 0.37, False)
    expected = torch.autograd.grad(ref_out.square().sum(), leaves64)
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(lse, ref_lse) < 1e-5
    for got, want in zip(grads, expected):
        assert rel_err(got, want) < 1e-5


# ---- dropout (Note [Dropout in blocks] in kernels.py) ----------------------------------------


def _dropout_args(block=(0, 1)):
    return (0.3, torch.tensor(1234), list(block))


@pytest.mark.parametrize("chunk", [1 << 22, 8], ids=["one_chunk", "row_chunks"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("bias_kind", BIASES)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_dropout_block_is_one_function_forward_and_backward(shape, bias_kind, is_causal, chunk, monkeypatch):
    """With a seed and a block fixed, the op is one deterministic function whose gradients
    (through out and lse) are its own; lse is the undropped one and empty rows stay empty."""
    from ring_rewrite import kernels

    monkeypatch.setattr(kernels, "DROPOUT_CHUNK", chunk)
    q, k, v = (t.requires_grad_() for t in _inputs(shape, dtype=torch.float64))
    bias = _bias(bias_kind, shape, dtype=torch.float64)
    drop = _dropout_args()

    def f(q, k, v):
        out, lse = block_attention(q, k, v, bias, 0.3, is_causal, *drop)
        return out, lse.masked_fill(lse == NEG_INF, 0.0)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)
    out, lse = block_attention(q, k, v, bias, 0.3, is_causal, *drop)
    again, _ = block_attention(q, k, v, bias, 0.3, is_causal, *drop)
    other, _ = block_attention(q, k, v, bias, 0.3, is_causal, *_dropout_args(block=(0, 2)))
    expected_out, expected_lse = _dense(q, k, v, bias, 0.3, is_causal)
    assert torch.equal(out, again) and not torch.equal(out, other)
    _check_lse(lse, expected_lse)
    assert (out[lse == NEG_INF] == 0).all()


def test_dropout_block_keeps_the_expected_fraction():
    """Values I show the probabilities: ``1 - p`` of them kept, scaled by ``1 / (1 - p)``."""
    q, k = torch.randn(1, 2, 300, 8), torch.randn(1, 2, 400, 8)
    eye = torch.eye(400).expand(1, 2, 400, 400)
    out, _ = block_attention(q, k, eye, None, 0.3, False, *_dropout_args())
    probs, _ = _dense(q, k, eye, None, 0.3, False)
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.7) < 5 * (0.21 / kept.numel()) ** 0.5
    assert rel_err(out[kept], probs[kept] / 0.7) < 1e-5


def test_opcheck_block_attention_with_dropout():
    q, k, v = (t.requires_grad_() for t in _inputs(SHAPES["gqa_d>dv"]))
    torch.library.opcheck(block_attention, (q, k, v, None, 0.3, True, *_dropout_args()))
