"""What a configuration needs per rank, without running it: ``plan()``.

The rewrite builds one ``SitePlan`` per site and rank from the site's shapes and the config
(``passes/rewrite_sdpa.py``); ``plan()`` builds the same plans from numbers alone, for every rank
of a group of any size, and sums what the report counts (``report.py``): useful FLOPs, bytes
each rank sends and its largest message, memory per rank. Nothing is allocated and no process
group is needed, so a run far beyond this machine can be asked about::

    >>> print(ring_rewrite.plan(seq_len=2**30, world_size=512, heads=32, kv_heads=8, head_dim=128,
    ...                         segment_lengths=[...], dilation_rates=[...]))

Numbers are per rank and per attention layer, the maximum over ranks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch
from tabulate import tabulate

from .site_plan import SitePlan
from .config import RingDilatedConfig
from .program import build
from .report import attention_memory_bytes, branch_bytes_sent, branch_flops, bytes_sent

__all__ = ["ScalePlan", "plan"]

BACKWARD_FLOPS = 2.5
"""Useful backward FLOPs per forward FLOP: five matmuls (scores again, dP, dV, dQ, dK) to two."""


@dataclasses.dataclass(frozen=True)
class ScalePlan:
    """What one attention layer, and ``layers`` of them, needs on each rank; made by ``plan()``.

    Holds the plans the rewrite would build for one site on every rank of the group and sums
    what the report counts, each the most of any rank: useful FLOPs, bytes sent forward and
    backward, the largest message, memory. ``str(scale_plan)`` is a summary line, a table of
    the branches and the per-layer totals (and, with ``layers > 1``, the model's attention
    peak).

    Args:
        plans (tuple[SitePlan, ...]): one site plan per rank of the group, rank 0 first.
        layers (int): attention layers of the model, for ``totals["model peak"]``. Default: 1.
        alternatives (tuple[tuple[str, ScalePlan | str], ...]): the same layer under every other
            way to share it (``comm`` and, for a hybrid, ``a2a_ranks``), each named, with its
            plans or why it cannot run so. Default: ``()``.

    Attributes:
        site (SitePlan): rank 0's plan (shapes, branches, world, sharding, layout).
        branch_rows (list[dict]): per branch: ``"branch (w, r)"``, ``"where"`` (local or the
            size of its ring), ``"head chunks"``, and the most of any rank of ``"flops"``
            (useful forward FLOPs), ``"sent fwd"`` / ``"sent bwd"`` and ``"message"`` (bytes).
        totals (dict[str, int]): the layer on its busiest rank: ``"forward flops"``,
            ``"backward flops"`` (2.5x forward), ``"sent forward"``, ``"sent backward"``,
            ``"largest message"``, ``"q, k, v"``, ``"saved"`` and ``"peak"`` (bytes; memory
            estimates as in Note [Memory of a site]) and ``"model peak"``: every layer's q, k,
            v and saved tensors plus one layer's peak (no weights, MLPs or optimizer).

    Example::

        sp = ring_rewrite.plan(2**20, 8, heads=8, head_dim=64,
                               segment_lengths=[4096, 2**20], dilation_rates=[1, 16])
        sp.totals["sent forward"]   # bytes the busiest rank sends per forward of one layer
        print(sp)
    """

    plans: tuple[SitePlan, ...]
    """One per rank of the group, as the rewrite would build them."""
    layers: int = 1
    alternatives: tuple[tuple[str, ScalePlan | str], ...] = ()
    """The same layer under every other ``comm`` (Note [Heads across ranks]), named as
    ``option`` names, with its plans or why it cannot run so; ``str`` compares them."""

    @property
    def option(self) -> str:
        """How the plans share the layer: ``comm='ring'``, ``comm='hybrid', a2a_ranks=2``, ..."""
        return self.site.option

    @property
    def least_sent(self) -> str:
        """The option (this one or an alternative) whose busiest rank sends the fewest bytes,
        forward and backward together; the first of equals."""
        ran = [self, *(a for _, a in self.alternatives if isinstance(a, ScalePlan))]
        return min(ran, key=lambda p: p.totals["sent forward"] + p.totals["sent backward"]).option

    @property
    def site(self) -> SitePlan:
        return self.plans[0]

    @functools.cached_property
    def branch_rows(self) -> list[dict]:
        """Per branch: FLOPs and bytes sent, the most of any rank."""
        rows = []
        for i, branch in enumerate(self.site.branches):
            per_rank = [(p, p.branches[i]) for p in self.plans]
            sent = [branch_bytes_sent(p, b) for p, b in per_rank]
            rows.append(
                {
                    "branch (w, r)": f"({branch.w}, {branch.r})",
                    "where": "local" if branch.is_local else f"ring of {len(branch.ring)}",
                    "head chunks": self.site.head_chunks(branch),
                    "flops": max(branch_flops(p, b) for p, b in per_rank),
                    "sent fwd": max(s["forward"] for s in sent),
                    "sent bwd": max(s["backward"] for s in sent),
                    "message": max(s["message"] for s in sent),
                }
            )
        return rows

    @functools.cached_property
    def totals(self) -> dict[str, int]:
        """The layer's totals on its busiest rank (each the most of any rank), in FLOPs and
        bytes; ``model peak`` adds the saved tensors of ``layers - 1`` more layers and every
        layer's q, k, v."""
        site = self.site
        rows = self.branch_rows
        flops = max(sum(branch_flops(p, b) for b in p.branches) for p in self.plans)
        memory = [attention_memory_bytes(p) for p in self.plans]
        saved, peak = max(m["saved"] for m in memory), max(m["peak"] for m in memory)
        sent = [bytes_sent(p) for p in self.plans]  # the ring's transfers, gathers, all-to-alls
        message = max(build(p, graph, folded=True).largest_message() for p in self.plans for graph in ("forward", "backward"))
        item = site.dtype.itemsize
        inputs = site.batch * site.n_local * (site.hq * site.d + site.hkv * (site.d + site.dv)) * item
        return {
            "forward flops": flops,
            "backward flops": round(BACKWARD_FLOPS * flops),
            "sent forward": max(s["forward"] for s in sent),
            "sent backward": max(s["backward"] for s in sent),
            "largest message": max([message, *(r["message"] for r in rows)]),
            "q, k, v": inputs,
            "saved": saved,
            "peak": peak,
            "model peak": self.layers * (inputs + saved) + peak - saved,
        }

    def __str__(self) -> str:
        site, totals = self.site, self.totals
        head = (
            f"ring_dilated plan: N = {site.n:,} tokens over {site.world} ranks ({site.n_local:,} per rank, "
            f"{site.sharding}, {site.layout}, {self.option}), batch {site.batch}, {site.hq} query / {site.hkv} kv heads "
            f"of {site.d}, {str(site.dtype).removeprefix('torch.')}, causal {site.is_causal}; per rank, "
            "the most of any rank" + _copies(site)
        )
        table = [
            {
                "branch (w, r)": r["branch (w, r)"],
                "where": r["where"],
                "head chunks": r["head chunks"],
                "TFLOP fwd": f"{r['flops'] / 1e12:.4g}",
                "GiB sent fwd / bwd": f"{_gib(r['sent fwd'])} / {_gib(r['sent bwd'])}",
                "largest message MiB": f"{r['message'] / 2**20:.4g}",
            }
            for r in self.branch_rows
        ]
        lines = [
            head,
            tabulate(table, headers="keys", tablefmt="simple"),
            f"per layer: {totals['forward flops'] / 1e12:.4g} TFLOP forward, "
            f"{totals['backward flops'] / 1e12:.4g} backward; sends {_gib(totals['sent forward'])} GiB "
            f"forward, {_gib(totals['sent backward'])} GiB backward; largest message "
            f"{totals['largest message'] / 2**20:.4g} MiB",
            f"memory per layer: q, k, v {_gib(totals['q, k, v'])} GiB; saved for backward "
            f"{_gib(totals['saved'])} GiB; attention peak {_gib(totals['peak'])} GiB (estimate "
            "as inductor schedules the site, Note [Memory of a site])",
        ]
        for name, other in self.alternatives:
            if isinstance(other, ScalePlan):
                lines.append(
                    f"{name} instead: sends {_gib(other.totals['sent forward'])} GiB forward, "
                    f"{_gib(other.totals['sent backward'])} GiB backward; attention peak {_gib(other.totals['peak'])} GiB"
                    + _copies(other.site)
                )
            else:
                lines.append(f"{name} instead: cannot run ({other})")
        if self.alternatives:
            lines.append(f"sends least: {self.least_sent}")
        if self.layers > 1:
            lines.append(
                f"{self.layers} layers: {_gib(totals['model peak'])} GiB (each layer's q, k, v and "
                "saved tensors, one layer's peak; no weights, MLPs or optimizer)"
            )
        return "\n".join(lines)


