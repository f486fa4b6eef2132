"""The pass before ``rewrite_sdpa``: attention modules become plain ops around one SDPA.

Dynamo keeps ``nn.MultiheadAttention`` (also the attention inside ``nn.TransformerEncoderLayer``
in training) as one opaque ``torch.nn.functional.multi_head_attention_forward`` node, and a
whole ``nn.TransformerEncoderLayer`` in eval under ``no_grad`` as one
``torch._transformer_encoder_layer_fwd`` node (its fast path). Neither shows an SDPA node, so
``rewrite_sdpa`` would not see them. This pass spells each supported node out as the ops torch
runs inside it.

Before::

    mha = torch.nn.functional.multi_head_attention_forward(x, x, x, E, H, w_in, b_in, None, None,
        False, p, w_out, b_out, training=t, key_padding_mask=kpm, need_weights=False, ...)
    out = mha[0]                                                     # (L, B, E)

After (every new node has ``meta["ring_rewrite"] = {"site": i, "role": "decompose"}``)::

    proj = torch._C._nn.linear(x, w_in, b_in)                        # packed: x is k is v
    proj = proj.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    q = proj[0].view(L, B, H, D).permute(1, 2, 0, 3)                 # (B, H, L, D); k, v alike
    mask = kpm.view(B, 1, 1, S)                                      # only with a key_padding_mask
    a = torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  dropout_p=p if t else 0.0, is_causal=c)
    a = a.permute(2, 0, 1, 3).reshape(B * L, E)
    out = torch._C._nn.linear(a, w_out, b_out).view(L, B, E)

``torch._transformer_encoder_layer_fwd(src, ...)`` (``src`` batch first, ``(B, L, E)``) becomes,
in the order ``norm_first`` gives::

    [layer_norm] -> linear(qkv) -> SDPA -> linear(proj) -> + src -> [layer_norm]
                 -> [layer_norm] -> linear -> relu | gelu -> linear -> + -> [layer_norm]

``find_attention_module_sites`` finds the nodes, ``module_unsupported_reason`` says why one must
stay as it is (or None); a node left alone is listed in ``gm.meta["ring_rewrite_sites"]`` with its
reason.

Note [Site ids of decomposed modules]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A decomposed module is not a site of its own: its SDPA node becomes one in ``rewrite_sdpa``,
which numbers sites in graph order after the records already in ``gm.meta``. The decompose
nodes get the id that SDPA node will get, so a site's report row and all its nodes agree.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import types
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dynamo.utils import counters

from ring_rewrite.config import RingDilatedConfig
from ring_rewrite.roles import role

from ._fx import RoleTracer, emit, location, propagate_example_values
from .find_sdpa import SDPA_TARGETS, _static_shape
from .records import leave_alone, records

__all__ = [
    "ModuleSite",
    "decompose_attention_modules",
    "find_attention_module_sites",
    "leave_attention_modules_alone",
    "module_unsupported_reason",
]

MHA = "multi_head_attention_forward"
ENCODER_LAYER = "transformer_encoder_layer_fwd"

_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_ENCODER_LAYER_OP = torch.ops.aten._transformer_encoder_layer_fwd.default
_ENCODER_LAYER_SIGNATURE = inspect.Signature(
    [
        inspect.Parameter(
            arg.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=arg.default_value if arg.has_default_value() else inspect.Parameter.empty,
        )
        for arg in _ENCODER_LAYER_OP._schema.arguments
    ]
)
_KINDS: dict[Any, tuple[str, inspect.Signature]] = {
    F.multi_head_attention_forward: (MHA, _MHA_SIGNATURE),
    torch._transformer_encoder_layer_fwd: (ENCODER_LAYER, _ENCODER_LAYER_SIGNATURE),
    _ENCODER_LAYER_OP: (ENCODER_LAYER, _ENCODER_LAYER_SIGNATURE),
}
# Arguments that choose the computation: they must be Python constants in the graph.
_CONSTANTS = {
    MHA: ("embed_dim_to_check", "num_heads", "add_zero_attn", "dropout_p", "training",
          "need_weights", "use_separate_proj_weight", "is_causal"),
    ENCODER_LAYER: ("embed_dim", "num_heads", "use_gelu", "norm_first", "eps", "mask_type"),
}
# Report shapes: the encoder layer attends over ``src`` with itself.
_SHAPE_ARGS = {
    MHA: {"query": "query", "key": "key", "value": "value",
          "key_padding_mask": "key_padding_mask", "attn_mask": "attn_mask"},
    ENCODER_LAYER: {"query": "src", "key": "src", "value": "src", "mask": "mask"},
}
_NEED_WEIGHTS = (
    "the attention weights (output 1) are used: the N x N weights would be materialised; "
    "call with need_weights=False or leave them unused"
)


@dataclasses.dataclass(frozen=True)
class ModuleSite:
    """One attention-module node, its arguments bound to the op's signature (defaults filled)."""

    node: fx.Node
    kind: str
    args: Mapping[str, Any]
    location: str

    def value(self, name: str) -> Any:
        """The argument ``name``: a constant, or a node's ``example_value``."""
        arg = self.args[name]
        return arg.meta.get("example_value") if isinstance(arg, fx.Node) else arg

    @property
    def shapes(self) -> dict[str, tuple[int, ...] | None]:
        return {key: _static_shape(self.value(arg)) for key, arg in _SHAPE_ARGS[self.kind].items()}


