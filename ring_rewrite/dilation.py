"""Dilation math: where each branch's rows live, and the gathers that move them.

Note [Branch lattice]
~~~~~~~~~~~~~~~~~~~~~
Branch ``(w, r)`` cuts the sequence into segments of ``w`` tokens (one segment when ``w >= N``,
rounded up to a multiple of ``r``) and keeps, for query head ``j``, the positions
``p ≡ j (mod r)`` of each segment (LongNet, Ding et al. 2023, eq. 4-6: "head j takes offset
j mod r"). Padding the sequence to ``Np = nseg * seg`` tokens makes every segment hold exactly
``m = seg / r`` rows per head, so one branch is one batched attention call over
``(B * nseg, heads, m, D)``:

    x (B, H, Np, C) --view--> (B, H, nseg, m, r, C) --pick (head, offset) pairs--> (B*nseg, A, m, C)

Row ``p`` of head ``j`` lands at segment ``p // seg``, row ``(p % seg) // r``: a strided view,
so no loop over segments or positions exists anywhere.

Keys follow their query head: kv head ``h`` serves query heads ``h*g .. h*g+g-1`` (``g = Hq /
Hkv``), which use the offsets ``(h*g + i) mod r``. When ``r`` divides ``g`` every kv head is
needed at every offset, each by ``g / r`` query heads: the kernel's own GQA runs on ``Hkv * r``
dilated kv heads (``Hkv * N`` rows in all, no repeat). Otherwise each query head gets its own
dilated kv head (``Hq * N / r`` rows; fewer than ``Hkv * N`` whenever ``g <= r``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

__all__ = ["BranchLayout", "last_dim"]


def last_dim(x: torch.Tensor, batch: int):
    """The last dim's size for a view of ``x``: ``-1``, except with a batch of 0, where ``-1``
    is ambiguous and the size is spelled out."""
    return -1 if batch else x.shape[-1]


@dataclasses.dataclass(frozen=True)
class BranchLayout:
    """Geometry of one branch ``(w, r)`` over ``n`` tokens, ``hq`` query and ``hkv`` kv heads.

    Methods read no tensor shapes (the rewrite traces them with FX proxies); channel dims are
    left to ``-1`` or passed in.
    """

    w: int
    r: int
    n: int
    batch: int
    hq: int
    hkv: int
    head0: int = 0
    """The site's number of the first query head: a layout of a slice of the heads (``heads``)
    keeps each head's lattice offset ``j mod r`` of its number ``j`` in the site."""

    def heads(self, start: int, stop: int) -> "BranchLayout":
        """The layout of query heads ``[start, stop)`` (and the kv heads they read) of this one:
        whole kv heads, so ``start`` and ``stop`` are multiples of ``g``."""
        assert start % self.g == 0 and stop % self.g == 0, (start, stop, self.g)
        return dataclasses.replace(
            self, hq=stop - start, hkv=(stop - start) // self.g, head0=self.head0 + start
        )

    @property
    def seg(self) -> int:
        """Effective segment length: ``w``, or the whole sequence rounded up to a multiple of r."""
        if self.w < self.n:
            return self.w
        return -(-self.n // self.r) * self.r

    @property
    def padded(self) -> int:
        return -(-self.n // self.seg) * self.seg

    @property
    def nseg(self) -> int:
        return self.padded // self.seg

    @property
    def gathered(self) -> bool:
        """Whether the branch's rows are copies (a gather at ``r > 1``, or padding), not views
        of the inputs."""
        return self.r > 1 or self.padded != self.n

    @property
    def m(self) -> int:
        """Rows per head per segment after dilation."""
        return self.seg // self.r

    @property
    def g(self) -> int:
        return self.hq // self.hkv

    @property
    def shared_kv(self) -> bool:
        """True when query heads share dilated kv heads (``r`` divides ``g``)."""
        return self.g % self.r == 0

    @property
    def kernel_group(self) -> int:
        """Query heads per dilated kv head in the block kernel."""
        return self.g // self.r if self.shared_kv else 1

    @property
    def kv_heads(self) -> int:
        """Dilated kv heads the block kernel sees."""
        return self.hkv * self.r if self.shared_kv else self.hq

    # ---- (head, offset) pairs -------------------------------------------------------------
    # Kernel order of query heads: grouped by the dilated kv head they read.

    def _q_pairs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.arange(self.hq, device=device)
        if not self.shared_kv:
            return a, (a + self.head0) % self.r
        per = self.g // self.r  # query heads per (kv head, offset)
        head, rest = a // self.g, a % self.g
        off, c = rest // per, rest % per
        return head * self.g + c * self.r + off, off

    def _q_inverse(self, device: torch.device) -> torch.Tensor:
        """Kernel position of each natural query head."""
        j = torch.arange(self.hq, device=device)
        if not self.shared_kv:
            return j
        per = self.g // self.r
        head, rest = j // self.g, j % self.g
        return head * self.g + (rest % self.r) * per + rest // self.r

    def _kv_pairs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shared_kv:
            a = torch.arange(self.hkv * self.r, device=device)
            return a // self.r, a % self.r
        a = torch.arange(self.hq, device=device)
        return (a if self.g == 1 else a // self.g), (a + self.head0) % self.r

    # ---- gathers --------------------------------------------------------------------------

    def _split(self, x: torch.Tensor, heads: int, fill: float = 0.0) -> torch.Tensor:
        """(B, H, n, C) -> (B, nseg, H, r, m, C), padding the sequence with ``fill``."""
        if self.padded != self.n:
            x = F.pad(x, (0, 0, 0, self.padded - self.n), value=fill)
        x = x.view(self.batch, heads, self.nseg, self.m, self.r, last_dim(x, self.batch))
        return x.permute(0, 2, 1, 4, 3, 5)

    def _merge_split(self, y: torch.Tensor, heads: int) -> torch.Tensor:
        """(B, nseg, H, r, m, C) -> (B, H, n, C): inverse of ``_split``."""
        y = y.permute(0, 2, 1, 4, 3, 5).reshape(self.batch, heads, self.padded, last_dim(y, self.batch))
        return y if self.padded == self.n else y[:, :, : self.n]

    def dilate_q(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Rows of query-like ``x (B, Hq, n, C)`` in kernel layout ``(B*nseg, Hq, m, C)``."""
        x6 = self._split(x, self.hq, fill)
        if self.r == 1:
            y = x6[:, :, :, 0]
        else:
            head, off = self._q_pairs(x.device)
            y = x6[:, :, head, off]
        return y.reshape(self.batch * self.nseg, self.hq, self.m, last_dim(y, self.batch))

    def undilate_q(self, y: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Inverse of ``dilate_q``: ``(B*nseg, Hq, m, C) -> (B, Hq, n, C)``, ``fill`` off-lattice."""
        y = y.view(self.batch, self.nseg, self.hq, self.m, last_dim(y, self.batch))
        if self.r == 1:
            return self._merge_split(y.unsqueeze(3), self.hq)
        if self.shared_kv:
            y = y[:, :, self._q_inverse(y.device)]
        heads = torch.arange(self.hq, device=y.device)
        offs = torch.arange(self.r, device=y.device)
        on_lattice = ((heads.view(-1, 1) + self.head0) % self.r == offs).view(1, 1, self.hq, self.r, 1, 1)
        y6 = y.unsqueeze(3).expand(-1, -1, -1, self.r, -1, -1)
        return self._merge_split(torch.where(on_lattice, y6, fill), self.hq)

    def dilate_kv(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of ``k`` or ``v (B, Hkv, n, C)`` in kernel layout ``(B*nseg, kv_heads, m, C)``."""
        x6 = self._split(x, self.hkv)
        if self.shared_kv:
            y = x6  # (head, offset) pairs in natural order: a view.
        else:
            head, off = self._kv_pairs(x.device)
            y = x6[:, :, head, off]
        return y.reshape(self.batch * self.nseg, self.kv_heads, self.m, last_dim(y, self.batch))

    def real_rows(self, real: int) -> tuple[int, dict[int, int]]:
        """Where the first ``real`` positions of the sequence end in the kernel layout: the
        segments whose rows all hold one of them, and per lattice offset the rows of the next
        segment that do (its heads hold positions ``start + offset + r * i``: a prefix of their
        rows, one more or one fewer than another offset's). No later segment holds any."""
        counts = {o: max(0, -(-(real - o) // self.r)) for o in sorted({o for _, o in _pairs(self, False)})}
        whole = min(self.nseg, min(counts.values()) // self.m)
        if whole == self.nseg:
            return whole, {}
        return whole, {o: min(self.m, c - whole * self.m) for o, c in counts.items()}

    def kernel_heads(self, offsets, *, kv: bool) -> list[int]:
        """The kernel heads (kv heads with ``kv``) at the lattice ``offsets``, in kernel order: a
        query head reads the same kv head among them as among all."""
        return [a for a, (_, o) in enumerate(_pairs(self, kv)) if o in offsets]

    @property
    def in_place(self) -> bool:
        """Whether a block kernel can read this layout's rows where they lie and add their
        gradients there (``lattice``): no padding, and no two kernel kv heads on the same rows
        (kernel heads run in parallel)."""
        kv = _pairs(self, True)
        return self.padded == self.n and len(set(kv)) == len(kv)

    def lattice(self, x: torch.Tensor, *, kv: bool) -> list[int]:
        """Where the kernel layout's rows of ``x (B, H, n[, C])`` lie in ``x`` itself, as
        ``flash_cpu.c`` reads them (``in_place`` layouts): element strides of a batch, a
        segment and a row, then each kernel head's first row, its head and lattice offset."""
        s0, s1, s2 = x.stride()[:3]
        return [s0, self.seg * s2, self.r * s2, *(h * s1 + o * s2 for h, o in _pairs(self, kv))]

    def gathered_shape(self, batch: int, channels: int, *, kv: bool, rows: bool) -> tuple[int, ...]:
        """Shape of ``gather``'s result for an input of ``batch`` and ``channels``."""
        heads = self.kv_heads if kv else self.hq
        if rows:
            return (batch, heads, self.nseg * self.m, channels)
        return (batch * self.nseg, heads, self.m, channels)

    def _runs(self, x: torch.Tensor, y: torch.Tensor, *, kv: bool, rows: bool):
        """For each kernel head of ``y`` (``gather``'s layout) and each run of its rows that is one
        strided view of ``x (B, H, n', C)``: ``(x's rows, y's rows)``, views of the same shape,
        and last, per head, the rows of ``y`` past the sequence (empty if no padding). ``x``
        holds the layout's ``n`` rows, or fewer: a length bucket's real ones (Note [Padding to a
        bucket]), the rest of the layout's rows being past the sequence."""
        pairs = _pairs(self, kv)
        batch, n, channels = x.shape[0], x.shape[2], x.shape[-1]
        assert n <= self.n, (n, self.n)
        if rows:
            runs = y.view(batch, len(pairs), self.nseg, self.m, channels)
        else:
            runs = y.view(batch, self.nseg, len(pairs), self.m, channels).transpose(1, 2)
        whole = n // self.seg  # segments inside the sequence; the next one may be cut short
        for a, (h, o) in enumerate(pairs):
            xh = x[:, h]
            if whole:
                cut = xh.narrow(1, 0, whole * self.seg).view(batch, whole, self.m, self.r, channels)
                yield cut[:, :, :, o], runs[:, a, :whole], ()
            if whole < self.nseg:
                tail = runs[:, a, whole]  # (B, m, C)
                start = whole * self.seg + o
                kept = max(0, -(-(n - start) // self.r))
                past = (tail.narrow(1, kept, self.m - kept), runs[:, a, whole + 1 :])
                yield xh[:, start :: self.r], tail.narrow(1, 0, kept), past

    def gather(
        self, x: torch.Tensor, *, kv: bool = False, rows: bool = False, fill: float = 0.0,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """``dilate_kv(x)`` (``kv``) or ``dilate_q(x, fill)`` copied into a buffer of its own, in
        ``dtype`` (default ``x``'s); with ``rows`` in a ring branch's layout ``(B, H', nseg*m, C)``
        (per head its segments one after another) instead of ``(B*nseg, H', m, C)``.

        One strided copy per kernel head (its head and lattice offset are Python ints here, not
        constants of generated code: Note [Gathers as calls]); rows past the
        sequence (``padded > n``, or past ``x``'s rows) get ``fill``.
        """
        out = x.new_empty(self.gathered_shape(x.shape[0], x.shape[-1], kv=kv, rows=rows), dtype=dtype)
        for src, dst, past in self._runs(x, out, kv=kv, rows=rows):
            dst.copy_(src)
            for rest in past:
                rest.fill_(fill)
        return out

    def scatter(self, total: torch.Tensor, y: torch.Tensor) -> None:
        """Writes ``y``, query rows in ``gather``'s layout, at their positions of ``total (B, Hq,
        n, C)``, in place (rows past the sequence dropped; every other position untouched)."""
        for dst, src, _ in self._runs(total, y, kv=False, rows=False):
            dst.copy_(src)

    def scatter_add(
        self, total: torch.Tensor, y: torch.Tensor, *, kv: bool = False, rows: bool = False, zero: bool = False
    ) -> None:
        """Adds ``y``, rows in ``gather``'s layout, at their positions of ``total (B, H, n, C)``
        (this layout's kv heads with ``kv``, else its query heads), in place: the adjoint of
        ``gather``, rows past the sequence dropped. With ``zero``, ``total`` is zeroed first
        (written, where every position gets one row: rate 1, no padding).

        Kernel heads add one after another, so two that read the same rows (a kv head serving
        query heads of one offset) both count (Note [Gradient sums as calls]).
        """
        write = zero and self.r == 1 and self.padded == self.n
        if zero and not write:
            total.zero_()
        for dst, src, _ in self._runs(total, y, kv=kv, rows=rows):
            dst.copy_(src) if write else dst.add_(src)


@functools.lru_cache(maxsize=256)
def _pairs(layout: BranchLayout, kv: bool) -> tuple[tuple[int, int], ...]:
    """``(head, offset)`` of each kernel head of ``layout``'s kv rows (``kv``) or query rows, as
    ints: a gather's or gradient sum's loop at run time (computed once per layout)."""
    head, off = (layout._kv_pairs if kv else layout._q_pairs)(torch.device("cpu"))
    return tuple(zip(head.tolist(), off.tolist()))
