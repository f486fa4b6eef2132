"""``BranchLayout``: the dilation gathers checked against the lattice, built with loops
(docs/semantics.md, The function).

Branch ``(w, r)``: query head ``j`` holds position ``p`` iff ``p % r == j % r``; segment ``s``
holds the positions with ``p // w == s`` (one segment when ``w >= n``). In kernel layout, batch
row ``b * nseg + s`` holds segment ``s`` of batch ``b``, and row ``i`` of a head is the ``i``-th
lattice position of that segment (then padding). Kernel query head ``a`` reads dilated kv head
``a // kernel_group`` (the block kernel's GQA).
"""

from __future__ import annotations

import pytest
import torch

from ring_rewrite.dilation import BranchLayout

# (w, r, n, batch, hq, hkv)
GRID = [
    (4, 1, 10, 2, 2, 2),  # r = 1, n not a multiple of w
    (4, 2, 10, 1, 4, 2),  # g = 2, r = 2: shared kv
    (6, 2, 12, 2, 6, 2),  # g = 3, r = 2: not shared
    (8, 4, 11, 1, 2, 1),  # g = 2 < r = 4, hq % r != 0
    (16, 2, 9, 2, 3, 3),  # w >= n, n odd, g = 1, hq % r != 0
    (12, 3, 7, 1, 6, 3),  # w >= n, n not a multiple of r, g = 2, r = 3
    (8, 2, 16, 1, 8, 2),  # g = 4, r = 2: shared, two query heads per (kv head, offset)
    (4, 4, 13, 2, 8, 2),  # g = 4, r = 4: shared, one query head per (kv head, offset)
    (9, 3, 20, 1, 3, 1),  # g = 3, r = 3: shared, w odd
    (5, 1, 5, 1, 1, 1),  # w == n, one head
    (6, 3, 6, 1, 5, 5),  # w == n, g = 1, hq % r != 0
    (2, 2, 5, 1, 4, 1),  # g = 4, r = 2, tiny segments
]
IDS = ["w{}-r{}-n{}-b{}-hq{}-hkv{}".format(*p) for p in GRID]
C = 3


def _layout(params) -> BranchLayout:
    return BranchLayout(*params)


