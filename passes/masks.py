"""Read the structure of a dense attention mask from the graph that builds it (docs/semantics.md,
Masks).

Models hand SDPA an ``(B|1, H|1, N, N)`` mask that they build in the captured graph from
position comparisons and a padding vector (transformers 5.x, for every call with an
``attention_mask`` or ``use_cache=False``)::

    q_idx = arange(N)[None, None, :, None]; kv_idx = arange(N)[None, None, None, :]
    b_idx = arange(B)[:, None, None, None]
    mask = ones((), bool) & (kv_idx <= q_idx) & (kv_idx > q_idx - W) & padding[b_idx, kv_idx]
    mask = mask.expand(B, -1, N, N)

At ``N`` = 512k such a mask would be 256 GB, so it is read, never built. ``mask_structure``
evaluates the construction symbolically: each tensor on the way is an expression of its own
indices (``Dim(i)``), built from constants, ``arange`` (affine in its index), opaque tensors
read at index expressions (``Data``: a padding vector, or any tensor the interpreter does not
follow) and pointwise operations; views, ``expand``, indexing and broadcasting only rename the
indices. The mask's expression, over ``(b, h, p, t)``, is then cut into its conjuncts:

* one that does not read the query position ``p``: a **key mask** ``(B|1, H|1, 1, N)``, computed
  in the graph from the same tensors (O(B N); ``key_mask``);
* a comparison of ``t - p`` with a constant: a **band** ``lo <= t - p <= hi``: ``hi = 0`` is
  causal, ``lo = 1 - W`` a window of ``W``;
* documents: ``f(b, t) <relation> f(b, p)`` (ids, chunks, block-causal), the band possibly on
  position values instead of indices (packed sequences);
* one ``or``: causal OR a block (``g[t] == g[p] & g[p] >= 0``, or a prefix ``t < L``), which is
  block-causal on each block's last position (``MaskStructure.blocks``);
* anything else (a query-side mask, another ``or`` across positions, a tensor indexed by both
  positions): the mask is not structured, and the reason says what was found.

A float mask is read as ``where(allowed, 0, -inf)`` terms plus any additive key bias. Nothing
is guessed: what the interpreter cannot prove is an opaque tensor, and an opaque tensor that
depends on both positions leaves the site alone.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_int

from ring_rewrite.numerics import masks

__all__ = [
    "DecodePositions", "MaskStructure", "decode_positions", "key_mask", "key_values", "mask_structure", "runs",
    "sharded_documents_reason", "sharded_keys_reason",
]


# ---- expressions ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Dim:
    """The index along dim ``i`` of the tensor an expression describes."""

    i: int


@dataclasses.dataclass(frozen=True)
class Const:
    value: Any
    node: fx.Node | None = None
    """The graph node of a size or offset computed at run time (``value`` its example)."""


@dataclasses.dataclass(frozen=True)
class Op:
    """A pointwise operation (``_POINTWISE``'s names, ``where``, ``not``, ``neg``, ``bool``)."""

    name: str
    args: tuple


@dataclasses.dataclass(frozen=True)
class Data:
    """The value of the graph tensor ``node`` at the index expressions ``index``."""

    node: fx.Node
    index: tuple


class NotStructured(Exception):
    """The mask's construction cannot be read; the message says why."""


def _subst(e, dims: dict[int, Any]):
    """``e`` with each ``Dim(i)`` replaced by ``dims[i]``."""
    if isinstance(e, Dim):
        return dims[e.i]
    if isinstance(e, Op):
        return Op(e.name, tuple(_subst(a, dims) for a in e.args))
    if isinstance(e, Data):
        return Data(e.node, tuple(_subst(a, dims) for a in e.index))
    return e


def _dims(e) -> set[int]:
    if isinstance(e, Dim):
        return {e.i}
    if isinstance(e, Op):
        return set().union(*(_dims(a) for a in e.args))
    if isinstance(e, Data):
        return set().union(*(_dims(a) for a in e.index))
    return set()


def _free_dims(e) -> set[int]:
    """Dims read as positions, outside any tensor's index."""
    if isinstance(e, Dim):
        return {e.i}
    if isinstance(e, Op):
        return set().union(*(_free_dims(a) for a in e.args))
    return set()


def _data(e) -> list[fx.Node]:
    if isinstance(e, Const):
        return [] if e.node is None else [e.node]
    if isinstance(e, Op):
        return [n for a in e.args for n in _data(a)]
    if isinstance(e, Data):
        return [e.node, *(n for a in e.index for n in _data(a))]
    return []


# ---- reading the graph ------------------------------------------------------------------------

_POINTWISE = {
    "add": (operator.add, torch.add, "add", "__add__", "__radd__"),
    "sub": (operator.sub, torch.sub, "sub", "__sub__"),
    "mul": (operator.mul, torch.mul, "mul", "__mul__", "__rmul__"),
    "floordiv": (operator.floordiv, torch.floor_divide, "floor_divide", "__floordiv__"),
    "le": (operator.le, torch.le, "le", "__le__"),
    "lt": (operator.lt, torch.lt, "lt", "__lt__"),
    "ge": (operator.ge, torch.ge, "ge", "__ge__"),
    "gt": (operator.gt, torch.gt, "gt", "__gt__"),
    "eq": (operator.eq, torch.eq, "eq", "__eq__"),
    "ne": (operator.ne, torch.ne, "ne", "__ne__"),
    "and": (operator.and_, torch.logical_and, torch.bitwise_and, "logical_and", "bitwise_and", "__and__"),
    "or": (operator.or_, torch.logical_or, torch.bitwise_or, "logical_or", "bitwise_or", "__or__"),
}
_NAMES = {target: name for name, targets in _POINTWISE.items() for target in targets}
_NOT = (operator.invert, torch.logical_not, torch.bitwise_not, "logical_not", "bitwise_not", "__invert__")
_NEG = (operator.neg, torch.neg, "neg", "__neg__")
# NOTE: dynamo records Python's built-in ``abs(x)`` as ``operator.abs``, another object than ``abs``.
_ABS = (operator.abs, abs, torch.abs, "abs", "__abs__")
_SAME = ("contiguous", "clone", "detach")  # methods that keep the value
_CASTS = {"bool": torch.bool, "float": torch.float32, "long": torch.int64, "int": torch.int32}


def _value(node) -> torch.Tensor | None:
    v = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


_LOWEST = torch.finfo(torch.float16).min  # the highest lowest value of a float dtype: fills at or below it mask
_COMPARISONS = {"le": operator.le, "lt": operator.lt, "ge": operator.ge, "gt": operator.gt, "eq": operator.eq,
                "ne": operator.ne}  # fmt: skip


def _pointwise(name: str, args: tuple):
    """``Op(name, args)``, with a comparison of a float mask ``where(c, a, b)`` (numbers, one of
    them ``-inf`` or a dtype's lowest value) with a number folded into ``c``, ``not c`` or a
    constant: Falcon tests ``mask < -1`` of ``where(allowed, 0, finfo.min)`` to get its bool mask
    back. (Group ids ``where(c, 0, -1) >= 0`` stay as written: ``_blocks`` reads them so.)"""
    if name in _COMPARISONS and len(args) == 2:
        x, y = args
        if (
            isinstance(x, Op) and x.name == "where" and isinstance(y, Const) and y.node is None
            and all(isinstance(a, Const) and a.node is None for a in x.args[1:])
            and any(isinstance(a.value, float) and a.value <= _LOWEST for a in x.args[1:])
        ):  # fmt: skip
            cond, yes, no = x.args
            a, b = (bool(_COMPARISONS[name](c.value, y.value)) for c in (yes, no))
            return cond if (a, b) == (True, False) else Op("not", (cond,)) if (a, b) == (False, True) else Const(a)
    return Op(name, args)


def _shape(node) -> tuple[int, ...]:
    v = _value(node)
    if v is None:
        raise NotStructured(f"{node} has no example value")
    # NOTE: sizes as they are: a symbolic one stays a symbol (a decode step's cache length);
    # comparing it guards a relation, never a value.
    return tuple(v.shape)


class _Reader:
    """The expression of each node that builds the mask, memoised."""

    def __init__(self) -> None:
        self.memo: dict[fx.Node, Any] = {}

    def expr(self, x) -> Any:
        """The expression of an argument: a node's, or a Python scalar's."""
        if isinstance(x, fx.Node):
            if x not in self.memo:
                self.memo[x] = self._read(x)
            return self.memo[x]
        if isinstance(x, (bool, int, float)):
            return Const(x)
        raise NotStructured(f"argument {x!r}")

    def operand(self, x, shape: tuple[int, ...]):
        """``x`` broadcast to ``shape``: its dims renamed to the result's, size-1 dims at 0."""
        e = self.expr(x)
        if _value(x) is None:  # a Python number or a size: the same everywhere
            return e
        own = _shape(x)
        lead = len(shape) - len(own)
        return _subst(e, {i: Const(0) if s == 1 else Dim(i + lead) for i, s in enumerate(own)})

    def _read(self, node: fx.Node):
        value = node.meta.get("example_value")
        if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
            return Const(value, node)  # a size or offset computed in the graph
        try:
            return self._follow(node)
        except NotStructured:
            raise
        except Exception:  # anything the interpreter does not follow is an opaque tensor
            pass
        return self._opaque(node)

    def _opaque(self, node: fx.Node):
        if _value(node) is None:
            raise NotStructured(f"{node} is no tensor")
        return Data(node, tuple(Dim(i) for i in range(len(_shape(node)))))

    def _follow(self, node: fx.Node):
        if node.op not in ("call_function", "call_method"):
            return self._opaque(node)
        target, args, kwargs = node.target, node.args, node.kwargs
        shape = _shape(node)
        if target in _NAMES:
            return _pointwise(_NAMES[target], tuple(self.operand(a, shape) for a in args[:2]))
        if target in _NOT or target in _NEG:
            return Op("not" if target in _NOT else "neg", (self.operand(args[0], shape),))
        if target in _ABS:
            return Op("abs", (self.operand(args[0], shape),))
        if target is torch.where and len(args) == 3:
            return Op("where", tuple(self.operand(a, shape) for a in args))
        if target in ("masked_fill", torch.masked_fill):
            x, cond, value = args
            return Op("where", (self.operand(cond, shape), self.operand(value, shape), self.operand(x, shape)))
        if target is torch.arange:
            return _arange(args, kwargs)
        if target in (torch.cumsum, "cumsum"):
            return self._cumsum(args[0], args[1] if len(args) > 1 else kwargs["dim"], shape)
        if target in ("new_ones", "new_zeros", "new_full") or target in (torch.ones, torch.zeros, torch.full):
            return Const(_fill(target, args))
        if target in _SAME:
            return self.expr(args[0])
        if target in _CASTS or target in ("to", "type"):
            dtype = _CASTS.get(target) or _dtype_arg(args[1:], kwargs)
            return self._cast(args[0], dtype)
        if target in ("unsqueeze", torch.unsqueeze):
            return self._unsqueeze(args[0], args[1] if len(args) > 1 else kwargs["dim"])
        if target in ("expand", "expand_as", "view", "reshape", torch.reshape, torch.broadcast_to):
            return self._reshape(args[0], shape)
        if target in ("transpose", torch.transpose):
            a, b = (d % len(shape) for d in args[1:3])
            perm = list(range(len(shape)))
            perm[a], perm[b] = perm[b], perm[a]
            return _subst(self.expr(args[0]), {perm[i]: Dim(i) for i in range(len(shape))})
        if target in ("permute", torch.permute):
            perm = args[1] if isinstance(args[1], (list, tuple)) else args[1:]
            return _subst(self.expr(args[0]), {p % len(shape): Dim(i) for i, p in enumerate(perm)})
        if target in ("tril", "triu", torch.tril, torch.triu):
            diagonal = args[1] if len(args) > 1 else kwargs.get("diagonal", 0)
            x = self.expr(args[0])
            j, i = Op("sub", (Dim(len(shape) - 1), Dim(len(shape) - 2))), Const(diagonal)
            keep = Op("le", (j, i)) if target in ("tril", torch.tril) else Op("ge", (j, i))
            return Op("where", (keep, x, Const(False if _value(node).dtype == torch.bool else 0)))
        if target is operator.getitem:
            return self._getitem(args[0], args[1], shape)
        return self._opaque(node)

    def _cumsum(self, x, dim: int, shape: tuple[int, ...]):
        """``cumsum`` of a constant ``c`` along ``dim``: ``c * (i + 1)`` (Falcon numbers its keys
        as ``ones.cumsum(-1) - 1``); of anything else, an opaque tensor."""
        e = self.expr(x)
        if not isinstance(e, Const) or e.node is not None:
            raise ValueError("cumsum of a tensor")  # read as an opaque tensor
        return Op("mul", (e, Op("add", (Dim(dim % len(shape)), Const(1)))))

    def _cast(self, x, dtype):
        e = self.expr(x)
        source = _value(x).dtype if isinstance(x, fx.Node) else None
        if dtype == torch.bool and source is not None and source != torch.bool:
            return Op("ne", (e, Const(0)))
        if dtype is not None and dtype.is_floating_point and source == torch.bool:
            return Op("where", (e, Const(1.0), Const(0.0)))
        both = len(_shape(x)) >= 2 and {len(_shape(x)) - 2, len(_shape(x)) - 1} <= _free_dims(e)
        if both and _rounds(source, dtype) and not _exact_choices(e, dtype):
            # The rounding is of the difference (ALiBi's slope_h * (t - p) cast to bfloat16),
            # which no key bias less the row's own reproduces.
            raise NotStructured(
                f"a bias of query and key positions rounded from {source} to {dtype}, which no key "
                "bias reproduces; a key bias (ALiBi as slope_h * t, as BLOOM and MPT write it) is read"
            )
        return e

    def _unsqueeze(self, x, dim: int):
        n = len(_shape(x)) + 1
        dim %= n
        return _subst(self.expr(x), {i: Dim(i + (i >= dim)) for i in range(n - 1)})

    def _reshape(self, x, shape: tuple[int, ...]):
        """A view or expand that only adds, drops or broadcasts size-1 dims."""
        own = _shape(x)
        if own == shape:
            return self.expr(x)
        kept = [s for s in own if s != 1]
        if [s for s in shape if s != 1] == kept:  # size-1 dims come and go
            big = [i for i, s in enumerate(shape) if s != 1]
            mine = [i for i, s in enumerate(own) if s != 1]
            dims = {i: Const(0) for i, s in enumerate(own) if s == 1}
            dims.update({m: Dim(b) for m, b in zip(mine, big)})
            return _subst(self.expr(x), dims)
        if len(shape) >= len(own) and all(s in (1, t) for s, t in zip(own, shape[len(shape) - len(own):])):
            return self.operand(x, shape)  # expand: broadcasting
        raise ValueError("a reshape that moves data")

    def _getitem(self, x, index, shape: tuple[int, ...]):
        if not isinstance(index, tuple):
            index = (index,)
        own = _shape(x)
        if any(isinstance(i, fx.Node) for i in index):
            return self._advanced(x, index, own, shape)
        if Ellipsis in index:
            at = index.index(Ellipsis)
            rest = len(own) - sum(1 for i in index if i is not None and i is not Ellipsis)
            index = index[:at] + (slice(None),) * rest + index[at + 1:]
        dims, out = {}, 0
        source = 0
        for i in index:
            if i is None:
                out += 1
            elif isinstance(i, int):
                dims[source] = Const(i % own[source])
                source += 1
            elif isinstance(i, slice):
                # NOTE: not slice.indices: that would specialise a symbolic size.
                start, step = i.start or 0, i.step or 1
                if not isinstance(start, int) or start < 0 or not isinstance(step, int) or step < 1:
                    raise ValueError(f"slice {i}")
                dims[source] = Op("add", (Op("mul", (Dim(out), Const(step))), Const(start)))
                source, out = source + 1, out + 1
            else:
                raise ValueError(f"index {i!r}")
        for rest in range(source, len(own)):
            dims[rest] = Dim(out + rest - source)
        return _subst(self.expr(x), dims)

    def _advanced(self, x, index, own, shape):
        """``x[i0, i1, ...]`` with tensor indices on its leading dims (broadcast together), and
        whole slices after them."""
        tensors = [i for i in index if isinstance(i, fx.Node)]
        if index[: len(tensors)] != tuple(tensors) or any(i != slice(None) for i in index[len(tensors):]):
            raise ValueError("tensor indices after other indices")
        lead = max(len(_shape(t)) for t in tensors)
        idx_shape = shape[:lead]
        dims = {d: self.operand(t, idx_shape) for d, t in enumerate(tensors)}
        dims.update({d: Dim(lead + d - len(tensors)) for d in range(len(tensors), len(own))})
        return _subst(self.expr(x), dims)


def _int(x):
    """An int argument, or the symbol of one computed at run time (a cache's length)."""
    v = x.meta.get("example_value") if isinstance(x, fx.Node) else x
    if isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool):
        return v
    raise NotStructured("arange with bounds that are no ints")


