"""Bytes each rank sends per forward and per backward, exact and dilated, against the plan.

Only ranks whose segments overlap exchange data, and only the dilated rows (1/r of them) travel
(docs/semantics.md, Memory and communication). One function calling
``F.scaled_dot_product_attention`` on ``q, k, v`` of shape ``(1, 8, N/P, 64)`` float32 is compiled
with the ``ring_dilated`` backend (sharded mode, contiguous layout, ``compiler="aot_eager"``) under
each config below, on P gloo ranks spawned on this machine, and run forward + backward once to
compile, then once measured.

The first step is also a check: every rank holds its shard of one global ``q, k, v, grad_out``
built from a fixed seed, and the output and q/k/v gradients of all ranks together are compared
with float64 ``ring_rewrite.reference.reference_attention`` over the whole sequence (each config's
computed once, in the parent): max-abs error over max-abs value, above 1e-5 every rank raises.

Sent: ``torch._dynamo.utils.counters["ring_rewrite"]["bytes_sent"]``, which the P2P op bumps by
the bytes it hands to ``batch_isend_irecv``, read and reset around the forward and around the
backward. Plan: ``ring_rewrite.report.bytes_sent(site.plan)`` of the site the backend recorded,
the report's own prediction for this rank.

Configs, causal and not (``--quick``: causal only):

* ``exact``: the default config, one branch ``(N, 1)``: a ring over all P ranks.
* ``(N,1)``: that branch given explicitly, the undilated ring the ratios are taken against.
* ``(N/8,1)+(N,r)`` for r = 2, 4, 8: one dilated branch over the whole sequence, a full ring.
  A branch of rate r > 1 alone is refused by the config (docs/semantics.md, Configs: some
  (head, position) would lie on no lattice and attend to nothing), so each comes with the
  nearest allowed companion: a rate-1 branch of segment N/8, local to every rank's shard for
  P <= 8, which sends nothing. Its ring should send exactly 1/r of the undilated ring's bytes,
  forward and backward.
* ``longnet``: segments [N/8, N/4, N/2, N], rates [1, 2, 4, 8].

Bytes do not depend on speed, so N can be small. Writes ``results/ring_comm.json`` and
``results/ring_comm.png`` (bytes against r, with the 1/r line).

    python benchmarks/ring_comm.py                  # N = 4096, P = 2, 4
    python benchmarks/ring_comm.py --quick          # N = 1024, causal only
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, for _common
from _common import (  # noqa: E402
    ring_sent,
    MIB,
    RESULTS,
    TENSORS,
    TOLERANCE,
    local,
    machine,
    pyplot,
    reference,
    require,
    ring_errors,
    run_ranks,
    save_plot,
    sequence_inputs,
    verdict,
    write_json,
)

BATCH, HEADS, HEAD_DIM = 1, 8, 64
SEED = 0
LAYOUT = "contiguous"
RATES = (2, 4, 8)
BASE = "(N,1)"
TARGETS = {
    "plan": "bytes sent equal the plan on every rank",
    "dilation": "single branch of rate r sends 1/r of the undilated ring",
}


# ---- configs ---------------------------------------------------------------------------------


def _configs(n: int, world: int) -> list[dict]:
    """``{"name", "r", "segment_lengths", "dilation_rates"}`` per config; r only for one ring."""
    local = n // max(8, world)  # the companion rate-1 branch: inside every rank's shard
    configs = [
        {"name": "exact", "r": None, "segment_lengths": None, "dilation_rates": None},
        {"name": BASE, "r": 1, "segment_lengths": [n], "dilation_rates": [1]},
    ]
    configs += [
        {"name": f"(N/8,1)+(N,{r})", "r": r, "segment_lengths": [local, n], "dilation_rates": [1, r]}
        for r in RATES
    ]
    configs.append({
        "name": "longnet", "r": None,
        "segment_lengths": [n // 8, n // 4, n // 2, n], "dilation_rates": [1, 2, 4, 8],
    })  # fmt: skip
    return configs


def _branches(config: dict, n: int) -> tuple[tuple[int, int], ...]:
    """The config's ``(w, r)`` branches: "exact" and "(N,1)" are one function."""
    if config["segment_lengths"] is None:
        return ((n, 1),)
    return tuple(zip(config["segment_lengths"], config["dilation_rates"]))


