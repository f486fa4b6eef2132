"""The pass: every supported SDPA site becomes dilated attention (docs/semantics.md, The
rewritten graph).

Before::

    out = torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c)

After::

    bias = <mask to additive key bias (B|1, Hq|1, N)>                  # role "mask", if m
    real = aten.scalar_tensor(s0 // parts, dtype=torch.int64)          # role "bucket", if padded to a bucket
    token = torch.ops.ring_rewrite.site_token(0, group, variant, timeout[, real])  # role "p2p", if P > 1
    seed = torch.randint(2**62, (), dtype=torch.int64)                      # role "dropout", if p > 0
    out = autograd_function_apply(ring_rewrite_fwd_0, ring_rewrite_bwd_0, q, k, v[, bias][, token][, seed][, real])

``ring_rewrite_fwd_0`` calls ``invoke_subgraph`` on the site's forward body: per branch the
``dilate`` gathers, the ring's transfers and ``block_attention`` nodes (``(out, lse)``), the
``undilate`` scatters, then the ``merge``; ``ring_rewrite_bwd_0`` likewise on the explicit backward
of ``ring_rewrite.attention``. Every inserted node carries ``meta["ring_rewrite"] = {"site": i,
"role": ..., "branch": ...}`` and the SDPA node's ``stack_trace``.

Note [Whole on every rank]
~~~~~~~~~~~~~~~~~~~~~~~~~~
What a site computes must not depend on P (docs/semantics.md, Sites left alone). The ring
needs every branch to fit the ranks' shards: a rate that divides each rank's part, a segment
that divides a part or is a multiple of it. In sharded mode the shards are given, so a branch
that does not fit is an error. In replicated mode the site first pads the sequence (up to
``_MAX_PADDING`` times its length, Note [Padding the sequence]);
where no padding helps (segments of 100 with a rate of 1024, say), every rank holds the whole
sequence anyway, so each computes the whole site as one rank would: the same function, with a
warning at every compile and a note in the report, at P times the compute and O(N) memory per
rank. No transfer, no gather: the ranks' results agree because their inputs do (with dropout,
each rank draws its own mask).

Note [Padding the sequence]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
In replicated mode the site chooses how to cut the sequence, so a length the ranks cannot
share (``N`` not a multiple of ``P``, shards that are no multiple of a rate, segments that
neither divide a shard nor are a multiple of it) is padded to the shortest ``N' > N`` that
they can (``_plan``). Padding goes after the sequence, so
every real position, and with it every segment and lattice, stays where it was;
padded keys get a ``-inf`` bias (none is needed with ``is_causal``: they come after every real
query), padded queries' rows are dropped from the output, and the gradients of the padding
are dropped in the backward. The backward's blocks take the padded rows as dead (their lse
``+inf``, ``attention._dead_padding``): their ``dout`` is 0, so they add nothing, but a padded
query of zeros meeting an infinite key scores ``0 * inf = NaN``, which as a live row's it would
add to every key it reaches. The same function, exactly, at the cost of ``N' - N`` more tokens.

Note [One body per plan]
~~~~~~~~~~~~~~~~~~~~~~~~
A transformer's layers have sites with the same plan (and input strides). Their forward and
backward bodies are traced once, by the first of them (whose index their nodes carry), and every
such site calls the same bodies through ``invoke_subgraph`` under the same identifier: AOT
autograd traces and inductor lowers each body once, not once per layer: inlined per layer, each
layer's LongNet site would compile on its own, seconds each at P = 4 (benchmarks/README.md,
compile cost, measures the model with and without the rewrite). The only per-site value a body
needs, the site index in the transfer tags, comes in as the token's value (Note [Ordering the
ring's messages]).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._dynamo.utils import counters
from torch._functorch.autograd_function import autograd_function_apply

from ring_rewrite.attention import site_backward, site_forward
from ring_rewrite.comm.calls import check_agreement, name_sites, variant_hash
from ring_rewrite.comm.groups import resolve_group, ring_group
from ring_rewrite.comm.ring import Rotater
from ring_rewrite.comm.transfers import checking_transfers
from ring_rewrite.site_plan import ExchangeRefused, SitePlan
from ring_rewrite.config import RingDilatedConfig
from ring_rewrite.layout import assemble, layout_of
from ring_rewrite.numerics import masked_fills
from ring_rewrite.ops import kernel_pairs
from ring_rewrite.layout import positions as shard_positions
from ring_rewrite.roles import role

from ._fx import RoleTracer, emit, erase_unused, location, stamp, trace_subgraph
from .bucket_lengths import KEYS, REAL, padded_rows, real_keys_only, unpadded_rows
from .find_sdpa import (
    SdpaSite, bind_sdpa, dense_mask, display_shapes, find_sdpa_sites, is_caller_input, is_decode_step,
    local_positions, sdpa_unsupported_reason, sharded_cache_keys, static_strides,
)  # fmt: skip
from .masks import MaskStructure, key_mask, key_values, runs, sharded_documents_reason, sharded_keys_reason
from .records import TOUCHED, SiteRecord, leave_alone, records
from .rewrite_decode import rewrite_decode_step

__all__ = ["NAME", "rewrite_sdpa"]

NAME = "rewrite_sdpa"
"""The pass's name in the pipeline and in the site records."""