def _arange(args, kwargs):
    args = [_int(a) for a in args if not isinstance(a, torch.dtype)]
    kwargs = {k: _int(v) for k, v in kwargs.items() if k in ("start", "end", "step")}
    start = args[0] if len(args) >= 2 else kwargs.get("start", 0)
    step = args[2] if len(args) >= 3 else kwargs.get("step", 1)
    return Op("add", (Op("mul", (Dim(0), Const(step))), Const(start)))


def _fill(target, args):
    if target in ("new_ones", torch.ones):
        return 1
    if target in ("new_zeros", torch.zeros):
        return 0
    return args[-1]


def _rounds(source: torch.dtype | None, dtype: torch.dtype | None) -> bool:
    """Whether a cast from float ``source`` to float ``dtype`` can round a value."""
    floats = source is not None and dtype is not None and source.is_floating_point and dtype.is_floating_point
    return floats and torch.finfo(dtype).eps > torch.finfo(source).eps


def _exact_choices(e, dtype: torch.dtype) -> bool:
    """Whether every value ``e`` takes is a constant that ``dtype`` holds (a mask's ``where`` of
    0 and a fill): a cast to ``dtype`` then changes nothing the reading depends on."""
    if isinstance(e, Const):
        value = e.value
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return isinstance(value, bool)
        return masks(value, dtype) or float(torch.tensor(value, dtype=dtype)) == value
    return isinstance(e, Op) and e.name == "where" and all(_exact_choices(a, dtype) for a in e.args[1:])


