"""Decorate an existing model class: every instance runs ring dilated attention, checked vs float64.

    python examples/decorate_class.py [--seq 512] [--compiler inductor] [--fast]

``TransformerBlock`` below stands for a block you already have, written with plain
``F.scaled_dot_product_attention``. One decorator line makes every instance of it compile with the
``ring_dilated`` backend (LongNet segments and dilation rates); the code of the block does not
change. The script runs forward and backward once and compares the output and every gradient with
the same block in float64 whose attention is ``ring_rewrite.reference_attention``.
Exits non-zero if any error exceeds the float32 bound (docs/semantics.md, Accuracy).

The default compiler here is ``aot_eager`` (a few seconds); ``--compiler inductor`` lowers the
rewritten graph with inductor, as a real run would.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import ring_rewrite

SEGMENTS, RATES = [32, 64, 128], [1, 2, 4]
BOUND = 1e-5  # float32 vs the float64 reference (docs/semantics.md, Accuracy)


class TransformerBlock(nn.Module):
    """A pre-norm causal transformer block: the user's existing code, untouched."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        a = self.attend(q, k, v)  # (B, H, N, D)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, dim))
        return x + self.mlp(self.norm2(x))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512, help="sequence length")
    parser.add_argument("--compiler", default="aot_eager", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--fast", action="store_true", help="a short sequence (for the tests)")
    args = parser.parse_args()
    seq = 128 if args.fast else args.seq

    # The one added line, written where the class is defined, would read
    #     @ring_rewrite.ring_dilated(segment_lengths=SEGMENTS, dilation_rates=RATES)
    # Here it decorates a subclass so that the undecorated class stays available for the
    # float64 reference below, and so that --compiler can choose the lowering.
    @ring_rewrite.ring_dilated(segment_lengths=SEGMENTS, dilation_rates=RATES, compiler=args.compiler)
    class LongNetBlock(TransformerBlock):
        """``TransformerBlock`` with ring dilated attention: each instance is compiled."""

    torch.manual_seed(0)
    model = LongNetBlock()
    x = torch.randn(2, seq, 64, requires_grad=True)
    out = model(x)
    out.square().mean().backward()

    # The float64 reference: the same weights in the undecorated class (so it runs eagerly; a
    # deep copy of `model` would stay compiled), attention swapped for the definition.
    reference = TransformerBlock().double()
    reference.load_state_dict(model.state_dict())
    reference.attend = functools.partial(
        ring_rewrite.reference_attention, segment_lengths=SEGMENTS, dilation_rates=RATES, is_causal=True
    )
    x64 = x.detach().double().requires_grad_()
    ref = reference(x64)
    ref.square().mean().backward()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    errors = {"output": rel(out.detach(), ref.detach()), "grad x": rel(x.grad, x64.grad)}
    ref_params = dict(reference.named_parameters())
    errors |= {f"grad {n}": rel(p.grad, ref_params[n].grad) for n, p in model.named_parameters()}
    for name, err in errors.items():
        print(f"{name:>18}: max rel. error vs float64 reference {err:.2e}")
    worst_name, worst = max(errors.items(), key=lambda item: item[1])
    ok = worst <= BOUND
    print(
        f"\n{'OK' if ok else 'FAIL'}: LongNetBlock (N={seq}, branches {list(zip(SEGMENTS, RATES))}, "
        f"{args.compiler}), worst {worst:.2e} ({worst_name}), bound {BOUND:.0e}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