def _references(n: int, worlds: list[int], causal_values: list[bool]) -> dict[tuple, dict]:
    """float64 out, dq, dk, dv over the whole sequence of every config's function at every P, by
    its ``(branches, causal)``."""
    whole = sequence_inputs((BATCH, HEADS, n, HEAD_DIM), SEED)
    refs = {}
    for world, causal in itertools.product(worlds, causal_values):
        for config in _configs(n, world):
            key = _branches(config, n), causal
            if key not in refs:
                segments, rates = zip(*key[0])
                refs[key] = reference(*whole, segment_lengths=segments, dilation_rates=rates, is_causal=causal)
    return refs


def _single_branch_refusal(n: int) -> str | None:
    """The config's error for one branch ``(N, 2)`` alone, or None if it is accepted."""
    from ring_rewrite import RingDilatedConfig

    try:
        RingDilatedConfig(segment_lengths=[n], dilation_rates=[2])
    except ValueError as e:
        return str(e)
    return None


# ---- measuring, inside one rank --------------------------------------------------------------


def _step(compiled, q, k, v, grad_out) -> tuple[tuple[int, int], dict[str, torch.Tensor]]:
    """One forward + backward: ``(bytes sent by the forward, by the backward)`` and ``out, dq,
    dk, dv``."""
    dist.barrier()  # NOTE: outside the ring: every rank starts the step together
    ring_sent()
    out = compiled(q, k, v)
    sent_fwd = ring_sent()
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return (sent_fwd, ring_sent()), dict(zip(TENSORS, (out.detach(), *grads)))


def _case(config: dict, causal: bool, args: dict, world: int, rank: int) -> dict:
    import ring_rewrite
    from ring_rewrite.report import bytes_sent

    torch._dynamo.reset()  # one backend per config: compile afresh
    n = args["seq"]
    whole = sequence_inputs((BATCH, HEADS, n, HEAD_DIM), SEED)
    q, k, v, grad_out = (local(x, LAYOUT) for x in whole)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    options = {"sharding": "sharded", "layout": LAYOUT, "compiler": "aot_eager"}
    if config["segment_lengths"] is not None:
        options.update(segment_lengths=config["segment_lengths"], dilation_rates=config["dilation_rates"])
    backend = ring_rewrite.backend(**options)
    compiled = torch.compile(attend, backend=backend, fullgraph=True)
    first, got = _step(compiled, q, k, v, grad_out)  # compiles forward and backward
    errors = ring_errors(got, args["reference"][_branches(config, n), causal], LAYOUT)
    require(errors, f"{config['name']}, causal={causal}, P = {world}, rank {rank}")
    (sent_fwd, sent_bwd), _ = _step(compiled, q, k, v, grad_out)
    (site,) = backend.records
    plan = bytes_sent(site.plan)
    return {
        "config": config["name"], "causal": causal, "rank": rank,
        "sent_fwd_bytes": sent_fwd, "sent_bwd_bytes": sent_bwd,
        "first_step_sent_bytes": list(first), "rel_err": errors,
        "plan_fwd_bytes": plan["forward"], "plan_bwd_bytes": plan["backward"],
        "branches": [
            {"w": b.w, "r": b.r, "ring": list(b.ring), "rows_per_head": b.layout.m,
             "kv_heads": b.layout.kv_heads}
            for b in site.plan.branches
        ],
    }  # fmt: skip


def _rank(rank: int, world: int, args: dict) -> dict:
    """Every config on this rank (``run_ranks`` has joined the gloo group)."""
    torch.set_num_threads(1)
    cases = [
        _case(config, causal, args, world, rank)
        for causal in args["causal"]
        for config in _configs(args["seq"], world)
    ]
    return {"rank": rank, "cases": cases}


# ---- driving, in the parent ------------------------------------------------------------------


