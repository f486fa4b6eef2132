"""A seeded random campaign of SDPA sites, each judged against the float64 function evaluated
pair by pair (docs/semantics.md, The function, Masks and Accuracy; docs/testing.md, The random
campaign).

``case(seed)`` turns one integer into a ``Case``: every choice that makes a site, from the shapes
(GQA and MQA, odd head sizes, lengths that are primes or just past a power of two) and the
function (causal, a scale, a dilated config, segments longer than ``N``) to the mask (none, a key
mask given as an input, a construction built in the graph as models write it, one the rewrite must
refuse, a dense mask given as an input), the dtype, the ranks (``P = 1`` or ``2``, replicated or
sharded, contiguous or zigzag), the compiler and, on one rank or sharded on the ring, a symbolic
length (``dynamic=True``: the site padded to its length bucket, or each shard to its own).
``run(case)`` compiles the site, runs it forward
and backward, and judges:

* what the backend did, where the case makes it certain: rewritten, left alone with its reason,
  or (sharded across ranks, where a site cannot be left alone) an error naming the reason;
* ``out``, ``dq``, ``dk``, ``dv`` against the float64 function of what ran: the rewritten
  function (``_pairs_reference``: each row over the keys it is connected to, the mask's bias
  added, a ``finfo.min`` fill read as ``-inf``), or for a site left alone SDPA itself in float64;
  within ``max(TOL[dtype] x max(1, S / 50), 2x the error of SDPA in the same dtype computing the
  same function)``, ``S`` the largest score magnitude (``score_magnitude``);
  non-finite entries where, and only where, the reference has them.

Every failure starts with its seed and the case in one line; ``python tests/fuzz.py --seed S``
runs that case again. ``python tests/fuzz.py --cases N --seed S`` runs ``N`` cases from seed
``S`` (the cases on two ranks share spawns of two gloo processes, many cases each) and exits
non-zero on any failure; ``tests/test_fuzz.py`` runs a fixed sample in the test suite.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ranks.py, conftest.py: run as a script too

import ring_rewrite  # noqa: E402
from ring_rewrite.reference import connection_counts  # noqa: E402

__all__ = ["Case", "Result", "case", "run", "run_cases"]

TOL = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 1e-5}  # and 2x SDPA's own error, every dtype (16-bit blocks run in float32)
ZERO = 0.1  # a tensor is measured against this share of its terms' scale at least (_error)
SCORES = 50.0  # beyond scores of this magnitude, TOL grows in proportion (docs/semantics.md, Accuracy)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
RING_TIMEOUT = 120.0  # seconds a rank waits for a ring transfer (a peer compiles meanwhile)
STALL = 900.0  # seconds without a result from a spawn of two ranks before it is killed

# Lengths: primes, just past (and at) powers of two, and a few others; in sharded mode N cuts
# into 2P = 4 chunks (both layouts).
LENGTHS = (1, 2, 3, 5, 7, 11, 13, 16, 17, 19, 23, 29, 31, 32, 33, 37, 41, 47, 53, 59, 61, 64, 65,
           67, 71, 89, 97, 100, 127, 128, 129, 131, 193, 211, 257)  # fmt: skip
SHARDED_LENGTHS = (4, 8, 12, 16, 20, 24, 32, 36, 40, 48, 56, 64, 72, 96, 100, 128, 160, 192, 256)
HEAD_SIZES = (1, 3, 5, 8, 12, 16, 24, 33, 64)


# ---- the case ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention site and how it runs, from one seed (``case(seed)``).

    ``causal`` is SDPA's ``is_causal`` where the site has no mask, and ``t <= p`` in the mask
    where it has one (SDPA takes one or the other). ``mask`` names a construction of
    ``CONSTRUCTIONS``; ``fill`` how its masked entries are written (``bool``, ``-inf``, or
    ``finfo(dtype).min``); ``pad`` the key padding it ANDs in (``"none"``: no padding term);
    ``param`` the construction's number (a window, a chunk, a prefix, or which position values).
    ``nonfinite`` places one NaN or inf: ``(tensor, value, (b, h, position, channel))``.
    """

    seed: int
    world: int
    sharding: str
    layout: str
    compiler: str
    dtype: str
    batch: int
    hq: int
    hkv: int
    enable_gqa: bool
    n: int
    d: int
    dv: int
    causal: bool
    scale: float | None
    segment_lengths: tuple[int, ...] | None
    dilation_rates: tuple[int, ...] | None
    mask: str
    fill: str
    pad: str
    param: int | None
    mask_batch: bool
    mask_heads: bool
    sharp: float
    nonfinite: tuple | None
    bnhd: bool = False
    """q, k, v given as ``(B, N, H, D)`` and transposed in the graph, as models do (strided)."""
    offset: float = 0.0
    """q and k share a direction of this length: every score about ``offset**2 * scale``."""
    comm: str = "ring"
    """``"all_to_all"``: the ranks exchange the sequence for heads (docs/ring.md, Heads across
    ranks)."""
    dynamic: bool = False
    """Compiled with ``dynamic=True``: the length a symbol, so that one rank pads the site to its
    length bucket, and sharded ranks each shard (where the site reads no position), and the
    blocks compute the real rows only (docs/semantics.md, Sequence lengths)."""

    @property
    def sharded(self) -> bool:
        """Whether each rank runs the site on its own shard (sharded mode over two ranks)."""
        return self.sharding == "sharded" and self.world > 1

    @property
    def exchange_refused(self) -> bool:
        """Whether ``comm="all_to_all"`` cannot carry the site: query heads the ranks cannot split."""
        return self.comm != "ring" and self.hq % self.world != 0

    @property
    def branches(self) -> tuple[tuple[int, int], ...]:
        if self.segment_lengths is None:
            return ((self.n, 1),)
        return tuple(zip(self.segment_lengths, self.dilation_rates))

    @property
    def expect(self) -> str:
        """What the backend must do: ``"rewrite"``; ``"alone"`` (left alone for one of
        ``expected_reasons``); ``"refuse"`` (an error naming one); ``"either"`` (rewritten and
        right, left alone and right, or an error naming one)."""
        construction = CONSTRUCTIONS[self.mask]
        if self.n == 0:
            return "alone"
        if self.refused and self.n < 2:
            return "either"  # one position: every mask is a key mask
        if self.refused:
            return "refuse" if self.sharded else "alone"
        if self.sharded and (construction.key_numbers or _geometry_error(self)):
            return "refuse"
        if self.exchange_refused:
            return "refuse" if self.sharded else "alone"
        if self.mask == "pos_band" and self.param != 0:
            return "either"  # position values that do not count up by one: a run-time error
        return "rewrite"

    @property
    def expected_reasons(self) -> tuple[str, ...]:
        """What the reason a site is left alone, or the error, says (any one of them)."""
        if self.n == 0:
            return ("empty",)
        values = ("do not step by one",) if self.mask == "pos_band" else ()  # the run-time check's
        exchange = ("comm='ring'",) if self.exchange_refused else ()
        if self.sharded:
            return (*values, *exchange, "cannot be rewritten", "branch (w=")
        unread = ("not a band", "rounded") if self.refused or not (values or exchange) else ()
        return (*values, *exchange, *unread)  # a mask it cannot read and heads it cannot split: either

    @property
    def refused(self) -> bool:
        """Whether the site's mask has no structure the rewrite can read: its construction's, or
        ALiBi written relative and rounded to bfloat16 (docs/masks.md)."""
        return CONSTRUCTIONS[self.mask].refused or self.mask == "alibi_relative" and self.dtype == "bfloat16"

    def key(self) -> tuple:
        """What the compiled graph depends on: cases with equal keys compile to equal graphs."""
        data_only = {"seed", "pad", "sharp", "offset", "nonfinite"} | ({"param"} if self.mask == "pos_band" else set())
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in data_only)

    def describe(self) -> str:
        """The case in one line."""
        ranks = f"P={self.world}" + (f" {self.sharding}/{self.layout}" if self.world > 1 else "")
        ranks += f" {self.comm}" if self.comm != "ring" else ""
        heads = f"Hq{self.hq}/Hkv{self.hkv}" + ("" if self.enable_gqa or self.hq == self.hkv else " (broadcast)")
        config = "exact" if self.segment_lengths is None else f"w={list(self.segment_lengths)} r={list(self.dilation_rates)}"
        mask = self.mask
        if self.mask != "none":
            construction = CONSTRUCTIONS[self.mask]
            shape = ("B" if self.mask_batch else "1") + ("H" if self.mask_heads else "1")
            parts = [construction.param_name(self.param), self.fill, "" if self.pad == "none" else f"pad={self.pad}",
                     f"({shape}, 1|N, N)" if construction.data in ("key", "dense") else ""]  # fmt: skip
            mask += f"({', '.join(filter(None, parts))})"
        extra = [f"scale={self.scale:g}" if self.scale is not None else "", "causal" if self.causal else "",
                 f"q x{self.sharp:g}" if self.sharp != 1 else "", f"q.k +{self.offset**2:g}" if self.offset else "",
                 "(B, N, H, D) in" if self.bnhd else "", "dynamic" if self.dynamic else "",
                 f"{self.nonfinite[1]} in {self.nonfinite[0]}{list(self.nonfinite[2])}" if self.nonfinite else ""]  # fmt: skip
        return " ".join(filter(None, [
            ranks, self.compiler, self.dtype, f"B{self.batch}", heads, f"N{self.n}", f"D{self.d}/Dv{self.dv}",
            *extra, config, f"mask={mask}", f"expect={self.expect}",
        ]))  # fmt: skip


