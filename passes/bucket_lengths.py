"""A symbolic sequence length becomes a static bucket: one graph for a range of lengths.

Dynamo compiles a function again for each new sequence length until, at the second, its
automatic dynamic shapes make the length a symbol ``s0`` (``dynamic=True`` and
``mark_dynamic`` do so at once). The rewrite needs static lengths (its plan cuts the sequence
into segments, lattices and shards), so without this pass it specialises, guarding
``s0 == n``: one graph per length, and dynamo's recompile limit after eight. Here a site whose
length is symbolic is padded, in the graph, to the bucket ``L``, the power of two with
``L / 2 < s0 <= L`` (guarded), and the padding masked (Note [Padding the sequence]:
the same function, exactly)::

    out = sdpa(q, k, v, attn_mask=m, is_causal=c)                 # q, k, v (B, H, s0, D)

becomes::

    n = q.size(2)
    qp, kp, vp = (padded_rows(x, L, n) for x in (q, k, v))     # (B, H, L, D), zeros after n
    keep = _key_mask(q, L, n, m)                           # keys [0, n) (and m); none if causal without m
    out = unpadded_rows(sdpa(qp, kp, vp, attn_mask=keep, is_causal=c), n)     # role "bucket"

so every length in ``(L/2, L]`` runs the graph compiled for the first of them, in replicated
mode and on one rank. In sharded mode each rank pads its own shard, where the site can take that
(Note [Padding shards to a bucket]); other sharded sites specialise.
``RingDilatedConfig(disable_passes=["length_buckets"])`` specialises instead.

A dense ``(B|1, H|1, s0, s0)`` mask (transformers builds one for every call with an
``attention_mask`` or without a cache, a batch padded to its longest row gives a new ``s0`` each
time) is read at its symbolic length (``masks.mask_structure``) and built again at ``L`` from
what it is: its band, its documents (ids past ``s0``: one more document) and its key part (keys
past ``s0`` masked), evaluated over the keys from the same tensors, so that the rewrite reads the
same structure at a static length (``_structured_mask``). Where its structure cannot be read at a
symbolic length (an order of documents other than equality, a band that depends on the length),
the site specialises as before.

Cross attention (Note [Self or cross attention]) is not touched.

Note [Padding to a bucket]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Padding is the same function (the padded keys are masked, or come after every real query of a
causal site), but computed it would cost the bucket's tokens, not the sequence's: one token past
a power of two would cost the next power's whole attention. So the padded SDPA node carries the
graph node of ``s0`` (meta ``REAL``) and ``rewrite_sdpa`` gives the site the count as a 0-d
tensor input (``real``) in one process. Its backward takes the rows past ``s0`` as dead (their
lse ``+inf``): their gradient is 0 anyway, but a padded query of zeros meeting an infinite key
scores ``0 * inf = NaN``, which a live row would add to every key it reaches.

The site's blocks compute the real rows only, and the real keys: no real row attends a key
past ``s0`` (a causal row attends no later key; without ``is_causal`` the padded keys are
masked, or in a document of their own). A head's real rows are a prefix of its dilated sequence
(``BranchLayout.real_rows``), so per local branch the segments that hold real positions run,
the first of them whole and the last cut to its real rows:

* read in place (float32 on CPU, causal, no mask): each head cut to its own real rows
  (``ops.kernel_calls``); where every branch is, no row past ``s0`` is read or written at all,
  and the site takes the unpadded q, k, v and returns the unpadded out
  (``rewrite_sdpa._unpadded_inputs``): the bucket's graph then costs what a graph compiled for
  ``s0`` costs (``benchmarks/lengths.py``);
* not read in place, without documents (a key mask, a band such as a sliding window, 16-bit
  inputs, dropout, layouts ``BranchLayout.in_place`` refuses): the site runs at the real
  length, as a sharded bucket does (Note [Padding shards to a bucket], ``SitePlan.bucketed``):
  it takes the unpadded q, k, v and the key bias at the real keys. A rate-1 branch's blocks
  read the real rows where they lie, the whole segments in one call and the last one's rows in
  another (``ops._on_site_rows``; a band's positions are a segment's, the same in both); a
  dilated branch is gathered from the real rows, its rows past them filled
  (``BranchLayout.gather``; keys masked), and its calls cut to the real rows as above
  (``ops.real_calls``); outs and gradients go to the real rows only. Of the bucket's size only
  a dilated branch's gathered rows are held (``1 / r`` of it);
* with documents (ids of the bucket's rows): the whole segments in one block call,
  the last segment's rows up to the most real rows of any head in another (``ops.real_calls``),
  rows and keys past them left out, their out 0 and lse ``-inf``; the padded copies of q, k, v
  and the mask stay, linear in the bucket.

With dropout, each of the calls a block is cut into draws a stream of its own (``ops._call_of``,
Note [Dropout in blocks]). Replicated mode on more than one rank: below (exact attention on the
ring); a dilated config there computes the bucket, its padding masked (the padding would lie on
the last ranks, and segments fix positions).

Note [Padding shards to a bucket]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
In sharded mode each rank holds ``s0`` tokens of the sequence (``2`` parts of ``s0 / 2`` with
zigzag), and ``s0`` is the symbol. Padding the sequence's end would leave the padding on the last
ranks and the work on the others; so each rank pads each part of its shard at its end instead,
to ``L / parts`` rows (``padded_rows``' ``parts``): the site sees a sequence of ``P * L`` with
the padding inside it, the real tokens in their order. That is the same function only where no
position is read as a number, so only such sites are padded (``_per_shard``): exact attention on
the ring (``comm="ring"``, one branch, rate 1 over the whole sequence), and no mask
or a mask of a causal band and key conjuncts that read the caller's tensors (a sliding window,
ALiBi and packed documents read positions; those specialise). Their mask is rebuilt over the
padded keys (``KEYS``: each rank's keys' values, padding masked, read as the caller's tensors
are).

The padding is what the rewrite plans with, never what runs: the site is planned for the bucket
(``SitePlan.bucketed``), and takes the unpadded q, k, v, the key bias at the real keys of each
part and returns the unpadded out (``rewrite_sdpa._unpadded_inputs``, ``_real_keys``). Its body
reads a part's rows as ``s0 / parts``, a symbol, where the plan has ``L / parts``
(``attention._Inputs.rows``): at rate 1 a ring's rows are the shard's, parts one after another,
in the sequence's order, so every block, transfer and sum of the bucket's program runs as it
would at a static ``s0``, on the real rows and keys only, and nothing of the bucket's size is
held. Every rank must hold the same ``s0``: the count goes into the site call's header
(``comm/calls.py``, ``site_token``'s ``length``), and ranks that differ raise.

In replicated mode the site chooses its cut, so exact attention on the ring runs at the real
length there too, whatever ``N``: the sequence is padded at its end as in one process
(``SitePlan.bucketed``), and the site takes the unpadded q, k, v, each rank its shard of the real
positions cut into ``P * parts`` chunks of ``ceil(N / (P * parts))`` rows
(``attention._bucket_rows``). The fewer than ``P * parts`` rows past ``N`` come last in the
sequence: zeros, masked as keys (none is needed with ``is_causal``), dead in the backward, dropped
from the gathered outputs and gradients. Only positions the ring never reads as numbers make
this the same function, as above; the header carries ``N``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from ring_rewrite.comm.groups import resolve_group
from ring_rewrite.config import RingDilatedConfig
from ring_rewrite.layout import LAYOUTS

from ring_rewrite.roles import role

from ._fx import RoleTracer, emit, erase_unused, propagate_example_values, stamp
from .find_sdpa import SdpaSite, cross_attention_reason, find_sdpa_sites, is_caller_input
from .masks import MaskStructure, key_mask, key_values, mask_structure, sharded_keys_reason
from .records import records, sharded

__all__ = ["KEYS", "NAME", "REAL", "bucket_lengths", "bucket", "padded_rows", "real_keys_only", "unpadded_rows"]

NAME = "length_buckets"
REAL = "ring_rewrite_real_length"
"""The meta key of a padded causal site's node: the graph node of its real length."""
KEYS = "ring_rewrite_shard_keys"
"""The meta key of a rebuilt mask's values over the keys of a padded shard: this rank's keys'
values of tensors the caller cut along the sequence, padding after each part's (sharded mode
reads them as it reads the caller's tensors: Note [Padding shards to a bucket])."""