def _span(values: list[int]) -> float | str:
    """MiB, max over ranks, with the min where the ranks differ."""
    hi, lo = max(values) / MIB, min(values) / MIB
    return hi if hi == lo else f"{hi:.4g} (min {lo:.4g})"


def _rows(runs: dict[int, list[dict]], n: int, causal_values: list[bool]) -> tuple[list[dict], dict]:
    rows, checks = [], {"plan": True, "dilation": None}
    for world, ranks in runs.items():
        for causal in causal_values:
            # cases[config] = the per-rank results of that config, in rank order.
            cases: dict[str, list[dict]] = {}
            for r in ranks:
                for c in r["cases"]:
                    if c["causal"] == causal:
                        cases.setdefault(c["config"], []).append(c)
            base = cases[BASE]
            for config in _configs(n, world):
                name, rate = config["name"], config["r"]
                got = cases[name]
                equal = all(
                    c["sent_fwd_bytes"] == c["plan_fwd_bytes"] and c["sent_bwd_bytes"] == c["plan_bwd_bytes"]
                    for c in got
                )  # fmt: skip
                checks["plan"] &= equal
                ratios = [
                    max(c[key] for c in got) / max(b[key] for b in base) if max(b[key] for b in base) else None
                    for key in ("sent_fwd_bytes", "sent_bwd_bytes")
                ]  # fmt: skip
                exact_ratio = None
                if rate is not None and world > 1:
                    # Every rank, forward and backward, exactly: sent * r == undilated ring's sent.
                    exact_ratio = all(
                        c[key] * rate == b[key]
                        for c, b in zip(got, base) for key in ("sent_fwd_bytes", "sent_bwd_bytes")
                    )  # fmt: skip
                    if rate > 1:
                        checks["dilation"] = exact_ratio and checks["dilation"] is not False
                rows.append({
                    "P": world,
                    "causal": causal,
                    "config": name,
                    "ring": " ".join(
                        f"({b['w']},{b['r']}):{'local' if len(b['ring']) == 1 else len(b['ring'])}"
                        for b in got[0]["branches"]
                    ),
                    "sent fwd MiB": _span([c["sent_fwd_bytes"] for c in got]),
                    "sent bwd MiB": _span([c["sent_bwd_bytes"] for c in got]),
                    "plan fwd MiB": _span([c["plan_fwd_bytes"] for c in got]),
                    "plan bwd MiB": _span([c["plan_bwd_bytes"] for c in got]),
                    "= plan": "yes" if equal else "NO",
                    f"fwd / {BASE}": ratios[0],
                    f"bwd / {BASE}": ratios[1],
                    "expected": None if rate is None else 1 / rate,
                    "= 1/r": None if exact_ratio is None else ("yes" if exact_ratio else "NO"),
                    "max rel err": max(got[0]["rel_err"].values()),
                })  # fmt: skip
    return rows, checks


