"""Train a Hugging Face causal LM with ``transformers.Trainer`` and context parallel, by one argument.

    torchrun --standalone --nproc-per-node 4 examples/trainer_hf.py --cp 2   # (dp, cp) = (2, 2)
    torchrun --standalone --nproc-per-node 4 examples/trainer_hf.py --cp 4   # (dp, cp) = (1, 4)
    torchrun --standalone --nproc-per-node 2 examples/trainer_hf.py --fast   # what the tests run

The script is the one a ``Trainer`` user writes, with ``Trainer`` replaced by
``ring_rewrite.RingTrainer`` and one more argument::

    trainer = ring_rewrite.RingTrainer(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                                       data_collator=collate, ring=dict(cp=2, **CONFIG))

RingTrainer builds the ``(dp, cp)`` mesh, deals batches over the dp replicas, compiles the model's
body with the ``ring_dilated`` backend in sharded mode and cuts every batch across each ring.

The model is a tiny Llama (GQA, RoPE) built from a config, random weights, nothing downloaded; the
data are rows of random lengths padded to the longest row of their batch (``attention_mask``,
``labels`` -100 on the padding), and gradients are accumulated over two batches. Before the first
optimizer step the loss and every parameter gradient are checked against one process running the
same model on every replica's batches with the float64 ``reference_attention`` in place of SDPA;
after a few steps, so is the evaluation loss. The script exits non-zero beyond the float32 bound
(1e-5 relative, per tensor).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

import ring_rewrite
from ring_rewrite.reference import reference_attention

BOUND = 1e-5  # relative: max-abs difference / max-abs value, per tensor
VOCAB = 128
CONFIG = {"segment_lengths": [32, 128], "dilation_rates": [1, 2]}  # LongNet-style, two branches


def build_model() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2, pad_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    return transformers.LlamaForCausalLM(config)


def rows(count: int, low: int, high: int, seed: int) -> list[dict[str, list[int]]]:
    """``count`` rows of ``low`` to ``high`` random tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=g).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]


def collate(features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Rows padded on the right to the longest, as DataCollatorWithPadding pads them, with
    ``labels`` (-100 on the padding)."""
    n = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), n, dtype=torch.long)
    mask = torch.zeros(len(features), n, dtype=torch.long)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[row, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Recorder:
    """The collator, keeping the whole batches it made (this rank's replica's), for the check."""

    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []

    def __call__(self, features):
        batch = collate(features)
        self.batches.append(batch)
        return batch


def reference_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as the dilated config defines it, in float64 (transformers looks SDPA up at call time)."""
    return reference_attention(q, k, v, is_causal=is_causal, scale=scale, key_bias=attn_mask, **CONFIG).to(q.dtype)


def reference_loss(model, batches: list[dict[str, torch.Tensor]], backward: bool) -> torch.Tensor:
    """One process over ``batches`` together: the sum of every labelled token's loss divided by
    their count (what Trainer's loss is over replicas and accumulation steps)."""
    count = sum((b["labels"][:, 1:] != -100).sum() for b in batches)
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = reference_sdpa
    try:
        total = torch.zeros(())
        for batch in batches:
            loss = model(**batch, use_cache=False, num_items_in_batch=count).loss
            if backward:
                loss.backward()
            total += loss.detach()
    finally:
        F.scaled_dot_product_attention = original
    return total


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def every_replica(batches: list, cp: int) -> list[list]:
    """The whole batches of every replica (a list each), from the cp rank 0 of each, on every rank."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, batches)
    return [part for rank, part in enumerate(gathered) if rank % cp == 0]


class FirstStepCheck(transformers.TrainerCallback):
    """Before the first optimizer step: the gradients (DDP's average, what the optimizer uses)
    against one process on every replica's batches of the step."""

    def __init__(self, recorder: Recorder, reference, cp: int) -> None:
        self.recorder, self.reference, self.cp = recorder, reference, cp
        self.errors: dict[str, float] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step:
            return
        # NOTE: accelerate's loader collates one batch ahead.
        replicas = every_replica(self.recorder.batches[: args.gradient_accumulation_steps], self.cp)
        batches = [b for part in replicas for b in part]
        self.loss = reference_loss(self.reference, batches, backward=True)
        grads = dict(self.reference.named_parameters())
        self.errors = {f"grad {name}": rel(p.grad, grads[name].grad) for name, p in model.named_parameters()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2, help="ranks that share each sequence (divides the ranks)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--max-len", type=int, default=300, help="rows are 20 to this many tokens long")
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--fast", action="store_true", help="short rows and 2 steps (for the tests)")
    args = parser.parse_args()
    if args.fast:
        args.steps, args.max_len = 2, 100
    torch.set_num_threads(1)

    model = build_model()
    reference = copy.deepcopy(model).double()
    train, held_out = rows(64, 20, args.max_len, seed=1), rows(8, 20, args.max_len, seed=2)
    recorder = Recorder()
    output = tempfile.mkdtemp(prefix="trainer_hf_")
    training = transformers.TrainingArguments(
        output_dir=output, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        gradient_accumulation_steps=2, max_steps=args.steps, learning_rate=3e-3, max_grad_norm=0.0,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        torch_compile_backend="ring_dilated",
    )  # fmt: skip
    trainer = ring_rewrite.RingTrainer(
        model=model, args=training, train_dataset=train, eval_dataset=held_out, data_collator=recorder,
        ring=dict(cp=args.cp, compiler=args.compiler, **CONFIG),
    )  # fmt: skip
    world, rank = trainer.args.world_size, trainer.args.process_index
    check = FirstStepCheck(recorder, reference, args.cp)
    trainer.add_callback(check)
    trainer.train()
    train_loss = next(log["loss"] for log in trainer.state.log_history if "loss" in log)
    errors = {"loss": abs(train_loss - check.loss.item()) / abs(check.loss.item()), **check.errors}

    recorder.batches.clear()
    metrics = trainer.evaluate()
    # One process on the same evaluation batches: each step's batches of every replica together.
    reference.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    dp = world // args.cp
    with torch.no_grad():
        steps = list(zip(*every_replica(recorder.batches, args.cp)))
        expected = sum(reference_loss(reference, step, backward=False).item() for step in steps) / len(steps)
    errors["eval loss"] = abs(metrics["eval_loss"] - expected) / abs(expected)

    worst_name, worst = max(errors.items(), key=lambda item: item[1])
    left_alone = [r for r in trainer.ring_backend.records if not r.rewritten]
    problems = [f"{worst_name} off by {worst:.2e} > {BOUND:.0e}"] if worst > BOUND else []
    problems += [f"sites left alone: {left_alone}"] if left_alone else []
    if rank == 0:
        print(ring_rewrite.Report(trainer.ring_backend.records))
        print(
            f"(dp, cp) = ({dp}, {args.cp}): first step loss {train_loss:.6f} / one process {check.loss.item():.6f}; "
            f"eval loss {metrics['eval_loss']:.6f} / one process {expected:.6f}; worst of {len(errors)} "
            f"(loss, {len(errors) - 2} gradients, eval loss) {worst:.2e} ({worst_name}), bound {BOUND:.0e}",
            flush=True,
        )  # fmt: skip
    verdict = f"rank {rank}/{world}: (dp, cp) = ({dp}, {args.cp}), worst {worst:.2e}, bound {BOUND:.0e}"
    print(f"OK {verdict}" if not problems else f"FAIL {verdict}\n  " + "\n  ".join(problems), flush=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
