"""The pass after ``attention_modules``: attention written by hand becomes one SDPA node.

Models that write attention out as ops (transformers' ``attn_implementation="eager"``, nanoGPT's
slow path, GPT-2's ``baddbmm`` path, timm's ``fused_attn=False``, research code) show dynamo no
SDPA node, so ``rewrite_sdpa`` would not see them. This pass finds each
``softmax(scores) @ v`` whose scores are a product of queries and keys, checks that the
subgraph computes exactly what one ``F.scaled_dot_product_attention`` call computes, and puts that
call in its place; the site then goes through ``find_sdpa`` and ``masks`` as any other. Where it
does not compute SDPA's function the site is left alone (it runs as written), with the reason in
the report.

Before (nanoGPT)::

    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
    att = self.attn_dropout(F.softmax(att, dim=-1))
    y = att @ v

After (every new node has ``meta["ring_rewrite"] = {"site": i, "role": "hand_written"}``)::

    y = torch._C._nn.scaled_dot_product_attention(q, k, v, dropout_p=p if training else 0.0,
                                                   is_causal=True, scale=0.3535...)

Note [Hand-written attention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A *site* is a ``softmax`` over the last dim whose input comes, through ops that keep the last
two dims ``(N, M)``, from a product of queries and keys (``MM1``), and whose output goes,
through casts, dropout and views, into the first operand of a product with the values
(``MM2``). Other softmaxes (a router's, a classifier's) are no sites and are not reported; nor
is a product with a module's parameter or buffer (``x @ W``): attention reads queries against
keys, both computed from the input.

The products read:

* ``q @ kt``, ``torch.matmul``, ``.matmul``: the key is ``kt``'s last two dims swapped
  (``k.transpose(-2, -1)``, ``k.mT``, ``k.permute(0, 1, 3, 2)`` give ``k`` back; a key stored
  pre-transposed gets a ``transpose`` view);
* ``torch.bmm`` over ``(B*H, N, D)`` and ``torch.baddbmm(x, q, kt, beta=0, alpha=a)`` (``a``
  is a scale; ``beta=1`` adds ``x`` as a bias): the heads are unfolded again from the 4-D
  tensor the 3-D one is a reshape of, so query head ``j`` stays head ``j`` (a dilated config
  gives heads different lattices); where none is found, from the other operands, else each
  batch entry is one head;
* ``torch.einsum`` with two operands (in either order: ``"bhmd,bhnd->bhnm", k, q``) and one
  contracted letter, output ``(batch..., n, m)``; ``MM2``'s output may be in any order of its
  letters (``bhqk,bkhd->bqhd``). ``baddbmm``'s operands may be keywords (BLOOM's).

Between ``MM1`` and the softmax, in any order that puts every scale before the first mask (a
scale after a bias scales the bias too):

* a scale: ``* c``, ``/ c`` (``c`` a number, ``torch.full([], c)``, or a one-element tensor,
  which then multiplies the query), ``baddbmm``'s ``alpha``; the scale on ``q`` or ``k``
  themselves stays where it is (it is part of their values);
* masks: ``masked_fill(m, v)``, ``where(m, s, v)`` / ``where(m, v, s)`` with ``v`` ``-inf`` or
  about ``finfo(dtype).min`` (see below);
* biases: ``+ b`` (transformers' additive ``causal_mask``, a padding bias);
* casts between float dtypes (softmax in float32), views of the leading dims, in-place forms.

After the softmax: casts, one ``dropout`` (its ``p`` when training, else 0), views of the leading
dims. Keys and values repeated for GQA (``repeat_kv``'s ``x[:, :, None].expand(...).reshape``,
``repeat_interleave(g, dim=1)``, ``expand`` of one head) are read as they were before the repeat,
with ``enable_gqa=True``: query head ``j`` reads head ``j // g``, as the repeat gave it.

Each check, and why the result is then exactly SDPA's function:

* **softmax over the last dim** (keys) only; over another dim it is no attention.
* **no other user** of any node from ``MM1`` to ``MM2``: where the scores or the probabilities
  are read elsewhere (``output_attentions=True``, a hook, attention rollout) SDPA would not
  compute them; the site is left alone with that reason.
* **scales before masks**; a scale after an additive bias: ``(s + b) * c == s * c + b * c``,
  SDPA with the scale ``c`` and the bias ``b * c`` (Falcon's ``(s + alibi) * inv_norm_factor``).
  The scaled bias keeps its fills (``min * c`` is passed as it is: Note [Fills that mask]
  says when a key bias masks). A scale
  after a mask is left alone (simple over clever), and so is a scale after a bias by a tensor
  that requires grad (SDPA's mask takes no gradient, ``find_sdpa``).
* **only the ops listed**: anything else on the scores (a softcap ``tanh``, Gemma 2's;
  ``s - s.amax()``) is a different function, left alone with its reason.
* **a fill of -inf or about the lowest finite value** of the dtype the masked scores have (at or
  below half of it, Note [Fills that mask]):
  ``finfo.min`` (transformers' eager masks, ``where(allowed, 0, min)``) gives a masked key the
  weight ``exp(min - max) = 0``, exactly as ``-inf`` does, in every row with a key allowed and
  scores below ``finfo.max / 2`` in magnitude. Such fills become ``-inf`` (masks.py reads
  ``-inf``). A fill like ``-1e4`` or ``-1e9`` masks only while the scores stay far above it: left
  alone. In a row with *no* key allowed the code as written gives NaN (``-inf``) or the mean
  of every value (``finfo.min``); SDPA and the rewrite give 0 (docs/semantics.md, Accuracy), as
  transformers' "sdpa" does against its "eager". That row is the one place the result differs.
* **a bias that requires grad** (a learned relative position bias, T5's in training) is left
  alone: SDPA's mask gets no gradient in the rewrite (``find_sdpa``).
* **a dense mask or bias the rewrite reads** (``masks.mask_structure``, at static lengths with
  ``N == M``): one that needs the query position otherwise (T5's bias in eval, bidirectional
  ALiBi) is left alone here with masks.py's reason, so the site runs as written.
* **a mask from module state** (nanoGPT's ``tril`` buffer): it is computed from the buffer's
  values when the graph is compiled, and must be a band ``lo <= t - p <= hi`` on every leading
  index; it becomes ``is_causal=True`` (alone, ``lo`` open, ``hi = 0``) or the band built from
  positions. A buffer is read as it is at compile time, as dynamo reads module attributes; a
  model that rewrites its causal buffer after compiling must compile again.
* **q, k, v of one dtype** once upcasts made for the product (``q.float()``) are undone; the
  softmax and the product then run in SDPA's own precision (float32 accumulation), the same
  function up to rounding in the dtype in use.

The SDPA node carries the softmax's stack trace and module path, so the report names the
site as transformers' "sdpa" path names it.

An exception while reading one site (a bug in this pass) leaves that site alone with the reason
``hand_written could not read this site: <error>``: finding is guarded per softmax, planning and
building per site, and nothing of the graph is changed before the SDPA call is made and checked
(``_replace``). The other sites are read as usual.

Note [Site ids of hand-written attention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Sites left alone here get their records first (in the order found); every new SDPA node then
gets the id ``rewrite_sdpa`` will give it: the records so far plus its place among all SDPA
nodes in graph order (as Note [Site ids of decomposed modules]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import guard_int, statically_known_true

from ring_rewrite.config import RingDilatedConfig
from ring_rewrite.numerics import masks
from ring_rewrite.roles import role

from ._fx import RoleTracer, erase_unused, location, propagate_example_values
from .find_sdpa import SDPA_TARGETS, _module_state
from .masks import mask_structure
from .records import leave_alone, records

__all__ = ["KIND", "NAME", "ROLE", "HandWrittenSite", "find_hand_written_sites", "hand_written_to_sdpa",
           "leave_hand_written_alone"]  # fmt: skip

NAME = "hand_written"
KIND = "hand_written"
"""The kind of a site left alone here (the report's ``kind`` column)."""
ROLE = "hand_written"
"""The role of the nodes this pass adds (the SDPA call and what its arguments need)."""

_NEG_INF = float("-inf")
_DEPTH = 16  # ops between a product and the softmax, or the softmax and the product with v


# ---- what the ops are ---------------------------------------------------------------------------


def _is(node: Any, functions: tuple = (), methods: tuple = ()) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in functions
    return node.op == "call_method" and node.target in methods


_MATMUL = ((torch.matmul, operator.matmul), ("matmul", "__matmul__"))
_BMM = ((torch.bmm,), ("bmm",))
_BADDBMM = ((torch.baddbmm,), ("baddbmm",))
_EINSUM = ((torch.einsum, torch.functional.einsum), ())
_SOFTMAX = ((F.softmax, torch.softmax, torch.special.softmax), ("softmax",))
_MUL = ((operator.mul, torch.mul, operator.imul), ("mul", "mul_", "__mul__", "__rmul__"))
_DIV = ((operator.truediv, torch.div, torch.true_divide, operator.itruediv),
        ("div", "div_", "true_divide", "__truediv__"))  # fmt: skip
_ADD = ((operator.add, torch.add, operator.iadd), ("add", "add_", "__add__", "__radd__"))
_MASKED_FILL = ((torch.masked_fill,), ("masked_fill", "masked_fill_"))
_WHERE = ((torch.where,), ())
_TANH = ((torch.tanh, F.tanh), ("tanh", "tanh_"))
_DROPOUT = ((F.dropout, torch.dropout), ())
_CASTS = ((), ("float", "double", "half", "bfloat16", "to", "type", "type_as"))
_SAME = ((torch.clone,), ("contiguous", "clone"))
_VIEWS = ((torch.reshape, torch.flatten, torch.unflatten, torch.unsqueeze, torch.squeeze),
          ("view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as", "reshape_as"))  # fmt: skip
_TRANSPOSES = ((torch.transpose, torch.permute, torch.swapaxes, torch.swapdims),
               ("transpose", "permute", "swapaxes", "swapdims"))  # fmt: skip
_REPEAT_INTERLEAVE = ((torch.repeat_interleave,), ("repeat_interleave",))
_EXPAND = ((), ("expand",))
_RANDOM = {torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
           torch.bernoulli, torch.multinomial, torch.normal, F.dropout, torch.dropout}  # fmt: skip


def _ev(node: Any) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _inplace(node: fx.Node) -> bool:
    """An op that writes its first operand (``x.masked_fill_``), whose own result is unused."""
    return node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__")


def _op_name(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _constant(x: Any) -> float | None:
    """A number written in the graph: a Python number, or ``torch.full([], c)`` /
    ``torch.tensor(c)`` / ``torch.scalar_tensor(c)`` of one; None for anything else."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        return float(x)  # specialised: a scale computed from a symbolic size
    if not isinstance(x, fx.Node):
        return None
    value = x.meta.get("example_value")
    if isinstance(value, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(value, bool):
        return float(value)
    if x.op != "call_function":
        return None
    if x.target is torch.full and len(x.args) >= 2 and tuple(x.args[0]) == ():
        return _constant(x.args[1])
    if x.target in (torch.tensor, torch.scalar_tensor) and x.args:
        return _constant(x.args[0])
    return None


# ---- products -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Product:
    """``x @ y`` read as ``x (..., R, C) @ y (..., C, S)``: each operand with the permutation that
    brings it to that layout, a factor, and an added term (``baddbmm``'s input)."""

    node: fx.Node
    x: fx.Node
    x_perm: tuple[int, ...] | None  # None: as it is
    y: fx.Node
    y_perm: tuple[int, ...] | None
    alpha: float = 1.0
    added: fx.Node | None = None
    out_perm: tuple[int, ...] | None = None  # einsum: the output from (batch..., R, S)
    reason: str | None = None


def _operands(node: fx.Node, *names: str) -> list[Any] | None:
    """``_arg`` of each of ``names`` in turn (``alibi.baddbmm(batch1=q, batch2=kt)``, as BLOOM
    calls it); None where one is missing."""
    got = [_arg(node, i, name) for i, name in enumerate(names)]
    return None if any(x is None for x in got) else got


def _product(node: fx.Node) -> _Product | None:
    if _is(node, *_MATMUL) or _is(node, *_BMM):
        operands = _operands(node, "input", "mat2" if _is(node, *_BMM) else "other")
        if operands is None:
            return None
        x, y = operands
        if not (_ev(x) is not None and _ev(y) is not None and _ev(x).dim() >= 2 and _ev(y).dim() >= 2):
            return None
        return _Product(node, x, None, y, None)
    if _is(node, *_BADDBMM):
        operands = _operands(node, "input", "batch1", "batch2")
        if operands is None:
            return None
        inp, x, y = operands
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        reason = None
        if not isinstance(alpha, (int, float)) or not isinstance(beta, (int, float)) or beta not in (0, 1):
            reason = f"baddbmm with beta={beta}, alpha={alpha} (beta 0 or 1 and a constant alpha are read)"
            alpha, beta = 1.0, 0
        return _Product(node, x, None, y, None, float(alpha), inp if beta == 1 else None, reason=reason)
    if _is(node, *_EINSUM):
        return _einsum(node)
    return None


def _einsum(node: fx.Node) -> _Product | None:
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or "->" not in equation or len(operands) != 2:
        return None
    if any(_ev(o) is None for o in operands):
        return None
    inputs, out = equation.replace(" ", "").split("->")
    subs = inputs.split(",")
    if len(subs) != 2:
        return None
    spare = iter(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation)
    ell: dict[int, str] = {}
    expanded = []
    for sub, o in zip(subs, operands):
        if "..." in sub:
            n = _ev(o).dim() - (len(sub) - 3)
            if n not in ell:
                ell[n] = "".join(next(spare) for _ in range(n))
            sub = sub.replace("...", ell[n])
        expanded.append(sub)
    if "..." in out:
        if len(ell) != 1:
            return None
        out = out.replace("...", next(iter(ell.values())))
    a, b = expanded
    if any(len(set(s)) != len(s) for s in (a, b, out)):
        return None
    if len(a) != _ev(operands[0]).dim() or len(b) != _ev(operands[1]).dim():
        return None
    contracted = [c for c in a if c in b and c not in out]
    batch = [c for c in out if c in a and c in b]
    rows = [c for c in out if c in a and c not in b]
    cols = [c for c in out if c in b and c not in a]
    if len(contracted) != 1 or len(rows) != 1 or len(cols) != 1 or len(batch) + 2 != len(out):
        return None
    if set(a) != {*batch, *rows, *contracted} or set(b) != {*batch, *cols, *contracted}:
        return None
    (c,), (r,), (s,) = contracted, rows, cols
    if out.index(r) > out.index(s):  # the operand of the rows second (``"bhmd,bhnd->bhnm", k, q``)
        a, b, operands, r, s = b, a, operands[::-1], s, r
    x_layout, y_layout = [*batch, r, c], [*batch, c, s]
    canonical = [*batch, r, s]
    x_perm = tuple(a.index(ch) for ch in x_layout)
    y_perm = tuple(b.index(ch) for ch in y_layout)
    out_perm = tuple(canonical.index(ch) for ch in out)
    ident = lambda p: None if p == tuple(range(len(p))) else p  # noqa: E731
    return _Product(node, operands[0], ident(x_perm), operands[1], ident(y_perm), out_perm=ident(out_perm))


def _operand_shape(node: fx.Node, perm: tuple[int, ...] | None) -> tuple:
    shape = tuple(_ev(node).shape)
    return shape if perm is None else tuple(shape[p] for p in perm)


def _product_shape(p: _Product) -> tuple:
    """The product's value in the layout ``(batch..., R, S)`` (before ``out_perm``)."""
    shape = tuple(_ev(p.node).shape)
    if p.out_perm is None:
        return shape
    canonical = [None] * len(shape)
    for i, j in enumerate(p.out_perm):
        canonical[j] = shape[i]
    return tuple(canonical)


# ---- finding sites ------------------------------------------------------------------------------


@dataclasses.dataclass
class HandWrittenSite:
    """One ``softmax(q @ k^T ...) @ v`` in the graph (Note [Hand-written attention])."""

    softmax: fx.Node
    scores: _Product | None
    """``MM1``; None where the softmax reaches more than one product (``reason`` says so)."""
    values: _Product | None
    """``MM2``: the probabilities are its ``x``; None only where the site could not be read."""
    scores_path: list[fx.Node]
    """``MM1`` .. the softmax's input, in order."""
    probs_path: list[fx.Node]
    """The softmax .. ``MM2``'s first operand, in order."""
    location: str
    reason: str | None = None

    @property
    def shapes(self) -> dict[str, Any]:
        def shape(node, perm=None):
            return None if node is None or _ev(node) is None else _operand_shape(node, perm)

        q = k = None
        if self.scores is not None:
            q = shape(self.scores.x, self.scores.x_perm)
            kt = shape(self.scores.y, self.scores.y_perm)
            k = None if kt is None else (*kt[:-2], kt[-1], kt[-2])
        value = None if self.values is None else shape(self.values.y, self.values.y_perm)
        return {"query": q, "key": k, "value": value, "attn_mask": None}


def _softmax_dim(node: fx.Node) -> int | None:
    dim = _arg(node, 1, "dim")
    x = _ev(node.args[0])
    if not isinstance(dim, int) or x is None:
        return None
    return dim % x.dim() if x.dim() else None


def _trailing(node: Any, n, m) -> bool:
    value = _ev(node)
    return value is not None and value.dim() >= 2 and value.is_floating_point() and tuple(value.shape[-2:]) == (n, m)


def find_hand_written_sites(gm: fx.GraphModule) -> list[HandWrittenSite]:
    """Every softmax over the last dim between a product of queries and keys and a product with
    values, in graph order."""
    sites = []
    for node in gm.graph.nodes:
        if not _is(node, *_SOFTMAX):
            continue
        try:
            site = _site(node)
        except Exception as error:  # a bug here: the softmax runs as written (Note [Hand-written attention])
            site = HandWrittenSite(node, None, None, [], [], location(node), _could_not_read(error))
        if site is not None:
            sites.append(site)
    return sites


def _could_not_read(error: Exception) -> str:
    return f"hand_written could not read this site: {type(error).__name__}: {error}"


def _site(node: fx.Node) -> HandWrittenSite | None:
    """The site of one softmax, or None where it is no attention."""
    x = _ev(node.args[0]) if node.args else None
    if x is None or x.dim() < 2 or _softmax_dim(node) != x.dim() - 1:
        return None
    n, m = x.shape[-2:]
    forward = _probs_path(node, n, m)
    if forward is None:
        return None
    probs_path, values = forward
    found = _scores_paths(node.args[0], n, m)
    if not found:
        return None
    where = location(node)
    if len({path[0] for path in found}) > 1:
        reason = "the scores add more than one product (a bias computed from the query, as Transformer-XL's?)"
        return HandWrittenSite(node, None, values, [], probs_path, where, reason)
    scores_path = found[0]
    product = _product(scores_path[0])
    if _module_tensor(product.x) or _module_tensor(product.y):
        return None  # x @ W: a router's or a classifier's logits, no queries against keys
    return HandWrittenSite(node, product, values, scores_path, probs_path, where)


def _module_tensor(node: Any) -> bool:
    """Whether ``node`` is, up to views and casts, a module's parameter or buffer."""
    x = node
    for _ in range(_DEPTH):
        if not isinstance(x, fx.Node):
            return False
        if x.op in ("placeholder", "get_attr"):
            return _module_state(x) is not None
        step = _is(x, *_VIEWS) or _is(x, *_SAME) or _is(x, *_CASTS) or _is(x, *_TRANSPOSES) or _is(x, *_EXPAND)
        if not (step or _permutation(x) is not None) or not x.args:
            return False
        x = x.args[0]
    return False


def _scores_paths(start: fx.Node, n, m) -> list[list[fx.Node]]:
    """The paths from a product with trailing dims ``(n, m)`` to ``start`` through nodes with
    those trailing dims (at most ``_DEPTH`` ops)."""
    memo: dict[fx.Node, list[list[fx.Node]]] = {}

    def walk(node: fx.Node, depth: int) -> list[list[fx.Node]]:
        if node in memo:
            return memo[node]
        found: list[list[fx.Node]] = []
        if _product(node) is not None:
            product = _product(node)
            shape = _product_shape(product)
            if product.out_perm is None and tuple(shape[-2:]) == (n, m):
                found = [[node]]
        elif depth > 0 and node.op in ("call_function", "call_method"):
            for x in dict.fromkeys(node.all_input_nodes):
                if _trailing(x, n, m):
                    found += [[*path, node] for path in walk(x, depth - 1)]
        memo[node] = found
        return found

    return walk(start, _DEPTH) if _trailing(start, n, m) else []


def _probs_path(softmax: fx.Node, n, m) -> tuple[list[fx.Node], _Product] | None:
    """The path from the softmax to the first operand of a product with values, through casts,
    dropout, views and ops that keep the trailing dims; None where none is reached."""
    frontier: list[list[fx.Node]] = [[softmax]]
    for _ in range(_DEPTH):
        following = []
        for path in frontier:
            for user in path[-1].users:
                product = _product(user)
                if product is not None and product.x is path[-1] and product.x_perm is None and product.reason is None:
                    x_shape = _operand_shape(product.x, product.x_perm)
                    if tuple(x_shape[-2:]) == (n, m):
                        return path, product
                if _trailing(user, n, m) and product is None:
                    following.append([*path, user])
        frontier = following
        if not frontier:
            return None
    return None


# ---- what a site computes -----------------------------------------------------------------------


@dataclasses.dataclass
class _Term:
    """A mask or a bias applied to the scores: ``node`` broadcast against scores whose leading
    dims were ``lead`` there; ``keep`` masks (True: attend) or adds ``node``; ``negate``: the
    mask is ``~node``."""

    node: fx.Node
    lead: tuple
    keep: bool
    negate: bool = False
    scales: list[tuple[Any, str]] = dataclasses.field(default_factory=list)
    """A bias scaled with the scores after it was added (Falcon's ``(s + alibi) * c``): each
    ``(factor, "mul" | "div")``, a number or a one-element tensor's node, in order."""


@dataclasses.dataclass
class _SdpaCall:
    q: fx.Node
    q_perm: tuple[int, ...] | None
    k: fx.Node  # keys (..., M, D) after k_perm
    k_perm: tuple[int, ...] | None
    v: fx.Node
    v_perm: tuple[int, ...] | None
    lead: tuple  # MM1's leading dims
    frame: tuple  # (B, H)
    q_lead: tuple
    k_lead: tuple
    v_lead: tuple
    scale: float
    scale_tensors: list[tuple[fx.Node, str]]
    terms: list[_Term]
    dropout_p: float
    out_lead: tuple  # MM2's leading dims
    out_perm: tuple[int, ...] | None
    gqa: int | None = None  # the group size, where k and v are read before their repeat


def _chain_ops(path: list[fx.Node]) -> list[tuple[fx.Node, fx.Node]] | str:
    """``(op, value it reads)`` along ``path`` (its first node excluded), in-place ops on a node of
    the path included where they run; a reason where a node on it has another user."""
    ops: list[tuple[fx.Node, fx.Node]] = []
    order = {node: i for i, node in enumerate(path[0].graph.nodes)}
    for prev, node in zip(path, path[1:]):
        extra = [u for u in prev.users if u is not node]
        for u in sorted(extra, key=order.__getitem__):
            if not (_inplace(u) and u.args and u.args[0] is prev and not u.users and order[u] < order[node]):
                return f"{prev.name} is used elsewhere ({u.name}: {_op_name(u)})"
            ops.append((u, prev))
        ops.append((node, prev))
    return ops


def _sdpa_call(site: HandWrittenSite) -> _SdpaCall | str:
    """What SDPA call computes the site, or why none does."""
    if site.reason is not None:
        return site.reason
    mm1, mm2 = site.scores, site.values
    if mm1 is None or mm1.reason is not None:
        return mm1.reason if mm1 is not None else "no product of queries and keys"
    if mm2.reason is not None:
        return mm2.reason
    # NOTE: each path with the node that reads its end, so that the end has no other user either.
    ops = _chain_ops([*site.scores_path, site.softmax])
    if isinstance(ops, str):
        return f"the attention scores are used elsewhere: {ops}"
    probs = _chain_ops([*site.probs_path, mm2.node])
    if isinstance(probs, str):
        return (
            f"the attention probabilities are used elsewhere: {probs}; SDPA does not compute them "
            "(output_attentions=True, a hook, attention weights returned)"
        )
    ops, probs = ops[:-1], probs[:-1]
    if any(_inplace(op) for op, _ in probs):
        return "the attention probabilities are written in place"
    lead = tuple(_product_shape(mm1)[:-2])
    scale, scale_tensors, terms = mm1.alpha, [], []
    if mm1.added is not None:
        if _ev(mm1.added) is None or not _ev(mm1.added).is_floating_point():
            return "baddbmm adds a tensor that is no float bias"
        terms.append(_Term(mm1.added, lead, keep=False))
    current = lead
    for op, prev in ops:
        out = _ev(op)
        step = _scores_op(op, prev, current)
        if isinstance(step, str):
            return step
        kind, payload = step
        if kind == "view":
            current = tuple(out.shape[:-2])
        elif kind == "scale":
            factor, tensor, how = payload
            # NOTE: (s + b) * c == s * c + b * c: a bias added before a scale is scaled with it.
            # A mask (a -inf or finfo.min fill) is not: left alone, simple over clever.
            if any(t.keep for t in terms):
                return ("the scores are scaled after a mask is applied (scales before masks, and scales "
                        "after an additive bias, are read)")  # fmt: skip
            if terms and tensor is not None and _ev(tensor).requires_grad:
                return "the scores are scaled after a bias by a tensor that requires grad (a learned temperature)"
            for term in terms:
                term.scales.append((tensor if factor is None else factor, how))
            if factor is not None:
                scale = scale * factor if how == "mul" else scale / factor
            else:
                scale_tensors.append((tensor, how))
        elif kind == "term":
            terms.append(payload)
    for op, _ in probs:
        if _is(op, *_VIEWS) or _is(op, *_CASTS) or _is(op, *_SAME) or _is(op, *_DROPOUT):
            continue
        return f"the attention probabilities pass through {_op_name(op)}, which SDPA does not compute"
    dropouts = [op for op, _ in probs if _is(op, *_DROPOUT)]
    if len(dropouts) > 1:
        return "more than one dropout on the attention probabilities"
    dropout_p = 0.0
    if dropouts:
        (d,) = dropouts
        if d.target is torch.dropout:
            p, training = _arg(d, 1, "p"), _arg(d, 2, "train")
        else:
            p, training = _arg(d, 1, "p", 0.5), _arg(d, 2, "training", True)
        if not isinstance(p, (int, float)) or not isinstance(training, bool):
            return "dropout with a probability or training flag computed at run time"
        dropout_p = float(p) if training else 0.0
    return _layout(site, lead, scale, scale_tensors, terms, dropout_p)


def _scores_op(op: fx.Node, prev: fx.Node, lead: tuple):
    """What one op on the scores does: ``("view", None)``, ``("cast", None)``, ``("scale",
    (factor, tensor, "mul" | "div"))``, ``("term", _Term)``; or a reason."""
    out, value = _ev(op), _ev(prev)
    if _is(op, *_TANH):
        return "a softcap (tanh) on the scores (as Gemma 2's attn_logit_softcapping): SDPA has no softcap"
    if _is(op, *_CASTS):
        if out is None or not out.is_floating_point():
            return f"the scores are cast to {None if out is None else out.dtype}"
        return "cast", None
    if _is(op, *_SAME):
        return "view", None
    if _is(op, *_VIEWS):
        if out is None or out.dim() < 2 or tuple(out.shape[-2:]) != tuple(value.shape[-2:]) or op.args[0] is not prev:
            return f"the scores are reshaped ({_op_name(op)}) across their last two dims"
        return "view", None
    if _is(op, *_MUL) or _is(op, *_DIV):
        a, b = op.args[0], op.args[1]
        how = "mul" if _is(op, *_MUL) else "div"
        if how == "div" and a is not prev:
            return "a number or tensor is divided by the scores"
        other = b if a is prev else a
        if other is prev:
            return "the scores are multiplied by themselves"
        factor = _constant(other)
        if factor is not None:
            if factor == 0 or not math.isfinite(factor):
                return f"the scores are scaled by {factor}"
            return "scale", (factor, None, how)
        t = _ev(other)
        if t is None or t.numel() != 1 or not t.is_floating_point():
            shape = None if t is None else tuple(t.shape)
            return f"the scores are scaled by a tensor of shape {shape} (a number or a one-element tensor is read)"
        return "scale", (None, other, how)
    if _is(op, *_ADD):
        if len(op.args) > 2 or op.kwargs.get("alpha", 1) != 1:
            return "the scores are added with an alpha"
        a, b = op.args[0], op.args[1]
        other = b if a is prev else a
        if other is prev:
            return "the scores are added to themselves"
        t = _ev(other)
        if t is None or not t.is_floating_point():
            return "a number or a non-float tensor is added to the scores"
        return "term", _Term(other, lead, keep=False)
    if _is(op, *_MASKED_FILL):
        if op.args[0] is not prev:
            return "a mask fills the scores into another tensor"
        cond, fill = _arg(op, 1, "mask"), _arg(op, 2, "value")
        if not masks(_constant(fill), out.dtype):
            return _fill_reason(fill, out.dtype)
        return "term", _Term(cond, lead, keep=True, negate=True)
    if _is(op, *_WHERE) and len(op.args) == 3:
        cond, yes, no = op.args
        fill, negate = (no, False) if yes is prev else (yes, True)
        if (yes is prev) == (no is prev):
            return "where() over the scores on both sides"
        if not masks(_constant(fill), out.dtype):
            return _fill_reason(fill, out.dtype)
        return "term", _Term(cond, lead, keep=True, negate=negate)
    return f"the scores pass through {_op_name(op)}, which SDPA does not compute"


def _fill_reason(fill: Any, dtype: torch.dtype) -> str:
    value = _constant(fill)
    shown = "a tensor" if value is None else f"{value:g}"
    return (
        f"the scores are masked with {shown}, not -inf or the lowest {dtype} value: it masks only "
        "approximately (Note [Hand-written attention] in passes/hand_written.py)"
    )


def _origin4(node: fx.Node, size) -> fx.Node | None:
    """The 4-D tensor ``(B, H, X, Y)`` with ``B * H == size`` that the 3-D ``node`` ``(B*H, X,
    Y)`` is a reshape of (through views, copies and casts), or None."""
    x, trailing = node, tuple(_ev(node).shape[-2:])
    for _ in range(_DEPTH):
        value = _ev(x)
        if value is None:
            return None
        if value.dim() == 4:
            ok = value.shape[0] * value.shape[1] == size and tuple(value.shape[2:]) == trailing
            return x if ok else None
        if not (_is(x, *_VIEWS) or _is(x, *_SAME) or _is(x, *_CASTS)) or not isinstance(x.args[0], fx.Node):
            return None
        x = x.args[0]
    return None


def _layout(site: HandWrittenSite, lead: tuple, scale: float, scale_tensors, terms, dropout_p) -> _SdpaCall | str:
    mm1, mm2 = site.scores, site.values
    q, q_perm = mm1.x, mm1.x_perm
    # keys: (.., M, D) is the product's second operand with its last two dims swapped
    kt_perm = mm1.y_perm if mm1.y_perm is not None else tuple(range(_ev(mm1.y).dim()))
    k, k_perm = mm1.y, (*kt_perm[:-2], kt_perm[-1], kt_perm[-2])
    v, v_perm = mm2.y, mm2.y_perm
    out_lead = tuple(_product_shape(mm2)[:-2])
    if len(lead) > 2:
        return f"the scores have {len(lead) + 2} dims (at most 4 are read)"
    frame: tuple | None = None
    if len(lead) == 2:
        frame = lead
    elif len(lead) == 1:
        # Heads folded into the batch (bmm): unfold them from the tensors they came from.
        origins = {}
        for name, node, perm in (("q", q, q_perm), ("k", k, mm1.y_perm), ("v", v, v_perm)):
            if perm is None:
                found = _origin4(node, lead[0])
                if found is not None:
                    origins[name] = found
        if "q" in origins:
            frame = tuple(_ev(origins["q"]).shape[:2])
        elif origins:
            frame = tuple(_ev(next(iter(origins.values()))).shape[:2])
        else:
            views = [_ev(n) for n in [*site.scores_path, *site.probs_path] if _ev(n) is not None and _ev(n).dim() == 4]
            frame = tuple(views[0].shape[:2]) if views else (lead[0], 1)
        # NOTE: an origin split otherwise than the frame stays 3-D and is unfolded as the frame says.
        same = {name: node for name, node in origins.items() if tuple(_ev(node).shape[:2]) == frame}
        if "q" in same:
            q = same["q"]
        if "k" in same:
            k, k_perm = _swap_last(same["k"])
        if "v" in same:
            v = same["v"]
    else:
        frame = (1, 1)
    if isinstance(frame[1], torch.SymInt) and len(lead) == 1:
        return "a symbolic number of heads folded into the batch"
    k, k_perm = _simplify(k, k_perm)
    q, q_perm = _simplify(q, q_perm)
    v, v_perm = _simplify(v, v_perm)
    call = _SdpaCall(
        q=q, q_perm=q_perm, k=k, k_perm=k_perm, v=v, v_perm=v_perm, lead=lead, frame=frame,
        q_lead=tuple(_operand_shape(q, q_perm)[:-2]), k_lead=tuple(_operand_shape(k, k_perm)[:-2]),
        v_lead=tuple(_operand_shape(v, v_perm)[:-2]), scale=scale, scale_tensors=scale_tensors,
        terms=terms, dropout_p=dropout_p, out_lead=out_lead, out_perm=mm2.out_perm,
    )  # fmt: skip
    qd, kd, vd = (_ev(x).dtype for x in (call.q, call.k, call.v))
    if qd != vd or kd != vd:
        q2, k2 = _uncast(call.q, vd), _uncast(call.k, vd)
        if q2 is None or k2 is None:
            return f"query/key/value dtypes differ ({qd}, {kd}, {vd})"
        call.q, call.k = q2, k2
    for name, size in (("query", call.q_lead), ("key", call.k_lead), ("value", call.v_lead)):
        if len(size) != len(lead) and not (len(lead) == 1 and len(size) == 2):
            return f"the {name} has {len(size) + 2} dims against scores of {len(lead) + 2}"
    gqa = _gqa(call)
    if gqa is not None:
        call.k, call.v, call.k_perm, call.v_perm, call.gqa = *gqa[:2], None, None, gqa[2]
        call.k_lead, call.v_lead = tuple(_ev(call.k).shape[:2]), tuple(_ev(call.v).shape[:2])
    if len(call.k_lead) == 2 and len(call.v_lead) == 2 and call.k_lead[1] != call.v_lead[1]:
        return f"keys and values of {call.k_lead[1]} and {call.v_lead[1]} heads"
    return call


def _swap_last(node: fx.Node):
    """``node`` (in the product's layout ``(.., D, M)``) read as keys ``(.., M, D)``."""
    n = _ev(node).dim()
    return node, (*range(n - 2), n - 1, n - 2)


_TRANSPOSED = {"mT"}


def _simplify(node: fx.Node, perm):
    """``node`` permuted by ``perm``, reaching through transposes and permutes in the graph, so
    that ``k.transpose(-2, -1)`` swapped back is ``k`` itself."""
    if perm is None:
        return node, None
    while perm != tuple(range(len(perm))):
        inner = _permutation(node)
        if inner is None:
            break
        source, p = inner
        perm = tuple(p[i] for i in perm)
        node = source
    return node, None if perm == tuple(range(len(perm))) else perm


def _permutation(node: fx.Node) -> tuple[fx.Node, tuple[int, ...]] | None:
    """``(x, p)`` where ``node`` is ``x.permute(p)`` (a transpose, permute, ``.mT``), else None."""
    if node.op == "call_function" and node.target is getattr and node.args[1] in _TRANSPOSED:
        x = node.args[0]
        n = _ev(x).dim()
        return x, (*range(n - 2), n - 1, n - 2)
    if not _is(node, *_TRANSPOSES) or not isinstance(node.args[0], fx.Node) or _ev(node.args[0]) is None:
        return None
    x = node.args[0]
    n = _ev(x).dim()
    name = node.target if isinstance(node.target, str) else node.target.__name__
    if name == "permute":
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        dims = dims or node.kwargs.get("dims")
        if not dims or not all(isinstance(d, int) for d in dims):
            return None
        return x, tuple(d % n for d in dims)
    a, b = _arg(node, 1, "dim0"), _arg(node, 2, "dim1")
    if not isinstance(a, int) or not isinstance(b, int):
        return None
    p = list(range(n))
    p[a % n], p[b % n] = p[b % n], p[a % n]
    return x, tuple(p)


def _uncast(node: fx.Node, dtype: torch.dtype) -> fx.Node | None:
    """``node`` before the upcasts that made it from a ``dtype`` tensor (``q.float()``), or itself
    if it is ``dtype`` already; None otherwise."""
    x = node
    for _ in range(_DEPTH):
        value = _ev(x)
        if value is None:
            return None
        if value.dtype == dtype:
            if x is node:
                return node
            return None if _ev(node).shape != value.shape else x
        if not _is(x, *_CASTS) or not isinstance(x.args[0], fx.Node):
            return None
        source = _ev(x.args[0])
        if source is None or not source.is_floating_point() or source.dtype.itemsize > value.dtype.itemsize:
            return None  # a downcast loses what the product read
        x = x.args[0]
    return None


def _gqa(call: _SdpaCall) -> tuple[fx.Node, fx.Node, int] | None:
    """Keys and values before a GQA repeat, and the group size, where both are repeated alike."""
    if len(call.frame) != 2 or call.k_perm is not None or call.v_perm is not None:
        return None
    if _ev(call.k).dim() != 4 or _ev(call.v).dim() != 4:
        return None
    kr, vr = _unrepeat(call.k), _unrepeat(call.v)
    if kr is None or vr is None or kr[1] != vr[1]:
        return None
    if _ev(kr[0]).shape[1] != _ev(vr[0]).shape[1] or _ev(kr[0]).shape[1] * kr[1] != call.frame[1]:
        return None
    return kr[0], vr[0], kr[1]


def _unrepeat(node: fx.Node) -> tuple[fx.Node, int] | None:
    """``(x, g)`` where ``node`` is ``x`` with each head repeated ``g`` times in place (head ``j``
    is ``x``'s head ``j // g``), else None."""
    value = _ev(node)
    if _is(node, *_REPEAT_INTERLEAVE):
        x, g, dim = node.args[0], _arg(node, 1, "repeats"), _arg(node, 2, "dim")
        if isinstance(g, int) and dim in (1, -3) and _ev(x) is not None and _ev(x).dim() == 4:
            return x, g
        return None
    if _is(node, *_EXPAND):
        x = node.args[0]
        xs = _ev(x)
        if xs is None or xs.dim() != 4 or xs.shape[1] != 1:
            return None
        if xs.shape[0] == value.shape[0] and tuple(xs.shape[2:]) == tuple(value.shape[2:]):
            return x, int(value.shape[1])
        return None
    if not (_is(node, (torch.reshape,), ("reshape", "view"))):
        return None
    e = node.args[0]
    if not _is(e, *_EXPAND) or _ev(e) is None or _ev(e).dim() != 5:
        return None
    u = e.args[0]
    us = _ev(u)
    if us is None or us.dim() != 5 or us.shape[2] != 1:
        return None
    if _is(u, (torch.unsqueeze,), ("unsqueeze",)) and _arg(u, 1, "dim") in (2, -3):
        x = u.args[0]
    elif u.op == "call_function" and u.target is operator.getitem:
        index = u.args[1]
        full = slice(None, None, None)
        if index not in ((full, full, None), (full, full, None, full, full), (full, full, None, Ellipsis)):
            return None
        x = u.args[0]
    else:
        return None
    es, xs = _ev(e).shape, _ev(x)
    if xs is None or xs.dim() != 4 or tuple(value.shape) != (es[0], es[1] * es[2], es[3], es[4]):
        return None
    if tuple(es[:2]) != tuple(xs.shape[:2]) or tuple(es[3:]) != tuple(xs.shape[2:]):
        return None
    return x, int(es[2])


# ---- the pass -----------------------------------------------------------------------------------


class _Tracer(RoleTracer):
    """Keeps the nodes it made, so that a site can be taken back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.made: list[fx.Node] = []
        self.fake_mode: Any = None

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        self.made.append(node)
        return node


def hand_written_to_sdpa(
    gm: fx.GraphModule, example_inputs: Any = None, *, config: RingDilatedConfig
) -> fx.GraphModule:
    """Replace every hand-written attention of ``gm`` that computes SDPA's function by one SDPA
    node, in place; record the others as left alone (Note [Hand-written attention])."""
    made: list[list[fx.Node]] = []
    for site in find_hand_written_sites(gm):
        try:
            call = _sdpa_call(site)
            result = _replace(gm, site, call) if isinstance(call, _SdpaCall) else call
        except Exception as error:  # a bug in reading this site: it runs as written, the others go on
            result = _could_not_read(error)
        if isinstance(result, str):
            _leave_alone(gm, config, site, result)
            continue
        made.append(result)
        counters["ring_rewrite"]["hand_written"] += 1
    if not made:
        return gm
    _number_sites(gm, made)
    gm.graph.lint()
    gm.recompile()
    return gm


def leave_hand_written_alone(gm: fx.GraphModule, *, config: RingDilatedConfig, reason: str) -> None:
    """What the pass does when it is disabled: every hand-written attention stays, with ``reason``."""
    for site in find_hand_written_sites(gm):
        _leave_alone(gm, config, site, reason)


def _leave_alone(gm: fx.GraphModule, config: RingDilatedConfig, site: HandWrittenSite, reason: str) -> None:
    leave_alone(
        gm, config, what="hand-written attention", fate="become SDPA", location=site.location,
        kind=KIND, shapes=site.shapes, reason=reason,
    )  # fmt: skip


def _number_sites(gm: fx.GraphModule, made: list[list[fx.Node]]) -> None:
    """Note [Site ids of hand-written attention]."""
    first = len(records(gm))
    ids, index = {}, first
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            ids[node] = index
            index += 1
    for nodes in made:
        sdpa = next(n for n in nodes if n.op == "call_function" and n.target in SDPA_TARGETS)
        for node in nodes:
            node.meta["ring_rewrite"]["site"] = ids[sdpa]


def _replace(gm: fx.GraphModule, site: HandWrittenSite, call: _SdpaCall) -> list[fx.Node] | str:
    """Put ``call`` in the site's place; returns the nodes made, or the reason
    it must stay (then nothing is changed)."""
    graph, mm2 = gm.graph, site.values.node
    anchor = site.softmax
    tracer = _Tracer(graph, -1, anchor.meta.get("stack_trace"), anchor.meta.get("nn_module_stack"))
    tracer.fake_mode = getattr(_ev(call.q), "fake_mode", None)
    wrap = lambda n: fx.Proxy(n, tracer)  # noqa: E731
    # NOTE: nothing of the graph is changed until the SDPA call is made and checked; an error
    # before that takes the new nodes back (a bug reaches hand_written_to_sdpa's reason).
    try:
        with graph.inserting_before(mm2), role(ROLE):
            result = _emit(call, tracer, wrap)
        if not isinstance(result, str):
            try:
                _propagate(tracer)
            except Exception as error:  # shapes SDPA refuses: the site runs as written
                result = f"SDPA does not take its operands ({type(error).__name__}: {error})"
        if not isinstance(result, str):
            want, got = _ev(mm2), _ev(result)
            if tuple(want.shape) != tuple(got.shape) or want.dtype != got.dtype:
                result = (f"SDPA's output {tuple(got.shape)} {got.dtype} is not the product's "
                          f"{tuple(want.shape)} {want.dtype}")  # fmt: skip
        region = [*site.scores_path, *(u for n in site.scores_path for u in n.users if _inplace(u)),
                  *site.probs_path, mm2]  # fmt: skip
        inputs = {x for n in region for x in n.all_input_nodes} - set(region)
    except Exception:
        _take_back(graph, tracer.made)
        raise
    if isinstance(result, str):
        _take_back(graph, tracer.made)
        return result
    mm2.replace_all_uses_with(result)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(region), key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    kept = []
    for node in reversed(tracer.made):  # terms read another way (a band), masks not needed
        if not node.users and node is not result:
            inputs.update(node.all_input_nodes)
            graph.erase_node(node)
        else:
            kept.append(node)
    for node in inputs - set(tracer.made):
        erase_unused(graph, node)
    return kept[::-1]


def _emit(call: _SdpaCall, tracer: _Tracer, wrap: Callable) -> fx.Node | str:
    """The SDPA call ``call`` and the views around it; the node in place of ``MM2``, or the
    reason its mask cannot be given."""
    mask, is_causal = _mask(call, tracer, wrap)
    if isinstance(mask, str):
        return mask
    q = _to_frame(wrap(call.q), call.q_perm, call.q_lead, call.frame, query=True)
    k = _to_frame(wrap(call.k), call.k_perm, call.k_lead, call.frame, query=False)
    v = _to_frame(wrap(call.v), call.v_perm, call.v_lead, call.frame, query=False)
    for tensor, how in call.scale_tensors:
        q = q * wrap(tensor) if how == "mul" else q / wrap(tensor)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if mask is None else wrap(mask), dropout_p=call.dropout_p,
        is_causal=is_causal, scale=call.scale, enable_gqa=call.gqa is not None,
    )  # fmt: skip
    out = _from_frame(out, call.out_lead, call.out_perm)
    return out.node


def _take_back(graph: fx.Graph, made: list[fx.Node]) -> None:
    for node in reversed(made):
        if not node.users:
            graph.erase_node(node)


def _to_frame(x, perm, lead: tuple, frame: tuple, *, query: bool):
    """A q / k / v proxy as ``(B, H, X, Y)``: permuted, its folded heads unfolded, a batch of one
    expanded (and a query's single head: keys and values may keep one head, SDPA broadcasts it)."""
    if perm is not None:
        x = x.permute(*perm)
    if len(lead) == 0:
        x, lead = x[None, None], (1, 1)
    elif len(lead) == 1:
        if frame[1] != 1 and lead[0] == frame[0] * frame[1]:
            x, lead = x.unflatten(0, (-1, frame[1])), frame
        else:
            x, lead = x.unsqueeze(1), (lead[0], 1)
    if lead[0] == 1 and frame[0] != 1:
        x = x.expand(frame[0], -1, -1, -1)
    if query and lead[1] == 1 and frame[1] != 1:
        x = x.expand(-1, frame[1], -1, -1)
    return x


def _from_frame(out, lead: tuple, perm):
    """SDPA's ``(B, H, N, Dv)`` as the product with the values gave it."""
    if len(lead) == 0:
        out = out[0, 0]
    elif len(lead) == 1:
        out = out.flatten(0, 1)
    if perm is not None:
        out = out.permute(*perm)
    return out


# ---- the mask -----------------------------------------------------------------------------------


def _mask(call: _SdpaCall, tracer: _Tracer, wrap: Callable) -> tuple[fx.Node | None | str, bool]:
    """The SDPA mask of the site's terms (nodes made by ``tracer``) and ``is_causal``; or a reason
    in place of the mask."""
    keeps, biases, bands = [], [], {}
    n, m = _operand_shape(call.q, call.q_perm)[-2], _operand_shape(call.k, call.k_perm)[-2]
    static = all(isinstance(s, int) for s in (n, m))
    square = statically_known_true(n == m)
    for term in call.terms:
        value = _ev(term.node)
        if term.keep:
            node = wrap(term.node)
            if value.dtype != torch.bool:
                node = node.to(torch.bool)
            node = ~node if term.negate else node
        else:
            if value.requires_grad:
                return ("a bias on the scores that requires grad (a learned position bias, as T5's or trained "
                        "ALiBi slopes): the rewrite reads no learned mask"), False  # fmt: skip
            # NOTE: a scaled bias keeps its fills: min * c is no lowest value, and (s + b) * c is
            # s * c + b * c for every b (inf included) only as written.
            node = wrap(term.node if term.scales else _refill(term.node, tracer))
            for factor, how in term.scales:
                factor = wrap(factor) if isinstance(factor, fx.Node) else factor
                node = node * factor if how == "mul" else node / factor
        if len(term.lead) == 1 and value.dim() == 3 and value.shape[0] != 1:
            if value.shape[0] != call.frame[0] * call.frame[1]:
                return f"a mask of shape {tuple(value.shape)} over scores of {term.lead} leading", False
            node = node.unflatten(0, (-1, call.frame[1]))  # heads folded into the batch
        _propagate(tracer)
        node = node.node
        if square and _ev(node).dim() >= 2 and _ev(node).shape[-2] != 1:
            read = _read_term(node, term, n, static, tracer, wrap, lambda: _lengths(call, wrap, static))
            if isinstance(read, str):
                return read, False
            if read is True:
                continue  # every key allowed
            node, band = read
            if band is not None:
                bands[node] = band
        (keeps if _ev(node).dtype == torch.bool else biases).append(node)
    if len(keeps) == 1 and not biases and bands.get(keeps[0]) == (None, 0):
        return None, True
    mask = None
    if biases:
        total = wrap(biases[0])
        for b in biases[1:]:
            total = total + wrap(b)
        for keep in keeps:
            total = torch.where(wrap(keep), total, _NEG_INF)
        _propagate(tracer)
        q_dtype = _ev(call.q).dtype
        if _ev(total.node).dtype != q_dtype:
            total = total.to(q_dtype)
            _propagate(tracer)
        mask = total.node
    elif keeps:
        total = wrap(keeps[0])
        for keep in keeps[1:]:
            total = total & wrap(keep)
        _propagate(tracer)
        mask = total.node
    if mask is not None and static and square and _ev(mask).shape[-2] != 1:
        structure = mask_structure(mask, n)
        if isinstance(structure, str):
            return f"its mask is no mask the rewrite reads: {structure}", False
    return mask, False


def _propagate(tracer: _Tracer) -> None:
    """Example values of the nodes made so far, in the graph's fake mode (a band's ``arange``
    has no input to take it from)."""
    with tracer.fake_mode if tracer.fake_mode is not None else contextlib.nullcontext():
        propagate_example_values([n for n in tracer.made if "example_value" not in n.meta])


def _refill(node: fx.Node, tracer: _Tracer) -> fx.Node:
    """``node`` with every ``finfo.min`` fill in its ``where`` / ``masked_fill`` (through views,
    casts and sums) made ``-inf`` (Note [Hand-written attention]); the node itself where it has
    none."""
    value = _ev(node)
    if value is None or not value.is_floating_point():
        return node
    if _is(node, *_WHERE) and len(node.args) == 3:
        cond, yes, no = node.args
        if masks(_constant(no), value.dtype):
            return tracer.create_node("call_function", torch.where, (cond, yes, _NEG_INF), {})
        if masks(_constant(yes), value.dtype):
            return tracer.create_node("call_function", torch.where, (cond, _NEG_INF, no), {})
        return node
    if _is(node, *_MASKED_FILL) and not _inplace(node):
        x, cond, fill = node.args[0], _arg(node, 1, "mask"), _arg(node, 2, "value")
        if masks(_constant(fill), value.dtype):
            x = _refill(x, tracer) if isinstance(x, fx.Node) else x
            return tracer.create_node("call_method", "masked_fill", (x, cond, _NEG_INF), {})
        return node
    views = any(_is(node, *kind) for kind in (_VIEWS, _SAME, _CASTS, _EXPAND, _TRANSPOSES))
    views = views or (node.op == "call_function" and node.target is operator.getitem)
    if views and isinstance(node.args[0], fx.Node):
        inner = _refill(node.args[0], tracer)
        if inner is node.args[0]:
            return node
        return tracer.create_node(node.op, node.target, (inner, *node.args[1:]), dict(node.kwargs))
    if _is(node, *_ADD) and not _inplace(node) and len(node.args) == 2:
        a, b = (_refill(x, tracer) if isinstance(x, fx.Node) else x for x in node.args)
        if a is node.args[0] and b is node.args[1]:
            return node
        return tracer.create_node(node.op, node.target, (a, b), dict(node.kwargs))
    return node


def _lengths(call: _SdpaCall, wrap: Callable, static: bool) -> tuple:
    """The query and key lengths: ints, or proxies of ``q.size(..)`` / ``k.size(..)``."""
    n, m = _operand_shape(call.q, call.q_perm)[-2], _operand_shape(call.k, call.k_perm)[-2]
    if static:
        return n, m
    q_dim = -2 if call.q_perm is None else call.q_perm[-2]
    k_dim = -2 if call.k_perm is None else call.k_perm[-2]
    return wrap(call.q).size(q_dim), wrap(call.k).size(k_dim)


def _read_term(node: fx.Node, term: _Term, n, static: bool, tracer: _Tracer, wrap: Callable, lengths: Callable):
    """A dense term as the rewrite will read it: ``(node, None)``, the node itself; ``(band node,
    (lo, hi))``, a band made from positions (a mask computed from module state); True, where it
    masks nothing; or a reason. At a symbolic length, a mask from module state is read at this
    length (the length is specialised, as ``find_sdpa`` would)."""
    structure = mask_structure(node, n, specialise=static)
    if not isinstance(structure, str):
        return node, None
    keep = _concrete_keep(node)
    if keep is None:
        if term.keep:
            return f"its mask is no mask the rewrite reads: {structure}"
        return (f"a bias on the scores that needs the query position and is no mask the rewrite reads (a "
                f"relative position bias, as T5's, or bidirectional ALiBi): {structure}")  # fmt: skip
    band = _band(keep)
    if band is None:
        return f"its mask, computed from module state, is no band of t - p: {structure}"
    if band is True:
        return True
    lo, hi = band
    device, (n, m) = _ev(node).device, lengths()
    size = lambda x: x.node if isinstance(x, fx.Proxy) else x  # noqa: E731
    p = wrap(tracer.create_node("call_function", torch.arange, (size(n),), {"device": device})).view(-1, 1)
    t = wrap(tracer.create_node("call_function", torch.arange, (size(m),), {"device": device})).view(1, -1)
    d = t - p
    allowed = None
    if hi is not None:
        allowed = d <= hi
    if lo is not None:
        allowed = d >= lo if allowed is None else allowed & (d >= lo)
    _propagate(tracer)
    return allowed.node, (lo, hi)


def _concrete_keep(node: fx.Node) -> torch.Tensor | None:
    """The values of a mask term (True: attend) computed from module state and constants only,
    evaluated now; None where it reads a caller's tensor or anything not evaluated.

    NOTE: first with every slice of a module's buffer that stops at a symbolic length opened to
    the buffer's end (nanoGPT's ``bias[:, :, :T, :T]``): a band over the whole buffer is the same
    band over every prefix, and no length is specialised. Only where that cannot be evaluated are
    the lengths specialised (guarded), as ``find_sdpa`` does for a mask it cannot read."""
    value = _evaluate(node, widen=True)
    if value is None and _evaluable(node):
        value = _evaluate(node, widen=False)
    if value is None:
        return None
    if value.dtype == torch.bool:
        return value
    if not value.is_floating_point():
        return None
    if not bool(((value == 0) | (value == _NEG_INF)).all()):
        return None
    return value == 0


class _Open:
    """A symbolic length, where a slice of a buffer may run to its end instead."""


def _state(x: fx.Node) -> torch.Tensor | None:
    state = _module_state(x)
    if state is None or isinstance(state, torch.nn.Parameter) or state.requires_grad:
        return None
    return state


def _evaluable(node: fx.Node) -> bool:
    """Whether ``node`` derives from module state, constants and sizes only (checked before a
    size is specialised for it)."""
    seen, stack = set(), [node]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        value = x.meta.get("example_value")
        if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
            continue
        if x.op in ("placeholder", "get_attr"):
            if _state(x) is None:
                return False
        elif x.op not in ("call_function", "call_method") or x.is_impure() or x.target in _RANDOM:
            return False
        stack.extend(x.all_input_nodes)
    return True


# What may follow a buffer's slice opened to its end: elementwise ops, which give the prefix
# of their result on the prefix of their input (a flip or a cumsum would not).
_ELEMENTWISE = (
    (operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.invert,
     operator.and_, operator.or_, operator.xor, operator.neg, torch.eq, torch.ne, torch.logical_not,
     torch.logical_and, torch.logical_or, torch.bitwise_not),
    ("eq", "ne", "lt", "le", "gt", "ge", "bool", "float", "to", "type", "contiguous", "clone",
     "logical_not", "logical_and", "logical_or", "bitwise_not", "__invert__", "__eq__", "__ne__",
     "__and__", "__or__"),
)  # fmt: skip


def _evaluate(node: fx.Node, *, widen: bool) -> torch.Tensor | None:
    memo: dict[fx.Node, Any] = {}
    opened: set[fx.Node] = set()  # values of a buffer's slice run to its end, or of ops on one
    missing = object()

    def evaluate(x: fx.Node) -> Any:
        if x in memo:
            return memo[x]
        value = x.meta.get("example_value")
        result: Any = missing
        if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
            if not isinstance(value, torch.SymInt):
                result = value
            else:
                result = _Open if widen else guard_int(value)
        elif x.op in ("placeholder", "get_attr"):
            state = _state(x)
            result = missing if state is None else state
        elif x.op in ("call_function", "call_method") and not x.is_impure() and x.target not in _RANDOM:
            args, kwargs = fx.node.map_arg((x.args, x.kwargs), evaluate)
            wide = any(n in opened for n in x.all_input_nodes)
            if x.target is operator.getitem and not wide:
                index = _opened(args[1])
                if index != args[1]:
                    opened.add(x)
                args = (args[0], index)
            elif wide:
                if not _is(x, *_ELEMENTWISE):
                    args = (missing,)  # not read on a prefix
                opened.add(x)
            if _no_missing((args, kwargs), missing) and _no_missing((args, kwargs), _Open):
                fn = getattr(args[0], x.target) if x.op == "call_method" else x.target
                try:
                    with torch.no_grad():
                        result = fn(*(args[1:] if x.op == "call_method" else args), **kwargs)
                except Exception:
                    result = missing
        memo[x] = result
        return result

    value = evaluate(node)
    return value if isinstance(value, torch.Tensor) else None


def _opened(index: Any) -> Any:
    """A buffer's index with every slice that stops at a symbolic length run to the end."""
    def one(i):
        if isinstance(i, slice) and i.stop is _Open and (i.step in (None, 1)) and isinstance(i.start or 0, int):
            return slice(i.start, None, i.step)
        return i

    return tuple(one(i) for i in index) if isinstance(index, tuple) else one(index)


def _no_missing(args: Any, missing: object) -> bool:
    found = []
    fx.node.map_aggregate(args, lambda a: found.append(a is missing))
    return not any(found)


def _band(keep: torch.Tensor) -> tuple[int | None, int | None] | bool | None:
    """``(lo, hi)`` where ``keep (.., N, M)`` allows exactly ``lo <= t - p <= hi`` on every leading
    index (None: unbounded), True where it allows everything, None where it is no band."""
    keep = keep.reshape(-1, *keep.shape[-2:])
    if not bool((keep == keep[:1]).all()):
        return None
    k = keep[0]
    if bool(k.all()):
        return True
    if not bool(k.any()):
        return None
    n, m = k.shape
    d = torch.arange(m, device=k.device).view(1, m) - torch.arange(n, device=k.device).view(n, 1)
    lo, hi = int(d[k].min()), int(d[k].max())
    if not bool((k == ((d >= lo) & (d <= hi))).all()):
        return None
    return (None if lo <= -(n - 1) else lo, None if hi >= m - 1 else hi)
