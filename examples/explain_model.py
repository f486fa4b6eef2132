"""explain(): which attention sites of a model would be rewritten, and why the others would not.

    python examples/explain_model.py [--seq 256] [--compiler inductor] [--fast]

``ring_rewrite.explain(model, *inputs, **config)`` runs the model once through the backend and
returns the report: one row per attention site, with the plan (branches, ring, FLOPs, bytes,
memory) of each rewritten site and the reason each other site is left alone. The model below has
five attention sites; three can be rewritten (one with dropout inside attention in training),
two cannot (a dense attention mask, ``nn.MultiheadAttention`` whose attention weights are used). The script
prints the report, checks every row against the expectation written next to each call in
``forward`` (``# site: ...``), then runs the compiled model and checks its output against the
same model with float64 reference attention at the rewritten sites. Exits non-zero if anything
differs.

The default compiler here is ``aot_eager`` (a few seconds); ``--compiler inductor`` lowers the
rewritten graph with inductor, as a real run would.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import ring_rewrite

SEGMENTS, RATES = [32, 64], [1, 2]
BOUND = 1e-5  # float32 vs the float64 reference (docs/semantics.md, Accuracy)

# What each site should show in the report: None if rewritten, else words of its reason.
EXPECTED = {
    "causal": None,
    "dropout": None,
    "dense mask": "dense attn_mask",
    "mha weights": "attention weights (output 1) are used",
    "mha": None,
}


def reference_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False) -> torch.Tensor:
    """What the rewritten model computes at an SDPA site in eval (no dropout): the reference, except
    at a site with a dense mask, which is left alone and stays SDPA."""
    if attn_mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return ring_rewrite.reference_attention(
        q, k, v, segment_lengths=SEGMENTS, dilation_rates=RATES, is_causal=is_causal
    )


class Model(nn.Module):
    """Five attention sites over one sequence (``reference``: the float64 check, in eval)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(3))
        self.mha_weights = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.weight_proj = nn.Linear(1, dim)
        # Called as self.sdpa(...) in forward: the report's `where` is the innermost frame of
        # each call, so a Python helper around SDPA would give every site the helper's line.
        self.sdpa = F.scaled_dot_product_attention
        self.reference = False

    def split(self, i: int, x: torch.Tensor):
        return self.qkv[i](x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)

    @staticmethod
    def merge(a: torch.Tensor) -> torch.Tensor:
        return a.transpose(1, 2).flatten(2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(0, x)
        x = x + self.merge(self.sdpa(q, k, v, is_causal=True))  # site: causal
        q, k, v = self.split(1, x)
        p = 0.1 if self.training else 0.0
        x = x + self.merge(self.sdpa(q, k, v, dropout_p=p))  # site: dropout
        q, k, v = self.split(2, x)
        x = x + self.merge(self.sdpa(q, k, v, attn_mask=mask))  # site: dense mask
        a, weights = self.mha_weights(x, x, x)  # site: mha weights
        # The weights (B, N, N) are used: the site needs the N x N matrix, so it stays as it is.
        x = x + a + self.weight_proj(weights.mean(-1, keepdim=True))
        if not self.reference:
            a = self.mha(x, x, x, need_weights=False)[0]  # site: mha
        else:
            a = self.mha_reference(x)
        return x + a

    def mha_reference(self, x: torch.Tensor) -> torch.Tensor:
        """``self.mha`` spelled out, its attention replaced by the reference."""
        q, k, v = (
            F.linear(x, self.mha.in_proj_weight, self.mha.in_proj_bias)
            .unflatten(-1, (3, self.heads, -1))
            .permute(2, 0, 3, 1, 4)
        )
        return self.mha.out_proj(self.merge(reference_sdpa(q, k, v)))


def site_lines() -> dict[int, str]:
    """Line number -> site name, from the ``# site: name`` comments in ``Model.forward``."""
    lines, first = inspect.getsourcelines(Model.forward)
    found = {}
    for offset, line in enumerate(lines):
        if m := re.search(r"# site: (.+)$", line):
            found[first + offset] = m.group(1).strip()
    return found


def check_report(report: ring_rewrite.Report) -> list[str]:
    """Compare every row of the report with ``EXPECTED``; return the differences."""
    names, problems, seen = site_lines(), [], set()
    for record in report.records:
        line = re.search(r":(\d+)\)?$", record.location)  # "[module.path (]file.py:line[)]"
        name = names.get(int(line.group(1))) if line else None
        if name is None:
            problems.append(f"site {record.site} at {record.location}: not a site of Model.forward")
            continue
        seen.add(name)
        expected = EXPECTED[name]
        if expected is None and not record.rewritten:
            problems.append(f"site {name!r} should be rewritten, left alone: {record.reason}")
        elif expected is not None and record.rewritten:
            problems.append(f"site {name!r} should be left alone ({expected}), was rewritten")
        elif expected is not None and expected not in record.reason:
            problems.append(f"site {name!r}: reason {record.reason!r} does not say {expected!r}")
    problems += [f"site {name!r} missing from the report" for name in EXPECTED if name not in seen]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256, help="sequence length")
    parser.add_argument("--compiler", default="aot_eager", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--fast", action="store_true", help="a short sequence (for the tests)")
    args = parser.parse_args()
    seq = 128 if args.fast else args.seq

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(2, seq, 32)
    mask = torch.randn(seq, seq)  # a dense additive bias: not a key-padding mask

    # 1. The report: explain() runs the model once (training mode: the dropout site has p = 0.1).
    report = ring_rewrite.explain(model, x, mask, segment_lengths=SEGMENTS, dilation_rates=RATES)
    print(report, end="\n\n")
    problems = check_report(report)

    # 2. The numbers, in eval mode (dropout off: deterministic): the rewritten sites compute
    # the reference, the sites left alone what they computed before.
    model.eval()
    compiled = torch.compile(
        model,
        backend="ring_dilated",
        options={"segment_lengths": SEGMENTS, "dilation_rates": RATES, "compiler": args.compiler},
    )
    with torch.no_grad():
        out = compiled(x, mask)
        model.reference, model.sdpa = True, reference_sdpa
        ref = model.double()(x.double(), mask.double())
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    print(f"output: max rel. error vs the model with float64 reference attention {err:.2e}")
    if err > BOUND:
        problems.append(f"output off by {err:.2e} > {BOUND:.0e}")

    summary = f"{len(report.rewritten)} of {len(report.records)} sites rewritten, the others left alone"
    print(f"\nOK: {summary} with their reasons; output within {err:.2e}" if not problems
          else "\nFAIL:\n  " + "\n  ".join(problems))  # fmt: skip
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