def _segments(w: int, n: int) -> list[list[int]]:
    """Positions of each segment (same segment iff ``p // w == t // w``)."""
    nseg = 1 if w >= n else -(-n // w)
    return [[p for p in range(n) if (p // w if w < n else 0) == s] for s in range(nseg)]


def _rows(w: int, r: int, n: int, head: int) -> list[list[int]]:
    """For each segment, the lattice positions of ``head`` in order."""
    return [[p for p in seg if p % r == head % r] for seg in _segments(w, n)]


def _kernel_heads(layout: BranchLayout, x: torch.Tensor, y: torch.Tensor, fill: float) -> list[int]:
    """The natural query head that each kernel head ``a`` of ``y = dilate_q(x)`` holds, checking
    that its rows are that head's lattice positions of each segment, then ``fill`` padding."""
    w, r, n, batch, hq = layout.w, layout.r, layout.n, layout.batch, layout.hq
    nseg = len(_segments(w, n))
    heads = []
    for a in range(hq):
        matches = []
        for j in range(hq):
            expected = torch.full((batch * nseg, layout.m, x.shape[-1]), fill, dtype=x.dtype)
            for b in range(batch):
                for s, rows in enumerate(_rows(w, r, n, j)):
                    assert len(rows) <= layout.m
                    for i, p in enumerate(rows):
                        expected[b * nseg + s, i] = x[b, j, p]
            if torch.equal(y[:, a], expected):
                matches.append(j)
        assert len(matches) == 1, f"kernel head {a} holds no (or no unique) query head's lattice"
        heads.append(matches[0])
    assert sorted(heads) == list(range(hq)), "kernel heads must be a permutation of query heads"
    return heads


@pytest.mark.parametrize("params", GRID, ids=IDS)
def test_geometry(params):
    layout = _layout(params)
    w, r, n, _, hq, hkv = params
    g = hq // hkv
    assert layout.nseg == len(_segments(w, n))
    assert layout.m >= max(len(rows) for j in range(hq) for rows in _rows(w, r, n, j))
    assert layout.shared_kv == (g % r == 0)
    assert layout.kv_heads * layout.kernel_group == hq


@pytest.mark.parametrize("fill", [0.0, float("-inf")])
@pytest.mark.parametrize("params", GRID, ids=IDS)
def test_dilate_undilate_q(params, fill):
    layout = _layout(params)
    w, r, n, batch, hq, _ = params
    x = torch.randn(batch, hq, n, C)
    y = layout.dilate_q(x, fill=fill)
    assert y.shape == (batch * layout.nseg, hq, layout.m, C)
    _kernel_heads(layout, x, y, fill)  # rows are the lattice, in some head order

    back = layout.undilate_q(y, fill=fill)
    expected = torch.empty_like(x)
    for b in range(batch):
        for j in range(hq):
            for p in range(n):
                expected[b, j, p] = x[b, j, p] if p % r == j % r else fill
    assert back.shape == x.shape
    assert torch.equal(back, expected)


@pytest.mark.parametrize("params", GRID, ids=IDS)
def test_dilate_kv_rows(params):
    layout = _layout(params)
    w, r, n, batch, hq, hkv = params
    g = hq // hkv
    nseg = layout.nseg
    x = torch.randn(batch, hq, n, C)
    heads = _kernel_heads(layout, x, layout.dilate_q(x), 0.0)

    k = torch.randn(batch, hkv, n, C)
    got = layout.dilate_kv(k)
    assert got.shape == (batch * nseg, layout.kv_heads, layout.m, C)

    # Each kernel query head a reads dilated kv head a // kernel_group: there must sit the kv
    # head of its query head, at that query head's offset; zeros for padding rows.
    expected = torch.full_like(got, float("nan"))
    for a, j in enumerate(heads):
        want = torch.zeros(batch * nseg, layout.m, C)
        for b in range(batch):
            for s, rows in enumerate(_rows(w, r, n, j)):
                for i, p in enumerate(rows):
                    want[b * nseg + s, i] = k[b, j // g, p]
        slot = a // layout.kernel_group
        if not expected[:, slot].isnan().all():
            assert torch.equal(expected[:, slot], want), (
                f"query heads sharing dilated kv head {slot} need different rows"
            )
        expected[:, slot] = want
    assert not expected.isnan().any(), "every dilated kv head is read by some query head"
    assert torch.equal(got, expected)


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("params", GRID, ids=IDS)
def test_gather_is_the_dilation_in_a_buffer_of_its_own(params, rows):
    """``gather`` (what ``ops.dilate`` runs): ``dilate_q`` / ``dilate_kv`` copied, in kernel
    layout or a ring branch's rows; for a slice of the heads too (``heads``: each keeps the
    lattice offset of its number in the site); from an expanded input; in another dtype."""
    whole = _layout(params)
    g = whole.g
    for layout in (whole, whole.heads(g, whole.hq) if whole.hkv > 1 else whole):
        batch = layout.batch
        for kv, fill in ((False, float("-inf")), (False, 0.0), (True, 0.0)):
            heads = layout.hkv if kv else layout.hq
            for x in (torch.randn(batch, heads, layout.n, C), torch.randn(batch, 1, layout.n, 1).expand(-1, heads, -1, -1)):
                want = layout.dilate_kv(x) if kv else layout.dilate_q(x, fill)
                if rows:  # per head its segments one after another
                    want = want.unflatten(0, (batch, layout.nseg)).transpose(1, 2).flatten(2, 3)
                got = layout.gather(x, kv=kv, rows=rows, fill=fill, dtype=torch.float64)
                assert got.dtype == torch.float64 and got.is_contiguous()
                assert torch.equal(got, want.double())


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("params", GRID, ids=IDS)
def test_scatter_add_is_the_adjoint_of_gather(params, rows):
    """``scatter_add`` (what ``ops.undilate_add`` runs) puts each dilated row back where
    ``gather`` took it, adding: ``<gather(x), y> == <x, scatter_add(0, y)>`` for query and kv
    rows, whole or a slice of the heads; it adds to a running total, and with ``zero`` ignores
    what the total held; for query rows it is ``undilate_q``."""
    whole = _layout(params)
    g = whole.g
    for layout in (whole, whole.heads(g, whole.hq) if whole.hkv > 1 else whole):
        batch = layout.batch
        for kv in (False, True):
            heads = layout.hkv if kv else layout.hq
            x = torch.randn(batch, heads, layout.n, C, dtype=torch.float64)
            y = torch.randn(layout.gathered_shape(batch, C, kv=kv, rows=rows), dtype=torch.float64)
            adjoint = torch.zeros_like(x)
            layout.scatter_add(adjoint, y, kv=kv, rows=rows)
            lhs = (layout.gather(x, kv=kv, rows=rows) * y).sum()
            torch.testing.assert_close(lhs, (x * adjoint).sum(), rtol=1e-12, atol=1e-12)

            total = torch.randn_like(x)
            got = total.clone()
            layout.scatter_add(got, y, kv=kv, rows=rows)
            torch.testing.assert_close(got, total + adjoint, rtol=1e-12, atol=1e-12)
            layout.scatter_add(total, y, kv=kv, rows=rows, zero=True)
            assert torch.equal(total, adjoint)
            if not kv and not rows:
                assert torch.equal(adjoint, layout.undilate_q(y))
