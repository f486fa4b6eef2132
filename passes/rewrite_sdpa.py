"""The pass: every supported SDPA site becomes dilated attention (SPEC §4).

Before::

    out = torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c)

After::

    bias = <mask to additive key bias (B|1, Hq|1, N)>                  # role "mask", if m
    out = autograd_function_apply(ring_rewrite_fwd_0, ring_rewrite_bwd_0, q, k, v[, bias])

``ring_rewrite_fwd_0`` holds, per branch, the ``dilate`` gathers, one ``block_attention`` node
(``(out, lse)``), the ``undilate`` scatters, then the ``merge``; ``ring_rewrite_bwd_0`` the
explicit backward of ``ring_rewrite.attention`` (one ``block_attention_backward`` per branch).
Every inserted node carries ``meta["ring_rewrite"] = {"site": i, "role": ..., "branch": ...}``
and the SDPA node's ``stack_trace``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._functorch.autograd_function import autograd_function_apply

from ring_rewrite._roles import role
from ring_rewrite.attention import SitePlan, site_backward, site_forward
from ring_rewrite.config import RingDilatedConfig
from ring_rewrite.p2p import check_agreement, resolve_group

from ._fx import RoleTracer, emit, stamp, trace_subgraph
from .find_sdpa import SdpaSite, bind_sdpa, find_sdpa_sites, unsupported_reason

__all__ = ["rewrite_sdpa", "SiteRecord", "UnsupportedSiteError"]


class UnsupportedSiteError(RuntimeError):
    """An SDPA site that cannot be rewritten where leaving it alone is not allowed."""


@dataclasses.dataclass(frozen=True)
class SiteRecord:
    """What the pass did with one attention site (one row of the report)."""

    site: int
    location: str
    kind: str
    shapes: dict[str, Any]
    reason: str | None = None
    plan: SitePlan | None = None

    @property
    def rewritten(self) -> bool:
        return self.plan is not None


def rewrite_sdpa(
    gm: fx.GraphModule, example_inputs: Any = None, *, config: RingDilatedConfig
) -> fx.GraphModule:
    """Rewrite every supported SDPA site of ``gm`` in place; records land in ``gm.meta``."""
    records: list[SiteRecord] = list(gm.meta.get("ring_rewrite_sites", ()))
    group, world, rank = resolve_group(config.group)
    sharded = config.sharding == "sharded" and world > 1
    rewritten = 0
    for node in [site.node for site in find_sdpa_sites(gm)]:
        site = bind_sdpa(node)  # its inputs may be sites rewritten a moment ago
        index = len(records)
        reason = unsupported_reason(site)
        plan = None
        if reason is None:
            if site.attn_mask is not None and world > 1:
                reason = "key-padding masks across ranks are not supported yet"
            else:
                try:
                    plan = _plan(site, config, index, group, world, rank)
                except ValueError as error:
                    reason = str(error)
        if plan is None:
            if config.strict or sharded:
                # NOTE: in sharded mode an SDPA left alone would attend within the local shard
                # only: a different function. So it is always an error there (SPEC §2).
                why = "sharded mode cannot leave it alone: " if sharded and not config.strict else ""
                raise UnsupportedSiteError(
                    f"ring_dilated: SDPA at {site.location} cannot be rewritten: {why}{reason}"
                )
            counters["ring_rewrite"]["skipped"] += 1
            records.append(SiteRecord(index, site.location, "sdpa", site.shapes, reason=reason))
            continue
        _rewrite_site(gm, site, plan, index)
        counters["ring_rewrite"]["rewritten"] += 1
        records.append(SiteRecord(index, site.location, "sdpa", site.shapes, plan=plan))
        rewritten += 1
    gm.meta["ring_rewrite_sites"] = records
    if world > 1:
        check_agreement(group, [_agreement_key(r) for r in records])
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return gm


def _agreement_key(record: SiteRecord) -> dict:
    """What every rank must agree on about a site (its plan minus the rank's own part)."""
    plan = record.plan
    if plan is None:
        return {"site": record.site, "reason": record.reason}
    key = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "rank"}
    key["branches"] = [(b.w, b.r, len(b.ring)) for b in plan.branches]
    key["dtype"] = str(plan.dtype)
    return key


def _plan(site: SdpaSite, config: RingDilatedConfig, index: int, group, world: int, rank: int) -> SitePlan:
    shapes = site.shapes
    b, hq, n, d = shapes["query"]
    hkv, dv = shapes["key"][1], shapes["value"][3]
    sharded = config.sharding == "sharded" and world > 1
    n_global = n * world if sharded else n
    return SitePlan.build(
        site=index,
        batch=b,
        hq=hq,
        hkv=hkv,
        n=n_global,
        d=d,
        dv=dv,
        dtype=site.meta(site.query).dtype,
        scale=d**-0.5 if site.scale is None else float(site.scale),
        is_causal=bool(site.is_causal),
        has_mask=site.attn_mask is not None,
        branches=config.branches(n_global),
        world=world,
        rank=rank,
        group_name=group.group_name if group is not None else "",
        sharding=config.sharding,
        layout=config.layout,
    )


def _key_bias(
    mask: torch.Tensor, plan: SitePlan, mask_shape: tuple[int, ...], is_bool: bool
) -> torch.Tensor:
    """A key-padding mask (bool keep-mask or additive) as an additive bias ``(B|1, Hq|1, N)``."""
    lead = (1,) * (4 - len(mask_shape)) + tuple(mask_shape[:-2])
    mask = mask.reshape(*lead, plan.n)
    if is_bool:
        return torch.where(mask, 0.0, float("-inf")).to(plan.dtype)
    return mask.to(plan.dtype)


def _rewrite_site(gm: fx.GraphModule, site: SdpaSite, plan: SitePlan, index: int) -> None:
    graph, node = gm.graph, site.node
    stack = node.meta.get("stack_trace")
    args = [site.query, site.key, site.value]
    names = ["q", "k", "v"]
    with graph.inserting_before(node):
        if site.attn_mask is not None:
            tracer = RoleTracer(graph, index, stack)
            with role("mask"):
                bias = emit(
                    tracer,
                    functools.partial(
                        _key_bias,
                        plan=plan,
                        mask_shape=site.shapes["attn_mask"],
                        is_bool=site.meta(site.attn_mask).dtype == torch.bool,
                    ),
                    site.attn_mask,
                )
            args.append(bias)
            names.append("mask")
        saved = ["q", "k", "v", "out", "lse", *names[3:]]
        fwd = trace_subgraph(functools.partial(site_forward, plan), names, index, stack)
        bwd = trace_subgraph(functools.partial(site_backward, plan), ["dout", *saved], index, stack)
        fwd_name, bwd_name = f"ring_rewrite_fwd_{index}", f"ring_rewrite_bwd_{index}"
        gm.add_submodule(fwd_name, fwd)
        gm.add_submodule(bwd_name, bwd)
        fwd_attr, bwd_attr = graph.get_attr(fwd_name), graph.get_attr(bwd_name)
        call = graph.call_function(
            autograd_function_apply,
            (fwd_attr, bwd_attr, *args),
            {"non_differentiable_idx": [], "saved_for_backward_idx": list(range(len(saved)))},
        )
    for new in (fwd_attr, bwd_attr, call):
        stamp(new, index, stack, role="site")
    call.meta["example_value"] = node.meta.get("example_value")
    node.replace_all_uses_with(call)
    graph.erase_node(node)