def _dtype_arg(args, kwargs):
    if "dtype" in kwargs:
        return kwargs["dtype"]
    return next((a for a in args if isinstance(a, torch.dtype)), None)


# ---- the structure ----------------------------------------------------------------------------

_B, _H, _P, _T = range(4)
_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class MaskStructure:
    """What a dense mask allows: key ``t`` for query ``p`` iff ``lo <= t - p <= hi`` (None:
    unbounded) and every key conjunct allows ``(b, h, t)``; plus additive key biases."""

    lo: int | None
    hi: int | None
    keys: tuple = ()
    """Bool expressions over ``(b, h, t)`` (dims 0, 1, 3)."""
    biases: tuple = ()
    """Float expressions over ``(b, h, t)``, added to the scores."""
    shape: tuple[int, ...] = ()
    """The mask's shape, as 4-D ``(B|1, H|1, N, N)``."""
    documents: Any = None
    """An expression ``f`` over ``(b, t)``: key ``t`` reaches query ``p`` only if ``f(b, t)
    <relation> f(b, p)`` (a document id, ``doc[b, t] == doc[b, p]``; block-causal, ``t // C <=
    p // C``), or None."""
    relation: str = "eq"
    """How a key's ``documents`` value compares to its query's: ``eq``, ``le``, ``lt``, ``ge``, ``gt``."""
    blocks: bool = False
    """Whether ``documents`` are the group ids of blocks in a causal mask (``causal | (g[t] ==
    g[p] & g[p] >= 0)``: bidirectional within each run of one id ``>= 0``, as transformers'
    ``block_sequence_ids`` and a prefix LM): then key ``t`` reaches query ``p`` iff ``end(t) <=
    end(p)``, ``end`` the last position of a position's block or the position itself
    (``ops.block_ends``, which raises where an id's positions are not one run)."""
    positions: Any = None
    """An expression over ``(b, t)`` the band compares instead of ``t`` itself (transformers
    compares ``position_ids`` values in packed sequences), or None. Then the band holds for
    positions only if ``positions - t`` is constant within each document: checked at run time
    (``ops.documents``), an O(N log N) guard that raises."""
    runs: Any = None
    """Where ``documents`` are the runs of an expression over ``(b, t)`` that counts up by one
    (a new document wherever it does not: transformers' ``cumsum(diff(position_ids) != 1)`` of a
    packed sequence), that expression; else None. A scan along the sequence: sharded mode
    computes it over the whole sequence's values (``runs``), not over a shard's."""

    @property
    def has_keys(self) -> bool:
        return bool(self.keys or self.biases)

    @property
    def data(self) -> list[fx.Node]:
        """The graph tensors the key mask, the documents and the positions read, in order, once
        each."""
        exprs = (*self.keys, *self.biases, *(e for e in (self.documents, self.positions) if e is not None))
        return list(dict.fromkeys(n for e in exprs for n in _data(e)))

    @property
    def reads_key_positions(self) -> bool:
        """Whether a key bias reads the key's position as a number (ALiBi's ``slope_h * t``): the
        key mask is then evaluated at each key's global position (``key_mask``'s ``keys``)."""
        return any(_T in _free_dims(e) for e in self.biases)

    def describe(self) -> str:
        if self.blocks:
            return ", ".join(["causal, bidirectional within blocks", *(["key mask"] if self.has_keys else [])])
        parts = []
        if self.hi == 0:
            parts.append("causal")
        elif self.hi is not None:
            parts.append(f"t - p <= {self.hi}")
        if self.lo is not None:
            parts.append(f"window {1 - self.lo}" if self.hi == 0 else f"t - p >= {self.lo}")
        if self.has_keys:
            parts.append("key mask")
        if self.documents is not None:
            parts.append("documents")
        return ", ".join(parts) or "all keys"