log = logging.getLogger(__name__)

_SITE_TOKEN = torch.ops.ring_rewrite.site_token.default
_SEEDS = 1 << 62  # a call's dropout seed is drawn from [0, _SEEDS)


def rewrite_sdpa(
    gm: fx.GraphModule, example_inputs: Any = None, *, config: RingDilatedConfig
) -> fx.GraphModule:
    """Rewrite every supported SDPA site of ``gm`` in place; records land in ``gm.meta``."""
    sites = records(gm)
    group, world, rank = resolve_group(config.group)
    if world > 1:
        code = graph_identity(gm.graph)  # before the rewrite: the user's graph
        group = ring_group(group)  # the ring's traffic keeps off the user's group
    rewritten = 0
    bodies: dict = {}  # traced site bodies by plan (Note [One body per plan])
    for node in [site.node for site in find_sdpa_sites(gm)]:
        site = bind_sdpa(node)  # its inputs may be sites rewritten a moment ago
        index = len(sites)
        cached = sharded_cache_keys(site)
        if cached is not None or is_decode_step(site):
            shapes, passes = display_shapes(site), (*node.meta.get(TOUCHED, ()), NAME)
            note = rewrite_decode_step(gm, site, cached, index, config, group, world)
            if note is not None:
                counters["ring_rewrite"]["rewritten"] += 1
                sites.append(SiteRecord(index, site.location, "sdpa", shapes, note, passes=passes, decode=True))
                rewritten += 1
            continue
        reason = sdpa_unsupported_reason(site)
        plan = note = structure = None
        if reason is None:
            structure = dense_mask(site)  # a mask read from the graph, or None
            try:
                plan, note = _plan(site, structure, config, index, group, world, rank)
            except ValueError as error:
                reason = str(error)
        if plan is None:
            leave_alone(
                gm, config, what="SDPA", fate="be rewritten", location=site.location,
                kind="sdpa", shapes=site.shapes, reason=reason,
            )  # fmt: skip
            continue
        passes = (*node.meta.get(TOUCHED, ()), NAME)
        bucket = _rewrite_site(gm, site, structure, plan, index, bodies, config)
        note = "; ".join(x for x in (note, bucket) if x) or None
        counters["ring_rewrite"]["rewritten"] += 1
        sites.append(
            SiteRecord(index, site.location, "sdpa", site.shapes, reason=note, plan=plan, passes=passes)
        )
        rewritten += 1
    if world > 1 and sites:
        keys = [_agreement_key(r) for r in sites]
        check_agreement(group, keys, config.timeout)
        # Headers name the compiled graph (Note [Calls, deadlines and recovery], comm/calls.py).
        variant = variant_hash([code, [r.location for r in sites]], keys)
        name_sites(variant, {r.site: r.location for r in sites})
        for token in gm.graph.find_nodes(op="call_function", target=_SITE_TOKEN):
            token.update_arg(2, variant)
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return gm


def graph_identity(graph: fx.Graph) -> list[str]:
    """What the graph computes, as every rank traced it: its ops in order. Not its code, whose
    placeholders (the symbols of dynamic sizes and strides) differ between ranks' shards, nor
    ``str`` of a target, which may hold an address."""
    return [
        n.target if isinstance(n.target, str) else _qualified_name(n.target)
        for n in graph.nodes if n.op not in ("placeholder", "output")
    ]  # fmt: skip


