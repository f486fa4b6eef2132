"""What the rewrite did, site by site: ``explain()`` and the table it prints."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from tabulate import tabulate

from .attention import SitePlan
from .backend import RingDilatedBackend
from .config import RingDilatedConfig

__all__ = [
    "Report", "explain", "attention_flops", "attention_memory_bytes", "branch_bytes_sent", "branch_flops",
    "bytes_sent",
]  # fmt: skip


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _block_pairs(layout, blk) -> int:
    """Query-key pairs a block computes (rows x rows, the causal diagonal halves)."""
    q_rows, k_rows = (blk.q1 - blk.q0) * layout.m, (blk.k1 - blk.k0) * layout.m
    return q_rows * (q_rows + 1) // 2 if blk.causal else q_rows * k_rows


def attention_flops(plan: SitePlan) -> int:
    """Useful forward FLOPs of the site on this rank (2 per multiply-add in QK^T and PV)."""
    return sum(branch_flops(plan, branch) for branch in plan.branches)


def branch_flops(plan: SitePlan, branch) -> int:
    """Useful forward FLOPs of one branch on this rank."""
    layout = branch.layout
    if branch.is_local:
        m = layout.m
        pairs = layout.nseg * (m * (m + 1) // 2 if plan.is_causal else m * m)
    else:
        pairs = sum(_block_pairs(layout, blk) for step in branch.steps for blk in step)
    return 2 * plan.batch * plan.hq * pairs * (plan.d + plan.dv)


def dense_flops(plan: SitePlan) -> int:
    """FLOPs of dense SDPA over the whole sequence, split evenly over the ranks."""
    n = plan.n
    pairs = n * (n + 1) // 2 if plan.is_causal else n * n
    return 2 * plan.batch * plan.hq * pairs * (plan.d + plan.dv) // plan.world


def bytes_sent(plan: SitePlan) -> dict[str, int]:
    """Bytes this rank sends per forward and per backward (what the P2P ops count)."""
    item = _itemsize(plan.dtype)
    fwd = bwd = 0
    for branch in plan.branches:
        sent = branch_bytes_sent(plan, branch)
        fwd, bwd = fwd + sent["forward"], bwd + sent["backward"]
    if plan.gathers:
        local = plan.batch * plan.n_local
        tag = 8
        probe = plan.hq * len(range(0, plan.n, max(1, plan.n // 16))) * item if plan.batch else 0
        fwd += (plan.world - 1) * (local * plan.hq * plan.dv * item + tag + probe)
        grads = local * (plan.hq * plan.d + plan.hkv * (plan.d + plan.dv)) * item + 3 * tag
        bwd += (plan.world - 1) * grads
    return {"forward": fwd, "backward": bwd}


def branch_bytes_sent(plan: SitePlan, branch) -> dict[str, int]:
    """Bytes one branch's ring sends from this rank per forward and per backward, and its
    largest message (one head chunk's K/V, or dK/dV in ``stat_dtype``, with the keys' bias)."""
    if branch.is_local:
        return {"forward": 0, "backward": 0, "message": 0}
    item, stat = _itemsize(plan.dtype), _itemsize(plan.stat_dtype)
    layout = branch.layout
    rows = layout.batch * layout.nseg * layout.kv_heads * layout.m * (plan.d + plan.dv)
    hops = len(branch.ring) - 1
    fwd = hops * rows * item
    bwd = hops * rows * item + hops * rows * stat  # K/V again, then dK/dV (stat_dtype)
    bias = 0
    if plan.needs_bias(branch):  # the keys' bias travels with them, both ways
        bias = layout.batch * layout.nseg * plan.hq * layout.m * _itemsize(plan.compute_dtype)
        fwd, bwd = fwd + hops * bias, bwd + hops * bias
    message = max(rows * item + bias, rows * stat) // plan.head_chunks(branch)
    return {"forward": fwd, "backward": bwd, "message": message}


def attention_memory_bytes(plan: SitePlan) -> dict[str, int]:
    """Estimated activation memory of the site on this rank, in bytes.

    ``saved``: what forward keeps for backward (merged out and lse, float32 or float64; q, k, v are the
    inputs'). ``peak``: ``saved`` plus the gradients handed back, plus the largest branch's
    dilated copies (rate > 1) and ring buffers (K/V arriving; dK/dV in float32 or float64: the owner's step-0
    share, an accumulator sent, one arriving).
    Kernel scratch is left out: measured peaks run up to a third higher (benchmarks/README.md).
    """
    item, compute = _itemsize(plan.dtype), _itemsize(plan.compute_dtype)
    stat = _itemsize(plan.stat_dtype)
    rows = plan.batch * plan.hq * plan.n_local
    saved = rows * plan.dv * item + rows * stat
    grads = (rows * plan.d + plan.batch * plan.hkv * plan.n_local * (plan.d + plan.dv)) * item
    branch_peak = 0
    for branch in plan.branches:
        layout = branch.layout
        q_rows = plan.batch * plan.hq * layout.padded // layout.r
        kv = plan.batch * layout.kv_heads * layout.padded // layout.r * (plan.d + plan.dv)
        copies = q_rows * (2 * plan.d + plan.dv) * compute + kv * item if layout.r > 1 else 0
        # One head chunk's ring buffers at a time (Note [Head chunks]).
        in_flight = 0 if branch.is_local else (kv * item + 3 * kv * stat) // plan.head_chunks(branch)
        branch_peak = max(branch_peak, copies + in_flight)
    return {"saved": saved, "peak": saved + grads + branch_peak}


def _branch_summary(plan: SitePlan, branch) -> str:
    where = "local" if branch.is_local else f"ring {_ranks(plan.ranks[r] for r in branch.ring)}"
    return f"({branch.w},{branch.r}) {where}"


def _ranks(ranks) -> str:
    """Global ranks, runs of consecutive ranks shortened: ``0-3``, ``1,3``, ``0-1,4-5``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)


