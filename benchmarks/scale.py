"""Scale: one LongNet attention layer, forward + backward, on P gloo ranks, N doubling until the
machine says no.

The layer is ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` with
4 query and 2 KV heads of 32 channels, float32, compiled with the ``ring_dilated`` backend:
segments [2048, 8192, 32768, 131072], rates [1, 4, 16, 64], ``sharding="sharded"``,
``layout="zigzag"``, inductor. Each rank builds only its own shard: the value of every position
comes from a generator seeded by the position's block of 4096 (``_rows``), so any process can
rebuild any position without the whole sequence, and nothing O(N) is held anywhere.

For each N (one fresh set of P processes, one thread each): the first forward + backward
(compiles, then runs), then one measured step: seconds, tokens/s (N over the step), the rise of
peak RSS over RSS before the step (inputs excluded; glibc serves large allocations with mmap, so
freed tensors leave RSS), the report's own peak estimate for the same plan
(``report.attention_memory_bytes``, Note [Memory of a site]) and the bytes the ring sent (the P2P
counter) against the plan's; then one more step under ``torch.profiler`` for the allocator's peak
(bytes allocated, ``_common.allocated_peak``), which is what the estimate counts: a page of an
allocated buffer counts in RSS only once written (a site whose local backward runs in head chunks
allocates its dq, dk, dv before the first chunk and writes them chunk by chunk). Before the next N, the plan and the measured peak at this N say
whether it can fit: an N whose predicted peak (measured bytes per token, scaled) exceeds the
memory available is reported as not run rather than left to the OOM killer.

Numerics at every N: on each rank, 4 sampled query rows (every head), their output and their dq
against a float64 computation of the site's function (docs/semantics.md, The function) for those
rows alone (``_reference_rows``: the keys each branch connects, weighted by how many branches
connect them; dq from the same probabilities), max-abs error over max-abs value of the sampled
rows, bound 1e-5.

Against torch's exact ring (``--compare N``): the same shards through torch's context-parallel
ring (``benchmarks/torch_ring.py``'s ``TorchRing``, all-gather rotation, its head-tail load
balancer, K/V heads repeated for its kernel), one warm-up and one measured step each, tokens/s of
ours over torch's: the choice a user makes between the dilated config and exact attention.

    python benchmarks/scale.py                          # N = 128k .. 4M on 4 ranks, compare at 32k
    python benchmarks/scale.py --quick                  # N = 16k, 32k: a smoke run
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate

import _common

B, HQ, HKV, D = 1, 4, 2, 32
SEGMENTS, RATES = [2048, 8192, 32768, 131072], [1, 4, 16, 64]
BLOCK = 4096  # positions per seeded block of inputs
SEED = 0
SAMPLES = 4  # query rows checked per rank
BOUND = 1e-5
TARGET = 4 * 2**20  # tokens, forward + backward, on 4 ranks


# ---- inputs, by position ---------------------------------------------------------------------

_KINDS = {"q": HQ, "k": HKV, "v": HKV, "dout": HQ}


def _block(kind: str, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED * 1_000_003 + list(_KINDS).index(kind) * 7_919 + index * 104_729)
    return torch.randn(B, _KINDS[kind], BLOCK, D, generator=gen)


def _rows(kind: str, start: int, stop: int) -> torch.Tensor:
    """Positions ``start .. stop - 1`` of input ``kind`` ``(B, heads, stop - start, D)``."""
    blocks = [_block(kind, i) for i in range(start // BLOCK, -(-stop // BLOCK))]
    whole = torch.cat(blocks, dim=2) if len(blocks) > 1 else blocks[0]
    first = start // BLOCK * BLOCK
    return whole[:, :, start - first : stop - first].contiguous()


def _shard(kind: str, n: int, world: int, rank: int) -> torch.Tensor:
    """This rank's zigzag shard: chunks ``rank`` and ``2 P - 1 - rank`` of ``2 P``."""
    c = n // (2 * world)
    return torch.cat([_rows(kind, i * c, (i + 1) * c) for i in (rank, 2 * world - 1 - rank)], dim=2)


# ---- the float64 rows ------------------------------------------------------------------------


