"""Decode steps: the last rows of dilated attention, for a query shorter than its keys.

With a KV cache, a model calls SDPA with ``q`` the newest ``m`` tokens and ``k, v`` the whole
prefix of ``N`` (cache + new). Those queries are positions ``N - m .. N - 1`` and the
step computes exactly those rows of the site's function, so greedy generation equals
recomputing the whole prefix at every step. Per branch ``(w, r)`` and query head ``j`` (offset
``o = j mod r``) query ``p`` reaches key ``t`` when ``p // w == t // w``, ``p ≡ t ≡ o (mod r)``
(and ``t <= p`` when causal: a prefix has no later key anyway): the ``log c`` bias of the dense
form, for ``m`` rows only. That is O(m N) per head, small for the ``m`` of a decode step, and
written with the cache length as a size, so a symbolic length (dynamo's automatic dynamic shapes,
from the second decode step on) compiles once for every later length.

A sharded cache (Note [A sharded KV cache]) holds each rank's part of the keys at positions it
names; the same rule, read at those positions, gives each rank its rows' partial result and
log-sum-exp, and one all-gather of the partials merges them exactly (``sharded_decode``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .merge import merge_partials
from .numerics import masked_fills, stat_dtype

__all__ = ["decode_attention", "sharded_decode", "sharded_keys"]

def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    branches: Sequence[tuple[int, int]],
    scale: float,
    is_causal: bool,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    with_lse: bool = False,
):
    """Rows ``N - m .. N - 1`` of dilated attention: ``q (B, Hq, m, D)``, ``k (B, Hkv, N, D)``,
    ``v (B, Hkv, N, Dv)``, ``bias`` an additive key bias broadcast to ``(B, Hq, 1, N)``;
    ``branches`` as ``RingDilatedConfig.branches`` (a segment ``w >= N`` is the whole prefix).
    Where the keys are not the prefix ``0 .. N - 1`` (a sliding-window cache holds the last keys
    only, a sharded cache a rank's part) ``query_positions (m,)`` and ``key_positions (N,)`` give
    the tokens' positions. With ``with_lse`` it returns ``(out, lse)``, the rows' log-sum-exp
    ``(B, Hq, m)`` in float32 (``-inf`` where a row reaches no key) and ``out`` in float32, the
    partial result ``merge_partials`` merges."""
    hq, m, hkv, n = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    acc = stat_dtype(q.dtype)
    p = torch.arange(m, device=q.device) + (n - m) if query_positions is None else query_positions
    t = torch.arange(n, device=q.device) if key_positions is None else key_positions
    heads = torch.arange(hq, device=q.device).view(-1, 1, 1)
    counts = 0
    for w, r in branches:
        same = (p.view(-1, 1) // w) == (t.view(1, -1) // w)
        on = ((p.view(1, -1, 1) - heads) % r == 0) & ((t.view(1, 1, -1) - heads) % r == 0)
        counts = counts + (same & on).to(acc)  # (Hq, m, N)
    if is_causal:
        counts = counts * (t.view(1, 1, -1) <= p.view(1, -1, 1))
    log_c = torch.where(counts > 0, counts.log(), float("-inf"))
    # Query head j reads kv head j // (Hq // Hkv): grouped, K/V never repeated.
    qg = q.to(acc).unflatten(1, (hkv, hq // hkv))
    scores = (qg @ k.to(acc).unsqueeze(2).transpose(-1, -2)).flatten(1, 2) * scale + log_c
    if bias is not None:
        # Less each row's largest value (a constant of the row: the same softmax), a bias that
        # grows with the position (ALiBi's slope_h * t) adds what the dense slope_h * (t - p)
        # adds (Note [Recentred key biases] in attention.py); fills mask as -inf does, also in
        # a row they mask whole, which attends to nothing (Note [Fills that mask] in numerics.py).
        # NOTE: float32's floor: the step is traced with proxies, whose dtype is no value; it
        # is at or above float64's.
        bias = masked_fills(bias.to(acc), torch.float32)
        top = bias.amax(-1, keepdim=True)
        scores = scores + (bias - torch.where(top > float("-inf"), top, 0.0))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(top == float("-inf"), 0.0, top)  # a row with nothing to attend: zeros
    probs = torch.exp(scores - top)
    total = probs.sum(-1, keepdim=True)
    out = (probs.unflatten(1, (hkv, hq // hkv)) @ v.to(acc).unsqueeze(2)).flatten(1, 2)
    out = out / torch.where(total > 0, total, 1.0)
    if with_lse:
        return out, (top + torch.log(total)).squeeze(-1)
    return out.to(q.dtype)


# Note [A sharded KV cache]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# After a prefill in sharded mode each rank holds the keys and values of its part of the prompt
# (``ring_rewrite.cache.ShardedCache``): ceil(N / P) tokens, at the positions the cache names
# (Note [An even cache]). Every rank runs each decode step with the same new tokens, so the step's queries are the
# same everywhere; each rank computes, for the rows of the function, the partial result over its
# keys and its log-sum-exp (``decode_attention`` at the keys' positions), and one all-gather of
# ``(out, lse)``, m rows per head, merges them (``merge_partials``): exact, as a ring step's merge
# is. Memory per rank stays O(N / P) and a step moves P * B * H * m * (Dv + 1) floats to a rank.
#
# New tokens are appended on every rank but attended on rank 0 only: the others, and the
# prefill's padding, hold position -1, which no segment contains (-1 // w = -1). The cost is a
# copy of the generated tokens per rank; in exchange every rank's step has the same shapes and
# so compiles at the same steps. Ranks whose shapes differed would compile at different steps,
# and one rank's compile-time agreement exchange would meet another's all-gather.
#
# The positions reach the graph through ``sharded_keys(keys, key_positions, query_positions, ...)``,
# which the cache wraps around the keys it returns: the rewrite reads the positions from its
# arguments and drops it (``passes/rewrite_decode.py``). Anywhere else it raises: one rank's keys
# attended as if they were all of them would be a silently wrong answer.


@torch.library.custom_op("ring_rewrite::sharded_keys", mutates_args=())
def sharded_keys(
    keys: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor, layout: str, world: int
) -> torch.Tensor:
    """A rank's part of a sharded KV cache, ``keys (B, Hkv, N_r, D)`` at ``key_positions (N_r,)``,
    for queries at ``query_positions (m,)``, cut by ``layout`` over ``world`` ranks: a marker
    only the backend's rewrite may read (Note [A sharded KV cache]), which checks that its own
    layout and ranks are the cache's."""
    raise RuntimeError(
        "ring_rewrite: keys of a ShardedCache reached attention that the ring_dilated backend did "
        "not rewrite: a sharded cache holds this rank's part of the keys only, so a model that "
        "decodes from it must be compiled with backend='ring_dilated' and sharding='sharded'"
    )


@sharded_keys.register_fake
def _(keys, key_positions, query_positions, layout, world):
    return torch.empty_like(keys)


def sharded_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    *,
    branches: Sequence[tuple[int, int]],
    scale: float,
    world: int,
    group_name: str,
) -> torch.Tensor:
    """A decode step over a sharded cache (Note [A sharded KV cache]): this rank's partial rows
    and their log-sum-exp, one all-gather of both over the ``world`` ranks of ``group_name``, the
    exact merge. ``q`` is the same on every rank; ``k, v`` and ``key_positions`` are this rank's."""
    out, lse = decode_attention(
        q, k, v, None, branches=branches, scale=scale, is_causal=False,
        query_positions=query_positions, key_positions=key_positions, with_lse=True,
    )  # fmt: skip
    if world == 1:
        return out.to(q.dtype)
    packed = torch.cat([out, lse.unsqueeze(-1)], -1)
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(packed, world, group_name)
    parts = torch.ops._c10d_functional.wait_tensor(gathered).unflatten(0, (world, -1))
    merged, _ = merge_partials([parts[i, ..., :-1] for i in range(world)], [parts[i, ..., -1] for i in range(world)])
    return merged.to(q.dtype)
