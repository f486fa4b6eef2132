"""Find SDPA sites in a dynamo graph and say which can be rewritten.

Finding is separate from rewriting: ``find_sdpa_sites`` returns one frozen record per
``F.scaled_dot_product_attention`` node, and ``unsupported_reason`` is the one guard that says
why a site must stay as it is (or None).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import guard_int

from ring_rewrite import kernels

from ._fx import location
from .masks import MaskStructure, mask_structure

__all__ = [
    "SdpaSite", "bind_sdpa", "dense_mask", "find_sdpa_sites", "unsupported_reason", "SDPA_TARGETS",
]  # fmt: skip

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
_SIGNATURE = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


@dataclasses.dataclass(frozen=True)
class SdpaSite:
    """One SDPA call in the graph, its arguments bound to the SDPA signature."""

    node: fx.Node
    query: fx.Node
    key: fx.Node
    value: fx.Node
    attn_mask: fx.Node | None
    dropout_p: object
    is_causal: object
    scale: object
    enable_gqa: object
    location: str

    def meta(self, node: fx.Node | None):
        return None if node is None else node.meta.get("example_value")

    @property
    def shapes(self) -> dict[str, tuple[int, ...] | None]:
        return {
            name: _static_shape(self.meta(getattr(self, name)))
            for name in ("query", "key", "value", "attn_mask")
        }


def find_sdpa_sites(gm: fx.GraphModule) -> list[SdpaSite]:
    return [
        bind_sdpa(node)
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target in SDPA_TARGETS
    ]


def bind_sdpa(node: fx.Node) -> SdpaSite:
    """The record of one SDPA node, from its arguments as they are now.

    NOTE: a rewrite replaces uses of the node it rewrites, so a later site fed by an earlier
    one must be bound again after that rewrite (``rewrite_sdpa`` does).
    """
    bound = dict(_DEFAULTS)
    bound.update(zip(_SIGNATURE, node.args))
    bound.update(node.kwargs)
    return SdpaSite(
        node=node,
        query=bound["query"],
        key=bound["key"],
        value=bound["value"],
        attn_mask=bound["attn_mask"],
        dropout_p=bound["dropout_p"],
        is_causal=bound["is_causal"],
        scale=bound["scale"],
        enable_gqa=bound["enable_gqa"],
        location=location(node),
    )


def unsupported_reason(site: SdpaSite) -> str | None:
    """Why ``site`` cannot be rewritten into dilated attention, or None."""
    for name in ("dropout_p", "is_causal", "scale", "enable_gqa"):
        if isinstance(getattr(site, name), fx.Node):
            return f"{name} is computed at run time (must be a constant)"
    if not 0.0 <= site.dropout_p <= 1.0:
        return f"dropout_p={site.dropout_p} is not a probability"
    q, k, v = (site.meta(n) for n in (site.query, site.key, site.value))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "query/key/value have no example value in the graph"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"inputs are {q.dim()}-D, not (B, H, N, D)"
    reason = kernels.unsupported_reason(q, k, v)
    if reason is not None:
        return reason
    qs, ks, vs = (_static_shape(t) for t in (q, k, v))
    if qs[2] != ks[2] or ks[2] != vs[2]:
        return f"query length {qs[2]} != key/value length {ks[2]}/{vs[2]} (cross attention or KV cache)"
    if qs[0] != ks[0] or ks[0] != vs[0] or ks[1] != vs[1]:
        return f"batch/head shapes do not match: q {qs}, k {ks}, v {vs}"
    if qs[1] != ks[1] and not site.enable_gqa:
        return f"query has {qs[1]} heads and key {ks[1]} without enable_gqa"
    if qs[1] % ks[1]:
        return f"query heads {qs[1]} not a multiple of key/value heads {ks[1]}"
    if site.attn_mask is not None:
        if site.is_causal:
            return "attn_mask together with is_causal"
        mask = site.meta(site.attn_mask)
        if not isinstance(mask, torch.Tensor):
            return "attn_mask has no example value in the graph"
        if mask.requires_grad:
            return "attn_mask requires grad (a learned bias is not supported)"
        if mask.dtype != torch.bool and not mask.is_floating_point():
            return f"attn_mask dtype {mask.dtype}"
        ms = _static_shape(mask)
        if not _broadcasts(ms, qs, ks[2]):
            return f"attn_mask of shape {ms} does not broadcast to (B, H, N, N) = {(*qs[:3], ks[2])}"
        structure = dense_mask(site)
        if isinstance(structure, str):
            return structure
    return None


def dense_mask(site: SdpaSite) -> MaskStructure | str | None:
    """The structure of the site's ``(.., N, N)`` mask read from the graph that builds it
    (``passes/masks.py``), or the reason it has none; None without a mask or for a key-padding
    mask ``(.., 1, N)``, which is its own key bias."""
    mask = site.meta(site.attn_mask)
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or mask.shape[-2] == 1:
        return None
    return mask_structure(site.attn_mask, _static_shape(site.meta(site.key))[2])


def _broadcasts(ms: tuple[int, ...], qs: tuple[int, ...], n: int) -> bool:
    """Whether a mask of shape ``ms`` is ``(B|1, H|1, 1|N, N)``."""
    if len(ms) < 2 or len(ms) > 4 or ms[-2] not in (1, qs[2]) or ms[-1] != n:
        return False
    lead = (1,) * (4 - len(ms)) + ms[:-2]
    return lead[0] in (1, qs[0]) and lead[1] in (1, qs[1])


def _static_shape(t) -> tuple[int, ...] | None:
    """Sizes as ints; a symbolic size is specialised (guarded) to its current value."""
    return None if not isinstance(t, torch.Tensor) else _ints(t.shape)


def static_strides(t) -> tuple[int, ...] | None:
    """Strides as ints, specialised like the sizes."""
    return None if not isinstance(t, torch.Tensor) else _ints(t.stride())


def _ints(values) -> tuple[int, ...]:
    return tuple(guard_int(v) if isinstance(v, torch.SymInt) else int(v) for v in values)


def getitem_users(node: fx.Node) -> dict[int, list[fx.Node]]:
    users: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem:
            users.setdefault(user.args[1], []).append(user)
    return users
