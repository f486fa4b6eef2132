"""``RingTrainer`` and ``ring_trainer``: Hugging Face ``Trainer`` (and TRL's ``SFTTrainer``) with
context parallel by one argument, on gloo ranks under inductor.

At P = 4 as ``(dp, cp) = (2, 2)``: batches dealt over the replicas (the same on the ranks of a ring,
others across replicas), every site rewritten on the shard's tokens, the first step's loss and
every gradient (two accumulated batches) equal to one process on all replicas' batches with the
float64 reference attention, then the evaluation loss and a metric over the whole sequences, and a
checkpoint written once. At P = 2: packed sequences (transformers' ``DataCollatorWithFlattening``,
TRL's ``SFTTrainer`` with ``packing=True``) and TRL with padding, first step against one process.
In one process: every combination that cannot compose is an error naming its fix.

A tiny Llama (1 layer, hidden 32, GQA), random weights, nothing downloaded; rows of 33 to 64
tokens, so that every batch pads to the one bucket of 64 and each trainer compiles one graph."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ring_rewrite  # noqa: E402
from conftest import rel_err  # noqa: E402
from ranks import run_ranks  # noqa: E402
from ring_rewrite.reference import reference_attention  # noqa: E402

BOUND = 1e-5
V = 64
CONFIG = {"segment_lengths": [16, 64], "dilation_rates": [1, 2]}
TIMEOUT = 120.0  # seconds a rank waits for a peer's transfer (covers a peer's compile)


def _model(attention: str = "sdpa") -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0,
        attn_implementation=attention,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _rows(count: int, seed: int) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(33, 65, (count,), generator=g).tolist()
    return [{"input_ids": torch.randint(1, V, (n,), generator=g).tolist()} for n in lengths]


def _collate(features) -> dict[str, torch.Tensor]:
    """Padding on the right to the longest row, ``labels`` -100 there."""
    n = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), n, dtype=torch.long)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class _Recorder:
    """A collator that keeps the whole batches it made."""

    def __init__(self, collate) -> None:
        self.collate, self.batches = collate, []

    def __call__(self, features):
        self.batches.append(self.collate(features))
        return self.batches[-1]


def _reference_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return reference_attention(q, k, v, is_causal=is_causal, scale=scale, key_bias=attn_mask, **CONFIG).to(q.dtype)


def _reference(model, batches, backward: bool = True):
    """One process over ``batches`` together (float64, reference attention): the summed token
    losses over their count, and the logits of each batch."""
    count = sum((b["labels"][:, 1:] != -100).sum() for b in batches)
    total, logits = torch.zeros((), dtype=torch.float64), []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", _reference_sdpa)
        for batch in batches:
            keep = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels", "position_ids")}
            out = model(**keep, use_cache=False, num_items_in_batch=count)
            if backward:
                out.loss.backward()
            total += out.loss.detach()
            logits.append(out.logits.detach())
    return total, logits


def _replicas(batches: list, cp: int) -> list[list]:
    """Every replica's batches, from the first rank of each ring."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, batches)
    return [part for rank, part in enumerate(gathered) if rank % cp == 0]


class _FirstStep(transformers.TrainerCallback):
    """Before the first optimizer step: the gradients DDP averaged vs one process on every
    replica's accumulated batches."""

    def __init__(self, recorder: _Recorder, reference, cp: int) -> None:
        self.recorder, self.reference, self.cp = recorder, reference, cp

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step:
            return
        # NOTE: accelerate's loader collates one batch ahead.
        mine = self.recorder.batches[: args.gradient_accumulation_steps]
        self.replicas = _replicas(mine, self.cp)
        self.loss, _ = _reference(self.reference, [b for part in self.replicas for b in part])
        expected = dict(self.reference.named_parameters())
        self.errors = {name: rel_err(p.grad, expected[name].grad) for name, p in model.named_parameters()}