def find_attention_module_sites(gm: fx.GraphModule) -> list[ModuleSite]:
    return [
        bind_module_site(node)
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target in _KINDS
    ]


def bind_module_site(node: fx.Node) -> ModuleSite:
    """The record of one attention-module node, from its arguments as they are now.

    NOTE: decomposing a node replaces its uses, so a later module fed by an earlier one must be
    bound again after that decomposition (``decompose_attention_modules`` does).
    """
    kind, signature = _KINDS[node.target]
    bound = signature.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    args = types.MappingProxyType(dict(bound.arguments))
    return ModuleSite(node, kind, args, location(node))


def module_unsupported_reason(site: ModuleSite) -> str | None:
    """Why ``site`` cannot be spelled out as SDPA plus plain ops, or None."""
    for name in _CONSTANTS[site.kind]:
        if isinstance(site.args[name], fx.Node):
            return f"{name} is computed at run time (must be a constant)"
    for name, arg in site.args.items():
        if isinstance(arg, fx.Node) and not isinstance(arg.meta.get("example_value"), torch.Tensor):
            return f"{name} has no example tensor in the graph"
    if site.kind == MHA:
        return _mha_reason(site)
    return _encoder_layer_reason(site)


def _mha_reason(site: ModuleSite) -> str | None:
    a = site.args
    # NOTE: need_weights=True (nn.MultiheadAttention's default) computes the same output; only
    # weights that are actually used must stay, dynamo drops the unused ones.
    for user in site.node.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return "its (output, weights) tuple is used as a whole"
        if user.args[1] != 0 and user.users:
            return _NEED_WEIGHTS
    if a["bias_k"] is not None or a["bias_v"] is not None:
        return "add_bias_kv=True: bias_k/bias_v append a learned key/value position"
    if a["add_zero_attn"]:
        return "add_zero_attn=True: a zero key/value position is appended"
    if a["static_k"] is not None or a["static_v"] is not None:
        return "static_k/static_v (precomputed keys/values) are not supported"
    if a["use_separate_proj_weight"]:
        if any(a[n] is None for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight")):
            return "use_separate_proj_weight=True without q/k/v_proj_weight"
    elif a["in_proj_weight"] is None:
        return "in_proj_weight is None"
    query, key, value = (site.value(n) for n in ("query", "key", "value"))
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        dims = f"{query.dim()}/{key.dim()}/{value.dim()}"
        return f"query/key/value are {dims}-D, not batched (L, B, E)"
    (_, batch, embed), src_len = _static_shape(query), _static_shape(key)[0]
    if embed % a["num_heads"]:
        return f"embed_dim {embed} is not a multiple of num_heads {a['num_heads']}"
    kpm, attn_mask = a["key_padding_mask"], a["attn_mask"]
    if a["is_causal"]:
        if attn_mask is None:
            return "is_causal=True without attn_mask (torch raises)"
        if kpm is not None:
            return "is_causal=True with a key_padding_mask: torch merges both into a dense mask"
    elif attn_mask is not None:
        return (
            f"dense attn_mask of shape {_static_shape(site.value('attn_mask'))} without "
            "is_causal (only key_padding_mask and is_causal=True are supported)"
        )
    if kpm is not None:
        mask = site.value("key_padding_mask")
        if mask.dtype != torch.bool and not mask.is_floating_point():
            return f"key_padding_mask dtype {mask.dtype}"
        if _static_shape(mask) != (batch, src_len):
            return f"key_padding_mask of shape {_static_shape(mask)}, not (B, S) {(batch, src_len)}"
    return None


def _encoder_layer_reason(site: ModuleSite) -> str | None:
    a = site.args
    src = site.value("src")
    if src.is_nested or src.dim() != 3:
        return "src is not a dense (B, L, E) tensor"
    batch, length, embed = _static_shape(src)
    if embed % a["num_heads"]:
        return f"embed_dim {embed} is not a multiple of num_heads {a['num_heads']}"
    if a["mask"] is None:
        return None
    mask, mask_type = site.value("mask"), a["mask_type"]
    if mask_type != 1:
        return (
            f"dense mask of shape {_static_shape(mask)} (mask_type={mask_type}): the layer's "
            "fast path merged src_mask (dropping is_causal) into it; for a causal layer, disable "
            "the fast path (torch.backends.mha.set_fastpath_enabled(False)) so is_causal reaches "
            "the attention"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        return f"mask dtype {mask.dtype}"
    if _static_shape(mask) != (batch, length):
        return f"key-padding mask of shape {_static_shape(mask)}, not (B, L) = {(batch, length)}"
    return None


def decompose_attention_modules(
    gm: fx.GraphModule, example_inputs: Any = None, *, config: RingDilatedConfig
) -> fx.GraphModule:
    """Spell out every supported attention-module node of ``gm`` in place (see the module doc)."""
    todo = []
    for site in find_attention_module_sites(gm):
        reason = module_unsupported_reason(site)
        if reason is None:
            todo.append(site)
        else:
            _leave_alone(gm, config, site, reason)
    if not todo:
        return gm
    ids = _sdpa_site_ids(gm, {site.node for site in todo}, len(records(gm)))
    for site in todo:
        site = bind_module_site(site.node)  # its inputs may be modules decomposed just now
        _decompose(gm, site, ids[site.node])
        counters["ring_rewrite"]["decomposed"] += 1
    gm.graph.lint()
    gm.recompile()
    return gm


def leave_attention_modules_alone(gm: fx.GraphModule, *, config: RingDilatedConfig, reason: str) -> None:
    """What the pass does when it is disabled: every attention-module node stays, with ``reason``."""
    for site in find_attention_module_sites(gm):
        _leave_alone(gm, config, site, reason)


def _leave_alone(gm: fx.GraphModule, config: RingDilatedConfig, site: ModuleSite, reason: str) -> None:
    leave_alone(
        gm, config, what=site.kind, fate="be decomposed into SDPA", location=site.location,
        kind=site.kind, shapes=site.shapes, reason=reason,
    )  # fmt: skip


def _sdpa_site_ids(gm: fx.GraphModule, nodes: set[fx.Node], first: int) -> dict[fx.Node, int]:
    """The id ``rewrite_sdpa`` will give the SDPA node that replaces each of ``nodes``
    (Note [Site ids of decomposed modules])."""
    ids, index = {}, first
    for node in gm.graph.nodes:
        if node in nodes:
            ids[node] = index
        elif not (node.op == "call_function" and node.target in SDPA_TARGETS):
            continue
        index += 1
    return ids


# ---- what each node becomes ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Attention:
    """Static sizes and flags of one site; the emitted code reads no shapes from its proxies."""

    batch: int
    length: int  # L, query positions
    src_len: int  # S, key/value positions
    embed_dim: int
    heads: int
    in_proj: Literal["self", "kv", "split", "separate"]
    """Packed weights for q is k is v ("self"), for k is v ("kv"), chunked in three ("split");
    or q/k/v_proj_weight ("separate")."""
    mask: Literal["ignore", "additive", "nonzero"] | None
    """The key-padding mask: bool with True = ignore, additive float, or float whose nonzero
    entries ignore the key."""
    dropout_p: float
    is_causal: bool

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.heads


@dataclasses.dataclass(frozen=True)
class _EncoderLayer:
    attention: _Attention
    use_gelu: bool
    norm_first: bool
    eps: float


def _decompose(gm: fx.GraphModule, site: ModuleSite, index: int) -> None:
    a = site.args
    if site.kind == MHA:
        fn: Callable[..., Any] = functools.partial(_mha_forward, _read_mha(site))
        names = ("query", "key", "value", "in_proj_weight", "in_proj_bias", "q_proj_weight",
                 "k_proj_weight", "v_proj_weight", "out_proj_weight", "out_proj_bias",
                 "key_padding_mask")
    else:
        fn = functools.partial(_encoder_layer_forward, _read_encoder_layer(site))
        names = ("src", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "norm_weight_1",
                 "norm_bias_1", "norm_weight_2", "norm_bias_2", "ffn_weight_1", "ffn_bias_1",
                 "ffn_weight_2", "ffn_bias_2", "mask")
    graph, node = gm.graph, site.node
    before = node.prev
    tracer = RoleTracer(
        graph, index, node.meta.get("stack_trace"), node.meta.get("nn_module_stack")
    )
    with graph.inserting_before(node), role("decompose"):
        out = emit(tracer, fn, *(a[n] for n in names))
    new = []
    cursor = before.next
    while cursor is not node:
        new.append(cursor)
        cursor = cursor.next
    propagate_example_values(new)
    if site.kind == MHA:
        for user in list(node.users):
            if user.args[1] == 0:
                user.replace_all_uses_with(out)
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(out)
    graph.erase_node(node)


def _read_mha(site: ModuleSite) -> _Attention:
    a = site.args
    length, batch, embed = _static_shape(site.value("query"))
    if a["use_separate_proj_weight"]:
        in_proj = "separate"
    elif a["query"] is a["key"] and a["key"] is a["value"]:
        in_proj = "self"
    elif a["key"] is a["value"]:
        in_proj = "kv"
    else:
        in_proj = "split"
    kpm = site.value("key_padding_mask")
    return _Attention(
        batch=batch,
        length=length,
        src_len=_static_shape(site.value("key"))[0],
        embed_dim=embed,
        heads=a["num_heads"],
        in_proj=in_proj,
        mask=None if kpm is None else "ignore" if kpm.dtype == torch.bool else "additive",
        dropout_p=float(a["dropout_p"]) if a["training"] else 0.0,
        # NOTE: with is_causal, need_weights=False and no key_padding_mask (the guard made sure)
        # torch drops attn_mask and calls SDPA with is_causal=True; so do we.
        is_causal=bool(a["is_causal"]),
    )


def _read_encoder_layer(site: ModuleSite) -> _EncoderLayer:
    a = site.args
    batch, length, embed = _static_shape(site.value("src"))
    mask = site.value("mask")
    return _EncoderLayer(
        attention=_Attention(
            batch=batch,
            length=length,
            src_len=length,
            embed_dim=embed,
            heads=a["num_heads"],
            in_proj="self",
            # NOTE: the fast path reads a float mask as a bool one (nonzero ignores the key),
            # unlike multi_head_attention_forward, which adds it; we compute what it computes.
            mask=None if mask is None else "ignore" if mask.dtype == torch.bool else "nonzero",
            dropout_p=0.0,
            is_causal=False,
        ),
        use_gelu=bool(a["use_gelu"]),
        norm_first=bool(a["norm_first"]),
        eps=float(a["eps"]),
    )


def _key_padding(mask: torch.Tensor, attn: _Attention) -> torch.Tensor:
    """``(B, S)`` key padding as an SDPA mask ``(B, 1, 1, S)``: bool keep-mask or additive."""
    if attn.mask == "ignore":
        mask = ~mask
    elif attn.mask == "nonzero":
        mask = mask == 0
    return mask.view(attn.batch, 1, 1, attn.src_len)


def _mha_forward(
    attn: _Attention, query, key, value, in_w, in_b, q_w, k_w, v_w, out_w, out_b, kpm
):
    """``F.multi_head_attention_forward``'s SDPA branch (need_weights=False) on ``(L, B, E)``."""
    e, h, d = attn.embed_dim, attn.heads, attn.head_dim
    if attn.in_proj == "self":
        proj = F.linear(query, in_w, in_b)
        proj = proj.unflatten(-1, (3, e)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        q, k, v = proj[0], proj[1], proj[2]
    elif attn.in_proj == "kv":
        w_q, w_kv = in_w.split([e, 2 * e])
        b_q, b_kv = (None, None) if in_b is None else in_b.split([e, 2 * e])
        q = F.linear(query, w_q, b_q)
        kv = F.linear(key, w_kv, b_kv)
        kv = kv.unflatten(-1, (2, e)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        k, v = kv[0], kv[1]
    else:
        if attn.in_proj == "split":
            q_w, k_w, v_w = in_w.chunk(3)
        b_q, b_k, b_v = (None, None, None) if in_b is None else in_b.chunk(3)
        q, k, v = F.linear(query, q_w, b_q), F.linear(key, k_w, b_k), F.linear(value, v_w, b_v)
    # (L, B, E) -> (B, H, L, D): the same strides as torch's view / transpose / view.
    q = q.view(attn.length, attn.batch, h, d).permute(1, 2, 0, 3)
    k = k.view(attn.src_len, attn.batch, h, d).permute(1, 2, 0, 3)
    v = v.view(attn.src_len, attn.batch, h, d).permute(1, 2, 0, 3)
    mask = None if kpm is None else _key_padding(kpm, attn)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=attn.dropout_p, is_causal=attn.is_causal
    )
    out = out.permute(2, 0, 1, 3).reshape(attn.batch * attn.length, e)
    return F.linear(out, out_w, out_b).view(attn.length, attn.batch, e)


def _encoder_layer_forward(attn: _EncoderLayer, src, qkv_w, qkv_b, proj_w, proj_b, norm_w1,
                           norm_b1, norm_w2, norm_b2, ffn_w1, ffn_b1, ffn_w2, ffn_b2, mask):
    """``torch._transformer_encoder_layer_fwd`` on dense ``(B, L, E)`` input (transformer.cpp)."""
    att = attn.attention
    b, n, e, h, d = att.batch, att.length, att.embed_dim, att.heads, att.head_dim

    def norm(x, weight, bias):
        return F.layer_norm(x, (e,), weight, bias, attn.eps)

    x = norm(src, norm_w1, norm_b1) if attn.norm_first else src
    qkv = F.linear(x, qkv_w, qkv_b).view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    mask = None if mask is None else _key_padding(mask, att)
    x = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=mask)
    x = F.linear(x.transpose(1, 2).reshape(b, n, e), proj_w, proj_b) + src
    if not attn.norm_first:
        x = norm(x, norm_w1, norm_b1)
    y = norm(x, norm_w2, norm_b2) if attn.norm_first else x
    y = F.linear(y, ffn_w1, ffn_b1)
    y = F.gelu(y) if attn.use_gelu else F.relu(y)
    x = F.linear(y, ffn_w2, ffn_b2) + x
    return x if attn.norm_first else norm(x, norm_w2, norm_b2)