def _qualified_name(target) -> str:
    try:
        return fx.node._get_qualified_name(target)
    except Exception:  # noqa: BLE001  (a callable without a module path: its name will do)
        return getattr(target, "__qualname__", type(target).__qualname__)


def _agreement_key(record: SiteRecord) -> dict:
    """What every rank must agree on about a site (its plan minus the rank's own part)."""
    plan = record.plan
    if plan is None:
        return {"site": record.site, "reason": record.reason}
    key = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "rank"}
    key["branches"] = [(b.w, b.r, len(b.ring)) for b in plan.branches]
    key["dtype"] = str(plan.dtype)
    # Fingerprints travel as extra messages: every rank must send them, or none.
    key["RING_REWRITE_CHECK_TRANSFERS"] = checking_transfers()
    return key


def _plan(site, structure, config, index, group, world, rank) -> tuple[SitePlan, str | None]:
    """The site's plan, and a note where it is not the ring over every rank: in replicated
    mode, on a padded sequence where the ranks cannot share the length as it is (Note [Padding
    the sequence] in ring_rewrite/attention.py), else whole on every rank (Note [Whole on every
    rank])."""
    n = site.shapes["query"][2]
    counted = local_positions(site, n) if config.sharding == "sharded" and world > 1 else None
    if counted is not None:
        node, how = counted
        raise ValueError(
            f"its query or key derives from positions counted over this rank's {n} tokens alone "
            f"({how} at {location(node)}), but in sharded mode positions are global: pass "
            "the global position_ids, as ring_rewrite.shard_batch(batch, group=..., layout=...) adds them, or "
            "position_ids=ring_rewrite.positions(N, world=P, rank=r, layout=...)"
        )
    if structure is not None and structure.documents is not None and config.sharding == "sharded" and world > 1:
        reason = sharded_documents_reason(structure, is_caller_input)
        if reason is not None:
            raise ValueError(f"its mask keeps documents apart (doc[p] == doc[t]), but {reason}")
    if structure is not None and structure.has_keys and config.sharding == "sharded" and world > 1:
        reason = sharded_keys_reason(structure, lambda node: is_caller_input(node) or node.meta.get(KEYS, False))
        if reason is not None:
            raise ValueError(f"{reason} ({structure.describe()})")
    build = functools.partial(_build, site, structure, config, index)
    try:
        return build(group, world, rank, pad=0), None
    except ValueError as error:
        if config.sharding == "sharded" or world == 1 or isinstance(error, ExchangeRefused):
            raise
        step = world * layout_of(config.layout).parts
        for padded in range(n + step - n % step, _MAX_PADDING * n + step, step):
            try:
                return build(group, world, rank, pad=padded - n), None
            except ValueError:
                continue
        note = (
            f"whole on every rank, not across them: {error}, and no padding up to "
            f"{_MAX_PADDING}x the length helps"
        )
        log.warning(
            "ring_rewrite: SDPA at %s runs %s (the same function; %d times the compute and O(N) "
            "memory per rank)", site.location, note, world,
        )  # fmt: skip
        return build(None, 1, 0, pad=0), note


_MAX_PADDING = 4  # a padded length is at most this multiple of the site's


def _build(site, structure, config, index, group, world, rank, *, pad) -> SitePlan:
    shapes = site.shapes
    b, hq, n, d = shapes["query"]
    hkv, dv = shapes["key"][1], shapes["value"][3]
    sharded = config.sharding == "sharded" and world > 1
    n_global = n * world if sharded else n + pad
    plan = SitePlan.build(
        site=index,
        batch=b,
        hq=hq,
        hkv=hkv,
        n=n_global,
        d=d,
        dv=dv,
        dtype=site.meta(site.query).dtype,
        device=site.meta(site.query).device.type,
        scale=d**-0.5 if site.scale is None else float(site.scale),
        is_causal=bool(site.is_causal) or (structure is not None and structure.hi == 0),
        has_mask=site.attn_mask is not None if structure is None else structure.has_keys,
        recentred=_biased(site, structure),
        band=_band(structure),
        documents=None if structure is None or structure.documents is None else structure.relation,
        branches=config.branches(n_global),
        world=world,
        rank=rank,
        group_name=group.group_name if group is not None else "",
        sharding=config.sharding,
        layout=config.layout,
        pad=pad,
        dropout=float(site.dropout_p),
        comm=config.comm,
        a2a=config.a2a_ranks,
        bucketed=sharded and site.node.meta.get(REAL) is not None,
    )
    if not _at_real_length(plan, site):
        return plan
    # At the real length there are no padded keys to mask (but a replicated bucket's own).
    has_mask = plan.has_mask and (plan.replicated or not real_keys_only(site.attn_mask))
    return dataclasses.replace(plan, bucketed=True, has_mask=has_mask)