def _copies(site: SitePlan) -> str:
    """What an exchanging option does to kv heads its group cannot split (GQA)."""
    if site.kv_copies == 1:
        return ""
    return f"; kv heads sent in {site.kv_copies} copies ({site.hkv} do not split over {site.a2a} ranks)"


def _gib(n: int) -> str:
    return f"{n / 2**30:.4g}"


def plan(
    seq_len: int,
    world_size: int,
    *,
    heads: int,
    head_dim: int,
    kv_heads: int | None = None,
    batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    is_causal: bool = True,
    layers: int = 1,
    device: str = "cuda",
    segment_lengths: Sequence[int] | None = None,
    dilation_rates: Sequence[int] | None = None,
    sharding: str = "sharded",
    layout: str = "zigzag",
    comm: str = "ring",
    a2a_ranks: int | None = None,
) -> ScalePlan:
    """What one attention layer of ``seq_len`` tokens needs on each of ``world_size`` ranks.

    Builds the site plan the rewrite would build on every rank of a group of ``world_size``
    (the same ``SitePlan.build``, from numbers alone: no tensor is allocated and no process
    group is needed), for SDPA with ``heads`` query heads, ``kv_heads`` key/value heads of
    ``head_dim`` (``Dv = head_dim``), scale ``head_dim ** -0.5`` and no mask, and returns them
    with their totals. Numbers are per rank and per layer, the most of any rank. Raises where
    the rewrite would: a config the shards cannot carry.

    Args:
        seq_len (int): the global sequence length ``N``.
        world_size (int): the ranks of the ring's group ``P``.
        heads (int): query heads ``Hq``.
        head_dim (int): the head dim ``D`` (and ``Dv``).
        kv_heads (int, optional): key/value heads ``Hkv``. Default: ``None`` (``heads``).
        batch (int): the batch size ``B``. Default: 1.
        dtype (torch.dtype): the inputs' dtype. Default: ``torch.bfloat16``.
        is_causal (bool): causal attention. Default: ``True``.
        layers (int): attention layers of the model, for the model's peak. Default: 1.
        device (str): the device type whose block kernel is counted (its compute dtype and
            memory); nothing runs there. Default: ``"cuda"``.
        segment_lengths (Sequence[int], optional): as ``RingDilatedConfig``. Default: ``None``
            (exact attention).
        dilation_rates (Sequence[int], optional): as ``RingDilatedConfig``. Default: ``None``.
        sharding (str): ``"sharded"`` or ``"replicated"``, as ``RingDilatedConfig``.
            Default: ``"sharded"``.
        layout (str): ``"zigzag"`` or ``"contiguous"``, as ``RingDilatedConfig``.
            Default: ``"zigzag"``.
        comm (str): ``"ring"``, ``"all_to_all"`` or ``"hybrid"``, as ``RingDilatedConfig``; the
            plan also says what every other option would send and hold (the ring, the
            all-to-all, the hybrid in groups of each divisor of ``P``), or why it cannot run,
            and which sends least. Default: ``"ring"``.
        a2a_ranks (int, optional): ranks in each all-to-all group of ``comm="hybrid"``.
            Default: ``None``.

    Returns:
        ScalePlan: the plans of every rank; ``print`` it for the table.

    Raises:
        ValueError: a bad config (as ``RingDilatedConfig``), ``seq_len`` that does not cut into
            ``P`` equal shards (``2P`` chunks for zigzag) with ``P > 1``, or a branch the shards
            cannot carry (a segment that neither divides nor is a multiple of a rank's part, a
            part that is not a multiple of the rate).

    Example::

        segs = [2048 * 4**i for i in range(10)] + [2**30]
        rates = [4**i for i in range(10)] + [2**19]
        print(ring_rewrite.plan(2**30, 512, heads=16, kv_heads=4, head_dim=128,
                                segment_lengths=segs, dilation_rates=rates, layers=24))

    .. warning::
        Memory is an estimate of how inductor schedules a site, compared with measured peaks
        on CPU only; on CUDA the kernel's own workspace is not counted, and a CUDA run of the
        ring across GPUs (NCCL) has never been measured.
    """
    config = RingDilatedConfig(
        segment_lengths=segment_lengths, dilation_rates=dilation_rates, sharding=sharding, layout=layout, comm=comm,
        a2a_ranks=a2a_ranks,
    )  # fmt: skip
    kv_heads = heads if kv_heads is None else kv_heads

    mine = ScalePlan(
        tuple(
            SitePlan.build(
                batch=batch, hq=heads, hkv=kv_heads, n=seq_len, d=head_dim, dv=head_dim, dtype=dtype, device=device,
                scale=head_dim**-0.5, is_causal=is_causal, has_mask=False, branches=config.branches(seq_len),
                world=world_size, rank=rank, sharding=sharding, layout=layout, comm=comm, a2a=a2a_ranks,
            )  # fmt: skip
            for rank in range(world_size)
        ),
        layers,
    )
    alternatives = [
        (name, other if isinstance(other, str) else ScalePlan(tuple(p.with_comm(other.comm, other.a2a) for p in mine.plans), layers))
        for name, other in mine.site.alternatives()
    ]  # fmt: skip
    return dataclasses.replace(mine, alternatives=tuple(alternatives))