def mask_structure(mask: fx.Node, n: int, *, specialise: bool = True) -> MaskStructure | str:
    """The structure of ``mask`` (an SDPA ``attn_mask`` of ``n`` queries and keys), or the
    reason it has none. ``specialise=False`` keeps a symbolic length a symbol (the band's bounds
    must not be one)."""
    try:
        shape = _shape(mask)
        if len(shape) < 2 or shape[-1] != n or shape[-2] not in (1, n):
            return f"attn_mask of shape {shape} for {n} queries and keys"
        # NOTE: the site's own shapes are specialised (find_sdpa), so its mask's are too; the
        # length-bucketing pass reads it at a symbolic length.
        full = (1,) * (4 - len(shape)) + shape
        if specialise:
            full = tuple(guard_int(x) if isinstance(x, torch.SymInt) else x for x in full)
        reader = _Reader()
        e = reader.operand(mask, full)
        parts = _Parts()
        if _value(mask).dtype == torch.bool:
            band = _conjuncts(e, parts)
        else:
            band = _additive(e, parts, _value(mask).dtype)
    except NotStructured as error:
        return f"dense attn_mask whose structure cannot be read ({error})"
    if band is None:
        return f"dense attn_mask of shape {shape} that depends on query and key positions in a way that is not a band"
    if not specialise and any(isinstance(x, torch.SymInt) for x in band):
        return f"dense attn_mask whose band {band} depends on the length"
    lo, hi = (None if x is None else guard_int(x) if isinstance(x, torch.SymInt) else x for x in band)
    if lo is not None and hi is not None and lo > hi:
        return f"dense attn_mask that allows no key ({lo} <= t - p <= {hi})"
    if len(parts.documents) > 1 or len(parts.positions) > 1:
        return "dense attn_mask with more than one document id or position tensor"
    documents, relation = parts.documents[0] if parts.documents else (None, "eq")
    positions = parts.positions[0] if parts.positions else None
    if positions is not None and documents is None:
        # A band over position values is a band over the keys only where they count up by one:
        # one document, whose check runs at every call (``ops.documents``; raises otherwise).
        documents = Const(0)
    return MaskStructure(
        lo, hi, tuple(parts.keys), tuple(parts.biases), full,
        documents=documents, relation=relation, positions=positions, blocks=parts.blocks,
        runs=None if documents is None else _runs_of(documents, reader),
    )  # fmt: skip


def _runs_of(documents, reader: _Reader):
    """The expression over ``(b, t)`` whose runs ``documents`` are (``MaskStructure.runs``), or
    None: ``documents`` must read, at ``(b, t)`` itself, a tensor built as
    ``cumsum(diff(x, prepend=x[:, :1] - 1, dim=-1) != 1, -1)`` of a 2-D ``x``."""
    if not isinstance(documents, Data) or len(documents.index) != 2:
        return None
    b, t = ({k: v for k, v in (_linear(i) or {None: None}).items() if v != 0} for i in documents.index)
    if t != {_T: 1} or b not in ({_B: 1}, {}):
        return None
    x = _scanned(documents.node)
    if x is None or len(_shape(x)) != 2:
        return None
    return _subst(reader.operand(x, _shape(x)), {0: Dim(_B) if _shape(x)[0] != 1 else Const(0), 1: Dim(_T)})


