"""Dense float64 reference of the function attention computes (docs/semantics.md, The function:
the log-count bias form). Slow and O(N^2): for tests and the training demo's first-step check."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.utils.checkpoint

__all__ = ["reference_attention", "reference_rows", "connection_counts"]


def connection_counts(
    n: int, heads: int, branches: Sequence[tuple[int, int]], *, is_causal: bool, device=None
) -> torch.Tensor:
    """``c[j, p, t]``: how many branches connect query ``p`` to key ``t`` for head ``j``."""
    pos = torch.arange(n, device=device)
    p, t = pos.view(-1, 1), pos.view(1, -1)
    counts = torch.zeros(heads, n, n, dtype=torch.float64, device=device)
    for w, r in branches:
        same_segment = (p // w) == (t // w)
        for j in range(heads):
            o = j % r
            counts[j] += (same_segment & (p % r == o) & (t % r == o)).double()
    if is_causal:
        counts = counts * (t <= p)
    return counts


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    segment_lengths: Sequence[int] | None = None,
    dilation_rates: Sequence[int] | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    key_bias: torch.Tensor | None = None,
    query_chunk: int | None = None,
) -> torch.Tensor:
    """Dilated attention in float64, the dense reference every numerics test compares against.

    Computes the function a rewritten site computes in its dense form (docs/semantics.md, The
    function): softmax attention with the additive bias ``log c(j, p, t)``, where ``c`` counts
    the branches ``(w_i, r_i)`` that connect query ``p`` and key ``t`` for head ``j`` (same
    segment ``p // w_i == t // w_i``, both on the lattice ``≡ j mod r_i``, and ``t <= p`` with
    ``is_causal``). A row with no connected key gives 0. With no segment lengths this is exact
    softmax attention. Inputs are cast to float64 and the result is float64; it is
    differentiable (gradients flow back to the inputs in their dtype). O(N^2) time; memory
    O(N^2) too unless ``query_chunk`` is given. With GQA (``Hq % Hkv == 0``) query head ``j``
    reads key/value head ``j // (Hq // Hkv)``. NaN propagates as in SDPA's kernels.

    Args:
        q (Tensor): queries.
        k (Tensor): keys.
        v (Tensor): values.
        segment_lengths (Sequence[int], optional): ``w_i`` of each branch, given together with
            ``dilation_rates``; not validated here (``RingDilatedConfig`` checks a config).
            Default: ``None`` (exact attention).
        dilation_rates (Sequence[int], optional): ``r_i`` of each branch. Default: ``None``.
        is_causal (bool): causal attention. Default: ``False``.
        scale (float, optional): the score scale. Default: ``None`` (``D ** -0.5``).
        key_bias (Tensor, optional): an additive float bias over the keys, or a bool keep-mask
            (``False``: masked out). Default: ``None``.
        query_chunk (int, optional): compute the queries this many at a time, so the scores
            never exceed ``(B, Hq, query_chunk, N)``, forward or backward (each chunk is
            recomputed in the backward; a float64 check at 16k tokens fits in a few GiB), each
            chunk over only the keys one of its queries connects to (with ``is_causal``, none
            after its last query). The same function up to float64 rounding of the sums.
            Default: ``None`` (one dense pass; so is any value ``>= N``).

    Returns:
        Tensor: the attention output, float64.

    Raises:
        ValueError: ``query_chunk < 1`` (when it is below ``N``).

    Shapes:
        - ``q``: :math:`(B, H_q, N, D)`.
        - ``k``: :math:`(B, H_{kv}, N, D)`.
        - ``v``: :math:`(B, H_{kv}, N, D_v)`.
        - ``key_bias``: :math:`(B, H_q, 1, N)`, each of ``B`` and ``H_q`` possibly 1
          (broadcast over the query rows).
        - Output: :math:`(B, H_q, N, D_v)`, float64.

    Example::

        q, k, v = (torch.randn(1, 4, 64, 16) for _ in range(3))
        ref = ring_rewrite.reference_attention(q, k, v, segment_lengths=[16, 64],
                                               dilation_rates=[1, 4], is_causal=True)
        out = torch.compile(attend, backend=ring_rewrite.backend(
            segment_lengths=[16, 64], dilation_rates=[1, 4]))(q, k, v)
        assert (out.double() - ref).abs().max() < 1e-5

    .. warning::
        Tested on CPU. A bool ``key_bias`` is turned into a float bias on the CPU, so with
        inputs on another device pass a float bias (``0`` / ``-inf``) instead.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    scale = d**-0.5 if scale is None else scale
    if segment_lengths is None:
        branches = [(n, 1)]
    else:
        branches = list(zip(segment_lengths, dilation_rates))
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    if key_bias is not None and key_bias.dtype == torch.bool:
        key_bias = torch.zeros(key_bias.shape, dtype=torch.float64).masked_fill(
            ~key_bias, float("-inf")
        )
    if query_chunk is None or query_chunk >= n:
        counts = connection_counts(n, hq, branches, is_causal=is_causal, device=q.device)
        return _attend(q, k, v, counts, key_bias, scale)
    if query_chunk < 1:
        raise ValueError(f"query_chunk must be >= 1, got {query_chunk}")
    grads = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    outs = []
    for start in range(0, n, query_chunk):
        chunk = functools.partial(
            _attend_rows, start=start, stop=min(start + query_chunk, n), branches=branches,
            is_causal=is_causal, scale=scale,
        )  # fmt: skip
        if grads:
            # Recomputed in the backward (counts and gathered keys too): one chunk's scores at a
            # time there as well, and nothing of size (queries x keys) saved.
            outs.append(torch.utils.checkpoint.checkpoint(chunk, q, k, v, key_bias, use_reentrant=False))
        else:
            outs.append(chunk(q, k, v, key_bias))
    return torch.cat(outs, dim=2)


