"""What the rewrite did, site by site: ``explain()`` and the table it prints, and what a site
costs per rank: FLOPs and bytes sent, counted over its programs, and memory (``memory.py``,
Note [Memory of a site]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from tabulate import tabulate

from . import cpu_choice, cpu_kernel
from .site_plan import SitePlan
from .backend import RingDilatedBackend
from .config import RingDilatedConfig
from .memory import copies_gradients, site_memory
from .program import build

__all__ = [
    "Report", "explain", "attention_flops", "attention_memory_bytes", "branch_bytes_sent", "branch_flops",
    "bytes_sent",
]  # fmt: skip


def _counted(plan: SitePlan, graph: str):
    """The plan's program folded for counting (``program.build``), so that ``plan()`` can count
    every rank's at any scale."""
    return build(plan, graph, folded=True)


def attention_flops(plan: SitePlan) -> int:
    """Useful forward FLOPs of the site on this rank (2 per multiply-add in QK^T and PV): the
    blocks of its forward program (a block that a band skips computes none)."""
    return _counted(plan, "forward").flops()


def branch_flops(plan: SitePlan, branch) -> int:
    """Useful forward FLOPs of one branch on this rank."""
    return _counted(plan, "forward").flops(plan.branches.index(branch))


def dense_flops(plan: SitePlan) -> int:
    """FLOPs of dense SDPA over the whole sequence, split evenly over the ranks."""
    n = plan.n
    pairs = n * (n + 1) // 2 if plan.is_causal else n * n
    return 2 * plan.batch * plan.hq * pairs * (plan.d + plan.dv) // plan.world


def bytes_sent(plan: SitePlan) -> dict[str, int]:
    """Bytes this rank sends per forward and per backward (what the P2P ops count): the
    programs' transfers and gathers."""
    return {graph: _counted(plan, graph).bytes_sent() for graph in ("forward", "backward")}


def branch_bytes_sent(plan: SitePlan, branch) -> dict[str, int]:
    """Bytes one branch's ring sends from this rank per forward and per backward, and its
    largest message (one head chunk's K/V, or dK/dV in ``stat_dtype``, with the keys' bias)."""
    i = plan.branches.index(branch)
    fwd, bwd = _counted(plan, "forward"), _counted(plan, "backward")
    message = max(fwd.largest_message(i), bwd.largest_message(i))
    return {"forward": fwd.bytes_sent(i), "backward": bwd.bytes_sent(i), "message": message}


def attention_memory_bytes(plan: SitePlan) -> dict[str, int]:
    """Estimated activation memory of the site on this rank, in bytes: ``saved`` for backward
    and the ``peak`` beyond its inputs (``memory.site_memory``, Note [Memory of a site])."""
    return site_memory(plan)


def _branch_summary(plan: SitePlan, branch) -> str:
    ranks = (plan.inner if plan.exchanged else plan).ranks  # a hybrid's ring: across the groups
    where = "local" if branch.is_local else f"ring {_ranks(ranks[r] for r in branch.ring)}"
    return f"({branch.w},{branch.r}) {where}"