def bucket(n: int) -> int:
    """The bucket of a length: the power of two ``L`` with ``L / 2 < n <= L``."""
    return 1 << max(0, n - 1).bit_length()


def bucket_lengths(gm: fx.GraphModule, example_inputs: Any = None, *, config: RingDilatedConfig) -> fx.GraphModule:
    """Pad every site with a symbolic sequence length to its bucket, in place."""
    parts = LAYOUTS[config.layout].parts if sharded(config) else None
    changed = 0
    first = len(records(gm))  # the site numbers rewrite_sdpa will give
    for i, site in enumerate(find_sdpa_sites(gm)):
        length = _symbolic_length(site)
        if length is not None and sharded(config) and not _per_shard(site, *length, config):
            continue
        if length is not None:
            _pad_site(gm.graph, site, *length, first + i, parts)
            counters["ring_rewrite"]["bucketed"] += 1
            changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _symbolic_length(site: SdpaSite) -> tuple[torch.SymInt, MaskStructure | None] | None:
    """The site's sequence length if it is a symbol that q, k, v (and a mask) share, in self
    attention; with a dense mask, also its structure."""
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
        if mask.dim() < 2 or not same(mask.shape[-1]):
            return None
        if mask.shape[-2] != 1:
            if not same(mask.shape[-2]):
                return None
            structure = mask_structure(site.attn_mask, n, specialise=False)
            if isinstance(structure, str) or structure.relation != "eq" and not structure.blocks:
                return None
            return n, structure
    return n, None


