"""Context parallel (sharded mode): cut the sequence with shard(), give RoPE the global positions().

    torchrun --nproc-per-node 2 examples/shard_positions.py [--layout zigzag] [--seq 512] [--compiler inductor]
    python examples/shard_positions.py          # one process: P = 1, no process group

A small causal language model with rotary position embeddings, compiled with
``sharding="sharded"``: each rank runs the whole model on its ``N / P`` tokens only, and the
attention sites pass K/V around the ring. Three helpers make that work:

* ``ring_rewrite.shard(x, 1, layout=...)`` cuts this rank's tokens (and targets) out of the sequence;
* ``ring_rewrite.positions(N, world=P, rank=r, layout=...)`` gives their global positions, which
  RoPE needs (with ``layout="zigzag"`` a rank's tokens are not even consecutive);
* ``ring_rewrite.unshard(x, 1, layout=...)`` puts the per-rank outputs back in sequence order.

Each rank's loss covers its own tokens, so parameter gradients are summed over the ranks with an
all-reduce (as data parallelism would). The script checks that the logits and the summed gradients
equal those of the same model run in one process over the full sequence (exact attention, the
default config), within 1e-5 relative, for each layout. Exits non-zero otherwise.

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
import torch.nn.functional as F

import ring_rewrite

BOUND = 1e-5  # relative: max-abs error / max-abs value
VOCAB, DIM, HEADS, LAYERS = 97, 64, 4, 2


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x (B, H, n, D)`` at global positions ``pos (n,)``.

    RoFormer (Su et al. 2021), §3.4.2: rotate each pair of channels by ``pos * 10000^(-2i/D)``.
    """
    d = x.shape[-1]
    freqs = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = pos.to(torch.float32)[:, None] * freqs  # (n, D/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, HEADS, -1)).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(rope(q, pos), rope(k, pos), v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Tokens ``(B, n)`` at positions ``pos (n,)`` -> next-token logits ``(B, n, VOCAB)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, pos)
        return self.head(self.norm(x))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def context_parallel(
    model: TinyLM, tokens: torch.Tensor, targets: torch.Tensor, layout: str, compiler: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor], ring_rewrite.Report]:
    """Run ``model`` on this rank's shard; return the full logits, the summed grads, the report."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    n = tokens.shape[1]
    backend = ring_rewrite.backend(sharding="sharded", layout=layout, compiler=compiler)
    compiled = torch.compile(model, backend=backend)

    my_tokens = ring_rewrite.shard(tokens, 1, layout=layout)  # (B, n / P)
    my_targets = ring_rewrite.shard(targets, 1, layout=layout)
    my_pos = ring_rewrite.positions(n, world=world, rank=rank, layout=layout)
    logits = compiled(my_tokens, my_pos)  # (B, n / P, VOCAB)
    # This rank's share of the mean over all tokens; the ranks' shares add up to the loss.
    loss = F.cross_entropy(logits.flatten(0, 1), my_targets.flatten(), reduction="sum")
    (loss / targets.numel()).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)  # SUM: each rank's gradient covers its own tokens
    full = ring_rewrite.unshard(logits.detach(), 1, layout=layout)  # (B, n, VOCAB), sequence order
    return full, grads, ring_rewrite.Report(backend.records)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512, help="sequence length (a multiple of 2 x world size)")
    parser.add_argument("--layout", default="both", choices=["contiguous", "zigzag", "both"])
    parser.add_argument("--compiler", default="aot_eager", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--fast", action="store_true", help="a short sequence (for the tests)")
    args = parser.parse_args()
    seq = 128 if args.fast else args.seq
    layouts = ["contiguous", "zigzag"] if args.layout == "both" else [args.layout]

    distributed = "RANK" in os.environ  # started by torchrun
    if distributed:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    torch.set_num_threads(1)

    torch.manual_seed(0)  # the same weights and the same full sequence on every rank
    model = TinyLM()
    tokens = torch.randint(VOCAB, (2, seq))
    targets = tokens.roll(-1, 1)

    # The single-process model over the full sequence, eager: what every layout must reproduce.
    ref_model = copy.deepcopy(model)
    ref = ref_model(tokens, torch.arange(seq))
    F.cross_entropy(ref.flatten(0, 1), targets.flatten()).backward()
    ref_grads = {name: p.grad for name, p in ref_model.named_parameters()}

    problems, worst_all = [], 0.0
    for layout in layouts:
        logits, grads, report = context_parallel(
            copy.deepcopy(model), tokens, targets, layout, args.compiler
        )
        grad_errors = {f"grad {n}": rel(grads[n], g) for n, g in ref_grads.items()}
        errors = {"logits": rel(logits, ref), **grad_errors}
        worst_name, worst = max(errors.items(), key=lambda item: item[1])
        worst_all = max(worst_all, worst)
        if rank == 0:
            print(report)
            print(f"layout={layout}: max rel. error vs the single-process model: logits "
                  f"{errors['logits']:.2e}, worst of {len(grad_errors)} parameter grads "
                  f"{max(grad_errors.values()):.2e}\n", flush=True)  # fmt: skip
        if worst > BOUND:
            problems.append(f"layout={layout}: {worst_name} off by {worst:.2e} > {BOUND:.0e}")
        if len(report.rewritten) != LAYERS or report.skipped:
            problems.append(f"layout={layout}: expected {LAYERS} sites, all rewritten:\n{report}")
        for record in report.rewritten:
            if record.plan.world != world or {len(b.ring) for b in record.plan.branches} != {world}:
                problems.append(f"layout={layout}: site {record.site} is not on a ring of {world}")

    verdict = f"rank {rank}/{world}: layouts {', '.join(layouts)}, worst {worst_all:.2e}, bound {BOUND:.0e}"
    print(f"OK {verdict}" if not problems else f"FAIL {verdict}\n  " + "\n  ".join(problems), flush=True)
    if distributed:
        dist.destroy_process_group()
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
