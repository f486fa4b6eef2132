"""Find SDPA sites in a dynamo graph and say which can be rewritten.

Finding is separate from rewriting: ``find_sdpa_sites`` returns one frozen record per
``F.scaled_dot_product_attention`` node, and ``sdpa_unsupported_reason`` is the one guard that
says why a site must stay as it is (or None).

Note [Self or cross attention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Only self attention is rewritten, decided by data flow, not by equal lengths (a
decoder's cross attention to an encoder output of its own length is still cross attention).
``data_flow`` walks back from q, k and v to their *sequences*: the graph's inputs that are
tensors and no module state (dynamo marks parameters, buffers and a module's tensor attributes
with ``_dynamo_static_input_type``; tensors made in the graph, ``arange`` say, are no inputs).
The walk follows every tensor input of a node (sizes are no tensors), except at the ops that mix
the positions of a sequence, where it follows only the operand that carries the rows (tokens):
the query of an SDPA call or of a site already rewritten (never its mask, keys or values), the
first operand of a matmul / bmm / linear / einsum (``addmm``-like ops: also the one they add).
In a two-layer decoder::

    x1 = x + out1(sdpa(q1(x), k1(memory), v1(memory)))     # layer 1's cross attention
    y = sdpa(q2(x1), k2(memory), v2(memory))              # layer 2's

the walk from layer 2's query goes through ``q2``'s linear to ``x1``, through the sum to ``x`` and
to layer 1's SDPA, and there to its query only: ``x``. The memory reaches ``x1`` through layer
1's keys and values alone, which move no rows of their own into the stream. So layer 2 is
cross attention: ``query from x but key/value from memory``.

A site is self attention when

* every input its query comes from is one its keys or values come from (q and k from ``x``
  and ``position_ids``; a KV cache's keys from the cache as well), and
* its keys and values come out of no attention call that the query's walk does not pass (they
  may be taken at an earlier layer of the query's own stream, as in cross-layer KV sharing).

Otherwise it is cross attention: ``query from x but key/value from memory``; a query of module
state only (learned latents) against keys from an input; and an encoder-decoder whose decoder
reads the encoder's own input shifted (BART without ``decoder_input_ids``): both come from
``input_ids``, but the keys come out of the encoder's attention, the query does not.

The graph cannot tell where it shows no projection: a query and a key that both reach their
inputs through no matmul-like op (``f(q, k, v)`` calling SDPA on its arguments, up to views,
casts, elementwise ops and attention over them), or a site that reaches no input at all, count
as self attention, as they did before the walk. A raw query against keys projected from another
input (a graph break between a projection and the SDPA call) counts as cross attention: left
alone, never rewritten wrongly.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
from collections.abc import Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._functorch.autograd_function import autograd_function_apply
from torch.fx.experimental.symbolic_shapes import guard_int

from ring_rewrite import kernels
from ring_rewrite.decode import sharded_keys  # noqa: F401  (registers the op read below)

from ._fx import location
from .masks import MaskStructure, decode_positions, mask_structure

__all__ = [
    "DataFlow",
    "Origin",
    "SDPA_TARGETS",
    "SdpaSite",
    "bind_sdpa",
    "cross_attention_reason",
    "data_flow",
    "decode_reason",
    "dense_mask",
    "dilated_decode_reason",
    "find_sdpa_sites",
    "is_caller_input",
    "is_decode_step",
    "local_positions",
    "sdpa_unsupported_reason",
    "sharded_cache_keys",
]

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
    for name in ("dropout_p", "is_causal", "scale", "enable_gqa"):
        bound[name] = _specialised(bound[name])
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


def _specialised(x):
    """A number that dynamo made a symbol (``dynamic=True`` turns a float such as a scale into
    a graph input) as its value, the graph guarded on it: a site's scalars are its plan's
    constants. Anything else as it is."""
    value = x.meta.get("example_value") if isinstance(x, fx.Node) else None
    for kind, cast in ((torch.SymBool, bool), (torch.SymInt, int), (torch.SymFloat, float)):
        if isinstance(value, kind):
            return cast(value)  # NOTE: guards the graph on the value: another one compiles again
    return x


def sdpa_unsupported_reason(site: SdpaSite) -> str | None:
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
    if 0 in (_static_shape(q)[2], _static_shape(k)[2]):
        return f"an empty sequence (q {tuple(q.shape)}, k {tuple(k.shape)}): SDPA's own empty result"
    reason = kernels.kernel_unsupported_reason(q, k, v)
    if reason is not None:
        return reason
    reason = cross_attention_reason(site)
    if reason is not None:
        return reason
    qs, ks, vs = (_static_shape(t) for t in (q, k, v))
    if qs[2] != ks[2] or ks[2] != vs[2]:
        lengths = f"query length {qs[2]} != key/value length {ks[2]}/{vs[2]}"
        same = data_flow(site).same_sequence
        if same is None:
            return f"{lengths} (cross attention or KV cache: the graph cannot tell)"
        if qs[2] < ks[2]:
            return f"{lengths}: a KV cache / decode step (key/value derive from the query's sequence)"
        return f"{lengths} (key/value derive from the query's sequence)"
    if qs[0] != ks[0] or ks[0] != vs[0] or ks[1] != vs[1]:
        return f"batch/head shapes do not match: q {qs}, k {ks}, v {vs}"
    reason = _heads_reason(qs[1], ks[1], site.enable_gqa)
    if reason is not None:
        return reason
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


def _heads_reason(hq: int, hkv: int, enable_gqa: bool) -> str | None:
    """Why ``hq`` query heads cannot attend to ``hkv`` key/value heads, or None.

    With ``enable_gqa`` query head ``j`` reads key/value head ``j // (hq // hkv)``. Without it SDPA
    broadcasts the head dim: a single key/value head serves every query head, which is
    grouped-query attention with one group (multi-query attention, as Falcon calls SDPA) and is
    rewritten as such. A single query head broadcast over several key/value heads gives an output
    of ``hkv`` heads: no grouped-query attention. Any other mismatch SDPA itself rejects.
    """
    if hq == hkv or hkv == 1:
        return None
    if not enable_gqa:
        if hq == 1:
            return f"query has 1 head and key/value {hkv} without enable_gqa (SDPA broadcasts the query's head)"
        return (
            f"query has {hq} heads and key/value {hkv} without enable_gqa (SDPA broadcasts a single "
            "key/value head only)"
        )
    if hq % hkv:
        return f"query heads {hq} not a multiple of key/value heads {hkv}"
    return None


def is_decode_step(site: SdpaSite) -> bool:
    """Whether ``site`` is a decode step: a query of a fixed length ``m`` shorter than its keys,
    which derive from the query's sequence (a KV cache: the last ``m`` positions; docs/semantics.md,
    Decode steps).

    NOTE: the key length is never specialised here: from the second decode step on dynamo makes
    it a symbol, and one graph then serves every later length (``ring_rewrite/decode.py``). Only
    ``N > m`` is guarded.
    """
    q, k, v = (site.meta(n) for n in (site.query, site.key, site.value))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return False
    m, n = q.shape[2], k.shape[2]
    if isinstance(m, torch.SymInt) or not _hint(n) > m:
        return False
    if data_flow(site).same_sequence is not True:
        return False
    return bool(n > m)


def decode_reason(site: SdpaSite) -> str | None:
    """Why a decode step (``is_decode_step``) cannot be rewritten, or None; its key length is
    compared, never specialised."""
    for name in ("dropout_p", "is_causal", "scale", "enable_gqa"):
        if isinstance(getattr(site, name), fx.Node):
            return f"{name} is computed at run time (must be a constant)"
    q, k, v = (site.meta(n) for n in (site.query, site.key, site.value))
    reason = kernels.kernel_unsupported_reason(q, k, v)
    if reason is not None:
        return reason
    if site.dropout_p:
        return "dropout in a decode step"
    if site.is_causal:
        # NOTE: SDPA aligns is_causal top-left when the query is shorter: not the last rows.
        return f"is_causal with a query of {q.shape[2]} shorter than its keys (SDPA aligns it top-left)"
    if q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        return f"batch/head shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not bool(k.shape[2] == v.shape[2]):
        return f"key length {k.shape[2]} != value length {v.shape[2]}"
    reason = _heads_reason(q.shape[1], k.shape[1], site.enable_gqa)
    if reason is not None:
        return reason
    if site.attn_mask is not None:
        mask = site.meta(site.attn_mask)
        if not isinstance(mask, torch.Tensor) or mask.requires_grad:
            return "attn_mask requires grad or has no example value"
        if mask.dtype != torch.bool and not mask.is_floating_point():
            return f"attn_mask dtype {mask.dtype}"
        lead = (1,) * (4 - mask.dim()) + tuple(mask.shape[:-2])
        keys = mask.dim() >= 2 and mask.shape[-2] == 1 and bool(mask.shape[-1] == k.shape[2])
        if not keys or lead[0] not in (1, q.shape[0]) or lead[1] not in (1, q.shape[1]):
            return f"a decode step with an attn_mask of shape {tuple(mask.shape)} (only key masks (B|1, H|1, 1, N))"
    return None


def dilated_decode_reason(site: SdpaSite) -> str | None:
    """Why the positions of a decode step's queries and keys are unknown, which a dilated config
    needs (its segments and lattices are absolute; the exact config does not care), or None. The
    keys must be a cache with the new tokens appended (``torch.cat`` on the sequence dim, the
    last piece the query's length): the whole prefix, or, where the mask places them at an
    offset (a sliding-window cache), the last keys from there (``masks.decode_positions``)."""
    m = site.meta(site.query).shape[2]
    for name, node in (("key", site.key), ("value", site.value)):
        if not _appended(node, m):
            return (
                f"its {name}s are not a cache with the new tokens appended (torch.cat on the sequence "
                "dim): a dilated decode step needs the whole prefix at positions 0 .. N-1 (a static "
                "or sliding-window cache?)"
            )
    if site.attn_mask is not None:
        positions = decode_positions(site.attn_mask)
        if isinstance(positions, str):
            return f"{positions}: a dilated decode step needs its positions"
    return None


_VIEWS = {"expand", "reshape", "view", "contiguous", "to", "unsqueeze", "flatten", "unflatten"}


def _appended(node: fx.Node, m: int) -> bool:
    """Whether ``node`` is, up to views (GQA's repeat included), ``torch.cat([cache, new], dim=2)``
    with ``new`` of length ``m``."""
    while node.op in ("call_method", "call_function") and (
        node.target in _VIEWS or node.target in (operator.getitem, torch.reshape)
    ):
        node = node.args[0]
    if node.op != "call_function" or node.target is not torch.cat:
        return False
    pieces = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    last = pieces[-1].meta.get("example_value") if isinstance(pieces[-1], fx.Node) else None
    return dim in (2, -2) and isinstance(last, torch.Tensor) and last.dim() == 4 and last.shape[2] == m


def sharded_cache_keys(site: SdpaSite) -> fx.Node | None:
    """The ``sharded_keys`` node the site's keys come from, up to views (GQA's repeat included),
    or None: a decode step over a rank's part of a sharded cache (Note [A sharded KV cache])."""
    node = site.key
    while isinstance(node, fx.Node) and node.op in ("call_method", "call_function"):
        if node.target in _SHARDED_KEYS:
            return node
        if not (node.target in _VIEWS or node.target in (operator.getitem, torch.reshape)):
            return None
        node = node.args[0]
    return None


_SHARDED_KEYS = (torch.ops.ring_rewrite.sharded_keys, torch.ops.ring_rewrite.sharded_keys.default)


def display_shapes(site: SdpaSite) -> dict[str, tuple | None]:
    """The site's shapes as the report shows them, symbols as they are (nothing guarded)."""
    return {
        name: None if not isinstance(t := site.meta(getattr(site, name)), torch.Tensor) else tuple(t.shape)
        for name in ("query", "key", "value", "attn_mask")
    }


def _hint(n) -> int:
    return n.node.hint if isinstance(n, torch.SymInt) else int(n)


def cross_attention_reason(site: SdpaSite) -> str | None:
    """Why ``site`` is cross attention (its query and key/value come from different sequences),
    or None (Note [Self or cross attention])."""
    flow = data_flow(site)
    if flow.same_sequence is not False:
        return None
    q, kv = flow.query, flow.key_value
    if not q.sequences or not q.sequences <= kv.sequences:
        return f"cross attention: query from {_names(q.sequences)} but key/value from {_names(kv.sequences)}"
    (*_, last) = (n for n in site.node.graph.nodes if n in kv.attention - q.attention)
    rewritten = last.meta.get("ring_rewrite", {}).get("site")
    where = location(last) if rewritten is None else f"site {rewritten} ({location(last)})"
    return (
        f"cross attention: key/value come out of the attention at {where}, the query does not "
        f"(both from {_names(kv.sequences)})"
    )


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a tensor's rows come from: the graph inputs its walk reaches (``sequences``), those
    of them it reaches through a projection, a matmul-like op (``projected``), and the attention
    calls on the way (``attention``)."""

    sequences: frozenset[fx.Node] = frozenset()
    projected: frozenset[fx.Node] = frozenset()
    attention: frozenset[fx.Node] = frozenset()

    def __or__(self, other: Origin) -> Origin:
        fields = ("sequences", "projected", "attention")
        return Origin(*(getattr(self, f) | getattr(other, f) for f in fields))


@dataclasses.dataclass(frozen=True)
class DataFlow:
    """The origins of a site's query, key and value."""

    query: Origin
    key: Origin
    value: Origin

    @property
    def key_value(self) -> Origin:
        return self.key | self.value

    @property
    def same_sequence(self) -> bool | None:
        """Whether q and k/v derive from the same sequence; None where the graph cannot tell
        (Note [Self or cross attention])."""
        q, k, kv = self.query, self.key, self.key_value
        if not q.sequences and not kv.sequences:
            return None  # module state and constants only
        if q.sequences and k.sequences and not q.projected and not k.projected:
            return None  # q and k are the graph's own inputs: f(q, k, v)
        return bool(q.sequences) and q.sequences <= kv.sequences and kv.attention <= q.attention


def data_flow(site: SdpaSite) -> DataFlow:
    """Walk back from the site's q, k and v to the graph inputs they derive from."""
    return DataFlow(*_origins([site.query, site.key, site.value]))


def _origins(nodes: Sequence[fx.Node]) -> list[Origin]:
    reached: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node not in reached:
            reached.add(node)
            stack.extend(_followed(node))
    origin: dict[fx.Node, Origin] = {}
    for node in nodes[0].graph.nodes:  # in order: a node's inputs come before it
        if node not in reached:
            continue
        if node.op == "placeholder":
            origin[node] = Origin(frozenset([node])) if _is_sequence(node) else Origin()
            continue
        mine = functools.reduce(operator.or_, (origin[x] for x in _followed(node)), Origin())
        if _projected_operands(node) is not None:
            mine = dataclasses.replace(mine, projected=mine.sequences)
        elif _attention_query(node) is not None:
            mine = dataclasses.replace(mine, attention=mine.attention | {node})
        origin[node] = mine
    return [origin[node] for node in nodes]


def _followed(node: fx.Node) -> list[fx.Node]:
    """The inputs of ``node`` the walk goes on to: its tensors; at a mixing op, the operands
    that carry the rows."""
    query = _attention_query(node)
    rows = [query] if query is not None else _projected_operands(node)
    return [x for x in (node.all_input_nodes if rows is None else rows) if _holds_tensor(x)]


def _attention_query(node: fx.Node) -> fx.Node | None:
    """The query of an SDPA call or of a site already rewritten; None for any other node."""
    if node.op == "call_function" and node.target in SDPA_TARGETS:
        return bind_sdpa(node).query
    if node.target is autograd_function_apply and node.meta.get("ring_rewrite", {}).get("role") == "site":
        return node.args[2]  # (fwd, bwd, q, k, v, ...): see rewrite_sdpa
    return None


_FIRST_OPERAND = {
    torch.matmul, operator.matmul, torch.bmm, torch.mm, F.linear, torch.einsum,
    F.multi_head_attention_forward,  # an attention module left alone: its query, projected
}  # fmt: skip
_FIRST_OPERAND_METHODS = {"matmul", "__matmul__", "bmm", "mm"}
_ADDED_AND_FIRST = {torch.baddbmm, torch.addmm, torch.addbmm}  # input + batch1 @ batch2
_ADDED_AND_FIRST_METHODS = {"baddbmm", "addmm", "addbmm"}


def _projected_operands(node: fx.Node) -> list[fx.Node] | None:
    """At a matmul-like op, the operands that carry its rows; None for any other node."""
    first = node.op == "call_function" and node.target in _FIRST_OPERAND
    first = first or node.op == "call_method" and node.target in _FIRST_OPERAND_METHODS
    added = node.op == "call_function" and node.target in _ADDED_AND_FIRST
    added = added or node.op == "call_method" and node.target in _ADDED_AND_FIRST_METHODS
    if not (first or added):
        return None
    operands = [x for x in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(x, fx.Node)]
    return operands[: 2 if added else 1]


def _holds_tensor(node: fx.Node) -> bool:
    """Whether ``node`` is a tensor (or holds some: a split's tuple), not a size; unknown
    values count as tensors."""
    if "example_value" not in node.meta:
        return True
    return any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(node.meta["example_value"]))