def _reference_rows(p: int, n: int) -> dict[str, torch.Tensor]:
    """Output and dq ``(B, HQ, D)`` of global query position ``p``, in float64 (docs/semantics.md,
    The function: the keys a branch connects to ``p`` for head ``j`` are those of ``p``'s segment
    on ``j``'s lattice when ``p`` is on it; each key weighs by how many branches connect it;
    causal)."""
    q, dout = (_rows(kind, p, p + 1)[:, :, 0].double() for kind in ("q", "dout"))
    lo = min((p // min(w, n)) * min(w, n) for w in SEGMENTS)
    k, v = (_rows(kind, lo, p + 1).double() for kind in ("k", "v"))
    t = torch.arange(lo, p + 1)
    out, dq = torch.zeros(B, HQ, D, dtype=torch.float64), torch.zeros(B, HQ, D, dtype=torch.float64)
    for j in range(HQ):
        count = torch.zeros(len(t), dtype=torch.float64)
        for w, r in zip(SEGMENTS, RATES):
            w = min(w, n)
            if p % r == j % r:
                count += ((t // w == p // w) & (t % r == j % r)).double()
        keep = count > 0
        kj, vj = k[:, j // (HQ // HKV), keep], v[:, j // (HQ // HKV), keep]
        scores = torch.einsum("bd,btd->bt", q[:, j], kj) * D**-0.5 + count[keep].log()
        prob = scores.softmax(-1)
        out[:, j] = torch.einsum("bt,btd->bd", prob, vj)
        dp = torch.einsum("bd,btd->bt", dout[:, j], vj)
        ds = prob * (dp - (dout[:, j] * out[:, j]).sum(-1, keepdim=True))
        dq[:, j] = torch.einsum("bt,btd->bd", ds, kj) * D**-0.5
    return {"out": out, "dq": dq}


def _sampled_error(out: torch.Tensor, dq: torch.Tensor, n: int, world: int, rank: int) -> dict[str, float]:
    import ring_rewrite

    positions = ring_rewrite.positions(n, world=world, rank=rank, layout="zigzag")
    gen = torch.Generator().manual_seed(SEED + rank)
    rows = torch.randint(0, len(positions), (SAMPLES,), generator=gen).tolist()
    got = {"out": [], "dq": []}
    want = {"out": [], "dq": []}
    for row in rows:
        ref = _reference_rows(int(positions[row]), n)
        for name, x in (("out", out), ("dq", dq)):
            got[name].append(x[:, :, row])
            want[name].append(ref[name])
    return {name: _common.rel_err(torch.stack(got[name]), torch.stack(want[name])) for name in got}


# ---- one rank ----------------------------------------------------------------------------------


def _attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _step(fn, q, k, v, dout) -> dict[str, Any]:
    _common.trim()
    dist.barrier()
    _common.ring_sent()
    _common.reset_peak()
    base = _common.rss()["VmRSS"]
    t0 = time.perf_counter()
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds, "peak_bytes": _common.rss()["VmHWM"] - base, "sent_bytes": _common.ring_sent(),
        "out": out.detach(), "dq": dq,
    }  # fmt: skip


def _rank(rank: int, world: int, args: dict) -> dict:
    _common.malloc_setup()
    torch.set_num_threads(1)
    import ring_rewrite
    from ring_rewrite.report import attention_memory_bytes, bytes_sent

    n = args["seq"]
    q, k, v, dout = (_shard(kind, n, world, rank) for kind in _KINDS)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    backend = ring_rewrite.backend(
        sharding="sharded", layout="zigzag", segment_lengths=SEGMENTS, dilation_rates=RATES, timeout=1800
    )
    ours = torch.compile(_attend, backend=backend, fullgraph=True)
    t0 = time.perf_counter()
    first = _step(ours, q, k, v, dout)
    first_s = time.perf_counter() - t0
    errors = _sampled_error(first["out"], first["dq"], n, world, rank)
    del first
    measured = _step(ours, q, k, v, dout)
    del measured["out"], measured["dq"]
    allocated = _common.allocated_peak(lambda: _step(ours, q, k, v, dout))
    (site,) = backend.records
    sent = bytes_sent(site.plan)
    result = {
        "rank": rank, "first_call_s": first_s, **measured, "allocated_bytes": allocated, "errors": errors,
        "report_peak_bytes": attention_memory_bytes(site.plan)["peak"],
        "plan_sent_bytes": sent["forward"] + sent["backward"],
        "q_bytes": q.numel() * q.element_size(),
    }  # fmt: skip
    if args.get("compare"):
        from torch_ring import TorchRing

        g = HQ // HKV

        def exact(q, k, v):
            k, v = (x.repeat_interleave(g, dim=1) for x in (k, v))
            return TorchRing.apply(q, k, v, True, "allgather", True)

        _step(exact, q, k, v, dout)  # warm-up
        theirs = _step(exact, q, k, v, dout)
        result["torch_seconds"] = theirs["seconds"]
    return result


# ---- the parent ----------------------------------------------------------------------------------


def _available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _row(n: int, world: int, ranks: list[dict]) -> dict:
    slowest = max(r["seconds"] for r in ranks)
    row = {
        "N": n, "N/P": n // world,
        "first call s": max(r["first_call_s"] for r in ranks),
        "s / step": slowest,
        "tokens/s": n / slowest,
        "peak MiB (max rank)": max(r["peak_bytes"] for r in ranks) / _common.MIB,
        "allocated MiB (max rank)": max(r["allocated_bytes"] for r in ranks) / _common.MIB,
        "report est. MiB": max(r["report_peak_bytes"] for r in ranks) / _common.MIB,
        "peak / q size": max(r["peak_bytes"] / r["q_bytes"] for r in ranks),
        "sent MiB (max rank)": max(r["sent_bytes"] for r in ranks) / _common.MIB,
        "= plan": all(r["sent_bytes"] == r["plan_sent_bytes"] for r in ranks),
        "max rel err (sampled rows)": max(max(r["errors"].values()) for r in ranks),
    }  # fmt: skip
    if "torch_seconds" in ranks[0]:
        theirs = max(r["torch_seconds"] for r in ranks)
        row["torch exact s"] = theirs
        row["ours / torch tokens/s"] = theirs / slowest
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--start", type=int, default=131072)
    parser.add_argument("--max", type=int, default=TARGET)
    parser.add_argument("--compare", type=int, default=32768, help="N at which torch's exact ring also runs (0: none)")
    parser.add_argument("--quick", action="store_true", help="N = 16k and 32k, compare at 16k: a smoke run")
    parser.add_argument("--out", type=Path, default=_common.RESULTS / "scale.json")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.start, opts.max, opts.compare = 16384, 32768, 16384
    world = opts.ranks
    sizes = ([opts.compare] if opts.compare else []) + [
        opts.start * 2**i for i in range(int(math.log2(opts.max // opts.start)) + 1)
    ]
    rows, stopped, per_token = [], None, None
    for n in sorted(set(sizes)):
        if per_token is not None:
            need = per_token * n + 3 * n * HQ * D * 4 + world * 400 * _common.MIB  # + inputs, processes
            if need > 0.9 * _available():
                stopped = f"N = {n}: about {need / 2**30:.1f} GiB needed, {_available() / 2**30:.1f} GiB available"
                break
        print(f"N = {n} on {world} ranks ...", flush=True)
        t0 = time.perf_counter()
        try:
            ranks = _common.run_ranks(_rank, world, {"seq": n, "compare": n == opts.compare})
        except Exception as error:  # a rank killed (memory), or a failed check
            stopped = f"N = {n}: {type(error).__name__}: {error}"
            break
        row = _row(n, world, ranks)
        row["wall s"] = time.perf_counter() - t0
        rows.append(row)
        print(tabulate([row], headers="keys", floatfmt=".4g"), flush=True)
        per_token = max(world * r["peak_bytes"] for r in ranks) / n
    print(f"\nLongNet site, {HQ} query / {HKV} KV heads of {D}, segments {SEGMENTS}, rates {RATES}, "
          f"{world} gloo ranks, sharded zigzag, inductor")  # fmt: skip
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    largest = max((r["N"] for r in rows if r["max rel err (sampled rows)"] < BOUND), default=0)
    met = largest >= TARGET
    print(f"largest N run and checked: {largest:,} (target {TARGET:,}): {_common.verdict(met)}")
    if stopped:
        print(f"stopped: {stopped}")
    targets = [{"line": f"forward + backward at >= {TARGET:,} tokens on 4 ranks, checked", "met": met}]
    _common.write_json(
        opts.out,
        {"rows": rows, "stopped": stopped, "largest": largest, "targets": targets, "machine": _common.machine(1)},
    )  # fmt: skip
    return 0 if all(r["max rel err (sampled rows)"] < BOUND for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