def _per_shard(site: SdpaSite, n: torch.SymInt, structure: MaskStructure | None, config: RingDilatedConfig) -> bool:
    """Whether a sharded site's shards can each be padded to a bucket (Note [Padding shards to
    a bucket]): exact attention on the ring, and a mask that reads no position
    (causal, key masks); each shard cut into the layout's parts whole."""
    world = resolve_group(config.group)[1]
    size = world * bucket(n.node.hint)
    ((w, r), *more) = config.branches(size)  # one branch: the shard's rows are its rows
    if more or r != 1 or w < size or config.comm != "ring":
        return False
    if structure is not None:
        if structure.documents is not None or structure.positions is not None or structure.reads_key_positions:
            return False
        if structure.lo is not None or structure.hi not in (None, 0):
            return False
        if sharded_keys_reason(structure, is_caller_input) is not None:
            return False  # the rewrite raises, naming it
    # NOTE: guards the graph on the parity of the shard (zigzag cuts it in two).
    return bool(n % LAYOUTS[config.layout].parts == 0)


def _pad_site(
    graph: fx.Graph, site: SdpaSite, n: torch.SymInt, structure: MaskStructure | None, index: int,
    parts: int | None,
) -> None:
    """Pad ``site`` to its bucket: the sequence's end in one process (``parts`` None), else each
    of a shard's ``parts`` parts (Note [Padding shards to a bucket])."""
    size, each = bucket(n.node.hint), parts or 1
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
        propagate_example_values([length])  # the structured mask reads it
        q, k, v = (call(padded_rows, x, size, length, each) for x in (site.query, site.key, site.value))
        mask = site.attn_mask
        if structure is not None:
            mask = _emit_structured_mask(graph, structure, site.query, size, length, each, index, node.meta.get("stack_trace"))
        elif mask is not None or not (site.is_causal or parts):
            mask = call(_key_mask, site.query, size, length, mask, each)
        args, kwargs = [q, k, v, *node.args[3:]], dict(node.kwargs)
        if len(args) > 3:
            args[3] = mask
        else:
            kwargs["attn_mask"] = mask
        padded = call(node.target, *args, **kwargs)
        out = call(unpadded_rows, padded, length, each)
    propagate_example_values(new[1:])
    padded.meta = {**node.meta, "example_value": padded.meta["example_value"]}
    padded.meta[REAL] = length  # what the rewrite knows of its padding (Note [Padding to a bucket])
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    if structure is not None:
        erase_unused(graph, site.attn_mask)  # the construction at the symbolic length


# NOTE: gathers, not pad and narrow: a narrowed view is contiguous at length L only, and the
# compilers below would guard on that (one graph more for the length L itself).