def is_caller_input(node: fx.Node) -> bool:
    """Whether ``node`` is a graph input that is a tensor of the caller's (no module state)."""
    return node.op == "placeholder" and _is_sequence(node)


def _is_sequence(placeholder: fx.Node) -> bool:
    """Whether a graph input is a tensor of the caller's, not a module's parameter or buffer."""
    value = placeholder.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
        return False
    # NOTE: dynamo marks a module's parameters, buffers and tensor attributes so.
    return "_dynamo_static_input_type" not in placeholder.meta.get("tensor_dict", {})


def _names(sequences: frozenset[fx.Node]) -> str:
    if not sequences:
        return "no input (module state and constants only)"
    return ", ".join(sorted(_input_name(n) for n in sequences))


_LOCAL_ARG = re.compile(r"^L\['([^']*)'\]")


def _input_name(placeholder: fx.Node) -> str:
    """The caller's name of a graph input: ``x``, ``batch['x']`` (dynamo's ``L['x']``)."""
    arg = placeholder.meta.get("grapharg")
    name = arg.source.name if arg is not None and arg.source is not None else placeholder.name
    return _LOCAL_ARG.sub(r"\1", name)


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


# Note [Positions in sharded mode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# In sharded mode each rank's graph sees its own N / P tokens, but positions are global. A query
# or key that depends on positions the graph counts over the shard's own tokens numbers every
# rank's tokens from 0: attention over the ring is still exact, but the model embeds the wrong
# positions, a different function with no error. Three ways models count them, each refused:
#
# * ``torch.arange(n)`` over the ``n`` tokens (transformers' default ``cache_position`` and
#   ``position_ids`` when the caller passes none; GPT-2's position embedding);
# * a slice ``[0:n]`` of a module's buffer (BERT's ``position_ids`` buffer, cached RoPE tables);
# * a cumulative sum along the ``n`` tokens (RoBERTa's positions from its padding mask).
#
# ``local_positions`` walks back from q and k through every input, except at an attention call
# (an SDPA node or a site already rewritten), where it follows only that call's q, k and v (its
# mask is built from positions too, and says nothing about the values that leave it). The first
# such count it meets is the reason the site cannot run sharded. Positions passed in as inputs
# (``position_ids``) are the caller's, and global where ``shard_batch`` made them.