def _exchange_summary(plan: SitePlan) -> str:
    if not plan.exchanged:
        return ""
    return ", all-to-all" if plan.a2a == plan.world else f", all-to-all of {plan.a2a} x ring of {plan.world // plan.a2a}"


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
    """What the ``ring_dilated`` rewrite did with each attention site it saw.

    One row per site record: the site id, where it is (module path and ``file:line``), its
    kind, the normalising passes that touched it, the q / k / v shapes, and whether it was
    rewritten or left alone and why. A rewritten site's row adds its branches (``local``, or
    ``ring`` and the ranks of its ring), ``P / mode / layout`` (and the padded length), this
    process's rank and its group's ranks (with more than one rank), ``is_causal`` and any band
    read from a mask, and its cost on this rank: useful forward GFLOP (dense in brackets), MiB
    sent forward / backward, MiB saved for backward / peak (estimates: Note [Memory of a site]).
    Ranks are global. ``str(report)`` is a ``tabulate`` table under a one-line summary
    (``ring_rewrite: no attention site found`` when there are no records) and, where a site runs
    on CPU, a line saying which block kernel runs its blocks and why (Note [Choosing the CPU block
    kernel]).

    Args:
        records (list[SiteRecord]): the site records, as a backend's ``.records`` or
            ``ring_rewrite.testing.Capture.records`` hold them.

    Attributes:
        rewritten (list[SiteRecord]): the records of sites rewritten (a plan, or a decode step).
        skipped (list[SiteRecord]): the records of sites left alone.
        rows() (list[dict[str, Any]]): the table's rows, column name to cell text.

    Example::

        be = ring_rewrite.backend(segment_lengths=[64, 256], dilation_rates=[1, 4])
        torch.compile(model, backend=be)(x)
        report = ring_rewrite.Report(be.records)
        assert not report.skipped, report
        print(report)
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
                        + _exchange_summary(plan)
                        + (f", K/V heads x{plan.kv_copies}" if plan.kv_copies > 1 else "")
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
            return "ring_rewrite: no attention site found"
        head = f"ring_rewrite: {len(self.rewritten)} of {len(self.records)} attention sites rewritten"
        head += " (per rank)" if any(r.plan is not None and r.plan.world > 1 for r in self.records) else ""
        kernel = _kernel_line([r.plan for r in self.rewritten if r.plan is not None])
        head += f"\n{kernel}" if kernel else ""
        others = [line for r in self.rewritten if r.plan is not None for line in _other_options(r.plan)]
        return "\n".join([head, tabulate(self.rows(), headers="keys", tablefmt="simple"), *others])


def _other_options(plan: SitePlan) -> list[str]:
    """What a site across ranks would send and hold on this rank under every other ``comm``
    (Note [Heads across ranks]), or why it cannot run so."""
    lines = []
    for name, other in plan.alternatives():
        if isinstance(other, str):
            lines.append(f"site {plan.site}, {name} instead: cannot run ({other})")
            continue
        sent, mem = bytes_sent(other), attention_memory_bytes(other)
        lines.append(
            f"site {plan.site}, {name} instead: MiB sent fwd / bwd {_mib(sent['forward'])} / "
            f"{_mib(sent['backward'])}, MiB saved / peak {_mib(mem['saved'])} / {_mib(mem['peak'])}"
            + (f", K/V heads x{other.kv_copies}" if other.kv_copies > 1 else "")
        )
    return lines


def _kernel_line(plans: list[SitePlan]) -> str | None:
    """Which kernel runs the CPU blocks of ``plans`` and why (Note [Choosing the CPU block kernel]);
    None without a CPU plan."""
    plans = [p for p in plans if p.device == "cpu"]
    if not plans:
        return None
    if all(copies_gradients(p, b) for p in plans for b in p.branches):  # no block that ours could run
        return "CPU block kernel: aten's flash kernel, the only candidate (float64, a bias, a band or dropout)"
    if not cpu_kernel.available():
        return "CPU block kernel: aten's flash kernel, the only candidate (csrc/flash_cpu.c is not built)"
    return f"CPU block kernel: {cpu_choice.describe()}"


def explain(model_or_fn: Callable[..., Any], *example_args: Any, dynamic: bool | None = None, **config: Any) -> Report:
    """Run ``model_or_fn(*example_args)`` once through the rewrite and report every site.

    Compiles ``model_or_fn`` with ``torch.compile`` and a new ``ring_dilated`` backend built
    from ``config``, calls it once on ``example_args`` (its output is dropped), and returns the
    report of every attention site of every graph compiled during that call. The rewritten
    graph runs eagerly (``compiler="eager"``) unless ``config`` names another compiler. The
    model itself is not modified. For keyword arguments of the model pass
    ``functools.partial(model, **kwargs)``. Under an initialised process group the call runs
    the ring, so every rank of the group must make it. With ``dynamic=True`` the sequence
    length is a symbol, as after a second length in training, so a site is padded to its
    length bucket and the report says what the bucket computes at the example's length.

    Args:
        model_or_fn (Callable): an ``nn.Module`` or a function.
        *example_args: its positional arguments.
        dynamic (bool, optional): ``torch.compile``'s ``dynamic``. Default: ``None``.
        **config: ``RingDilatedConfig`` fields; ``compiler`` defaults to ``"eager"``.

    Returns:
        Report: one row per attention site; ``print`` it for the table.

    Raises:
        TypeError, ValueError: a bad config field.
        torch._dynamo.exc.BackendCompilerFailed: the rewrite raised while compiling (with
            ``strict=True`` or in sharded mode, a site that cannot be rewritten).

    Example::

        print(ring_rewrite.explain(model, x, segment_lengths=[64, 256], dilation_rates=[1, 4]))
        # ring_rewrite: 2 of 2 attention sites rewritten
        #   site  where  ...  branches (w, r)  ...  status  ...
    """
    config.setdefault("compiler", "eager")
    be = RingDilatedBackend(RingDilatedConfig(**config))
    torch.compile(model_or_fn, backend=be, dynamic=dynamic)(*example_args)
    return Report(list(be.records))