def _scanned(node: fx.Node) -> fx.Node | None:
    """``x`` where ``node`` is ``cumsum(diff(x, prepend=x[:, :1] - 1, dim=-1) != 1, -1)``."""

    def call(n, *targets):
        return isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and n.target in targets

    if not call(node, "cumsum", torch.cumsum) or _arg(node, 1, "dim") not in (-1, 1):
        return None
    ne = node.args[0]
    if not call(ne, *_POINTWISE["ne"]) or ne.args[1] != 1:
        return None
    diff = ne.args[0]
    if not call(diff, torch.diff, "diff") or diff.kwargs.get("dim", -1) not in (-1, 1) or len(diff.args) != 1:
        return None
    x, first = diff.args[0], diff.kwargs.get("prepend")
    if not call(first, *_POINTWISE["sub"]) or first.args[1] != 1:
        return None
    head = first.args[0]
    if not call(head, operator.getitem) or head.args[0] is not x:
        return None
    if head.args[1] != (slice(None), slice(None, 1)):
        return None
    return x


def _arg(node: fx.Node, i: int, name: str):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name)


@dataclasses.dataclass
class _Parts:
    """What the conjuncts of a mask are, as they are found."""

    keys: list = dataclasses.field(default_factory=list)
    biases: list = dataclasses.field(default_factory=list)
    documents: list = dataclasses.field(default_factory=list)
    positions: list = dataclasses.field(default_factory=list)
    blocks: bool = False


def _additive(e, parts: _Parts, dtype: torch.dtype):
    """A float mask: a sum of ``where(allowed, x, -inf)`` terms (``masked_fill(~allowed, -inf)``
    alike) and key biases; returns the band (or None).

    A fill that masks in ``dtype`` (its ``finfo.min``, transformers' fill: Note [Fills that mask])
    masks as
    ``-inf`` does: a masked key's weight is ``exp(min - max)``, 0 in every row with a key allowed
    (scores below ``finfo.max / 2`` in magnitude). Only a row with no key allowed differs: there
    the dense mask gives the mean of the values and the rewrite 0 (docs/semantics.md, Accuracy)."""
    band: tuple = (None, None)
    terms = _terms(e)
    while terms:
        term = terms.pop()
        if _is(term, 0):
            continue
        if _P not in _dims(term):
            parts.biases.append(term)
            continue
        if not (isinstance(term, Op) and term.name == "where"):
            key = _key_part(term)
            if key is None:
                return None
            parts.biases.append(key)
            continue
        cond, yes, no = term.args
        if _masks(no, dtype):
            allowed, rest = cond, yes
        elif _masks(yes, dtype):
            allowed, rest = Op("not", (cond,)), no
        else:
            return None
        got = _conjuncts(allowed, parts)
        if got is None:
            return None
        band = _meet(band, got)
        terms += _terms(rest)  # where the condition allows, the rest adds
    return band


def _key_part(e):
    """``f`` where ``e`` is ``f(b, h, t) + g(b, h, p)``, or None: ``g``, constant along a row,
    changes no softmax, so ``e`` adds as the key bias ``f`` (ALiBi written relative, ``slope_h *
    (t - p)``, adds as ``slope_h * t``). Sums, differences and products with a factor that reads
    neither position are split; ``g`` may read no tensor at ``p`` (where it could be infinite, a
    row of the dense mask would be masked whole)."""
    dims = _dims(e)
    if _P not in dims:
        return e
    if _T not in dims:
        return Const(0) if not any(_P in _dims(x) for d in _data_reads(e) for x in d.index) else None
    if isinstance(e, Op) and e.name in ("add", "sub"):
        a, b = (_key_part(x) for x in e.args)
        return None if a is None or b is None else Op(e.name, (a, b))
    if isinstance(e, Op) and e.name == "neg":
        a = _key_part(e.args[0])
        return None if a is None else Op("neg", (a,))
    if isinstance(e, Op) and e.name == "mul":
        x, y = e.args
        if not {_P, _T} & _dims(x):
            y = _key_part(y)
            return None if y is None else Op("mul", (x, y))
        if not {_P, _T} & _dims(y):
            x = _key_part(x)
            return None if x is None else Op("mul", (x, y))
    return None


def _data_reads(e) -> list[Data]:
    if isinstance(e, Data):
        return [e, *(d for a in e.index for d in _data_reads(a))]
    if isinstance(e, Op):
        return [d for a in e.args for d in _data_reads(a)]
    return []


def _masks(e, dtype: torch.dtype) -> bool:
    """Whether ``e`` is a fill that masks in ``dtype``: ``-inf``, or about the dtype's lowest value."""
    return isinstance(e, Const) and isinstance(e.value, (int, float)) and masks(e.value, dtype)


def _terms(e) -> list:
    if isinstance(e, Op) and e.name == "add":
        return [t for a in e.args for t in _terms(a)]
    return [e]


def _is(e, value) -> bool:
    return isinstance(e, Const) and e.value == value


def _conjuncts(e, parts: _Parts):
    """Split a bool expression into key conjuncts, documents and positions (into ``parts``) and
    a band; None where a conjunct reads the query position otherwise."""
    band: tuple = (None, None)
    pending = _and_terms(e)
    while pending:
        c = pending.pop(0)
        if isinstance(c, Const):
            if bool(c.value):
                continue
            return None  # nothing allowed
        if _P not in _dims(c):
            parts.keys.append(c)
            continue
        if _every_position(c):
            continue
        if isinstance(c, Op) and c.name == "or":
            terms = [t for t in _or_terms(c) if not _is(t, False)]
            if any(_is(t, True) for t in terms):
                continue
            if len(terms) == 1:
                pending += _and_terms(terms[0])
                continue
            groups = _blocks(terms)
            if groups is None or parts.blocks:
                return None
            parts.documents.append((groups, "le"))
            parts.blocks = True
            continue
        documents = _same_document(c)
        if documents is not None:
            if documents not in parts.documents:
                parts.documents.append(documents)
            continue
        got = _relative(c)
        if got is None:
            return None
        (lo, hi), positions = got
        if positions is not None and positions not in parts.positions:
            parts.positions.append(positions)
        band = _meet(band, (lo, hi))
    return band


def _or_terms(e) -> list:
    if isinstance(e, Op) and e.name == "or":
        return [t for a in e.args for t in _or_terms(a)]
    return [e]


