"""Ring, all-to-all and hybrid: the same site on 4 gloo ranks with ``comm="ring"``,
``comm="all_to_all"`` and ``comm="hybrid", a2a_ranks=2`` (2 x 2) side by side (Note [Heads across
ranks]), and ``plan()``'s figures of every option for 8 to 512 ranks.

    python benchmarks/comm_options.py            # N = 16384 and 32768, exact and LongNet configs
    python benchmarks/comm_options.py --seq 4096 16384 32768 65536 131072 262144 --exact-max 131072 --check-max 4096
                                                 # the run in benchmarks/README.md
    python benchmarks/comm_options.py --quick    # N = 4096: a smoke run

One causal ``F.scaled_dot_product_attention`` on ``q, k, v`` of ``(1, 16, N/P, 64)`` float32 per
rank, compiled with inductor in sharded mode (contiguous layout), forward and backward. For each
config and N, the options run in the same spawn of 4 ranks, one after the other: a warm-up step
(compiles), a step checked against float64 over the whole sequence (every rank raises above
1e-5; up to ``--check-max``), then a timed step whose bytes sent (``counters["ring_rewrite"]["bytes_sent"]``) must equal
the plan's (``report.bytes_sent``), and one more under ``torch.profiler`` for the allocator's
peak, beside the report's estimate. LongNet: segments 1024, 4096, 16384 with rates 1, 4, 16 (as in
``lengths.py``): a cost linear in N, so it runs to 256k here; the exact config is quadratic and stops
at ``--exact-max``.

The plan table: ``ring_rewrite.plan`` for 1M and 16M tokens over 8 to 512 ranks, 64 heads of
128, bfloat16, exact attention: bytes per rank per step of the ring, the all-to-all (or why it
cannot run) and the hybrid whose groups send least, and which option sends least. No target on
gloo's timings (a GPU feature); the bytes must equal the plan's.

Writes ``results/comm_options.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, for _common
from _common import (  # noqa: E402
    ring_sent,
    MIB,
    RESULTS,
    allocated_peak,
    forward_backward,
    local,
    machine,
    reference,
    require,
    ring_errors,
    run_ranks,
    sequence_inputs,
    verdict,
    write_json,
)

WORLD, BATCH, HEADS, HEAD_DIM = 4, 1, 16, 64
LONGNET = ([1024, 4096, 16384], [1, 4, 16])  # segment_lengths, dilation_rates
SEED = 0
OPTIONS = {"ring": dict(comm="ring"), "all_to_all": dict(comm="all_to_all"), "hybrid 2x2": dict(comm="hybrid", a2a_ranks=2)}


def _rank(rank: int, world: int, args: dict) -> dict:
    """Every option on this rank (``run_ranks`` has joined the gloo group)."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    import ring_rewrite
    from ring_rewrite.report import attention_memory_bytes, bytes_sent

    if args["reference"] is None:  # unchecked: this rank's shard alone (the whole may not fit 4 times)
        q, k, v, grad_out = sequence_inputs((BATCH, HEADS, args["seq"] // world, HEAD_DIM), SEED + 1 + rank)
    else:
        whole = sequence_inputs((BATCH, HEADS, args["seq"], HEAD_DIM), SEED)
        q, k, v, grad_out = (local(x, "contiguous") for x in whole)
        del whole
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    results = {}
    for comm, option in OPTIONS.items():
        options = dict(sharding="sharded", compiler="inductor", timeout=600, **option)
        if args["segment_lengths"] is not None:
            options.update(segment_lengths=args["segment_lengths"], dilation_rates=args["dilation_rates"])
        backend = ring_rewrite.backend(**options)
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), backend=backend
        )
        step = lambda: forward_backward(compiled, q, k, v, grad_out)  # noqa: E731
        step()  # compiles
        if args["reference"] is not None:
            require(ring_errors(step(), args["reference"], "contiguous"), f"{comm}, rank {rank}")
        dist.barrier()  # NOTE: outside the rings: the options' timed steps start together
        ring_sent()
        t0 = time.perf_counter()
        step()
        seconds = time.perf_counter() - t0
        sent = ring_sent()
        allocated = allocated_peak(step)
        (site,) = backend.records
        planned = bytes_sent(site.plan)
        results[comm] = {
            "seconds": seconds, "sent_bytes": sent, "plan_bytes": planned["forward"] + planned["backward"],
            "allocated_bytes": allocated, "estimate_bytes": attention_memory_bytes(site.plan)["peak"],
        }  # fmt: skip
    return results


