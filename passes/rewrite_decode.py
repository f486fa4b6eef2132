"""Decode steps: an SDPA site whose queries are the last rows of a longer key sequence (a KV
cache) becomes those rows of the site's function, in plain torch ops (role "decode"), never a
ring (docs/semantics.md, Decode steps).

Over a whole cache (replicated mode, or one rank) each rank computes the step's rows over every
key (``ring_rewrite/decode.py``, ``decode_attention``), at the positions the mask places them for
a sliding-window cache. Over a cache that stays sharded (``ring_rewrite.prefill``'s, marked by
``sharded_keys``) each rank attends its own keys at their global positions, and one all-gather
merges the ranks' rows exactly (Note [A sharded KV cache]). A step
that cannot be rewritten is left alone over a whole cache, and raises over a sharded one (left
alone it would attend to one rank's keys).
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from ring_rewrite.config import RingDilatedConfig
from ring_rewrite.decode import decode_attention, sharded_decode
from ring_rewrite.roles import role

from ._fx import RoleTracer, emit, stamp
from .find_sdpa import SdpaSite, bind_sdpa, decode_reason, dilated_decode_reason, display_shapes
from .masks import decode_positions
from .records import UnsupportedSiteError, leave_alone, sharded

__all__ = ["rewrite_decode_step"]


def rewrite_decode_step(
    gm: fx.GraphModule, site: SdpaSite, cached: fx.Node | None, index: int, config: RingDilatedConfig, group, world: int
) -> str | None:
    """Rewrite a decode step, over a sharded cache (``cached``, its ``sharded_keys`` marker) or
    a whole one; returns its record's note, or None where it is left alone."""
    m = site.meta(site.query).shape[2]
    if cached is not None:
        _rewrite_sharded_decode(gm, site, cached, index, config, group, world)
        return f"decode step over a sharded cache: the last {m} rows, merged across ranks"
    reason = decode_reason(site)
    if reason is None and not config.is_exact:
        reason = dilated_decode_reason(site)
    if reason is None and sharded(config):
        reason = (
            "a decode step over a whole KV cache in sharded mode (ring_rewrite.prefill makes a "
            "cache that stays sharded; a whole one runs in replicated mode or on one rank)"
        )
    if reason is not None:
        leave_alone(
            gm, config, what="SDPA", fate="be rewritten", location=site.location,
            kind="sdpa", shapes=display_shapes(site), reason=reason,
        )  # fmt: skip
        return None
    _rewrite_decode(gm, site, index, config)
    return f"decode step: the last {m} rows, on every rank"


def _rewrite_decode(gm: fx.GraphModule, site: SdpaSite, index: int, config: RingDilatedConfig) -> None:
    """A decode step becomes its rows of the site's function (``ring_rewrite/decode.py``), in
    plain torch ops on every rank (role "decode"); the key length stays as dynamo has it."""
    node = site.node
    d = site.meta(site.query).shape[-1]
    decode = functools.partial(
        _decode,
        branches=config.branches(_WHOLE),
        scale=d**-0.5 if site.scale is None else float(site.scale),
    )
    inputs = [site.query, site.key, site.value]
    if site.attn_mask is not None:
        inputs.append(site.attn_mask)
        decode.keywords["bool_mask"] = site.meta(site.attn_mask).dtype == torch.bool
        positions = None if config.is_exact else decode_positions(site.attn_mask)
        if positions is not None:  # where the mask places them (a sliding-window cache)
            decode.keywords["positions"] = positions
            inputs += positions.data
    _replace_step(gm, node, index, decode, inputs)


def _replace_step(gm: fx.GraphModule, node: fx.Node, index: int, decode, inputs: list) -> None:
    """``node`` (a decode step's SDPA) replaced by ``decode(*inputs)`` traced in its place."""
    graph = gm.graph
    with graph.inserting_before(node):
        tracer = RoleTracer(graph, index, node.meta.get("stack_trace"))
        with role("decode"):
            out = emit(tracer, decode, *inputs)
    stamp(out, index, node.meta.get("stack_trace"), role="site", decode=True)
    out.meta["example_value"] = node.meta.get("example_value")
    node.replace_all_uses_with(out)
    graph.erase_node(node)


_WHOLE = 1 << 62  # the exact config's one segment: longer than any prefix


def _decode(q, k, v, mask=None, *data, branches, scale, bool_mask=False, positions=None):
    bias = torch.where(mask, 0.0, float("-inf")) if bool_mask else mask
    query_positions = key_positions = None
    if positions is not None:
        first_query, first_key = positions.evaluate(*data)
        query_positions = torch.arange(q.shape[2], device=q.device) + first_query
        key_positions = torch.arange(k.shape[2], device=q.device) + first_key
    return decode_attention(
        q, k, v, bias, branches=branches, scale=scale, is_causal=False, query_positions=query_positions,
        key_positions=key_positions,
    )  # fmt: skip


def _rewrite_sharded_decode(gm, site: SdpaSite, cached: fx.Node, index: int, config, group, world) -> None:
    """A decode step whose keys are this rank's part of a sharded cache becomes its rows over
    those keys at their positions, merged across the ranks by one all-gather (Note [A sharded KV
    cache] in ring_rewrite/decode.py); the ``sharded_keys`` marker is dropped. Raises where the
    step cannot be rewritten: left alone it would attend to one rank's keys."""
    layout, ranks = cached.args[3:5]
    reason = decode_reason(site)
    if reason is None and config.sharding != "sharded":
        reason = f"sharding={config.sharding!r} (a sharded cache needs sharding='sharded')"
    if reason is None and (layout, ranks) != (config.layout, world):
        reason = (
            f"the cache was prefilled with layout={layout!r} over {ranks} ranks, the backend runs "
            f"layout={config.layout!r} over {world}"
        )
    if reason is None and any(site.meta(n).requires_grad for n in (site.query, site.key, site.value)):
        reason = "it would need gradients (a sharded decode step is inference: run it under torch.no_grad)"
    if reason is None and site.attn_mask is not None:
        reason = (
            "an attn_mask (padding or a sliding window: a mask indexes the keys as one sequence, "
            "not a rank's part of them; prompts of one length without padding, full attention; "
            "without an attention_mask, generate infers padding from pad_token_id among the ids: "
            "pass attention_mask=torch.ones_like(input_ids))"
        )
    if reason is not None:
        raise UnsupportedSiteError(
            f"ring_rewrite: a decode step over a sharded KV cache at {site.location} cannot be rewritten: {reason}"
        )
    graph, node = gm.graph, site.node
    keys, key_positions, query_positions = cached.args[:3]
    cached.replace_all_uses_with(keys)
    graph.erase_node(cached)
    site = bind_sdpa(node)  # its key was the marker
    d = site.meta(site.query).shape[-1]
    decode = functools.partial(
        sharded_decode,
        branches=config.branches(_WHOLE),
        scale=d**-0.5 if site.scale is None else float(site.scale),
        world=world,
        group_name=group.group_name if world > 1 else "",
    )
    inputs = [site.query, site.key, site.value, key_positions, query_positions]
    _replace_step(gm, node, index, decode, inputs)