def _at_real_length(plan: SitePlan, site: SdpaSite) -> bool:
    """Whether a site padded to its length bucket (at the sequence's end) can run at its real
    length (``SitePlan.bucketed``, as a sharded bucket's does): no documents (ids of the
    bucket's rows); in one process not read in place (which takes the real rows its own way,
    Note [Padding to a bucket]), a band or not (a segment's positions, the bucket's too); in
    replicated mode exact attention on the ring without a band (its blocks' positions are the
    bucket's parts'), whose shards it cuts from the real positions (Note [Padding shards to a
    bucket])."""
    if site.node.meta.get(REAL) is None or plan.documents or plan.pad:
        return False
    if plan.world == 1:
        return not plan.local_in_place
    (branch, *more) = plan.branches
    exact = not more and branch.r == 1 and branch.w >= plan.n and len(branch.ring) == plan.world
    return plan.replicated and not plan.exchanged and exact and plan.band is None


def _biased(site: SdpaSite, structure: MaskStructure | None) -> bool:
    """Whether the site's key bias may hold more than a mask (``SitePlan.recentred``): a float
    key mask given as it is, or a dense mask with an additive key bias (ALiBi's ``slope_h * t``)."""
    if structure is not None:
        return bool(structure.biases)
    return site.attn_mask is not None and site.meta(site.attn_mask).dtype.is_floating_point


def _band(structure: MaskStructure | None) -> tuple[int | None, int | None] | None:
    """The plan's band (Note [Bands] in ring_rewrite/program.py): what the mask allows of
    ``t - p`` beyond causal attention, None for nothing."""
    if structure is None:
        return None
    lo, hi = structure.lo, structure.hi
    if hi == 0:
        hi = None  # is_causal
    return None if lo is None and hi is None else (lo, hi)


def _documents(structure: MaskStructure, q: torch.Tensor, *data: torch.Tensor, where: str) -> torch.Tensor:
    """Each position's document id ``(B|1, 1, N, 1)``, checked against the positions the mask's
    band compares, if it compares tensor values (``ops.documents``)."""
    docs = key_values(structure, structure.documents, *data, like=q)
    positions = None
    if structure.positions is not None:
        positions = key_values(structure, structure.positions, *data, like=q)
    return _checked_documents(structure, docs, positions, where)


_DOCUMENTS_GATHER = 4  # a site call's gather index for documents (its body's: 0 out, 1 to 3 dq, dk, dv)