def _plan_rows() -> list[dict]:
    """``plan()``'s bytes per rank and step for every option, exact attention."""
    import ring_rewrite

    rows = []
    for n in (2**20, 2**24):
        for world in (8, 32, 128, 512):
            p = ring_rewrite.plan(n, world, heads=64, kv_heads=64, head_dim=128)
            sent = {name: _sent(other) for name, other in p.alternatives if isinstance(other, ring_rewrite.ScalePlan)}
            hybrids = {name: b for name, b in sent.items() if "hybrid" in name}
            best = min(hybrids, key=hybrids.get)
            rows.append({
                "N": n, "P": world, "ring GiB": _sent(p), "all-to-all GiB": sent.get("comm='all_to_all'"),
                "best hybrid": best.split(", ")[1], "hybrid GiB": hybrids[best], "sends least": p.least_sent,
            })  # fmt: skip
    return rows


def _sent(p) -> float:
    """GiB the busiest rank sends in a step, forward and backward."""
    return (p.totals["sent forward"] + p.totals["sent backward"]) / 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[16384, 32768], help="global sequence lengths N")
    parser.add_argument("--quick", action="store_true", help="N = 4096: a smoke run")
    parser.add_argument(
        "--exact-max", type=int, default=32768,
        help="the exact config runs up to this N (its float64 reference is quadratic); LongNet at every N",
    )  # fmt: skip
    parser.add_argument(
        "--check-max", type=int, default=32768,
        help="steps are checked against float64 up to this N (beyond: time, bytes and memory only)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "comm_options.json")
    opts = parser.parse_args(argv)
    lengths = [4096] if opts.quick else opts.seq
    record = machine(threads=1)
    rows, equal = [], True
    for config in ("exact", "longnet"):
        for n in [n for n in lengths if config == "longnet" or n <= opts.exact_max]:
            segments, rates = (None, None) if config == "exact" else LONGNET
            expected = None
            if n <= opts.check_max:
                whole = sequence_inputs((BATCH, HEADS, n, HEAD_DIM), SEED)
                expected = reference(*whole, is_causal=True, segment_lengths=segments, dilation_rates=rates)
                del whole
            args = {"seq": n, "segment_lengths": segments, "dilation_rates": rates, "reference": expected}
            t0 = time.perf_counter()
            ranks = run_ranks(_rank, WORLD, args)
            print(f"  {config} N={n}: done in {time.perf_counter() - t0:.1f} s", flush=True)
            for comm in OPTIONS:
                got = [r[comm] for r in ranks]
                equal &= all(g["sent_bytes"] == g["plan_bytes"] for g in got)
                rows.append({
                    "config": config, "N": n, "comm": comm, "checked": expected is not None,
                    "step s": max(g["seconds"] for g in got),
                    "sent MiB": max(g["sent_bytes"] for g in got) / MIB,
                    "plan MiB": max(g["plan_bytes"] for g in got) / MIB,
                    "allocated MiB": max(g["allocated_bytes"] for g in got) / MIB,
                    "estimate MiB": max(g["estimate_bytes"] for g in got) / MIB,
                })  # fmt: skip
                print("   ", {key: round(x, 4) if isinstance(x, float) else x for key, x in rows[-1].items()}, flush=True)
    print()
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    print(
        f"\nP = {WORLD} gloo ranks on {record['cpu_count']} cores ({record['cpu']}), 1 thread each; times of "
        "one step on oversubscribed cores, not speeds; max over ranks"
    )
    print(f"target: bytes sent equal the plan's on every rank, every option: {verdict(equal)}")
    plan_rows = _plan_rows()
    print("\nplan(): bytes per rank per step (forward + backward), exact attention, 64 heads of 128, bfloat16")
    print(tabulate(plan_rows, headers="keys", floatfmt=".4g"))
    write_json(
        opts.out,
        {
            "benchmark": "comm_options", "machine": record, "world": WORLD,
            "shape": {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32", "is_causal": True},
            "runs": rows, "plan": plan_rows,
            "targets": [{"line": "bytes sent equal the plan's on every rank, every option", "met": equal}],
        },
    )  # fmt: skip
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