def _plot(rows: list[dict], path: Path, n: int) -> None:
    """Bytes sent (max over ranks) against r for each P, causal rows, with the 1/r line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    causal = any(r["causal"] for r in rows)
    rates = (1, *RATES)
    names = [BASE] + [f"(N/8,1)+(N,{r})" for r in RATES]
    for world in sorted({r["P"] for r in rows if r["P"] > 1}):
        by_name = {r["config"]: r for r in rows if r["P"] == world and r["causal"] == causal}
        for column, marker in (("sent fwd MiB", "o"), ("sent bwd MiB", "s")):
            ys = [_top(by_name[name][column]) for name in names]
            ax.plot(rates, ys, marker + "-", label=f"P={world} {column.split()[1]}")
            ax.plot(rates, [ys[0] / r for r in rates], ":", color="gray")
    ax.plot([], [], ":", color="gray", label="1/r of the undilated ring")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(rates, [str(r) for r in rates])
    ax.yaxis.set_major_formatter(lambda y, _: f"{y:g}")
    ax.set_xlabel("dilation rate r of the full-sequence branch")
    ax.set_ylabel("MiB sent per rank (max over ranks)")
    ax.set_title(f"ring_dilated bytes sent per step, N = {n}, {'causal' if causal else 'non-causal'}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_plot(fig, path)
    plt.close(fig)


def _top(value: float | str) -> float:
    return value if isinstance(value, float) else float(value.split()[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, help="global sequence length N (default 4096; 1024 with --quick)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="values of P")
    parser.add_argument("--quick", action="store_true", help="N = 1024, causal only")
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "ring_comm.json", help="JSON path; the PNG goes beside it"
    )
    opts = parser.parse_args(argv)
    n = opts.seq or (1024 if opts.quick else 4096)
    causal_values = [True] if opts.quick else [True, False]
    for world in opts.ranks:
        if world < 1 or n % (8 * max(8, world)):
            parser.error(
                f"N = {n} must be a multiple of 8 max(8, P) = {8 * max(8, world)} (segments N/8, "
                "rate 8 on each rank's N/P tokens)"
            )

    refusal = _single_branch_refusal(n)
    print(
        f"ring_dilated, one SDPA site, q/k/v ({BATCH}, {HEADS}, N/P, {HEAD_DIM}) float32, N = {n}, "
        f"sharded/contiguous, compiler aot_eager, P = {opts.ranks}; gloo on loopback, "
        f"{os.cpu_count()} cores shared, 1 thread per rank\n"
        "a single branch (N, r > 1) alone is "
        + (f"refused by the config:\n  {refusal}\nso each rate r > 1 runs as (N/8,1)+(N,r): the "
           "rate-1 companion is local and sends nothing\n" if refusal else "accepted\n"),
        flush=True,
    )  # fmt: skip
    record_machine = machine(threads=1)  # before the run: the commit measured
    t0 = time.perf_counter()
    args = {"seq": n, "causal": causal_values, "reference": _references(n, opts.ranks, causal_values)}
    print(f"  float64 references: {time.perf_counter() - t0:.1f} s", flush=True)
    runs = {}
    for world in opts.ranks:
        t0 = time.perf_counter()
        runs[world] = run_ranks(_rank, world, args)
        print(f"  P={world}: done in {time.perf_counter() - t0:.1f} s", flush=True)

    rows, checks = _rows(runs, n, causal_values)
    print()
    print(tabulate(rows, headers="keys", floatfmt=".4g", missingval="-"))
    print(
        "\nsent = bytes this rank handed to the P2P ops (counter), plan = ring_rewrite.report."
        "bytes_sent(site.plan); MiB, max over ranks (min shown where ranks differ);\n"
        f"= plan: every rank, forward and backward; fwd / {BASE}, bwd / {BASE}: sent over the "
        f"undilated ring's at the same P and causality; = 1/r: sent * r == the undilated ring's, "
        "every rank, fwd and bwd\nring: (w,r):local, or the size of the (sub-)ring the branch "
        "runs on; max rel err: out, dq, dk, dv of all ranks against float64 reference_attention over "
        f"the whole sequence (bound {TOLERANCE:g})"
    )
    print()
    for key, line in TARGETS.items():
        print(f"target: {line}: {verdict(checks[key])}")

    record = {
        "benchmark": "ring_comm",
        "machine": record_machine,
        "setup": {
            "seq": n, "ranks": opts.ranks, "batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM,
            "dtype": "float32", "causal": causal_values, "sharding": "sharded",
            "layout": LAYOUT, "compiler": "aot_eager", "quick": opts.quick, "seed": SEED,
            "configs": _configs(n, max(opts.ranks)),
            "single_branch_refused": refusal,
            "sent": 'counters["ring_rewrite"]["bytes_sent"] around the measured forward and backward',
            "plan": "ring_rewrite.report.bytes_sent(site.plan)",
            "check": "the first step's out, dq, dk, dv of all ranks against float64 reference_attention "
                     "over the whole sequence",
            "tolerance": TOLERANCE,
        },  # fmt: skip
        "targets": [{"line": line, "met": checks[key]} for key, line in TARGETS.items()],
        "rows": rows,
        "ranks": {str(world): ranks for world, ranks in runs.items()},
    }
    print()
    write_json(opts.out, record)
    _plot(rows, opts.out.with_suffix(".png"), n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
