"""ALiBi at length: the error of a rewritten ALiBi site against float64, as N grows.

ALiBi models (BLOOM, MPT, Falcon with ``alibi=True``) add the key bias ``slope_h * t``: under a
softmax over the keys ``t`` it equals ``slope_h * (t - p)``. At ``t = 65,536`` and slope 1/4 it
is 16,384, where a float32 score keeps 3 bits after the point, so a kernel that adds the bias as
it is loses accuracy as N grows. The rewrite adds ``b_t - b_p`` instead, the bias less each
query row's own (Note [Recentred key biases]): the dense bias
``slope_h * (t - p)`` itself.

One function builds the mask as BLOOM does, ``where(causal, 0, -inf) + slopes[h] * t`` over
``(1, H, N, N)`` (read from the graph, never built), and calls SDPA on ``q, k, v (1, 4, N, 16)``
float32, slopes ``2 ** (-2 (h + 1))``; compiled with ``backend="ring_dilated"`` (inductor, one
process), forward and backward. Configs: ``exact`` (one branch ``(N, 1)``, up to 16k: its
O(N^2) float64 reference takes hours beyond on 2 cores) and ``longnet`` (segments ``N/16, N/4,
N``, rates ``1, 4, 16``: its last branch spans the whole sequence, where the bias is largest). Each is compared with float64
``reference_attention`` with the same key bias, in chunks of queries: max-abs error over
max-abs value of ``out, dq, dk, dv``. The exact config also runs float32 SDPA with the key bias
``(1, H, 1, N)`` added as it is (as BLOOM's eager code runs it): the error the recentring avoids.

Target: every error of the rewrite within 1e-5 (the float32 bound, docs/semantics.md, Accuracy)
at every N. Writes ``results/alibi_accuracy.json``.

    python benchmarks/alibi_accuracy.py              # N = 16k, 64k
    python benchmarks/alibi_accuracy.py --quick      # N = 4k
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
    RESULTS,
    TENSORS,
    TOLERANCE,
    errors,
    forward_backward,
    machine,
    reference,
    sequence_inputs,
    verdict,
    write_json,
)

HEADS, HEAD_DIM = 4, 16


def slopes(heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-2 * (h + 1)) for h in range(heads)])


def alibi_attention(q, k, v):
    """BLOOM's form: a causal mask plus the key bias ``slopes[h] * t``, as one dense mask."""
    i = torch.arange(q.shape[2])
    causal = torch.where(i[None, :] <= i[:, None], 0.0, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal + slopes(q.shape[1]).view(1, -1, 1, 1) * i)


def key_bias(n: int) -> torch.Tensor:
    return slopes(HEADS).view(1, -1, 1, 1) * torch.arange(n).view(1, 1, 1, n)


EXACT_UP_TO = 16384  # the exact config's O(N^2) reference and baseline take hours beyond, on 2 cores


def configs(n: int) -> dict[str, dict]:
    longnet = {"longnet": {"segment_lengths": [n // 16, n // 4, n], "dilation_rates": [1, 4, 16]}}
    return {"exact": {}, **longnet} if n <= EXACT_UP_TO else longnet


def measure(n: int) -> list[dict]:
    import ring_rewrite

    q, k, v, grad_out = sequence_inputs((1, HEADS, n, HEAD_DIM))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    rows = []
    for name, config in configs(n).items():
        t0 = time.perf_counter()
        expected = reference(q, k, v, grad_out, is_causal=True, key_bias=key_bias(n).double(), **config)
        reference_s = time.perf_counter() - t0
        torch._dynamo.reset()
        backend = ring_rewrite.backend(**config)
        compiled = torch.compile(alibi_attention, backend=backend, fullgraph=True)
        t0 = time.perf_counter()
        got = errors(forward_backward(compiled, q, k, v, grad_out), expected)
        rewrite_s = time.perf_counter() - t0
        (record,) = backend.records
        if not (record.rewritten and record.plan.recentred):
            raise AssertionError(f"the site was not rewritten with a recentred bias: {record}")
        as_is = None
        if not config:
            as_is = errors(forward_backward(_causal_key_bias, q, k, v, grad_out), expected)
        rows.append({
            "n": n, "config": name, "rewrite": got, "bias_as_is": as_is,
            "reference_s": round(reference_s, 1), "rewrite_s": round(rewrite_s, 1),
        })  # fmt: skip
        print(f"N = {n:,} {name}: rewrite {max(got.values()):.2e}"
              + ("" if as_is is None else f", bias as is {max(as_is.values()):.2e}"), flush=True)
    return rows


def _causal_key_bias(q, k, v):
    """Float32 SDPA, causal, with the key bias ``(1, H, 1, N)`` added as it is, in chunks of
    queries (a causal chunk sees the keys up to its last row)."""
    bias = key_bias(q.shape[2]).to(q.dtype)
    outs = []
    rows = 1024
    for r0 in range(0, q.shape[2], rows):
        r1 = min(r0 + rows, q.shape[2])
        i, j = torch.arange(r0, r1), torch.arange(r1)
        mask = bias[..., :r1].masked_fill(j[None, :] > i[:, None], float("-inf"))
        outs.append(F.scaled_dot_product_attention(q[:, :, r0:r1], k[:, :, :r1], v[:, :, :r1], attn_mask=mask))
    return torch.cat(outs, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--quick", action="store_true", help="N = 4096")
    opts = parser.parse_args(argv)
    lengths = opts.lengths or ([4096] if opts.quick else [16384, 65536])
    record = {"machine": machine(torch.get_num_threads()), "heads": HEADS, "head_dim": HEAD_DIM, "rows": []}
    for n in lengths:
        record["rows"].extend(measure(n))
    table = []
    for row in record["rows"]:
        line = {"N": f"{row['n']:,}", "config": row["config"]}
        line.update({f"rewrite {t}": f"{row['rewrite'][t]:.1e}" for t in TENSORS})
        line.update({f"as is {t}": "-" if row["bias_as_is"] is None else f"{row['bias_as_is'][t]:.1e}" for t in TENSORS})
        table.append(line)
    print(tabulate(table, headers="keys"))
    met = all(max(row["rewrite"].values()) <= TOLERANCE for row in record["rows"])
    line = f"ALiBi rewrite within {TOLERANCE:g} of float64 at N up to {max(lengths):,}"
    record["targets"] = [{"line": line, "met": met}]
    print(f"{line}: {verdict(met)}")
    write_json(RESULTS / "alibi_accuracy.json", record)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
