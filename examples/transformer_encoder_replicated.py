"""A stock nn.TransformerEncoder made context-parallel, drop-in: same results as without the rewrite.

    torchrun --nproc-per-node 2 examples/transformer_encoder_replicated.py [--seq 512] [--compiler inductor]
    python examples/transformer_encoder_replicated.py          # one process: P = 1, no process group

``torch.compile(encoder, backend="ring_dilated")`` with the default config (exact attention,
``sharding="replicated"``): every rank holds the whole sequence, and each attention site inside
``nn.TransformerEncoderLayer`` (decomposed into projections + SDPA by the backend) takes this
rank's shard of the sequence, passes K/V around a ring over all ranks, and re-assembles the full
output. The script checks, on every rank, that the compiled encoder gives the same outputs and
parameter (and input) gradients as the un-rewritten encoder run eagerly, within 1e-5 relative,
in training mode and in eval under ``torch.no_grad`` (the fused fast path); and that the report
shows every attention site rewritten on a ring of all ranks. Exits non-zero otherwise.

The default compiler here is ``aot_eager`` (a few seconds); ``--compiler inductor`` lowers the
rewritten graph with inductor, as a real run would.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import ring_rewrite

BOUND = 1e-5  # relative: max-abs error / max-abs value


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512, help="sequence length (a multiple of the world size)")
    parser.add_argument("--compiler", default="aot_eager", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--fast", action="store_true", help="a short sequence (for the tests)")
    parser.add_argument(
        "--eval", action=argparse.BooleanOptionalAction, default=True,
        help="also compare in eval mode under no_grad (the layer's fused fast path)",
    )  # fmt: skip
    args = parser.parse_args()
    seq = 128 if args.fast else args.seq

    distributed = "RANK" in os.environ  # started by torchrun
    if distributed:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    torch.set_num_threads(1)

    torch.manual_seed(0)  # the same weights and the same full sequence on every rank
    layer = nn.TransformerEncoderLayer(
        d_model=64, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True
    )
    encoder = nn.TransformerEncoder(layer, num_layers=2)
    x = torch.randn(2, seq, 64)
    # NOTE: not out.square().mean(): the encoder ends in a LayerNorm, whose output has a nearly
    # constant square mean, so that loss would have gradients of rounding-noise size only.
    weight = torch.randn(2, seq, 64)

    # The un-rewritten encoder (eager) and a copy compiled with ring attention. The registered
    # name works as well: torch.compile(model, backend="ring_dilated", options={...}); the
    # backend object also keeps the record of every site it rewrote, for the report.
    backend = ring_rewrite.backend(compiler=args.compiler)  # exact attention, replicated
    twin = copy.deepcopy(encoder)
    compiled = torch.compile(twin, backend=backend)

    # Training mode (dropout is 0, so the function is deterministic): outputs and gradients.
    results = []
    for run, params in ((encoder, encoder), (compiled, twin)):
        xi = x.clone().requires_grad_()
        out = run(xi)
        (out * weight).sum().backward()
        results.append({"output": out.detach(), "grad x": xi.grad,
                        **{f"grad {n}": p.grad for n, p in params.named_parameters()}})  # fmt: skip
    errors = {f"train {name}": rel(results[1][name], t) for name, t in results[0].items()}

    if args.eval:
        # Eval under no_grad: nn.TransformerEncoderLayer takes its fused fast path here, which
        # the backend spells out as SDPA plus plain ops before rewriting it.
        encoder.eval(), compiled.eval()
        with torch.no_grad():
            errors["eval output"] = rel(compiled(x), encoder(x))

    report = ring_rewrite.Report(backend.records)
    if rank == 0:
        print(report, end="\n\n")
        for name, err in errors.items():
            print(f"{name:>46}: max rel. error vs the un-rewritten encoder {err:.2e}")

    problems = []
    worst_name, worst = max(errors.items(), key=lambda item: item[1])
    if worst > BOUND:
        problems.append(f"{worst_name} is off by {worst:.2e} > {BOUND:.0e}")
    # Two layers, compiled for training and, with --eval, again for eval (the fast path).
    sites = 4 if args.eval else 2
    if len(report.records) != sites or report.skipped:
        problems.append(f"expected {sites} attention sites, all rewritten:\n{report}")
    for record in report.rewritten:
        rings = {len(b.ring) for b in record.plan.branches}
        if record.plan.world != world or rings != {world}:
            problems.append(f"site {record.site}: ring of {rings} ranks, world size {world}")
    verdict = f"rank {rank}/{world}: " + (
        f"{len(report.rewritten)} attention sites rewritten on a ring of {world}, "
        f"worst {worst:.2e} ({worst_name}), bound {BOUND:.0e}"
    )
    print(f"OK {verdict}" if not problems else f"FAIL {verdict}\n  " + "\n  ".join(problems), flush=True)
    if distributed:
        dist.destroy_process_group()
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