def _blocks(terms: list):
    """``causal | same block`` as the group ids of the blocks, an expression over ``(b, t)``
    (``MaskStructure.blocks``), else None. The block term is ``g[t] == g[p] & g[p] >= 0`` (either
    side's ``g``; transformers' ``blockwise_overlay``) or a prefix of the keys, ``t < L`` (a
    prefix LM: one block ``0 .. L - 1``, ids ``where(t < L, 0, -1)``)."""
    causal = [c for c in terms if _relative(c) == ((None, 0), None)]
    if len(terms) != 2 or len(causal) != 1:
        return None
    (other,) = [c for c in terms if c is not causal[0]]
    if _P not in _dims(other):
        diff = _difference(other, ("le", "lt", "ge", "gt"))
        if diff is None or any(_T in _dims(k) or _P in _dims(k) for k in diff if isinstance(k, Data)):
            return None
        a = diff.get(_T, 0)
        if set(diff) - {_T, None} - {k for k in diff if isinstance(k, Data)} or not a:
            return None
        if (a > 0) != (other.name in ("le", "lt")):
            return None  # t > L: a suffix, not a prefix
        return Op("where", (other, Const(0), Const(-1)))
    conjuncts = _and_terms(other)
    same = [_same_document(c) for c in conjuncts]
    equal = [s for s in same if s is not None and s[1] == "eq"]
    if len(conjuncts) != 2 or len(equal) != 1:
        return None
    groups = equal[0][0]
    (rest,) = [c for c, s in zip(conjuncts, same) if s is None or s[1] != "eq"]
    if _as_key(rest) not in (Op("ge", (groups, Const(0))), Op("gt", (groups, Const(-1))), Op("le", (Const(0), groups))):
        return None
    return groups


def _as_key(e):
    """``e`` with the query position read as the key position."""
    return _subst(e, {_B: Dim(_B), _H: Dim(_H), _P: Dim(_T), _T: Dim(_T)})


def _same_document(c):
    """``f(b, t) <relation> f(b, p)`` as ``(f over keys, relation)``, else None. An order
    relation only where ``f`` is no affine function of positions (block-causal ``t // C <= p //
    C``): ``t <= p`` itself, also of position values, is a band (``_relative``)."""
    if not (isinstance(c, Op) and c.name in _RELATIONS):
        return None
    for (a, b), rel in ((c.args, _FLIP_SIDES[c.name]), (c.args[::-1], c.name)):
        da, db = _dims(a), _dims(b)
        if _P in da and _T not in da and _T in db and _P not in db and _as_key(a) == b:
            if rel != "eq" and _linear(b) is not None:
                return None
            return b, rel
    return None


_RELATIONS = ("eq", "le", "lt", "ge", "gt")
_FLIP_SIDES = {"eq": "eq", "le": "ge", "lt": "gt", "ge": "le", "gt": "lt"}  # a <op> b as b <op'> a


def _and_terms(e) -> list:
    if isinstance(e, Op) and e.name == "and":
        return [t for a in e.args for t in _and_terms(a)]
    if isinstance(e, Op) and e.name in ("le", "lt", "ge", "gt"):
        small, big = e.args if e.name in ("le", "lt") else e.args[::-1]
        if isinstance(small, Op) and small.name == "abs":  # |x| <= c: x <= c and -x <= c
            name = "le" if e.name in ("le", "ge") else "lt"
            (x,) = small.args
            return [Op(name, (x, big)), Op(name, (Op("neg", (x,)), big))]
    if isinstance(e, Op) and e.name == "not":
        (a,) = e.args
        if isinstance(a, Op) and a.name == "or":  # De Morgan
            return [t for x in a.args for t in _and_terms(Op("not", (x,)))]
        if isinstance(a, Op) and a.name in _FLIP:
            return [Op(_FLIP[a.name], a.args)]
        if isinstance(a, Op) and a.name == "not":
            return _and_terms(a.args[0])
    if isinstance(e, Op) and e.name == "ne" and isinstance(e.args[1], Const) and e.args[1].value == 0:
        inner = e.args[0]  # bool(x) of a bool expression
        if isinstance(inner, Op) and inner.name in (*_FLIP, "and", "or", "not"):
            return _and_terms(inner)
    if isinstance(e, Op) and e.name == "where" and _is(e.args[2], False) and _is(e.args[1], True):
        return _and_terms(e.args[0])
    if isinstance(e, Op) and e.name == "where" and _is(e.args[2], False):
        return _and_terms(e.args[0]) + _and_terms(e.args[1])  # tril / triu of a mask
    return [e]


_FLIP = {"le": "gt", "lt": "ge", "ge": "lt", "gt": "le", "eq": "ne", "ne": "eq"}


def _meet(a: tuple, b: tuple) -> tuple:
    lo = max((x for x in (a[0], b[0]) if x is not None), default=None)
    hi = min((x for x in (a[1], b[1]) if x is not None), default=None)
    return lo, hi


def _linear(e) -> dict | None:
    """``e`` as ``{dim: coefficient, None: constant}`` if it is affine in dims, else None."""
    if isinstance(e, Const) and isinstance(e.value, (int, float, torch.SymInt)) and not isinstance(e.value, bool):
        return {None: e.value}
    if isinstance(e, Dim):
        return {e.i: 1}
    if isinstance(e, Data):
        try:
            hash(e)
        except TypeError:  # a symbolic size inside: not a variable this reads
            return None
        return {e: 1}
    if not isinstance(e, Op):
        return None
    if e.name in ("add", "sub"):
        a, b = (_linear(x) for x in e.args)
        if a is None or b is None:
            return None
        sign = 1 if e.name == "add" else -1
        return {k: a.get(k, 0) + sign * b.get(k, 0) for k in a.keys() | b.keys()}
    if e.name == "mul":
        a, b = (_linear(x) for x in e.args)
        if a is None or b is None:
            return None
        if set(b) == {None}:
            a, b = b, a
        if set(a) != {None}:
            return None  # a product of positions
        return {k: a[None] * v for k, v in b.items()}
    if e.name == "neg":
        a = _linear(e.args[0])
        return None if a is None else {k: -v for k, v in a.items()}
    return None


def _difference(c, names) -> dict | None:
    """A comparison ``lhs <op> rhs`` (``op`` in ``names``) as ``lhs - rhs``, linear, or None."""
    if not (isinstance(c, Op) and c.name in names):
        return None
    lhs, rhs = (_linear(x) for x in c.args)
    if lhs is None or rhs is None:
        return None
    return {k: lhs.get(k, 0) - rhs.get(k, 0) for k in lhs.keys() | rhs.keys()}