def _sources(size: int, length, parts: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a sequence of ``length`` tokens padded to ``size`` (each of its ``parts``
    parts at its end): the token it holds (the part's last for padding) and whether it is real."""
    i = torch.arange(size, device=device)
    if parts == 1:
        return i.clamp_max(length - 1), i < length
    part, real = size // parts, length // parts
    within = i % part
    return i // part * real + within.clamp_max(real - 1), within < real


def padded_rows(x: torch.Tensor, size: int, length, parts: int = 1) -> torch.Tensor:
    """``x (B, H, length, C)`` with zeros after its tokens, or after each of its ``parts``
    parts' tokens: ``(B, H, size, C)``."""
    source, real = _sources(size, length, parts, x.device)
    return torch.where(real.view(size, 1), x.index_select(2, source), 0)


def _key_mask(q: torch.Tensor, size: int, length, mask: torch.Tensor | None, parts: int = 1) -> torch.Tensor:
    """The real keys of ``size`` (``padded_rows``'s): a keep-mask ``(1, 1, 1, size)``, or the
    site's key-padding ``mask (.., 1, length)`` with the padded keys masked."""
    source, real = _sources(size, length, parts, q.device)
    keep = real.view(1, 1, 1, size)
    if mask is None:
        return keep
    keys = mask.index_select(-1, source)
    return torch.where(keep, keys, False if mask.dtype == torch.bool else float("-inf"))


def real_keys_only(node: Any) -> bool:
    """Whether a padded site's mask ``node`` masks the bucket's padded keys and nothing else
    (``_key_mask`` of no mask of the caller's): a site at the real length needs none."""
    return isinstance(node, fx.Node) and node.target is _key_mask and node.args[3] is None


def unpadded_rows(x: torch.Tensor, length, parts: int = 1, dim: int = 2) -> torch.Tensor:
    """The ``length`` real tokens of ``x`` (along ``dim``), padded as ``padded_rows`` pads."""
    i = torch.arange(length, device=x.device)
    if parts > 1:
        real = length // parts
        i = i // real * (x.shape[dim] // parts) + i % real
    return x.index_select(dim, i)


def _emit_structured_mask(graph, structure, q, size, length, parts, index, stack) -> fx.Node:
    """``_structured_mask`` as graph nodes of plain torch ops, with example values: the rewrite
    reads the mask back from them (``masks.mask_structure``)."""
    before = set(graph.nodes)
    with role("bucket"):
        build = functools.partial(_structured_mask, structure, size=size, parts=parts)
        mask = emit(RoleTracer(graph, index, stack), build, q, length, *structure.data)
    propagate_example_values([n for n in graph.nodes if n not in before])
    return mask


def _structured_mask(structure: MaskStructure, q: torch.Tensor, length, *data, size: int, parts: int = 1) -> torch.Tensor:
    """The dense mask ``structure`` describes, at ``size`` tokens, the padded keys (past
    ``length``, or past each of ``parts`` parts' tokens) masked: ``(B|1, H|1, size|1, size)``,
    boolean (additive in ``q``'s dtype with key biases), built as ``masks.mask_structure``
    reads it. ``data`` are the tensors ``structure.data`` names, at ``length`` tokens."""
    b, h = structure.shape[:2]
    structure = dataclasses.replace(structure, shape=(b, h, length, length))  # the graph's length
    i = torch.arange(size, device=q.device)
    p, t = i.view(1, 1, size, 1), i.view(1, 1, 1, size)
    # NOTE: a gather from the values followed by ``size`` fills, not a concatenation of
    # ``size - length`` fills: that is empty at ``length == size``, and the compilers would guard
    # on it (one graph more for the length of the bucket itself).
    source, real = _sources(size, length, parts, q.device)
    pick = torch.where(real, source, i + length)

    def keys(values: torch.Tensor, fill: torch.Tensor, lead: tuple[int, ...] = ()) -> torch.Tensor:
        """``values (*lead|1, length)`` over the keys, then ``fill (*lead|1, size)`` past them:
        ``(*lead, size)``, a tensor the mask reads as data."""
        both = torch.cat([values.expand(*lead, length), fill.expand(*lead, size)], -1)
        out = both.index_select(-1, pick)
        if isinstance(out, fx.Proxy):
            out.node.meta[KEYS] = True
        return out

    bias = key_mask(structure, q, *data)  # 0 / -inf and key biases
    bias = keys(bias, bias.new_full((1, 1, 1), float("-inf")), (b, h))
    allowed = torch.ones((), dtype=torch.bool, device=q.device)
    distance = t - p
    if structure.positions is not None:
        # The padding counts its own positions: a document of its own (below).
        positions = key_values(structure, structure.positions, *data, like=q)
        positions = keys(positions, i.view(1, size), (b,)).view(b, 1, 1, size)
        distance = positions - positions.transpose(-1, -2)
    if structure.lo is not None:
        allowed = allowed & (distance >= structure.lo)
    if structure.hi is not None:
        allowed = allowed & (distance <= structure.hi)
    if structure.documents is not None:
        docs = key_values(structure, structure.documents, *data, like=q)
        if structure.blocks:  # no block after the tokens: ids below 0
            docs = keys(docs, docs.new_full((1, 1), -1), (b,)).view(b, 1, 1, size)
            allowed = allowed & ((t <= p) | ((docs == docs.transpose(-1, -2)) & (docs.transpose(-1, -2) >= 0)))
        else:  # one more document after the tokens
            docs = keys(docs, (docs.max() + 1).view(1, 1), (b,)).view(b, 1, 1, size)
            allowed = allowed & (docs == docs.transpose(-1, -2))
    if not structure.biases:
        # Keys by conjuncts alone (0 or -inf): a boolean mask, so that the rewrite reads a
        # conjunct again, not an additive key bias to recentre in every block (Note [Recentred
        # key biases]).
        return allowed & (bias != float("-inf")).view(b, h, 1, size)
    return torch.where(allowed, 0.0, float("-inf")).to(q.dtype) + bias.view(b, h, 1, size)