def _causal(plan: SitePlan) -> str:
    """``is_causal`` and the band a mask read from the graph adds (Note [Bands])."""
    if plan.band is None:
        return str(plan.is_causal)
    lo, hi = plan.band
    if plan.is_causal and hi is None:
        return f"True, window {1 - lo}"
    return f"{plan.is_causal}, {'-inf' if lo is None else lo} <= t - p <= {'inf' if hi is None else hi}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _shape(s: Any) -> str:
    return "x".join(map(str, s)) if s else "-"


@dataclasses.dataclass
class Report:
    """One row per attention site the backend saw; ``str(report)`` is a ``tabulate`` table.

    Ranks are global: ``rank (group)`` (with more than one rank) is this process and the ranks of
    its ring's group, and a ring branch names the ranks of its (sub-)ring.
    """

    records: list[Any]

    @property
    def rewritten(self) -> list[Any]:
        return [r for r in self.records if r.rewritten]

    @property
    def skipped(self) -> list[Any]:
        return [r for r in self.records if not r.rewritten]

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for r in self.records:
            row = {
                "site": r.site,
                "where": r.location,
                "kind": r.kind,
                "passes": ", ".join(r.passes) or "-",
                "q / k / v": " ".join(_shape(r.shapes.get(n)) for n in ("query", "key", "value")),
            }
            if r.decode:
                row.update({"branches (w, r)": "-", "status": f"rewritten, {r.reason}"})
            elif r.plan is None:
                row.update({"branches (w, r)": "-", "status": f"left alone: {r.reason}"})
            else:
                plan = r.plan
                mem, sent = attention_memory_bytes(plan), bytes_sent(plan)
                row.update(
                    {
                        "branches (w, r)": " ".join(_branch_summary(plan, b) for b in plan.branches),
                        "P / mode / layout": f"{plan.world} / {plan.sharding} / {plan.layout}"
                        + (f" (N padded to {plan.n})" if plan.pad else "")
                        if plan.world > 1
                        else "1",
                        **({"rank (group)": f"{plan.ranks[plan.rank]} ({_ranks(plan.ranks)})"}
                           if plan.world > 1 else {}),
                        "causal": _causal(plan),
                        "status": "rewritten" if r.reason is None else f"rewritten, {r.reason}",
                        "GFLOP fwd (dense)": f"{attention_flops(plan) / 1e9:.3g} "
                        f"({dense_flops(plan) / 1e9:.3g})",
                        "MiB sent fwd / bwd": f"{_mib(sent['forward'])} / {_mib(sent['backward'])}",
                        "MiB saved / peak": f"{_mib(mem['saved'])} / {_mib(mem['peak'])}",
                    }
                )
            rows.append(row)
        return rows

    def __str__(self) -> str:
        if not self.records:
            return "ring_dilated: no attention site found"
        head = f"ring_dilated: {len(self.rewritten)} of {len(self.records)} attention sites rewritten"
        head += " (per rank)" if any(r.plan is not None and r.plan.world > 1 for r in self.records) else ""
        return head + "\n" + tabulate(self.rows(), headers="keys", tablefmt="simple")


def explain(model_or_fn: Callable[..., Any], *example_args: Any, **config: Any) -> Report:
    """Run ``model_or_fn(*example_args)`` once through the rewrite and report every site.

    ``config`` holds ``RingDilatedConfig`` fields; the graph runs eagerly after the rewrite
    (``compiler="eager"``) unless another compiler is named.
    """
    config.setdefault("compiler", "eager")
    be = RingDilatedBackend(RingDilatedConfig(**config))
    torch.compile(model_or_fn, backend=be)(*example_args)
    return Report(list(be.records))