def _every_position(c) -> bool:
    """Whether ``c`` is a comparison of the query position alone that every position ``p >= 0``
    passes (transformers' encoders AND in ``q_idx >= 0``)."""
    diff = _difference(c, ("le", "lt", "ge", "gt"))
    if diff is None:
        return False
    a, c0 = diff.get(_P, 0), diff.get(None, 0)
    if any(v for k, v in diff.items() if k not in (_P, None)):
        return False
    # a * p + c0 <op> 0 at p = 0, and not failing as p grows.
    holds = {"le": c0 <= 0, "lt": c0 < 0, "ge": c0 >= 0, "gt": c0 > 0}[c.name]
    return holds and (a <= 0 if c.name in ("le", "lt") else a >= 0)


def _relative(c):
    """A comparison ``a (x(t) - x(p)) + c0 <op> 0`` as the band ``(lo, hi)`` of ``x(t) - x(p)``
    and ``x`` (None for the position itself, else a tensor's values over keys), or None."""
    diff = _difference(c, ("le", "lt", "ge", "gt", "eq"))
    if diff is None:
        return None
    variables = {k: v for k, v in diff.items() if k is not None and v}
    keys = [k for k in variables if k == _T or (isinstance(k, Data) and _T in _dims(k) and _P not in _dims(k))]
    queries = [k for k in variables if k == _P or (isinstance(k, Data) and _P in _dims(k) and _T not in _dims(k))]
    if len(keys) != 1 or len(queries) != 1 or len(variables) != 2:
        return None
    (xt,), (xp,) = keys, queries
    a, c0 = variables[xt], diff.get(None, 0)
    if variables[xp] != -a:
        return None
    if isinstance(xt, Data) != isinstance(xp, Data) or (isinstance(xt, Data) and _as_key(xp) != xt):
        return None
    positions = xt if isinstance(xt, Data) else None
    # a * d + c0 <op> 0 with d = x(t) - x(p), an integer.
    name = c.name if a > 0 else {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq"}[c.name]
    if abs(a) == 1:
        bound = -c0 * a  # exact, also for a symbolic offset
        floor = ceil = bound
    else:
        bound = -c0 / a
        floor, ceil = math.floor(bound), math.ceil(bound)
    if name == "le":
        return (None, floor), positions
    if name == "lt":
        return (None, ceil - 1), positions
    if name == "ge":
        return (ceil, None), positions
    if name == "gt":
        return (floor + 1, None), positions
    if floor != ceil:
        return (1, 0), positions  # no integer d: nothing allowed
    return (floor, floor), positions


@dataclasses.dataclass(frozen=True)
class DecodePositions:
    """Where a decode step's mask places its first query and its first key (a sliding-window
    cache holds the last keys only and builds its mask with their offset): expressions over the
    graph values ``data`` (sizes and offsets computed at run time)."""

    query: Any
    key: Any

    @property
    def data(self) -> list[fx.Node]:
        return list(dict.fromkeys([*_data(self.query), *_data(self.key)]))

    def evaluate(self, *data) -> tuple:
        """``(first query, first key)`` from the values of ``data`` (proxies while traced)."""
        tensors = dict(zip(self.data, data))
        return _evaluate(self.query, {}, tensors), _evaluate(self.key, {}, tensors)


def decode_positions(mask: fx.Node) -> DecodePositions | str | None:
    """The positions a decode step's mask compares: its causal comparison ``kv <= q`` (``q``
    the query's position, ``kv`` the key's index plus an offset); None where the mask compares
    no key position (then keys sit at ``0 .. N - 1``, queries last); a reason where it cannot be
    read."""
    try:
        e = _Reader().expr(mask)
    except NotStructured as error:
        return f"its mask cannot be read to place the keys ({error})"
    stack, compared = [e], False
    while stack:
        x = stack.pop()
        if isinstance(x, Data):
            stack.extend(x.index)
        if not isinstance(x, Op):
            continue
        stack.extend(x.args)
        if x.name not in _RELATIONS:
            continue
        sides = [_linear(a) for a in x.args]
        keyed = [s is not None and s.get(_T, 0) != 0 for s in sides]
        compared |= any(keyed)
        small, big = x.args if x.name == "le" else x.args[::-1] if x.name == "ge" else (None, None)
        if small is None:
            continue
        s, b = _linear(small), _linear(big)
        if s is None or b is None or s.get(_T) != 1 or set(s) - {_T, None} or set(b) - {_P, None}:
            continue
        return DecodePositions(_subst(big, {_P: Const(0), _T: Const(0)}), _subst(small, {_T: Const(0)}))
    if compared:
        return "its mask compares key positions in no causal comparison (kv <= q) that places them"
    return None


# ---- the key mask, in the graph ---------------------------------------------------------------


def key_mask(
    structure: MaskStructure, like: torch.Tensor, *data: torch.Tensor, keys: torch.Tensor | None = None
) -> torch.Tensor:
    """The key conjuncts and biases as an additive bias ``(B|1, H|1, N)`` in ``like``'s dtype,
    on its device (0 or ``-inf`` where a conjunct masks, plus the biases); ``data`` are the
    tensors ``structure.data`` names, in order, and ``like`` the site's query (proxies while the
    rewrite traces this: the bias is built from them, so a mask of constants alone is computed
    in the graph too); ``keys (N,)`` the keys' global positions, where they are not ``0 ..
    N-1`` (a rank's shard)."""
    index, tensors = _key_index(structure, data, like)
    numbers = None if keys is None else {**index, _T: keys.view(1, 1, 1, -1)}
    b, h, _, n = structure.shape
    bias = like.new_zeros(1, 1, 1, n)
    for e in structure.keys:
        bias = bias.masked_fill(~_evaluate(e, index, tensors).to(torch.bool), _NEG_INF)
    for e in structure.biases:
        bias = bias + _evaluate(e, index, tensors, numbers)
    lead = (b if _B in _uses(structure) else 1, h if _H in _uses(structure) else 1)
    return bias.type_as(like).expand(*lead, 1, n).reshape(*lead, n)


def key_values(structure: MaskStructure, e, *data: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """An expression over ``(b, t)`` (``structure.documents`` or ``.positions``) evaluated over
    the keys: ``(B|1, N)``, on ``like``'s device. NOTE: traced, the indices are computed from
    ``like`` (the site's query), so ids of the positions alone (``t // 8``) are graph nodes too,
    never a constant tensor, which the graph's code cannot spell."""
    index, tensors = _key_index(structure, data, like)
    b, n = structure.shape[0], structure.shape[3]
    values = _evaluate(e, index, tensors)
    if isinstance(values, (bool, int, float)):
        values = torch.full((1, 1, 1, n), values, device=index[_T].device)
    return values.expand(b if _B in _dims(e) else 1, 1, 1, n).reshape(-1, n)


def runs(x: torch.Tensor) -> torch.Tensor:
    """Document ids of ``x (B, N)``: a new id wherever ``x`` does not count up by one from the
    position before (``MaskStructure.runs``; transformers' packed-sequence ids)."""
    return (torch.diff(x, prepend=x[:, :1] - 1, dim=-1) != 1).cumsum(-1)


def sharded_keys_reason(structure: MaskStructure, is_input) -> str | None:
    """Why the key mask of ``structure`` cannot be evaluated on each rank's own keys in sharded
    mode, or None. Each rank evaluates it over its keys, at their global positions: that needs
    key conjuncts that read the key's position only as an index into a tensor (a prefix ``t <
    L`` is ``L`` of the local shard), biases that read it as a number only linearly (``slope_h *
    t``: then a shard's offset is a constant of every row), and tensors read at the key that the
    caller cut along the sequence (``is_input(node)``), not computed from the shard (BLOOM's
    ``cumsum`` of the local ``attention_mask``)."""
    if any(_T in _free_dims(e) for e in structure.keys):
        return "its mask reads key positions as numbers, which in sharded mode are each rank's local positions"
    if not all(_affine_in_key(e) for e in structure.biases):
        return (
            "its key bias reads key positions as numbers other than linearly, and in sharded mode "
            "positions are each rank's local ones"
        )
    for e in (*structure.keys, *structure.biases):
        for d in _data_reads(e):
            if any(_T in _dims(i) for i in d.index) and not is_input(d.node):
                return (
                    f"its key mask or bias reads {d.node} at each key, computed in the graph from this "
                    "rank's shard, which in sharded mode holds this rank's tokens only (BLOOM's and "
                    "Falcon's ALiBi number keys from the shard's attention_mask or length): pass it as "
                    "an input, or run such a model in replicated mode"
                )
    return None


def _affine_in_key(e) -> bool:
    """Whether ``e`` reads the key position ``t`` as a number (outside tensor indices) only as
    ``a * t + c``, ``a`` and ``c`` free of it."""
    if _T not in _free_dims(e):
        return True
    if isinstance(e, Dim):
        return True
    if isinstance(e, Op) and e.name in ("add", "sub"):
        return all(_affine_in_key(a) for a in e.args)
    if isinstance(e, Op) and e.name == "neg":
        return _affine_in_key(e.args[0])
    if isinstance(e, Op) and e.name == "mul":
        x, y = e.args
        return (_T not in _free_dims(x) and _affine_in_key(y)) or (_T not in _free_dims(y) and _affine_in_key(x))
    return False


def sharded_documents_reason(structure: MaskStructure, is_input) -> str | None:
    """Why the documents of ``structure`` cannot be told across ranks in sharded mode, or None.
    Each rank computes its keys' values of the expressions and gathers them: that needs
    expressions that read, at each key, only tensors the caller cut along the sequence
    (``is_input(node)``) and never the key's position as a number, which is local there."""
    exprs = [structure.documents if structure.runs is None else structure.runs, structure.positions]
    for e in (e for e in exprs if e is not None):
        if _T in _free_dims(e):
            return "its document ids read key positions as numbers, which in sharded mode are each rank's local ones"
        computed = [n for n in _data(e) if not is_input(n)]
        if computed:
            return (
                f"its document ids are computed in the graph from this rank's shard ({computed[0]}); in "
                "sharded mode pass them, or the packed position_ids they come from, as inputs"
            )
    return None


def _key_index(structure: MaskStructure, data, like: torch.Tensor | None = None) -> tuple[dict, dict]:
    """The index of every dim over the keys (``p`` at 0), and the tensors by their nodes; the
    indices on ``like``'s device (``data``'s, without it)."""
    b, h, _, n = structure.shape
    device = like.device if like is not None else data[0].device if data else None
    index = {
        _B: torch.arange(b, device=device).view(b, 1, 1, 1),
        _H: torch.arange(h, device=device).view(1, h, 1, 1),
        _P: 0,
        _T: torch.arange(n, device=device).view(1, 1, 1, n),
    }
    return index, dict(zip(structure.data, data))


def _uses(structure: MaskStructure) -> set[int]:
    return set().union(*(_dims(e) for e in (*structure.keys, *structure.biases)))


_EVAL = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "floordiv": operator.floordiv, "le": operator.le,
    "lt": operator.lt, "ge": operator.ge, "gt": operator.gt, "eq": operator.eq, "ne": operator.ne,
    "and": operator.and_, "or": operator.or_, "abs": operator.abs,
}  # fmt: skip


def _evaluate(e, index: dict, tensors: dict, numbers: dict | None = None):
    """``e`` at ``index``; a dim read as a number (outside a tensor's index) at ``numbers``,
    where given (a shard's global key positions, while its tensors are indexed locally)."""
    if isinstance(e, Dim):
        return (index if numbers is None else numbers)[e.i]
    if isinstance(e, Const):
        return e.value if e.node is None else tensors[e.node]
    if isinstance(e, Data):
        return tensors[e.node][tuple(_evaluate(i, index, tensors) for i in e.index)]
    args = [_evaluate(a, index, tensors, numbers) for a in e.args]
    if e.name in _EVAL:
        return _EVAL[e.name](*args)
    if e.name == "not":
        return ~args[0] if isinstance(args[0], (torch.Tensor, fx.Proxy)) else not args[0]
    if e.name == "neg":
        return -args[0]
    if e.name == "where":
        cond, yes, no = args
        if isinstance(cond, bool):
            return yes if cond else no
        if all(isinstance(x, (int, float)) for x in (yes, no)) and float in (type(yes), type(no)):
            # NOTE: of two numbers torch.where makes a float32 tensor, which float64's finfo.min
            # overflows (transformers' fill in a float64 model): float64 holds either dtype's.
            yes, no = (torch.full_like(cond, x, dtype=torch.float64) for x in (yes, no))
        return torch.where(cond, yes, no)
    raise AssertionError(e.name)
