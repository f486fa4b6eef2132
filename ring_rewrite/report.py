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

__all__ = ["Report", "explain", "attention_flops", "attention_memory_bytes"]


def attention_flops(plan: SitePlan) -> int:
    """Useful forward FLOPs of the site (2 per multiply-add in QK^T and PV, causal halves)."""
    total = 0
    for branch in plan.branches:
        layout = branch.layout
        m = layout.m
        pairs = m * (m + 1) // 2 if plan.is_causal else m * m
        total += 2 * plan.batch * plan.hq * layout.nseg * pairs * (plan.d + plan.dv)
    return total


def dense_flops(plan: SitePlan) -> int:
    n = plan.n
    pairs = n * (n + 1) // 2 if plan.is_causal else n * n
    return 2 * plan.batch * plan.hq * pairs * (plan.d + plan.dv)


def attention_memory_bytes(plan: SitePlan) -> dict[str, int]:
    """Activation memory of the site per rank: saved for backward, and the largest branch workspace."""
    item = torch.empty((), dtype=plan.dtype).element_size()
    rows = plan.batch * plan.hq * plan.n
    saved = rows * plan.dv * item + rows * 4  # merged out + float32 lse (q, k, v are the inputs')
    workspace = 0
    for branch in plan.branches:
        layout = branch.layout
        q_rows = plan.batch * plan.hq * layout.padded // layout.r
        kv_rows = plan.batch * layout.kv_heads * layout.padded // layout.r
        branch = q_rows * (plan.d + plan.dv) * item + q_rows * 4 + kv_rows * (plan.d + plan.dv) * item
        workspace = max(workspace, branch)
    return {"saved": saved, "workspace": workspace}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _shape(s: Any) -> str:
    return "x".join(map(str, s)) if s else "-"


@dataclasses.dataclass
class Report:
    """One row per attention site the backend saw; ``str(report)`` is a ``tabulate`` table."""

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
                "q / k / v": " ".join(_shape(r.shapes.get(n)) for n in ("query", "key", "value")),
            }
            if r.plan is None:
                row.update({"branches (w, r)": "-", "status": f"left alone: {r.reason}"})
            else:
                plan = r.plan
                mem = attention_memory_bytes(plan)
                row.update(
                    {
                        "branches (w, r)": " ".join(f"({b.w},{b.r})" for b in plan.branches),
                        "causal": plan.is_causal,
                        "status": "rewritten",
                        "GFLOP fwd (dense)": f"{attention_flops(plan) / 1e9:.3g} "
                        f"({dense_flops(plan) / 1e9:.3g})",
                        "MiB saved / work": f"{_mib(mem['saved'])} / {_mib(mem['workspace'])}",
                    }
                )
            rows.append(row)
        return rows

    def __str__(self) -> str:
        if not self.records:
            return "ring_dilated: no attention site found"
        head = f"ring_dilated: {len(self.rewritten)} of {len(self.records)} attention sites rewritten"
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