def _distributed_env(rank: int, world: int) -> None:
    """What torchrun sets, so that accelerate sees the process group ``run_ranks`` made."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def _args(output_dir: str, cls=None, **fields):
    common = dict(
        output_dir=output_dir, per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=1,
        learning_rate=1e-3, max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    return (cls or transformers.TrainingArguments)(**{**common, **fields})


def _label_logprob(prediction) -> dict[str, float]:
    """The mean log-probability of each next-token label: a metric of the whole sequences' logits."""
    logits = torch.as_tensor(prediction.predictions, dtype=torch.float64)[:, :-1]
    labels = torch.as_tensor(prediction.label_ids)[:, 1:]
    keep = labels != -100
    picked = logits.log_softmax(-1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    return {"label_logprob": (picked[keep].mean()).item()}


# ---- P = 4, (dp, cp) = (2, 2) ------------------------------------------------------------------


def _two_replicas_of_two(rank: int, world: int, output_dir: str) -> None:
    _distributed_env(rank, world)
    cp = 2
    model = _model()
    reference = copy.deepcopy(model).double()
    recorder = _Recorder(_collate)
    args = _args(
        output_dir, gradient_accumulation_steps=2, max_steps=2, torch_compile_backend="ring_dilated",
    )  # fmt: skip
    trainer = ring_rewrite.RingTrainer(
        model=model, args=args, train_dataset=_rows(16, seed=1), eval_dataset=_rows(8, seed=2),
        data_collator=recorder, compute_metrics=_label_logprob,
        ring=dict(cp=cp, timeout=TIMEOUT, **CONFIG),
    )  # fmt: skip
    assert trainer.mesh.mesh_dim_names == ("dp", "cp") and tuple(trainer.mesh.shape) == (2, 2)
    first = _FirstStep(recorder, reference, cp)
    trainer.add_callback(first)
    trainer.train()

    # Samplers: the ranks of a ring load the same batches, the replicas others.
    every: list = [None] * world
    dist.all_gather_object(every, [b["input_ids"] for b in recorder.batches[:2]])
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))  # noqa: E731
    assert same(every[0], every[1]) and same(every[2], every[3]), "a ring's ranks loaded other batches"
    assert not same(every[0], every[2]), "the replicas loaded the same batches"
    # Sharded: every site rewritten on this rank's 64 / cp tokens.
    records = trainer.ring_backend.records
    assert records and all(r.rewritten for r in records), records
    assert {r.shapes["query"][2] for r in records} == {64 // cp}, [r.shapes for r in records]
    # The first step: loss (the mean of the logged losses) and every gradient, two batches accumulated.
    loss = next(log["loss"] for log in trainer.state.log_history if "loss" in log)
    assert abs(loss - first.loss.item()) / first.loss.item() < BOUND, (loss, first.loss.item())
    worst = max(first.errors.items(), key=lambda item: item[1])
    assert worst[1] < BOUND, worst

    # Evaluation over the whole sequences: each step's batches of both replicas together.
    recorder.batches.clear()
    metrics = trainer.evaluate()
    reference.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    steps = list(zip(*_replicas(recorder.batches, cp)))
    with torch.no_grad():
        results = [_reference(reference, list(step), backward=False) for step in steps]
    expected_loss = sum(loss.item() for loss, _ in results) / len(steps)
    assert abs(metrics["eval_loss"] - expected_loss) / expected_loss < BOUND, (metrics, expected_loss)
    logits = [x for _, out in results for x in out]
    labels = [b["labels"] for step in steps for b in step]
    width = max(x.shape[1] for x in logits)
    pad = lambda x, fill: F.pad(x, (0, 0) * (x.dim() - 2) + (0, width - x.shape[1]), value=fill)  # noqa: E731
    whole = transformers.EvalPrediction(
        predictions=torch.cat([pad(x, -100.0) for x in logits]).numpy(),
        label_ids=torch.cat([pad(y, -100) for y in labels]).numpy(),
    )
    expected_metric = _label_logprob(whole)["label_logprob"]
    assert abs(metrics["eval_label_logprob"] - expected_metric) < BOUND * abs(expected_metric), metrics

    # A checkpoint, written by rank 0 only, holds the trained weights under their own names.
    trainer.save_model(os.path.join(output_dir, "saved"))
    dist.barrier()
    from safetensors.torch import load_file

    saved = load_file(os.path.join(output_dir, "saved", "model.safetensors"))
    state = model.state_dict()
    assert set(saved) <= set(state) and all(torch.equal(saved[k], state[k]) for k in saved), sorted(saved)


def test_two_replicas_of_two_ranks_match_one_process(tmp_path):
    run_ranks(4, _two_replicas_of_two, str(tmp_path))


# ---- P = 2: packed sequences, TRL ----------------------------------------------------------------


def _tokenizer():
    import tokenizers

    vocab = {f"t{i}": i for i in range(V)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t1")


def _first_step(trainer, model, reference, recorder: _Recorder, what: str) -> None:
    first = _FirstStep(recorder, reference, cp=2)
    trainer.add_callback(first)
    trainer.train()
    assert all(r.rewritten for r in trainer.ring_backend.records), (what, trainer.ring_backend.records)
    loss = next(log["loss"] for log in trainer.state.log_history if "loss" in log)
    assert abs(loss - first.loss.item()) / first.loss.item() < BOUND, (what, loss, first.loss.item())
    worst = max(first.errors.items(), key=lambda item: item[1])
    assert worst[1] < BOUND, (what, worst)


def _packed(rank: int, world: int, output_dir: str) -> None:
    _distributed_env(rank, world)
    ring = dict(cp=2, timeout=TIMEOUT, **CONFIG)
    # transformers' flattening collator: one row of documents, position_ids restarting at each.
    model = _model()
    reference = copy.deepcopy(model).double()
    recorder = _Recorder(transformers.DataCollatorWithFlattening())
    trainer = ring_rewrite.RingTrainer(
        model=model, args=_args(output_dir), train_dataset=_rows(8, seed=3), data_collator=recorder, ring=ring
    )
    _first_step(trainer, model, reference, recorder, "DataCollatorWithFlattening")
    assert recorder.batches[0]["input_ids"].shape[0] == 1 and "position_ids" in recorder.batches[0]

    try:
        import datasets
        from trl import SFTConfig, SFTTrainer
    except ImportError:
        return
    for packing in (True, False):
        model = _model()
        reference = copy.deepcopy(model).double()
        config = _args(
            output_dir, cls=SFTConfig, packing=packing, max_length=64, gradient_checkpointing=False, bf16=False
        )
        trainer = ring_rewrite.ring_trainer(SFTTrainer)(
            model=model, args=config, train_dataset=datasets.Dataset.from_list(_rows(8, seed=4)),
            processing_class=_tokenizer(), ring=ring,
        )  # fmt: skip
        recorder = _Recorder(trainer.data_collator)
        trainer.data_collator = recorder
        _first_step(trainer, model, reference, recorder, f"SFTTrainer packing={packing}")
        batch = recorder.batches[0]
        assert ("position_ids" in batch and batch["input_ids"].shape[0] == 1) == packing, batch.keys()


def test_packed_sequences_and_trl_match_one_process(tmp_path):
    run_ranks(2, _packed, str(tmp_path))


# ---- what cannot compose ------------------------------------------------------------------------


def _trainer(tmp_path, ring=None, model=None, **fields):
    kwargs = {key: fields.pop(key) for key in ("compute_loss_func", "data_collator") if key in fields}
    return ring_rewrite.RingTrainer(
        model=model or _model(), args=_args(str(tmp_path), **fields), train_dataset=_rows(4, seed=5),
        ring=ring or {}, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(
    "case, fix",
    [
        (dict(ring={"cp": 1, "segments": [4]}), "has no key"),
        (dict(ring={"cp": 2}), "positive divisor of the 1 ranks"),
        (dict(torch_compile=True, torch_compile_backend="aot_eager"), "torch_compile_backend='ring_dilated'"),
        (dict(activation_checkpointing=True), "activation_checkpointing=False"),
        (dict(bf16=True), "bf16=False"),
        (dict(label_smoothing_factor=0.1), "leave it 0"),
        (dict(train_sampling_strategy="batch_rebalance"), "deals them over the replicas"),
        (dict(compute_loss_func=lambda *a, **k: 0), "fold the loss"),
        (dict(model="flex_attention"), "attn_implementation='sdpa'"),
        (dict(ring={"cp": 1, "buckets": "yes"}), "must be True, False or 'shards'"),
    ],
    ids=[
        "ring-key", "cp", "compile-backend", "checkpointing", "bf16", "smoothing", "rebalance", "loss-func", "flex",
        "buckets",
    ],  # fmt: skip
)
def test_what_cannot_compose_is_an_error_naming_the_fix(tmp_path, case, fix):
    if case.get("model") == "flex_attention":
        model = _model()
        model.config._attn_implementation = "flex_attention"
        case = {**case, "model": model}
    with pytest.raises(ValueError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        _trainer(tmp_path, **case)


@pytest.mark.parametrize(
    "ring, buckets",
    [({"cp": 1}, "shards"), ({"cp": 1, **CONFIG}, True), ({"cp": 1, "buckets": False}, False)],
    ids=["exact", "dilated", "given"],
)
def test_exact_attention_pads_each_shard_to_its_bucket_by_default(tmp_path, ring, buckets):
    """Exact attention on the ring pads batches to the shards only, and its compiled graph each
    shard to its bucket (shard_batch's buckets="shards"); a dilated config reads positions, so its
    batches are padded whole to a power of two."""
    assert _trainer(tmp_path, ring=ring)._buckets == buckets


def test_a_collator_without_input_ids_is_an_error_naming_the_fix(tmp_path):
    def embeds_only(features):
        return {"inputs": torch.zeros(len(features), 40, dtype=torch.long)}

    trainer = _trainer(tmp_path, ring={"cp": 1}, data_collator=embeds_only, remove_unused_columns=False)
    with pytest.raises(ValueError, match="use a data collator that returns input_ids"):
        trainer.train()


def test_ring_dilated_as_the_compile_backend_composes(tmp_path):
    trainer = _trainer(tmp_path, ring={"cp": 1}, torch_compile=True, torch_compile_backend="ring_dilated")
    assert not trainer.args.torch_compile and trainer.ring_backend.config.sharding == "sharded"
    assert ring_rewrite.ring_trainer(transformers.Trainer) is ring_rewrite.RingTrainer
    with pytest.raises(TypeError, match="not a transformers.Trainer class"):
        ring_rewrite.ring_trainer(object)


def test_importing_the_package_imports_no_transformers():
    code = "import sys, ring_rewrite; assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