def local_positions(site: SdpaSite, n: int) -> tuple[fx.Node, str] | None:
    """The node that counts positions over the site's ``n`` tokens and that its query or key
    derive from, with how it counts them (Note [Positions in sharded mode]), or None."""
    seen: set[fx.Node] = set()
    stack = [site.query, site.key]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        how = _counts_tokens(node, n)
        if how is not None:
            return node, how
        stack.extend(_attention_operands(node) or node.all_input_nodes)
    return None


def _attention_operands(node: fx.Node) -> list[fx.Node] | None:
    """q, k and v of an SDPA call or of a site already rewritten; None for any other node."""
    if node.op == "call_function" and node.target in SDPA_TARGETS:
        site = bind_sdpa(node)
        return [site.query, site.key, site.value]
    if node.target is autograd_function_apply and node.meta.get("ring_rewrite", {}).get("role") == "site":
        return list(node.args[2:5])  # (fwd, bwd, q, k, v, ...): see rewrite_sdpa
    return None


def _counts_tokens(node: fx.Node, n: int) -> str | None:
    """How ``node`` counts positions over ``n`` tokens (Note [Positions in sharded mode]), or None."""
    if node.op not in ("call_function", "call_method"):
        return None
    if node.target is torch.arange:
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or _hint(value.shape[0]) != n:
            return None
        bounds = [a for a in node.args if not isinstance(a, torch.dtype)]
        start = bounds[0] if len(bounds) >= 2 else node.kwargs.get("start", 0)
        step = bounds[2] if len(bounds) >= 3 else node.kwargs.get("step", 1)
        values = [x.meta.get("example_value") if isinstance(x, fx.Node) else x for x in (start, step)]
        counts = all(isinstance(v, (int, torch.SymInt)) for v in values) and [_hint(v) for v in values] == [0, 1]
        return "torch.arange" if counts else None
    if node.target in (torch.cumsum, "cumsum"):
        x = node.args[0].meta.get("example_value") if isinstance(node.args[0], fx.Node) else None
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if isinstance(x, torch.Tensor) and isinstance(dim, int) and x.dim() and _hint(x.shape[dim]) == n:
            return "a cumulative sum along the tokens"
        return None
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        buffer = _module_state(node.args[0])
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if buffer is None or Ellipsis in index or None in index:
            return None
        for dim, i in enumerate(index):
            if not (isinstance(i, slice) and isinstance(i.stop, int) and (i.step or 1) == 1):
                continue
            values = buffer.narrow(dim, i.start or 0, i.stop - (i.start or 0)) if dim < buffer.dim() else None
            # NOTE: a buffer that does not change along the tokens (token type ids of zeros) is no count.
            if values is not None and values.shape[dim] == n and not bool((values == values.narrow(dim, 0, 1)).all()):
                return "a slice of a module's buffer"
    return None


def _module_state(node: fx.Node) -> torch.Tensor | None:
    """The value of a module's buffer (or parameter) that ``node`` is, or None."""
    if node.op == "get_attr" and node.graph.owning_module is not None:
        value = getattr(node.graph.owning_module, node.target, None)
    elif node.op == "placeholder" and not _is_sequence(node) and node.meta.get("grapharg") is not None:
        value = node.meta["grapharg"].example
    else:
        return None
    return value if isinstance(value, torch.Tensor) else None