def _sharded_documents(
    structure: MaskStructure, plan: SitePlan, token: torch.Tensor, *data: torch.Tensor, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sharded mode: every position's document id over the whole sequence ``(B|1, 1, N, 1)`` and
    the site's next token. Each rank evaluates the documents' expression (or the one whose runs
    they are) and the compared positions over its own keys, the ranks gather them (O(N) integers
    per rank, as a varlen ring's global sequence lengths), and the ids follow from the whole."""
    exprs = [structure.documents if structure.runs is None else structure.runs, structure.positions]
    b, _, _, n = structure.shape
    values = [key_values(structure, e, *data).long().expand(b, n) for e in exprs if e is not None]
    local = torch.stack(values)  # (documents[, positions], B, n)
    rotater = Rotater(plan.group_name, token)
    gathered = rotater.all_gather(local, plan.world, _DOCUMENTS_GATHER)
    whole = assemble(gathered, 2, n, world=plan.world, layout=plan.layout)
    docs = whole[0] if structure.runs is None else runs(whole[0])
    positions = None if structure.positions is None else whole[1]
    return _checked_documents(structure, docs, positions, where), rotater.token


def _checked_documents(structure: MaskStructure, docs, positions, where: str) -> torch.Tensor:
    if structure.blocks:
        docs = torch.ops.ring_rewrite.block_ends(docs, where)
    shift = None
    if positions is not None:
        shift = positions - torch.arange(docs.shape[-1], device=docs.device)
    return torch.ops.ring_rewrite.documents(docs, shift, where).unsqueeze(1).unsqueeze(-1)


def _key_mask(structure: MaskStructure, plan: SitePlan, q: torch.Tensor, *data: torch.Tensor) -> torch.Tensor:
    """``masks.key_mask`` over this rank's keys; in sharded mode at their global positions, where
    a bias reads them (``slope_h * t``). A bias at ``finfo.min`` masks (``numerics.masked_fills``)."""
    keys = None
    if plan.sharding == "sharded" and plan.world > 1 and structure.reads_key_positions:
        keys = shard_positions(plan.n, world=plan.world, rank=plan.rank, layout=plan.layout, device=q.device)
    return masked_fills(key_mask(structure, q, *data, keys=keys), plan.dtype)


def _key_bias(
    mask: torch.Tensor, plan: SitePlan, mask_shape: tuple[int, ...], is_bool: bool
) -> torch.Tensor:
    """A key-padding mask (bool keep-mask or additive) as an additive bias ``(B|1, Hq|1, N)``
    (``N`` the keys this rank sees: the local shard's in sharded mode); a fill at ``finfo.min``
    as ``-inf`` (``numerics.masked_fills``)."""
    lead = (1,) * (4 - len(mask_shape)) + tuple(mask_shape[:-2])
    mask = mask.reshape(*lead, mask_shape[-1])
    if is_bool:
        return torch.where(mask, 0.0, float("-inf")).to(plan.dtype)
    return masked_fills(mask.to(plan.dtype), plan.dtype)


def _unpadded_inputs(plan: SitePlan, site: SdpaSite) -> list[fx.Node] | None:
    """The unpadded q, k, v of a site the ``length_buckets`` pass padded, where the site can
    take them: a bucket's shard in sharded mode, whose ring runs at the real rows (Note [Padding
    shards to a bucket]); in one process, every branch local and read in place, so that the
    kernels read and write only the real rows where they lie (Note [Padding to a bucket]);
    None elsewhere."""
    nodes = (site.query, site.key, site.value)
    padded = all(isinstance(x, fx.Node) and x.target is padded_rows for x in nodes)
    (out,) = site.node.users if len(site.node.users) == 1 else (None,)
    padded = padded and out is not None and out.target is unpadded_rows
    if plan.bucketed:
        # NOTE: the length_buckets pass made these nodes; a bucketed plan runs on nothing else.
        assert padded, f"site {plan.site}: a bucketed shard's padding is not length_buckets'"
        return [x.args[0] for x in nodes]
    if plan.world != 1 or not plan.local_in_place or not all(b.is_local for b in plan.branches):
        return None
    if not padded or not all(len(x.users) == 1 for x in nodes):
        return None
    originals = [x.args[0] for x in nodes]
    if not all(site.meta(x).stride(-1) == 1 for x in originals):
        return None
    return originals


def _real_keys(graph: fx.Graph, plan: SitePlan, bias: fx.Node, real: fx.Node | None, index: int, stack) -> fx.Node:
    """A bucketed shard's key bias at its real keys, those of each part (the site takes the
    shard's real rows: ``_unpadded_inputs``); the bias as it is elsewhere."""
    if not plan.bucketed:
        return bias
    parts = 1 if plan.world == 1 or plan.replicated else layout_of(plan.layout).parts
    keys = graph.call_function(unpadded_rows, (bias, real, parts), {"dim": -1})
    stamp(keys, index, stack, role="mask")
    return keys


def _rewrite_site(
    gm: fx.GraphModule, site: SdpaSite, structure: MaskStructure | None, plan: SitePlan,
    index: int, bodies: dict, config: RingDilatedConfig,
) -> str | None:  # fmt: skip
    """Replace ``site`` by its call; returns a note for the report where the site is a bucket's
    that computes only its real rows (Note [Padding to a bucket])."""
    graph, node = gm.graph, site.node
    stack = node.meta.get("stack_trace")
    args = [site.query, site.key, site.value]
    names = ["q", "k", "v"]
    with graph.inserting_before(node):
        real, count, unpadded = node.meta.get(REAL), None, None
        if real is not None and _skips_padding(plan):
            # A sequence padded to its length bucket (in sharded mode each shard's parts): the
            # blocks skip the padding, and where they read every row in place, the site takes
            # the unpadded tensors.
            per_part = real
            if plan.sharding == "sharded" and plan.world > 1:
                per_part = graph.call_function(operator.floordiv, (real, layout_of(plan.layout).parts))
                stamp(per_part, index, stack, role="bucket")
            count = graph.call_function(torch.ops.aten.scalar_tensor.default, (per_part,), {"dtype": torch.int64})
            stamp(count, index, stack, role="bucket")
        if structure is not None and structure.has_keys:
            # The dense mask's key conjuncts, computed from the tensors it was built from.
            tracer = RoleTracer(graph, index, stack)
            with role("mask"):
                bias = emit(tracer, functools.partial(_key_mask, structure, plan), site.query, *structure.data)
            args.append(_real_keys(graph, plan, bias, real, index, stack))
            names.append("mask")
        token = None
        if plan.world > 1:
            timeout_ms = round(config.timeout * 1000)
            token = graph.call_function(
                _SITE_TOKEN, (index, plan.group_name, 0, timeout_ms, count)  # the variant comes last
            )
            stamp(token, index, stack, role="p2p")
        if structure is not None and structure.documents is not None:
            tracer = RoleTracer(graph, index, stack)
            with role("mask"):
                if plan.world > 1 and plan.sharding == "sharded":
                    docs, token = emit(
                        tracer, functools.partial(_sharded_documents, structure, plan, where=site.location),
                        token, *structure.data,
                    )  # fmt: skip
                else:
                    docs = emit(
                        tracer, functools.partial(_documents, structure, where=site.location), site.query,
                        *structure.data,
                    )  # fmt: skip
        if structure is None and plan.has_mask:
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
            args.append(_real_keys(graph, plan, bias, real, index, stack))
            names.append("mask")
        if plan.documents:
            args.append(docs)
            names.append("docs")
        if token is not None:
            args.append(token)
            names.append("token")
        if plan.dropout:
            # Each call draws its own dropout; the backward gets the same seed (saved).
            seed = graph.call_function(torch.randint, (_SEEDS, ()), {"dtype": torch.int64})
            stamp(seed, index, stack, role="dropout")
            args.append(seed)
            names.append("seed")
        if plan.bucketed:  # the real rows (Note [Padding to a bucket], [Padding shards to a bucket])
            unpadded = _unpadded_inputs(plan, site)
            args[:3] = unpadded
            if plan.world == 1:  # the blocks cut segments at the real rows
                args.append(count)
                names.append("real")
        elif count is not None:
            args.append(count)
            names.append("real")
            unpadded = _unpadded_inputs(plan, site)
            if unpadded is not None:
                args[:3] = unpadded
        saved = ["q", "k", "v", "out", "lse", *names[3:]]
        inputs = [site.query, site.key, site.value, site.attn_mask if structure is None else None]
        strides = tuple(static_strides(site.meta(x)) for x in inputs)
        fwd, bwd = _bodies(bodies, plan, names, saved, strides, index, stack)
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
    if unpadded is not None:  # the site's output is the unpadded one
        (cut,) = call.users
        call.meta["example_value"] = cut.meta.get("example_value")
        cut.replace_all_uses_with(call)
        graph.erase_node(cut)
        for padded in (site.query, site.key, site.value):
            erase_unused(graph, padded)
    if isinstance(site.attn_mask, fx.Node) and (structure is not None or not plan.has_mask):
        erase_unused(graph, site.attn_mask)  # the dense construction, where nothing else reads it
    if real is None or not _skips_padding(plan):
        return None
    rows = "its blocks compute the real rows only"
    if unpadded is not None:
        sends = plan.bucketed and plan.world > 1
        rows = "reads, sends and computes the real rows only" if sends else "reads and writes the real rows only"
    return f"a bucket of {plan.n}: {rows}{_computed(plan, real)}"


def _skips_padding(plan: SitePlan) -> bool:
    """Whether the site learns the real length of its bucket: in one process (its blocks skip
    the padding, or it runs at the real length), or across ranks where it runs at each shard's
    real length and the call's header carries it (Note [Padding shards to a bucket])."""
    return plan.world == 1 or plan.sharding == "sharded" or plan.bucketed


def _computed(plan: SitePlan, real: fx.Node) -> str:
    """What a bucketed site's local branches compute at the length it was compiled for (the
    hint of its symbolic length), as a share of the bucket's query-key pairs."""
    n = real.meta.get("example_value")
    n = n.node.hint if isinstance(n, torch.SymInt) else n
    local = [b.layout for b in plan.branches if b.is_local]
    if isinstance(n, int) and plan.world > 1:  # a ring's blocks: each part's real rows and keys
        share = (n / (plan.n if plan.replicated else plan.n_local)) ** 2
        shard = "" if plan.replicated else " a shard"
        return f"; compiled at {n} positions{shard}: {share:.0%} of the bucket's query-key pairs"
    if not isinstance(n, int) or not local:
        return ""
    count = functools.partial(kernel_pairs, is_causal=plan.is_causal, in_place=plan.local_in_place)
    pairs = [(count(lay, n), count(lay, None)) for lay in local]
    share = sum(p for p, _ in pairs) / sum(whole for _, whole in pairs)
    return f"; compiled at {n} positions: {share:.0%} of the bucket's query-key pairs"


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a value of a site's traced result comes from: the ``index``-th output of its body
    (``"body"``) or the ``index``-th input of the call (``"input"``)."""

    source: str
    index: int


@dataclasses.dataclass(frozen=True)
class _Body:
    """A site's forward or backward, traced once per plan.

    An ``invoke_subgraph`` body must return a flat tuple of distinct tensors that alias none of
    its inputs; the traced functions return nested lists, inputs (the saved ``q, k, v``, a token
    no transfer used) and one tensor twice (``out``, returned and saved). So the body returns
    each tensor it computes once, and ``result`` is the traced output with a ``_Slot`` in place
    of every tensor.
    """

    module: fx.GraphModule
    identifier: str
    names: tuple[str, ...]
    result: Any
    outputs: int


def _trace_body(fn, plan: SitePlan, names: list[str], index: int, stack: str | None) -> _Body:
    # The names are the parameters of site_forward / site_backward.
    module = trace_subgraph(lambda *xs: fn(plan, **dict(zip(names, xs))), names, index, stack)
    (output,) = module.graph.find_nodes(op="output")
    inputs = {node: j for j, node in enumerate(module.graph.find_nodes(op="placeholder"))}
    computed: dict[fx.Node, int] = {}

    def slot(x):
        if not isinstance(x, fx.Node):
            return x
        if x in inputs:
            return _Slot("input", inputs[x])
        return _Slot("body", computed.setdefault(x, len(computed)))

    result = pytree.tree_map(slot, output.args[0])
    output.args = (tuple(computed),)
    module.recompile()
    return _Body(module, f"ring_rewrite_{fn.__name__}_{index}", tuple(names), result, len(computed))


def _bodies(shared, plan, names, saved, strides, index, stack) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The site's forward and backward graphs: calls of the bodies in ``shared`` (traced here
    if new), shared by every site with the same plan and input strides (Note [One body per plan])."""
    # NOTE: AOT traces a body, and inductor compiles it, for the strides of its first call.
    key = (dataclasses.replace(plan, site=0), tuple(names), strides)
    if key not in shared:
        shared[key] = (
            _trace_body(site_forward, plan, names, index, stack),
            _trace_body(site_backward, plan, ["dout", *saved], index, stack),
        )
    return tuple(_invoke(body, index, stack) for body in shared[key])


def _invoke(body: _Body, index: int, stack: str | None) -> fx.GraphModule:
    graph = fx.Graph()
    inputs = [graph.placeholder(name) for name in body.names]
    root = torch.nn.Module()
    root.body = body.module
    call = graph.call_function(
        torch.ops.higher_order.invoke_subgraph, (graph.get_attr("body"), body.identifier, *inputs)
    )
    values = {
        "input": inputs,
        "body": [graph.call_function(operator.getitem, (call, i)) for i in range(body.outputs)],
    }
    graph.output(
        pytree.tree_map(lambda x: values[x.source][x.index] if isinstance(x, _Slot) else x, body.result)
    )
    for node in graph.nodes:
        if node.op not in ("placeholder", "output"):
            stamp(node, index, stack, role="site")
    return fx.GraphModule(root, graph)
