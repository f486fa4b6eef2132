"""Fine-tune a Hugging Face causal LM on ranks that each hold part of every sequence.

    torchrun --standalone --nproc-per-node 4 examples/finetune_hf.py [--steps 8] [--max-len 1000]
    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py --fast   # what the tests run

The training loop is the one a transformers user writes, plus two lines: the model is compiled
with ``ring_rewrite.backend(sharding="sharded", layout="zigzag", ...)`` and each batch goes
through ``ring_rewrite.shard_batch`` before the model sees it::

    batch = ring_rewrite.shard_batch(collate(rows), layout="zigzag")  # this rank's tokens
    loss = model(**batch, use_cache=False).loss                         # its share of the mean
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)                                         # sum the ranks' shares

The model is a tiny Llama (GQA, RoPE) built from a config, random weights, nothing downloaded,
``attn_implementation="sdpa"``; the data are rows of random lengths padded to the longest row of
their batch, as ``DataCollatorWithPadding`` pads them, with ``labels`` (``-100`` on the padding).
``shard_batch`` pads each batch further, to the next power of two, so that batches of any length
compile one graph per bucket; it passes global ``position_ids`` (without them every rank's RoPE
would start at 0), next-token labels shifted over the whole sequence and the batch's count of
labelled tokens, so the ranks' losses add up to the batch's mean.

Before the first optimizer step the loss and every parameter gradient (summed over the ranks)
are checked against one process running the same model on the whole batch with the float64
``reference_attention`` in place of SDPA (the function the dilated config defines); the script
exits non-zero beyond the float32 bound (1e-5 relative, per tensor). Then it trains on batches of
new lengths and checks that every one of them ran rewritten within a few compiled graphs.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ring_rewrite
from ring_rewrite.reference import reference_attention

BOUND = 1e-5  # relative: max-abs difference / max-abs value, per tensor
VOCAB = 128
CONFIG = {"segment_lengths": [32, 128], "dilation_rates": [1, 2]}  # LongNet-style, two branches
LAYOUT = "zigzag"


def build_model():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2, pad_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    return transformers.LlamaForCausalLM(config)


def collate(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Rows of ``lengths`` tokens padded on the right to the longest, as DataCollatorWithPadding
    does: ``input_ids``, ``attention_mask``, ``labels`` (``-100`` on the padding)."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask[row, :length] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def reference_step(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and gradients of one process over the whole batch, with float64 reference
    attention under ``CONFIG`` in place of SDPA (transformers looks SDPA up at call time)."""

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        out = reference_attention(q, k, v, is_causal=is_causal, scale=scale, key_bias=attn_mask, **CONFIG)
        return out.to(q.dtype)

    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa
    try:
        loss = model(**batch, use_cache=False).loss
        loss.backward()
    finally:
        F.scaled_dot_product_attention = original
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps after the checked one")
    parser.add_argument("--max-len", type=int, default=1000, help="rows are 100 to this many tokens long")
    parser.add_argument("--batch", type=int, default=2, help="rows per batch")
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--fast", action="store_true", help="rows of one bucket and 2 steps (for the tests)")
    args = parser.parse_args()
    if args.fast:
        args.steps, args.max_len = 2, 128

    distributed = "RANK" in os.environ  # started by torchrun
    if distributed:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    torch.set_num_threads(1)

    model = build_model()
    reference = copy.deepcopy(model)
    backend = ring_rewrite.backend(sharding="sharded", layout=LAYOUT, compiler=args.compiler, **CONFIG)
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    lengths = torch.randint(100, args.max_len + 1, (args.steps + 1, args.batch), generator=torch.Generator().manual_seed(1))

    def step(i: int) -> torch.Tensor:
        """One step's loss (the whole batch's mean) and this rank's gradients summed over the ranks."""
        whole = collate(lengths[i].tolist(), seed=i)
        batch = ring_rewrite.shard_batch(whole, layout=LAYOUT)
        loss = compiled(**batch, use_cache=False).loss
        loss.backward()
        loss = loss.detach()
        if distributed:
            for p in model.parameters():
                dist.all_reduce(p.grad)  # each rank's gradient covers the loss of its own tokens
            dist.all_reduce(loss)
        return loss

    start = time.perf_counter()
    loss = step(0)
    ref_loss, ref_grads = reference_step(reference, collate(lengths[0].tolist(), seed=0))
    errors = {"loss": rel(loss, ref_loss)}
    errors.update({f"grad {name}": rel(p.grad, ref_grads[name]) for name, p in model.named_parameters()})
    worst_name, worst = max(errors.items(), key=lambda item: item[1])
    problems = [] if worst <= BOUND else [f"first step: {worst_name} off by {worst:.2e} > {BOUND:.0e}"]
    if rank == 0:
        print(ring_rewrite.Report(backend.records))
        print(
            f"first step ({time.perf_counter() - start:.1f} s, rows {lengths[0].tolist()}) vs one process "
            f"with float64 reference attention: loss {loss.item():.6f} / {ref_loss.item():.6f}, worst of "
            f"{len(errors)} (loss, {len(errors) - 1} gradients) {worst:.2e} ({worst_name}), bound {BOUND:.0e}",
            flush=True,
        )  # fmt: skip
    optimizer.step()
    optimizer.zero_grad()

    for i in range(1, args.steps + 1):
        loss = step(i)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {i}/{args.steps}: rows {lengths[i].tolist()}, loss {loss.item():.4f}", flush=True)

    sites = {record.location for record in backend.records}
    graphs = len(backend.records) // max(len(sites), 1)
    left_alone = [record for record in backend.records if not record.rewritten]
    if left_alone:
        problems.append(f"sites left alone: {left_alone}")
    buckets = {1 << (max(row) - 1).bit_length() for row in lengths.tolist()}
    if graphs > len(buckets):
        problems.append(f"{graphs} graphs compiled for {len(buckets)} buckets of lengths")
    verdict = (
        f"rank {rank}/{world}: {args.steps + 1} batches of {len(set(lengths.max(1).values.tolist()))} "
        f"lengths in {graphs} compiled graphs, first step worst {worst:.2e}, bound {BOUND:.0e}"
    )
    print(f"OK {verdict}" if not problems else f"FAIL {verdict}\n  " + "\n  ".join(problems), flush=True)
    if distributed:
        dist.destroy_process_group()
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