def reference_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    *,
    segment_lengths: Sequence[int] | None = None,
    dilation_rates: Sequence[int] | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Rows ``[start, start + L)`` of :func:`reference_attention` of the whole sequence, where
    ``q (B, Hq, L, D)`` holds only those rows' queries and ``k``, ``v`` every key: float64,
    differentiable. A row depends on its own query alone, so its out and dq are exact from
    ``q``'s rows (how ``benchmarks/gpu.py`` checks sequences too long for the whole reference).
    Only the keys the rows connect to are cast to float64. Time and memory O(L x N)."""
    n, hq, stop = k.shape[2], q.shape[1], start + q.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    branches = [(n, 1)] if segment_lengths is None else list(zip(segment_lengths, dilation_rates))
    keys = stop if is_causal else n  # causal: no key after the last row is connected
    counts = _counts(start, stop, keys, hq, branches, is_causal=is_causal, device=q.device)
    used = (counts.amax(dim=(0, 1)) > 0).nonzero().squeeze(1)
    k, v = (x[:, :, used].double().repeat_interleave(hq // x.shape[1], dim=1) for x in (k, v))
    return _attend(q.double(), k, v, counts[:, :, used], None, scale)


def _counts(
    start: int,
    stop: int,
    keys: int,
    heads: int,
    branches: Sequence[tuple[int, int]],
    *,
    is_causal: bool,
    device=None,
) -> torch.Tensor:
    """``connection_counts(...)[:, start:stop, :keys]`` without building the whole matrix.

    The lattice of offset o in a rate-r branch is the strided block ``[o::r, o::r]`` (rows
    shifted by the chunk start), shared by heads ``o, o + r, ...``: each branch tests
    same-segment (and causal) on ``1/r^2`` of the entries only.
    """
    counts = torch.zeros(heads, stop - start, keys, dtype=torch.float64, device=device)
    for w, r in branches:
        for o in range(min(r, heads)):
            i0 = (o - start) % r  # first row of the chunk with p ≡ o (mod r); keys start at 0
            if start + i0 >= stop or o >= keys:
                continue
            p = torch.arange(start + i0, stop, r, device=device).view(-1, 1)
            t = torch.arange(o, keys, r, device=device).view(1, -1)
            connected = (p // w) == (t // w)
            if is_causal:
                connected &= t <= p
            counts[o::r, i0::r, o::r] += connected
    return counts


def _attend_rows(q, k, v, key_bias, *, start, stop, branches, is_causal, scale) -> torch.Tensor:
    """Rows ``[start, stop)`` of the chunked reference: only the keys one of them connects to."""
    b, hq, n, _ = q.shape
    keys = stop if is_causal else n  # causal: no key after the chunk's last query is connected
    counts = _counts(start, stop, keys, hq, branches, is_causal=is_causal, device=q.device)
    # Keys no query of the chunk connects to (for any head) only add exp(-inf) = 0: drop them.
    used = (counts.amax(dim=(0, 1)) > 0).nonzero().squeeze(1)
    if used.numel() == 0:  # no query of the chunk attends to anything: zeros
        return q.new_zeros(b, hq, stop - start, v.shape[-1])
    if key_bias is not None and key_bias.shape[-1] == n:
        key_bias = key_bias[..., used]
    qs, ks, vs = q[:, :, start:stop], k[:, :, used], v[:, :, used]
    return _attend(qs, ks, vs, counts[:, :, used], key_bias, scale)


def _attend(q, k, v, counts, key_bias, scale) -> torch.Tensor:
    """Softmax attention with the additive bias ``log counts`` (+ ``key_bias``); empty rows give 0.

    NaN propagates as in SDPA's kernels: a row is NaN when its query is, or when a key it is
    connected to has a NaN score or value. Keys it is not connected to (or masked to ``-inf``)
    are not attended at all, so a NaN there does not reach it (SDPA's flash kernel skips masked
    blocks too; within a block it computes it may still multiply a NaN value by probability 0).
    """
    scores = torch.where(counts > 0, scale * q @ k.transpose(-1, -2) + counts.log(), float("-inf"))
    if key_bias is not None:
        scores = scores + key_bias.double()
    live = ~(scores == float("-inf")).all(-1, keepdim=True)
    probs = torch.softmax(torch.where(live, scores, 0.0), dim=-1) * live
    if not v.isnan().any():
        return probs @ v
    out = probs @ torch.nan_to_num(v, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    # Rows that attend to a NaN value (probability > 0, or NaN itself).
    bad = ((probs != 0).to(v.dtype) @ v.isnan().any(-1, keepdim=True).to(v.dtype)) > 0
    return torch.where(bad, float("nan"), out)