def _geometry_error(c: Case) -> bool:
    """Whether sharded mode's shards cannot carry a branch (``schedule_branch`` in
    ``ring_rewrite/schedule.py``): a rate that does not divide a rank's part where the segment
    does not fit in it, or a segment neither dividing a part nor a multiple of it. An
    all-to-all attends the whole sequence on every rank: no branch rings."""
    if c.comm != "ring":
        return False
    parts = 2 if c.layout == "zigzag" else 1
    part = c.n // c.world // parts
    for w, r in c.branches:
        if part % w == 0:
            continue
        if part % r:
            return True
        if w >= c.n:
            continue
        if w % part or (c.layout == "zigzag" and c.world % (w // part)):
            return True
    return False


# ---- mask constructions, as models write them --------------------------------------------------
# Each takes the case, q and the site's data inputs (the rank's shard in sharded mode: positions
# are read as global ones there) and returns the mask SDPA gets, or the allowed entries as a bool
# tensor that ``_filled`` writes in the case's fill.


def _positions(q):
    i = torch.arange(q.shape[2])
    return i[:, None], i[None, :]  # p (query), t (key)


def _padded(c: Case, allowed, data):
    """``allowed`` AND the key padding ``pad[b, t]``, where the case has padding."""
    if c.pad == "none":
        return allowed
    return allowed & data[0][:, None, None, :]


def _filled(c: Case, q, allowed):
    """The bool mask as the case writes it: as it is, ``where(allowed, 0, -inf)`` or
    ``zeros.masked_fill(~allowed, finfo.min)`` (transformers' float masks)."""
    if c.fill == "bool":
        return allowed
    if c.fill == "-inf":
        return torch.where(allowed, 0.0, float("-inf")).to(q.dtype)
    return torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)


def _causal_and(c: Case, q, allowed):
    p, t = _positions(q)
    return allowed & (t <= p) if c.causal else allowed


def slopes(q) -> torch.Tensor:
    """ALiBi's slopes ``2 ** (-8 (j + 1) / H)`` for head ``j``, ``(1, H, 1, 1)``: float64 for a
    float64 site, else float32 (BLOOM computes its bias in float32 and casts it)."""
    heads = q.shape[1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.tensor([2.0 ** (-8 * (j + 1) / heads) for j in range(heads)], dtype=dtype).view(1, -1, 1, 1)


def m_tril(c, q, *data):
    """A hand-written causal mask: ``ones(N, N).tril()``."""
    n = q.shape[2]
    return _filled(c, q, _padded(c, torch.ones(n, n, dtype=torch.bool).tril(), data))


def m_hf_causal(c, q, *data):
    """transformers 5.x's sdpa_mask: index vectors, ``kv_idx <= q_idx``, padding read by
    advanced indexing, expanded to ``(B, 1, N, N)``."""
    b, n = q.shape[0], q.shape[2]
    batch = torch.arange(b)[:, None, None, None]
    q_idx, kv_idx = torch.arange(n)[None, None, :, None], torch.arange(n)[None, None, None, :]
    mask = q_idx.new_ones((), dtype=torch.bool) & (kv_idx <= q_idx)
    if c.pad != "none":
        mask = mask & data[0].to(torch.bool)[batch, kv_idx]
    return _filled(c, q, mask.expand(b, -1, n, n))


def m_window(c, q, *data):
    """A causal sliding window of ``W``: ``t <= p & t > p - W``."""
    p, t = _positions(q)
    return _filled(c, q, _padded(c, (t <= p) & (t > p - c.param), data))


def m_band(c, q, *data):
    """A two-sided band ``|t - p| <= W``."""
    p, t = _positions(q)
    return _filled(c, q, _padded(c, _causal_and(c, q, (t - p).abs() <= c.param), data))


def m_chunked(c, q, *data):
    """Chunks of ``C`` counted from position 0, ``t // C == p // C`` (Llama 4's chunked attention
    without padding); ``C`` need not divide ``N``."""
    p, t = _positions(q)
    return _filled(c, q, _padded(c, _causal_and(c, q, t // c.param == p // c.param), data))


def m_block_causal(c, q, *data):
    """Block-causal: every key of the query's block of ``C`` and of the blocks before."""
    p, t = _positions(q)
    return _filled(c, q, _padded(c, t // c.param <= p // c.param, data))


def m_prefix_lm(c, q, *data):
    """A prefix LM: the first ``L`` keys seen by every query, causal after them."""
    p, t = _positions(q)
    return _filled(c, q, _padded(c, (t <= p) | (t < c.param), data))


def m_packed(c, q, pos):
    """transformers' packed-sequence mask from ``position_ids``: documents where positions
    restart, causal on the position values."""
    from test_masks import hf_packed

    return _filled(c, q, hf_packed(q, pos))


def m_documents(c, q, doc, *data):
    """Document ids given, ``doc[t] == doc[p]``, causal or not, with a window where ``W``."""
    allowed = _causal_and(c, q, doc[:, None, :, None] == doc[:, None, None, :])
    if c.param:
        p, t = _positions(q)
        allowed = allowed & ((t - p).abs() <= c.param)
    return _filled(c, q, _padded(c, allowed, data))


def m_alibi_key(c, q, *data):
    """ALiBi as BLOOM and MPT add it: the key bias ``slope_h * t`` on a causal mask."""
    p, t = _positions(q)
    allowed = _padded(c, t <= p, data)
    bias = (slopes(q) * torch.arange(q.shape[2]).view(1, 1, 1, -1)).to(q.dtype)
    return _filled(c, q, allowed) + bias


def m_alibi_relative(c, q, *data):
    """ALiBi written relative, ``slope_h * (t - p)``, on a causal mask."""
    p, t = _positions(q)
    allowed = _padded(c, t <= p, data)
    return _filled(c, q, allowed) + (slopes(q) * (t - p)).to(q.dtype)


def m_key(c, q, mask):
    """A key mask ``(B|1, H|1, 1, N)`` given as an input (bool, or a float bias), with the
    causal band built in the graph where the case is causal."""
    if not c.causal:
        return mask
    p, t = _positions(q)
    causal = t <= p
    return mask & causal if mask.dtype == torch.bool else mask + _filled(c, q, causal)


def m_dense(c, q, mask):
    """A dense ``(B|1, 1, N, N)`` mask given as an input: no structure to read."""
    return mask


def m_query(c, q, *data):
    """A query-side mask: ``pad[p]``, causal or not (refused: not a band)."""
    p, t = _positions(q)
    allowed = data[0][:, None, :, None] & _causal_and(c, q, torch.ones(q.shape[2], q.shape[2], dtype=torch.bool))
    return _filled(c, q, allowed)


def m_bidirectional_alibi(c, q, *data):
    """ALiBi both ways, ``-slope_h * |t - p|``: a bias of both positions, no key bias
    (refused)."""
    p, t = _positions(q)
    bias = (-slopes(q) * (t - p).abs()).to(q.dtype)
    return _filled(c, q, _padded(c, torch.ones_like(t - p, dtype=torch.bool), data)) + bias


def m_pos_band(c, q, pos):
    """``pos[t] <= pos[p]`` over per-token values given as an input: causal where they count
    up by one (``param`` 0), else a relation on other values (checked at every call)."""
    return pos[:, None, None, :] <= pos[:, None, :, None]


@dataclasses.dataclass(frozen=True)
class Construction:
    build: Callable | None
    data: str = ""
    """The site's data inputs: ``pad``, ``key``, ``dense``, ``positions``, ``documents``."""
    refused: bool = False
    """Left alone (replicated) or an error (sharded): no structure the rewrite can read."""
    key_numbers: bool = False
    """Reads a key's position as a number: an error in sharded mode (docs/masks.md)."""
    param: str = ""
    fills: tuple[str, ...] = ("bool", "-inf", "min")
    own_causal: bool = False
    """Causal whatever the case says (the construction is)."""

    def param_name(self, value) -> str:
        return f"{self.param}={value}" if self.param else ""


CONSTRUCTIONS: dict[str, Construction] = {
    "none": Construction(None, fills=("",)),
    "key": Construction(m_key, "key", fills=("bool", "-inf", "min")),
    "tril": Construction(m_tril, "pad", own_causal=True),
    "hf_causal": Construction(m_hf_causal, "pad", own_causal=True),
    "window": Construction(m_window, "pad", param="W", own_causal=True),
    "band": Construction(m_band, "pad", param="W"),
    "chunked": Construction(m_chunked, "pad", key_numbers=True, param="C"),
    "block_causal": Construction(m_block_causal, "pad", key_numbers=True, param="C", own_causal=True),
    "prefix_lm": Construction(m_prefix_lm, "pad", key_numbers=True, param="L", own_causal=True),
    "packed": Construction(m_packed, "positions", own_causal=True),
    "documents": Construction(m_documents, "documents", param="W"),
    "alibi_key": Construction(m_alibi_key, "pad", fills=("-inf", "min"), own_causal=True),
    "alibi_relative": Construction(m_alibi_relative, "pad", fills=("-inf", "min"), own_causal=True),
    "dense": Construction(m_dense, "dense", refused=True, fills=("bool", "-inf", "min")),
    "query": Construction(m_query, "pad", refused=True),
    "bidirectional_alibi": Construction(m_bidirectional_alibi, "pad", refused=True, fills=("-inf", "min")),
    "pos_band": Construction(m_pos_band, "values", param="values", fills=("bool",), own_causal=True),
}
MASK_WEIGHTS = {
    "none": 14, "key": 14, "tril": 5, "hf_causal": 5, "window": 7, "band": 6, "chunked": 6, "block_causal": 5,
    "prefix_lm": 5, "packed": 6, "documents": 5, "alibi_key": 5, "alibi_relative": 4, "dense": 5, "query": 3,
    "bidirectional_alibi": 3, "pos_band": 3,
}  # fmt: skip
PADS = ("none", "full", "left", "right", "random", "hole")


# ---- the generator ----------------------------------------------------------------------------


def case(seed: int) -> Case:
    """The case of ``seed``: the same on every machine and every call."""
    rng = random.Random(seed)
    world = 2 if rng.random() < 0.3 else 1
    layout = rng.choice(["contiguous", "zigzag"]) if world > 1 else "contiguous"
    mask = rng.choices(list(MASK_WEIGHTS), weights=list(MASK_WEIGHTS.values()))[0]
    construction = CONSTRUCTIONS[mask]
    sharded = world > 1 and mask != "dense" and rng.random() < 0.5
    dtype = rng.choices(["float32", "float64", "bfloat16"], weights=[75, 20, 5])[0]
    compiler = rng.choices(["inductor", "aot_eager"], weights=[75, 25])[0]

    if sharded:
        n = rng.choice(SHARDED_LENGTHS)
    elif mask in ("none", "key") and rng.random() < 0.02:
        n = 0
    else:
        n = rng.choice(LENGTHS)
    hkv = rng.choice([1, 1, 2, 2, 3, 4])
    hq = hkv * rng.choice([1, 1, 2, 3, 4])
    if hq > 8:
        hq = hkv
    batch = rng.choice([1, 1, 2, 2, 3])
    d = rng.choice(HEAD_SIZES)
    dv = d if rng.random() < 0.8 else rng.choice([2, 7, 16])
    if n > 128:  # the float64 references are O(B H N^2 D)
        batch, d, dv = min(batch, 2), min(d, 33), min(dv, 33)
    enable_gqa = hq != hkv and (hkv > 1 or rng.random() < 0.6)

    segment_lengths, dilation_rates = _config(rng, n, world, layout if sharded else None)
    causal = construction.own_causal or rng.random() < 0.4
    scale = None if rng.random() < 0.6 else rng.choice([0.05, 0.3, 1.0, 2.5, 4 * max(d, 1) ** -0.5])
    fill = rng.choice(construction.fills)
    pad = "none"
    if construction.data in ("pad", "key", "documents"):
        pad = rng.choice(PADS[1:] if construction.data == "key" or construction.refused else PADS)
    param = _param(rng, mask, n)
    mask_batch = rng.random() < 0.7 if construction.data in ("key", "dense") else True
    mask_heads = construction.data == "key" and rng.random() < 0.25
    sharp = rng.choice([1.0, 1.0, 1.0, 1.0, 3.0, 8.0])
    nonfinite = None
    if dtype != "bfloat16" and n > 0 and rng.random() < 0.08:
        where = rng.choice(["q", "k", "v"])
        heads = hq if where == "q" else hkv
        nonfinite = (where, rng.choice(["nan", "+inf", "-inf"]),
                     (rng.randrange(batch), rng.randrange(heads), rng.randrange(n), rng.randrange(d if where != "v" else dv)))  # fmt: skip
    # Draws added later come last, so that a seed keeps the choices made before them.
    bnhd = rng.random() < 0.25
    offset = 10.0 if rng.random() < 0.06 else 0.0
    if rng.random() < 0.04:
        scale = rng.choice([0.0, -0.7])
    if construction.data == "key" and fill != "bool" and dtype != "bfloat16" and not nonfinite and rng.random() < 0.15:
        nonfinite = ("mask", rng.choice(["nan", "+inf"]),
                     (rng.randrange(batch) if mask_batch else 0, rng.randrange(hq) if mask_heads else 0, 0, rng.randrange(max(n, 1))))  # fmt: skip
    if n and rng.random() < 0.03:  # large enough that a site cuts its heads into chunks of >= 1 MiB
        n = rng.choice([1024, 2048] if sharded else [1024, 1031, 2048])
        batch, hkv, hq, d, dv = 2, 4, rng.choice([4, 8]), 32, 32
        segment_lengths, dilation_rates = _config(random.Random(seed + 1), n, world, layout if sharded else None)
        param = _param(random.Random(seed + 2), mask, n)
        enable_gqa = hq != hkv
        nonfinite = None
    made = Case(
        seed=seed, world=world, sharding="sharded" if sharded else "replicated", layout=layout, compiler=compiler,
        dtype=dtype, batch=batch, hq=hq, hkv=hkv, enable_gqa=enable_gqa, n=n, d=d, dv=dv, causal=causal, scale=scale,
        segment_lengths=segment_lengths, dilation_rates=dilation_rates, mask=mask, fill=fill, pad=pad, param=param,
        mask_batch=mask_batch, mask_heads=mask_heads, sharp=sharp, nonfinite=None, bnhd=bnhd, offset=offset,
    )  # fmt: skip
    if world > 1 and rng.random() < 0.35:
        made = dataclasses.replace(made, comm="all_to_all")
    if (world == 1 or made.comm == "ring") and rng.random() < 0.3:
        made = dataclasses.replace(made, dynamic=True)
    if nonfinite and made.expect == "rewrite":  # a site left alone is SDPA's business
        made = dataclasses.replace(made, nonfinite=nonfinite)
    return made


def _config(rng: random.Random, n: int, world: int, sharded_layout: str | None):
    """Exact, or one to four LongNet branches (one of rate 1, ``w % r == 0``, no pair twice):
    short segments, segments near ``N``, longer than ``N``, and in sharded mode mostly ones
    that fit the shards."""
    if rng.random() < 0.35:
        return None, None
    part = max(n // world // (2 if sharded_layout == "zigzag" else 1), 1)
    rates = [1] + [rng.choice([1, 2, 2, 3, 4, 4, 8]) for _ in range(rng.choice([0, 1, 1, 2, 2, 3]))]
    pairs: list[tuple[int, int]] = []
    for r in rates:
        for _ in range(20):
            kind = rng.random()
            if sharded_layout is not None and kind < 0.6:
                w = rng.choice([part // 4, part // 2, part, 2 * part, 4 * part, 8 * part])
                if w < 1 or w % r:
                    continue
            elif kind < 0.45:
                w = r * rng.randint(1, 8)
            elif kind < 0.7:
                w = r * max(1, -(-n // r) + rng.choice([-1, 0, 1]))
            else:
                w = r * (-(-2 * max(n, 1) // r) + rng.choice([0, 5, 1000]))  # longer than N
            if (w, r) not in pairs:
                pairs.append((w, r))
                break
    rng.shuffle(pairs)
    return tuple(w for w, _ in pairs), tuple(r for _, r in pairs)


def _param(rng: random.Random, mask: str, n: int) -> int | None:
    """A window, a chunk, a prefix, or which position values (``pos_band``: 0 counts up by one
    from an offset; 1 block ids; 2 counting down)."""
    if mask in ("window", "band"):
        return rng.choice([1, 2, 3, 5, 8, 13, max(n - 1, 1), n + 3])
    if mask in ("chunked", "block_causal"):
        return rng.choice([2, 3, 5, 7, 14, 16, n + 1])
    if mask == "prefix_lm":
        return rng.randint(0, n + 1)
    if mask == "documents":
        return rng.choice([0, 0, 2, 5])
    if mask == "pos_band":
        return rng.choice([0, 0, 0, 1, 2])
    return None


# ---- inputs -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    data: list[torch.Tensor]
    """The site's data inputs over the whole sequence."""
    seq_dims: list[int]
    """Each data input's sequence dim (cut in sharded mode)."""


def inputs(c: Case) -> Inputs:
    """The case's tensors over the whole sequence (every rank makes the same)."""
    g = torch.Generator().manual_seed(c.seed)
    dtype = DTYPES[c.dtype]

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    q = randn(c.batch, c.hq, c.n, c.d) * c.sharp
    k, v = randn(c.batch, c.hkv, c.n, c.d), randn(c.batch, c.hkv, c.n, c.dv)
    dout = randn(c.batch, c.hq, c.n, c.dv)
    if c.offset:
        direction = torch.randn(c.d, generator=g, dtype=torch.float64)
        shared = (c.offset * direction / direction.norm()).to(dtype)
        q, k = q + shared, k + shared
    kind = CONSTRUCTIONS[c.mask].data
    data, dims = [], []
    if kind == "documents":  # first: m_documents(c, q, doc, pad)
        data.append(_documents(c, g)), dims.append(1)
    if kind in ("pad", "documents") and c.pad != "none" or kind == "key":
        pad = _pad(c, g)
        if kind == "key":
            data.append(_key_mask(c, pad, g)), dims.append(3)
        else:
            data.append(pad), dims.append(1)
    if kind == "positions":
        data.append(_packed_positions(c, g)), dims.append(1)
    if kind == "values":
        data.append(_values(c)), dims.append(1)
    if kind == "dense":
        data.append(_dense_mask(c, g)), dims.append(-1)
    if c.nonfinite:
        where, value, index = c.nonfinite
        (data[-1] if where == "mask" else {"q": q, "k": k, "v": v}[where])[index] = float(value)
    return Inputs(q, k, v, dout, data, dims)


def _pad(c: Case, g: torch.Generator) -> torch.Tensor:
    """Key padding ``(B, N)``, True where a key is kept; every row keeps one key at least."""
    b, n = c.batch, c.n
    pad = torch.ones(b, n, dtype=torch.bool)
    for row in range(b):
        cut = int(torch.randint(0, max(n, 1), (), generator=g))
        if c.pad == "left":
            pad[row, :cut] = False
        elif c.pad == "right":
            pad[row, n - cut :] = False
        elif c.pad == "random":
            pad[row] = torch.rand(n, generator=g) > 0.3
        elif c.pad == "hole":  # a run of masked keys: whole segments of a branch may hold only them
            length = int(torch.randint(1, max(n // 2, 1) + 1, (), generator=g))
            pad[row, cut : cut + length] = False
        if n and not pad[row].any():
            pad[row, int(torch.randint(0, n, (), generator=g))] = True
    return pad


def _key_mask(c: Case, pad: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A key mask ``(B|1, H|1, 1, N)`` given as an input: bool, or float (a random key bias
    half the time) with the masked keys at ``-inf`` or ``finfo.min``."""
    dtype = DTYPES[c.dtype]
    heads = c.hq if c.mask_heads else 1
    keep = pad[:, None, None, :].expand(-1, heads, 1, -1)
    if not c.mask_batch:
        keep = keep[:1]
    if c.fill == "bool":
        return keep.contiguous()
    bias = torch.zeros(keep.shape, dtype=torch.float64)
    if torch.rand((), generator=g) < 0.5:
        bias = torch.randn(keep.shape, generator=g, dtype=torch.float64)
    fill = float("-inf") if c.fill == "-inf" else torch.finfo(dtype).min
    return bias.to(dtype).masked_fill(~keep, fill)


def _documents(c: Case, g: torch.Generator) -> torch.Tensor:
    """Document ids ``(B, N)``: runs of random lengths, counting up."""
    starts = torch.rand(c.batch, c.n, generator=g) < 0.15
    starts[:, :1] = True
    return starts.long().cumsum(-1)


def _packed_positions(c: Case, g: torch.Generator) -> torch.Tensor:
    """``position_ids`` of packed sequences ``(B, N)``: each document counts up from 0."""
    pos = torch.empty(c.batch, c.n, dtype=torch.long)
    for row in range(c.batch):
        start = 0
        for i in range(c.n):
            if i and torch.rand((), generator=g) < 0.12:
                start = i
            pos[row, i] = i - start
    return pos


def _values(c: Case) -> torch.Tensor:
    """``pos_band``'s values ``(B, N)``: counting up by one from an offset (0), block ids (1),
    counting down (2)."""
    i = torch.arange(c.n).expand(c.batch, c.n)
    return (i + 3, i // 4, c.n - i)[c.param].contiguous()


def _dense_mask(c: Case, g: torch.Generator) -> torch.Tensor:
    """A dense ``(B|1, 1, N, N)`` mask given as an input: random, every row with a key; causal
    (and random) where the case is causal."""
    b = c.batch if c.mask_batch else 1
    keep = torch.rand(b, 1, c.n, c.n, generator=g) < 0.5
    if c.causal:
        keep &= torch.ones(c.n, c.n, dtype=torch.bool).tril()
    rows = torch.arange(c.n)
    keep[..., rows, rows] = True  # every row keeps its own key
    dtype = DTYPES[c.dtype]
    if c.fill == "bool":
        return keep
    fill = float("-inf") if c.fill == "-inf" else torch.finfo(dtype).min
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, fill)


# ---- the site ---------------------------------------------------------------------------------


def site(c: Case) -> Callable:
    """``attend(q, k, v, *data)``: the site as a model writes it (with ``c.bnhd``, q, k, v and
    the result ``(B, N, H, D)``, transposed in the graph)."""
    build = CONSTRUCTIONS[c.mask].build
    sdpa = dict(scale=c.scale, enable_gqa=c.enable_gqa)

    def attend(q, k, v, *data):
        if c.bnhd:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if build is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=c.causal, **sdpa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=build(c, q, *data), **sdpa)
        return out.transpose(1, 2) if c.bnhd else out

    return attend


def dense_mask(c: Case, data: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The mask the site gives SDPA over the whole sequence, as the float64 bias the function
    adds: ``-inf`` where masked, a fill at or below half the dtype's lowest read as ``-inf``
    (docs/masks.md, Key-padding masks); ``(B|1, H|1, N, N)``. A NaN or inf in a key mask reaches
    the pairs the mask's other parts allow (a causal band's ``-inf`` stays ``-inf``: the mask is
    an AND of its parts, docs/semantics.md, Masks), not every pair of its key."""
    build = CONSTRUCTIONS[c.mask].build
    if build is None:
        return None
    placed = c.nonfinite is not None and c.nonfinite[0] == "mask"
    if placed:  # the mask of the finite key mask, then the value where that allows the key
        b, h, _, t = c.nonfinite[2]
        data = [data[0].clone().index_put_((torch.tensor(b), torch.tensor(h), torch.tensor(0), torch.tensor(t)), torch.tensor(0.0, dtype=data[0].dtype)), *data[1:]]
    mask = build(c, torch.empty(c.batch, c.hq, c.n, 1, dtype=DTYPES[c.dtype]), *data)
    if mask.dim() == 4 and mask.shape[-2] == 1:
        mask = mask.expand(*mask.shape[:2], c.n, c.n)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    lowest = torch.finfo(mask.dtype).min / 2
    bias = mask.double().masked_fill(mask <= lowest, float("-inf"))
    if placed:
        bias = bias.expand(c.batch, c.hq, c.n, c.n).clone()
        column = bias[b if c.mask_batch else slice(None), h if c.mask_heads else slice(None), :, t]
        column.masked_fill_(column != float("-inf"), float(c.nonfinite[1]))
    return bias


# ---- the float64 references -------------------------------------------------------------------


def _pairs_reference(q, k, v, counts, bias, scale) -> torch.Tensor:
    """The function in float64, each (batch, head, query) row over the keys it is connected to,
    gathered (docs/semantics.md, The function; ``tests/test_nonfinite.py`` has the key-bias
    form): ``scale q.k + log c + bias`` over the pairs with ``c > 0`` and a bias above ``-inf``,
    softmax, times the values. A pair that is not connected takes part in no product, so a NaN
    or inf reaches exactly what the function makes it reach; a row with nothing to attend (every
    score ``-inf``) gives 0 and no gradient. ``counts (Hq, N, N)``, ``bias (B|1, Hq|1, N, N)``.
    Rows in chunks, each recomputed in the backward: memory O(chunk x N). Where every input is
    finite, a pair that is not connected adds exactly 0 to every product (its probability and
    its score's gradient are 0), so the rows are evaluated as dense products then (fast at 2k
    tokens); the function is the same."""
    b, hq, n, _ = q.shape
    dv = v.shape[-1]
    if n == 0:
        return q.new_zeros(b, hq, 0, dv, dtype=torch.float64) + 0 * q.sum() + 0 * k.sum() + 0 * v.sum()
    k, v = (x.double().repeat_interleave(hq // x.shape[1], 1) for x in (k, v))
    bias = torch.zeros(1, 1, n, n, dtype=torch.float64) if bias is None else bias
    bias = bias.expand(b, hq, n, n)
    connected = (counts > 0) & (bias != float("-inf"))
    finite = all(bool(x.isfinite().all()) for x in (q, k, v)) and not bool((bias.isnan() | (bias == float("inf"))).any())
    rows_of, size = (_dense_rows, b * hq * n) if finite else (_pair_rows, b * hq * n * max(q.shape[-1], dv))
    rows = max(1, (1 << 22) // max(1, size))
    outs = []
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        outs.append(torch.utils.checkpoint.checkpoint(
            rows_of, q[:, :, start:stop].double(), k, v, counts[:, start:stop], bias[:, :, start:stop],
            connected[:, :, start:stop], scale, use_reentrant=False,
        ))  # fmt: skip
    return torch.cat(outs, 2)


def _dense_rows(q, k, v, counts, bias, connected, scale):
    s = torch.where(connected, scale * q @ k.transpose(-1, -2) + counts.log() + bias, float("-inf"))
    live = ~(s == float("-inf")).all(-1, keepdim=True)
    return (torch.softmax(torch.where(live, s, 0.0), -1) * live) @ v


def _pair_rows(q, k, v, counts, bias, connected, scale):
    b, hq, rows, _ = q.shape
    n = k.shape[2]
    kx, vx = (torch.cat([x, x.new_zeros(b, hq, 1, x.shape[-1])], 2) for x in (k, v))  # padding key
    bx = torch.cat([bias, bias.new_zeros(b, hq, rows, 1)], 3)
    cx = torch.cat([counts.expand(b, hq, rows, n), counts.new_ones(1, 1, 1, 1).expand(b, hq, rows, 1)], 3)
    bi, hi = torch.arange(b).view(b, 1, 1, 1), torch.arange(hq).view(1, hq, 1, 1)

    def scores(connected):
        keys = max(int(connected.sum(-1).max()), 1)
        order = connected.to(torch.int8).sort(dim=-1, descending=True, stable=True).indices[..., :keys]
        valid = connected.gather(-1, order)
        idx = torch.where(valid, order, n)
        s = (q.unsqueeze(3) * kx[bi, hi, idx]).sum(-1) * scale + cx.gather(-1, idx).log() + bx.gather(-1, idx)
        return valid, s.masked_fill(~valid, float("-inf")), vx[bi, hi, idx]

    with torch.no_grad():
        live = ~(scores(connected)[1] == float("-inf")).all(-1, keepdim=True)
    valid, s, vg = scores(connected & live)  # a row with nothing to attend: no pair at all
    p = (torch.softmax(s.masked_fill(~live, 0.0), -1) * live).masked_fill(~valid, 0.0)
    return (p.unsqueeze(-1) * vg).sum(-2)


def _forward_backward(fn, tensors: Inputs, dtype=None, *data):
    """``fn``'s output and the gradients of ``<out, dout>`` w.r.t. q, k, v (leaves in ``dtype``)."""
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_() for x in (tensors.q, tensors.k, tensors.v)]
    out = fn(*leaves, *data)
    if out.numel() == 0:
        return [out.detach(), *(torch.zeros_like(x) for x in leaves)]
    return [out.detach(), *torch.autograd.grad(out, leaves, tensors.dout.to(out.dtype))]


def function_reference(c: Case, x: Inputs):
    """The rewritten function: ``(float64 out/grads, SDPA's out/grads computing the same
    function in the case's dtype, and the float64 ones those are measured against)``. SDPA's are,
    tensor by tensor, the worse of its two CPU kernels: the math kernel (what it runs with head
    sizes that differ) and its fused flash kernel (what it runs where they are equal: a flash
    backward recomputes each weight from the row's log-sum-exp, and where q and k share a large
    offset its gradients err far more than the math kernel's). Where the inputs hold a NaN or
    inf, SDPA's error is measured on a finite twin (the value 0 in its place: SDPA's dense
    products spread a NaN further than the function does)."""
    counts = connection_counts(c.n, c.hq, c.branches, is_causal=c.causal and c.mask == "none")
    scale = c.d**-0.5 if c.scale is None else c.scale

    def evaluate(x: Inputs):
        bias = dense_mask(c, x.data)
        expected = _forward_backward(lambda q, k, v: _pairs_reference(q, k, v, counts, bias, scale), x, torch.float64)
        # -inf where not connected; 4-D, as a model passes a mask (a 3-D one sends SDPA to
        # another kernel on CPU, with another error)
        total = (counts.log() + (0.0 if bias is None else bias)).expand(c.batch, c.hq, c.n, c.n)
        sdpa_bias = total.float() if c.dtype == "bfloat16" else total.to(DTYPES[c.dtype])

        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_bias, scale=scale, enable_gqa=c.hq != c.hkv)

        def flash(q, k, v):  # as SDPA's front end calls it: heads repeated, one head size
            k, v = (t.repeat_interleave(c.hq // c.hkv, 1) for t in (k, v))
            size = max(c.d, c.dv)
            q, k, v = (F.pad(t, (0, size - t.shape[-1])) for t in (q, k, v))
            out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=sdpa_bias.to(q.dtype), scale=scale)[0]
            return out[..., : c.dv]

        baselines = [_forward_backward(sdpa, x)]
        if c.n:
            baselines.append(_forward_backward(flash, x))
        return expected, _worse(baselines, expected, terms(c, x))

    expected, baseline = evaluate(x)
    if not c.nonfinite:
        return expected, baseline, expected
    twin, twin_baseline = evaluate(inputs(dataclasses.replace(c, nonfinite=c.nonfinite[:1] + ("0",) + c.nonfinite[2:])))
    return expected, twin_baseline, twin


def score_magnitude(c: Case, x: Inputs) -> float:
    """The largest finite ``|scale q.k + bias|`` over the pairs the function connects: what
    float32 rounds a softmax weight in proportion to (docs/semantics.md, Accuracy)."""
    counts = connection_counts(c.n, c.hq, c.branches, is_causal=c.causal and c.mask == "none")
    scale = c.d**-0.5 if c.scale is None else c.scale
    bias = dense_mask(c, x.data)
    k = x.k.double().repeat_interleave(c.hq // c.hkv, 1)
    top = 0.0
    for b in range(c.batch):
        s = scale * x.q[b].double() @ k[b].transpose(-1, -2)
        if bias is not None:
            s = s + bias[min(b, bias.shape[0] - 1)]
        s = s.masked_fill((counts == 0) | ~s.isfinite(), 0.0)
        top = max(top, float(s.abs().max()) if s.numel() else 0.0)
    return top


def _worse(baselines, expected, scales) -> list[torch.Tensor]:
    """Tensor by tensor, the baseline whose finite entries err most against ``expected``."""
    worse = []
    for i, e in enumerate(expected):
        sure = torch.isfinite(e)
        worse.append(max((b[i] for b in baselines), key=lambda t: _error(torch.nan_to_num(t.double(), nan=0.0)[sure], e[sure], scales[i])))
    return worse


def sdpa_reference(c: Case, x: Inputs):
    """A site left alone runs as written: SDPA's own function in float64, what the case's
    compiler makes of the site without the backend (the baseline: inductor lowers SDPA its own
    way, with its own error), and float64 again (what the baseline is measured against)."""
    attend = site(dataclasses.replace(c, bnhd=False))
    data64 = [t.double() if t.is_floating_point() else t for t in x.data]
    expected = _forward_backward(attend, x, torch.float64, *data64)
    torch._dynamo.reset()
    _Compiled.key = None
    plain = torch.compile(attend, backend=c.compiler, fullgraph=True, dynamic=False)
    return expected, _forward_backward(plain, x, None, *x.data), expected


# ---- running one case -------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    seed: int
    ok: bool
    outcome: str
    """``rewritten``, ``left alone``, ``raised`` (as the case allows), or ``error``."""
    message: str = ""
    """Why it failed: the seed, the case in one line, then what went wrong."""
    errors: dict[str, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    mask: str = ""
    world: int = 1
    fatal: bool = False
    """The ring cannot go on in this spawn (a transfer timed out)."""


class _Compiled:
    """The last compiled site, reused by the next case whose graph is equal."""

    key: tuple | None = None
    fn: Callable | None = None
    backend = None


def _backend(c: Case):
    options = dict(compiler=c.compiler, sharding=c.sharding, layout=c.layout, comm=c.comm, timeout=RING_TIMEOUT)
    if c.segment_lengths is not None:
        options.update(segment_lengths=list(c.segment_lengths), dilation_rates=list(c.dilation_rates))
    return ring_rewrite.backend(**options)


def _compiled(c: Case):
    if _Compiled.key != c.key():
        torch._dynamo.reset()
        _Compiled.backend = _backend(c)
        _Compiled.fn = torch.compile(site(c), backend=_Compiled.backend, fullgraph=True, dynamic=c.dynamic)
        _Compiled.key = c.key()
    return _Compiled.fn, _Compiled.backend


def _cut(t: torch.Tensor, dim: int, c: Case) -> torch.Tensor:
    return ring_rewrite.shard(t.detach(), dim, layout=c.layout).contiguous() if c.sharded else t


def run(c: Case) -> Result:
    """Compile ``c``'s site, run it forward and backward on this rank, and judge it (the module
    docstring). Never raises: a failure is a ``Result`` whose message starts with the seed."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != c.world:
        raise ValueError(f"seed {c.seed} is a case of {c.world} ranks, run on {world} (run_cases runs each where it belongs)")
    start = time.perf_counter()
    try:
        result = _judge(c)
    except Exception as e:  # a bug of the campaign itself: still one line per case
        result = Result(c.seed, False, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    result.seconds, result.mask, result.world = time.perf_counter() - start, c.mask, c.world
    if not result.ok:
        result.message = f"seed {c.seed}: {c.describe()}: {result.message}"
    return result


def _judge(c: Case) -> Result:
    x = inputs(c)
    given = (lambda t: t.transpose(1, 2).contiguous()) if c.bnhd else (lambda t: t)  # noqa: E731
    seq = 1 if c.bnhd else 2
    # Copies: the site must not write into them (compared after), nor into x (the references').
    leaves = [_cut(given(t), seq, c).clone().requires_grad_() for t in (x.q, x.k, x.v)]
    data = [_cut(t, dim, c).clone() for t, dim in zip(x.data, x.seq_dims)]
    try:
        fn, backend = _compiled(c)
        out = fn(*leaves, *data)
        got = [out.detach(), *(torch.autograd.grad(out, leaves, _cut(given(x.dout), seq, c)) if out.numel() else
                               [torch.zeros_like(t) for t in leaves])]  # fmt: skip
        if c.bnhd:
            got = [t.transpose(1, 2) for t in got]
    except Exception as e:
        _Compiled.key = None
        text = f"{type(e).__name__}: {e}"
        fatal = type(e).__name__ == "TransferTimeout"
        if c.expect in ("refuse", "either") and any(reason in text for reason in c.expected_reasons):
            return Result(c.seed, True, "raised", fatal=fatal)
        return Result(c.seed, False, "error", f"raised {_first_lines(text)}", fatal=fatal)
    written = [
        f"{name} ({int((a != b).sum())} of {a.numel()} entries)"
        for name, a, b in zip(("q", "k", "v", *(f"data[{i}]" for i in range(len(data)))), [*leaves, *data],
                              [_cut(given(t), seq, c) for t in (x.q, x.k, x.v)] + [_cut(t, dim, c) for t, dim in zip(x.data, x.seq_dims)])
        if not torch.equal(a.detach().nan_to_num(), b.nan_to_num())
    ]  # fmt: skip
    if written:
        return Result(c.seed, False, "error", f"the site wrote into its inputs: {', '.join(written)}")
    if not backend.records:
        return Result(c.seed, False, "error", "no site recorded")
    record = backend.records[-1]  # the site's, at its latest compile
    outcome = "rewritten" if record.rewritten else "left alone"
    if c.expect == "rewrite" and not record.rewritten:
        return Result(c.seed, False, outcome, f"left alone, expected rewritten: {record.reason}")
    if c.expect == "refuse":
        return Result(c.seed, False, outcome, f"{outcome}, expected an error naming {' or '.join(c.expected_reasons)!r}")
    if c.expect == "alone" and (record.rewritten or not any(r in (record.reason or "") for r in c.expected_reasons)):
        why = "rewritten" if record.rewritten else f"left alone for another reason: {record.reason}"
        return Result(c.seed, False, outcome, f"{why}; expected left alone: {' or '.join(c.expected_reasons)}")
    references = (function_reference if record.rewritten else sdpa_reference)(c, x)
    expected, baseline, baseline_expected = ([_cut(t, 2, c) for t in tensors] for tensors in references)
    magnitude = score_magnitude(c, x) if record.rewritten else 0.0
    problems, errors = _compare(c, got, expected, baseline, baseline_expected, magnitude, terms(c, x))
    if problems:
        return Result(c.seed, False, outcome, "; ".join(problems), errors)
    return Result(c.seed, True, outcome, errors=errors)


def _first_lines(text: str, lines: int = 3) -> str:
    return " | ".join(line for line in text.strip().splitlines()[:lines] if line.strip())


def _error(a: torch.Tensor, b: torch.Tensor, size: float = 1.0) -> float:
    """Max-abs error over the reference's max-abs value, or over ``ZERO`` of ``size`` (the
    scale of the terms that sum into the tensor) where that is larger: a gradient whose terms
    cancel (q and k sharing an offset; a softmax over one key, whose gradient is 0) is a
    float32 kernel's rounding of those terms."""
    if not a.numel():
        return 0.0
    scale = max(float(b.abs().max()), ZERO * size)
    return float((a.double() - b.double()).abs().max()) / (scale or 1.0)


def terms(c: Case, x: Inputs) -> list[float]:
    """The scale of the terms that sum into ``out, dq, dk, dv`` (finite entries): ``|v|``,
    ``|scale| |dout| |v| |k|``, the same with ``|q|``, and ``|dout|``."""
    def top(t):
        t = t.double()
        return float(t[t.isfinite()].abs().max()) if t.isfinite().any() else 0.0

    scale = abs(c.d**-0.5 if c.scale is None else c.scale)
    q, k, v, dout = (top(t) for t in (x.q, x.k, x.v, x.dout))
    return [v, scale * dout * v * k, scale * dout * v * q, dout]


def _compare(c: Case, got, expected, baseline, baseline_expected, magnitude: float = 0.0,
             scales: Sequence[float] = (1.0,) * 4) -> tuple[list[str], dict[str, float]]:
    """What differs, and each tensor's error: the entries that are not finite where the
    reference's are (or the other way), or the finite ones beyond the bound
    ``max(TOL x max(1, magnitude / SCORES), 2x SDPA's own error)``: the documented bound holds
    for scores up to about 50 and grows in proportion beyond (docs/semantics.md, Accuracy)."""
    problems, errors = [], {}
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        g, e = got[i], expected[i]
        if g.shape != e.shape:
            problems.append(f"{name} of shape {tuple(g.shape)}, expected {tuple(e.shape)}")
            continue
        bad, want = ~torch.isfinite(g), ~torch.isfinite(e)
        if not torch.equal(bad, want):
            problems.append(f"{name}: {int(bad.sum())} entries not finite where the reference has {int(want.sum())}")
            continue
        err = _error(g[~want], e[~want], scales[i])
        sure = ~want & torch.isfinite(baseline_expected[i])  # the entries ours is measured on
        own = _error(torch.nan_to_num(baseline[i].double(), nan=0.0)[sure], baseline_expected[i][sure], scales[i])
        bound = max(TOL[c.dtype] * max(1.0, magnitude / SCORES), 2 * own)
        errors[name] = err
        if not err <= bound:
            scores = f"; scores to {magnitude:.0f}" if magnitude > SCORES else ""
            problems.append(f"{name} off by {err:.1e} (bound {bound:.1e}; SDPA {own:.1e}{scores})")
    return problems, errors


# ---- running many -----------------------------------------------------------------------------


def quiet() -> None:
    """No warning per site left alone (the campaign counts them)."""
    for name in ("ring_rewrite", "torch._dynamo", "torch._inductor"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _by_graph(cases: Sequence[Case]) -> list[int]:
    """Indices of ``cases`` in an order that puts equal graphs next to each other (one compile)."""
    return sorted(range(len(cases)), key=lambda i: repr(cases[i].key()))


def run_local(cases: Sequence[Case], on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Cases of one rank, here; results in the order of ``cases``."""
    quiet()
    results: list[Result | None] = [None] * len(cases)
    for i in _by_graph(cases):
        results[i] = run(cases[i])
        if on_result:
            on_result(results[i])
    return results  # type: ignore[return-value]


def _rank_main(rank: int, world: int, cases: list[Case], folder: str) -> None:
    """One rank of a spawn: run each case, append its result to ``rank<r>.jsonl``."""
    torch.set_num_threads(1)
    quiet()
    with open(os.path.join(folder, f"rank{rank}.jsonl"), "a") as f:
        for c in cases:
            result = run(c)
            f.write(json.dumps(dataclasses.asdict(result)) + "\n")
            f.flush()
            if result.fatal:
                return


def _read(folder: str, rank: int) -> list[Result]:
    path = os.path.join(folder, f"rank{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [Result(**r) for r in map(json.loads, f)]


def _merged(a: Result, b: Result) -> Result:
    """One result of a case from its two ranks': it passes where both pass."""
    what = a.message.split(": ", 2)[-1], b.message.split(": ", 2)[-1]
    if not a.ok and not b.ok and what[0] != what[1]:
        a = dataclasses.replace(a, message=f"{a.message} [rank 1: {what[1]}]")
    elif a.ok != b.ok:
        a = dataclasses.replace(a if not a.ok else b, message=f"{(a if not a.ok else b).message} [rank {0 if not a.ok else 1} only]")
    return dataclasses.replace(a, seconds=max(a.seconds, b.seconds))


def run_pairs(cases: Sequence[Case], on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Cases on two gloo ranks, in spawns of two processes that each run many; results in the
    order of ``cases``. A spawn that dies or stalls fails the case it was running, and the
    cases after it run in a new spawn."""
    from ranks import start_ranks

    order = _by_graph(cases)
    results: list[Result | None] = [None] * len(cases)
    while order:
        todo = [cases[i] for i in order]
        with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
            context = start_ranks(2, _rank_main, (todo, folder), join=False)
            died, last, seen = "", time.monotonic(), 0
            while True:
                try:
                    if context.join(timeout=5):
                        break
                except Exception as e:  # a rank raised outside run(): the spawn is over
                    died = _first_lines(str(e), 2)
                    break
                done = min(len(_read(folder, 0)), len(_read(folder, 1)))
                if done != seen:
                    seen, last = done, time.monotonic()
                elif time.monotonic() - last > STALL:
                    died = f"no result for {STALL:.0f} s"
                    for process in context.processes:
                        process.kill()
                    break
            ranks = [_read(folder, 0), _read(folder, 1)]
        finished = [_merged(a, b) for a, b in zip(*ranks)]
        if len(finished) < len(todo):  # the spawn ended during todo[len(finished)]
            c = todo[len(finished)]
            finished.append(Result(c.seed, False, "error", f"seed {c.seed}: {c.describe()}: the ranks' spawn ended "
                                   f"during this case: {died or 'a rank exited'}", mask=c.mask, world=c.world))  # fmt: skip
        for i, r in zip(order, finished):
            results[i] = r
            if on_result:
                on_result(r)
        order = order[len(finished) :]
    return results  # type: ignore[return-value]


def run_cases(cases: Sequence[Case], *, jobs: int = 1, on_result=None) -> list[Result]:
    """Every case: those of one rank here (or in ``jobs`` processes), those of two ranks in
    spawns of two gloo processes. Results: those of one rank, then those of two."""
    ones = [c for c in cases if c.world == 1]
    twos = [c for c in cases if c.world == 2]
    results: list[Result] = []
    if jobs > 1 and ones:
        import concurrent.futures
        import multiprocessing

        ordered = [ones[i] for i in _by_graph(ones)]
        chunks = [ordered[i :: jobs] for i in range(jobs)]
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=_worker_init, initargs=(jobs,)) as pool:  # fmt: skip
            futures = [pool.submit(run_local, chunk) for chunk in chunks if chunk]
            twos_results = run_pairs(twos, on_result) if twos else []
            for future in concurrent.futures.as_completed(futures):
                for r in future.result():
                    if on_result:
                        on_result(r)
                    results.append(r)
            results += twos_results
    else:
        results += run_local(ones, on_result)
        results += run_pairs(twos, on_result) if twos else []
    return results


def _worker_init(jobs: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // jobs))


def summary(results: Sequence[Result], wall: float) -> str:
    """A table by mask construction and world, then one line of totals and timings."""
    from tabulate import tabulate

    table: dict[tuple[str, int], collections.Counter] = collections.defaultdict(collections.Counter)
    seconds = collections.defaultdict(list)
    for r in results:
        table[r.mask, r.world][r.outcome if r.ok else "FAILED"] += 1
        seconds[r.world].append(r.seconds)
    columns = ["rewritten", "left alone", "raised", "FAILED"]
    rows = [[mask, world, *(counts[col] for col in columns)] for (mask, world), counts in sorted(table.items())]
    failed = [r.seed for r in results if not r.ok]
    timing = ", ".join(f"P={w} {sum(s) / len(s):.1f} s/case" for w, s in sorted(seconds.items()))
    text = tabulate(rows, headers=["mask", "P", *columns], tablefmt="simple")
    return (f"{text}\n{len(results)} cases, {len(results) - len(failed)} passed, {len(failed)} failed "
            f"({timing}; {wall:.0f} s in all)" + (f"\nfailing seeds: {' '.join(map(str, sorted(failed)))}" if failed else ""))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="the first seed (with --cases 1: that one case)")
    parser.add_argument("--cases", type=int, default=1, help="how many cases, from --seed on")
    parser.add_argument("--world", type=int, choices=[1, 2], help="only cases of this many ranks")
    parser.add_argument("--jobs", type=int, default=1, help="processes for the cases of one rank")
    parser.add_argument("--list", action="store_true", help="print the cases, run none")
    parser.add_argument("-v", "--verbose", action="store_true", help="a line for every case, not only failures")
    args = parser.parse_args(argv)
    seeds, seed = [], args.seed
    while len(seeds) < args.cases:
        if args.world is None or case(seed).world == args.world:
            seeds.append(seed)
        seed += 1
    if args.list:
        for s in seeds:
            print(f"seed {s}: {case(s).describe()}")
        return 0
    start = time.perf_counter()

    def show(r: Result) -> None:
        if not r.ok:
            print(f"FAIL {r.message}\n     reproduce: python tests/fuzz.py --seed {r.seed}", flush=True)
        elif args.verbose or len(seeds) == 1:
            errors = " ".join(f"{k} {v:.1e}" for k, v in r.errors.items())
            print(f"ok   seed {r.seed}: {case(r.seed).describe()}: {r.outcome} {errors} ({r.seconds:.1f} s)", flush=True)

    results = run_cases([case(s) for s in seeds], jobs=args.jobs, on_result=show)
    print(summary(results, time.perf_counter() - start))
    return 1 if any(not r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
