"""A symbolic sequence length becomes a static bucket: one graph for a range of lengths.

Dynamo compiles a function again for each new sequence length until, at the second, its
automatic dynamic shapes make the length a symbol ``s0`` (``dynamic=True`` and
``mark_dynamic`` do so at once). The rewrite needs static lengths (its plan cuts the sequence
into segments, lattices and shards), so without this pass it specialises, guarding
``s0 == n``: one graph per length, and dynamo's recompile limit after eight. Here a site whose
length is symbolic is padded, in the graph, to the bucket ``L``, the power of two with
``L / 2 < s0 <= L`` (guarded), and the padding masked (Note [Padding the sequence] in
``ring_rewrite/attention.py``: the same function, exactly)::

    out = sdpa(q, k, v, attn_mask=m, is_causal=c)                 # q, k, v (B, H, s0, D)

becomes::

    n = q.size(2)
    qp, kp, vp = (_padded(x, L, n) for x in (q, k, v))     # (B, H, L, D), zeros after n
    keep = _key_mask(q, L, n, m)                           # keys [0, n) (and m); none if causal without m
    out = _unpadded(sdpa(qp, kp, vp, attn_mask=keep, is_causal=c), n)     # role "bucket"

so every length in ``(L/2, L]`` runs the graph compiled for the first of them. Only where the
sequence is the site's to cut: replicated mode, or one rank (in sharded mode each rank's shard
holds fixed global positions). ``RingDilatedConfig(disable_passes=["length_buckets"])``
specialises instead.
Cross attention (Note [Self or cross attention] in ``find_sdpa.py``) and a site whose shapes would
not be rewritten anyway (a dense mask) are not touched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from ring_rewrite.config import RingDilatedConfig

from ._fx import propagate_example_values, stamp
from .find_sdpa import SdpaSite, cross_attention_reason, find_sdpa_sites
from .records import records, sharded

__all__ = ["NAME", "bucket_lengths", "bucket"]

NAME = "length_buckets"


def bucket(n: int) -> int:
    """The bucket of a length: the power of two ``L`` with ``L / 2 < n <= L``."""
    return 1 << max(0, n - 1).bit_length()


def bucket_lengths(gm: fx.GraphModule, example_inputs: Any = None, *, config: RingDilatedConfig) -> fx.GraphModule:
    """Pad every site with a symbolic sequence length to its bucket, in place."""
    if sharded(config):
        return gm
    changed = 0
    first = len(records(gm))  # the site numbers rewrite_sdpa will give
    for i, site in enumerate(find_sdpa_sites(gm)):
        length = _symbolic_length(site)
        if length is not None:
            _pad_site(gm.graph, site, length, first + i)
            counters["ring_rewrite"]["bucketed"] += 1
            changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _symbolic_length(site: SdpaSite) -> torch.SymInt | None:
    """The site's sequence length if it is a symbol that q, k, v (and a key-padding mask)
    share, in self attention."""
    q, k, v, mask = (site.meta(x) for x in (site.query, site.key, site.value, site.attn_mask))
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k, v)):
        return None
    if cross_attention_reason(site) is not None:
        return None
    n = q.shape[2]
    if not isinstance(n, torch.SymInt) or n.node.is_constant():
        return None

    def same(x) -> bool:
        # NOTE: guards that x equals n (separate inputs get separate symbols of equal values).
        return isinstance(x, torch.SymInt) and x.node.hint == n.node.hint and bool(x == n)

    if not (same(k.shape[2]) and same(v.shape[2])):
        return None
    if site.attn_mask is not None:
        if not isinstance(mask, torch.Tensor) or site.is_causal or mask.requires_grad:
            return None
        if mask.dim() < 2 or not same(mask.shape[-1]) or mask.shape[-2] != 1:
            return None
    return n


def _pad_site(graph: fx.Graph, site: SdpaSite, n: torch.SymInt, index: int) -> None:
    size = bucket(n.node.hint)
    # NOTE: comparing the symbol guards the graph on its bucket: another length compiles again.
    if not size // 2 < n <= size:
        raise AssertionError(f"length {n} outside its own bucket {size}")
    node = site.node
    new = []

    def call(target, *args, **kwargs) -> fx.Node:
        new.append(graph.call_function(target, args, kwargs))
        stamp(new[-1], index, node.meta.get("stack_trace"), role="bucket")
        return new[-1]

    with graph.inserting_before(node):
        length = call(torch.ops.aten.sym_size.int, site.query, 2)
        q, k, v = (call(_padded, x, size, length) for x in (site.query, site.key, site.value))
        mask = site.attn_mask
        if mask is not None or not site.is_causal:
            mask = call(_key_mask, site.query, size, length, mask)
        args, kwargs = [q, k, v, *node.args[3:]], dict(node.kwargs)
        if len(args) > 3:
            args[3] = mask
        else:
            kwargs["attn_mask"] = mask
        padded = call(node.target, *args, **kwargs)
        out = call(_unpadded, padded, length)
    propagate_example_values(new)
    padded.meta = {**node.meta, "example_value": padded.meta["example_value"]}
    node.replace_all_uses_with(out)
    graph.erase_node(node)


# NOTE: gathers, not pad and narrow: a narrowed view is contiguous at length L only, and the
# compilers below would guard on that (one graph more for the length L itself).


def _padded(x: torch.Tensor, size: int, length) -> torch.Tensor:
    """``x (B, H, length, C)`` with zeros after its tokens: ``(B, H, size, C)``."""
    positions = torch.arange(size, device=x.device)
    rows = x.index_select(2, positions.clamp_max(length - 1))
    return torch.where((positions < length).view(size, 1), rows, 0)


def _key_mask(q: torch.Tensor, size: int, length, mask: torch.Tensor | None) -> torch.Tensor:
    """The keys ``[0, length)`` of ``size``: a keep-mask ``(1, 1, 1, size)``, or the site's
    key-padding ``mask (.., 1, length)`` with the padded keys masked."""
    positions = torch.arange(size, device=q.device)
    keep = (positions < length).view(1, 1, 1, size)
    if mask is None:
        return keep
    keys = mask.index_select(-1, positions.clamp_max(length - 1))
    return torch.where(keep, keys, False if mask.dtype == torch.bool else float("-inf"))


def _unpadded(x: torch.Tensor, length) -> torch.Tensor:
    """The first ``length`` tokens of ``x`` (dim 2)."""
    return x.index_select(2, torch.arange(length, device=x.device))
