"""Quick start: compile a small LongNet-style block with backend="ring_dilated", print the rewrite
report, and check outputs and gradients against the float64 reference. Exits non-zero if wrong.

    python examples/quickstart.py [--seq 2048] [--compiler inductor]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import ring_rewrite
from ring_rewrite.reference import reference_attention

SEGMENTS, RATES = [256, 512, 1024], [1, 2, 4]


class Block(nn.Module):
    """Pre-norm causal self-attention with GQA, written with plain SDPA."""

    def __init__(self, dim: int = 128, heads: int = 8, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def project(self, x: torch.Tensor):
        b, n, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return q, k, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = attn.shape
        return x + self.out(attn.transpose(1, 2).reshape(b, n, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)
        return self.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same block with reference attention in float64."""
        q, k, v = self.project(x.double())
        attn = reference_attention(
            q, k, v, segment_lengths=SEGMENTS, dilation_rates=RATES, is_causal=True
        )
        return self.finish(x.double(), attn)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager", "eager"])
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(1, args.seq, 128)

    report = ring_rewrite.explain(model, x, segment_lengths=SEGMENTS, dilation_rates=RATES)
    print(report, end="\n\n")

    compiled = torch.compile(
        model,
        backend="ring_dilated",
        options={"segment_lengths": SEGMENTS, "dilation_rates": RATES, "compiler": args.compiler},
        fullgraph=True,
    )
    out = compiled(x)
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    model.double()
    ref = model.reference(x)
    ref.square().mean().backward()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    errors = {"output": rel(out, ref), **{f"grad {n}": rel(grads[n], p.grad) for n, p in model.named_parameters()}}
    worst = max(errors.values())
    for name, err in errors.items():
        print(f"{name:>16}: max rel. error vs float64 reference {err:.2e}")
    bound = 1e-5
    print(f"\n{'OK' if worst <= bound else 'FAIL'}: worst {worst:.2e} (float32 bound {bound:.0e})")
    return 0 if worst <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
