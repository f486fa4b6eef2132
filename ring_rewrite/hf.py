"""Context parallel for Hugging Face ``Trainer`` (and TRL's ``SFTTrainer``) by one argument.

``RingTrainer(..., ring=dict(cp=2))`` is a ``transformers.Trainer`` that runs under ``torchrun``
on a ``(dp, cp)`` mesh: every ``cp`` ranks share each sample of their replica's batches, the
model's body is compiled with the ``ring_dilated`` backend in sharded mode on ``mesh["cp"]``, and
each batch goes through ``shard_batch`` before the model sees it (Note [Trainer on a (dp, cp)
mesh]). ``ring_trainer(SFTTrainer)`` makes the same of another ``Trainer`` subclass.

Needs ``transformers`` and ``accelerate`` (imported here only).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import transformers

from .backend import backend as make_backend
from .config import RingDilatedConfig
from .layout import layout_of, shard_batch, unshard

__all__ = ["RingTrainer", "ring_trainer"]

# ``ring=`` keys beside the config's fields: how batches are cut.
_BATCH_KEYS = ("cp", "buckets")
_CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(RingDilatedConfig) if f.name not in ("group", "sharding"))
# Hints for variable-length kernels (flash attention) that describe the whole sequence, not a shard;
# an SDPA site reads the documents from ``position_ids`` instead.
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


# Note [Trainer on a (dp, cp) mesh]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# World = dp x cp ranks; rank d * cp + c is rank c of the ring of replica d (init_device_mesh's
# order). What ``Trainer`` does over the whole world and what changes:
#
# * data: accelerate shards every data loader over dp only (replica d takes batches d, d + dp, ...
#   of the one order every rank draws), so the cp ranks of a replica load the same whole batch;
# * the model: its body (``model.base_model``: the layers where attention is) is compiled in place
#   with the sharded backend on mesh["cp"]; the head and the loss run eagerly on the shard;
# * batches: ``compute_loss`` cuts each whole batch with ``shard_batch`` (padding to a bucket,
#   global ``position_ids``, labels shifted over the whole sequence);
# * the loss: Trainer counts the labelled tokens ``N`` of the whole batches (over its accumulation
#   steps, and over every rank with ``average_tokens_across_devices``, where ``get_cp_size``
#   divides the cp copies out again) and multiplies the loss by the world size, because DDP
#   averages gradients over all ranks. Rank (d, c)'s loss is then ``S_dc * world / N``, ``S_dc``
#   the sum over its own tokens: the mean over c is replica d's loss as Trainer computes it for a
#   replica holding the whole sequence, and DDP's average over the world is the gradient of the
#   mean over replicas: one process on the whole global batch. Where Trainer passes no count
#   (an evaluation under a subclass's ``prediction_step``), ``compute_loss`` counts it as Trainer
#   would, so that the same holds;
# * evaluation: ``prediction_step`` averages the loss over cp and puts every output of the shard's
#   tokens back to the whole sequence (cut to the batch's length), with the whole labels; the
#   evaluation loop then gathers over dp only, one copy per replica, so losses and metrics are
#   those of the whole sequences. Logged training losses are means over the world, which the same
#   arithmetic makes the replicas' mean.


def _check_ring_keys(ring: Mapping[str, Any]) -> None:
    unknown = sorted(set(ring) - set(_BATCH_KEYS) - set(_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"RingTrainer: ring= has no key(s) {unknown}; it takes {list(_BATCH_KEYS)} and the backend's "
            f"{list(_CONFIG_KEYS)} (the group is mesh['cp'] and sharding 'sharded', set by RingTrainer)"
        )


def _config_and_options(ring: Mapping[str, Any], world: int) -> tuple[int, bool | str, dict[str, Any]]:
    """``cp``, ``buckets`` and the backend's fields from ``ring``, checked."""
    cp = ring.get("cp", world)
    if not isinstance(cp, int) or cp < 1 or world % cp:
        raise ValueError(f"RingTrainer: ring['cp'] = {cp!r} must be a positive divisor of the {world} ranks")
    fields = {key: ring[key] for key in _CONFIG_KEYS if key in ring}
    fields.setdefault("layout", "zigzag")  # balances causal work across the ring
    # Exact attention on the ring buckets each shard in the graph, computing none of its
    # padding (shard_batch's buckets="shards"); dilated sites read positions, so they pad whole.
    exact = fields.get("segment_lengths") is None and fields.get("comm", "ring") == "ring"
    buckets = ring.get("buckets", "shards" if exact else True)
    if buckets not in (True, False, "shards"):
        raise ValueError(f"RingTrainer: ring['buckets'] must be True, False or 'shards', got {buckets!r}")
    return cp, buckets, fields


def _check_args(args: transformers.TrainingArguments, compiler: str) -> transformers.TrainingArguments:
    """A copy of ``args`` without accelerate's own compile, or the reason they cannot compose."""
    if args.torch_compile and args.torch_compile_backend not in (None, "ring_dilated", compiler):
        raise ValueError(
            f"RingTrainer: torch_compile_backend={args.torch_compile_backend!r}: RingTrainer compiles the model "
            "with the ring_dilated backend itself; pass torch_compile_backend='ring_dilated' (or leave torch_compile "
            "off), and choose what lowers the rewritten graph with ring=dict(compiler=...)"
        )
    if args.fsdp:
        raise ValueError(
            "RingTrainer: FSDP is not supported; leave fsdp unset (under torchrun, DDP replicates the model "
            "and averages its gradients over every rank)"
        )
    if args.deepspeed or getattr(args, "parallelism_config", None) is not None:
        raise ValueError(
            "RingTrainer: deepspeed and parallelism_config bring their own meshes; leave them unset "
            "(ring=dict(cp=...) builds the (dp, cp) mesh)"
        )
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        raise ValueError(
            "RingTrainer: activation (gradient) checkpointing puts each layer's attention inside a checkpointed "
            "region, which the rewrite does not enter; pass activation_checkpointing=False and "
            "gradient_checkpointing=False (TRL's configs turn it on by default)"
        )
    if args.bf16 or args.fp16:
        raise ValueError(
            "RingTrainer: bf16 / fp16 autocast gives attention query, key and value of mixed dtypes (the rotary "
            "embedding's float32 promotes q and k), which the ring refuses; pass bf16=False, fp16=False (TRL's "
            "configs turn bf16 on by default) and cast the model itself, model.to(torch.bfloat16), instead"
        )
    if args.label_smoothing_factor:
        raise ValueError(
            "RingTrainer: label_smoothing_factor shifts labels inside a shard; leave it 0 "
            "(the model's own loss reads the labels shifted over the whole sequence)"
        )
    if getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        raise ValueError(
            "RingTrainer: train_sampling_strategy='batch_rebalance' deals batches over every rank; use "
            "'random', 'sequential' or 'group_by_length' (RingTrainer deals them over the replicas)"
        )
    args = copy.copy(args)
    args.torch_compile, args.torch_compile_backend, args.torch_compile_mode = False, None, None
    return args


class _ShardedBatch(dict):
    """A batch already cut to this rank's tokens (Trainer keeps a mapping's type)."""


class _RingMixin:
    """What ``ring_trainer`` adds to a ``Trainer`` class (Note [Trainer on a (dp, cp) mesh])."""

    def __init__(self, *args, ring: Mapping[str, Any] | None = None, **kwargs):
        ring = dict(ring or {})
        _check_ring_keys(ring)
        compiler = ring.get("compiler", "inductor")
        if len(args) > 1:  # Trainer(model, args, ...)
            args = (args[0], _check_args(args[1], compiler), *args[2:])
        elif kwargs.get("args") is not None:
            kwargs["args"] = _check_args(kwargs["args"], compiler)
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError(
                "RingTrainer: compute_loss_func receives a shard's outputs with its unshifted labels; fold the loss "
                "into the model's forward (it gets shift_labels and num_items_in_batch) instead"
            )
        super().__init__(*args, **kwargs)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:  # set up by accelerate's launcher
            raise ValueError(
                "RingTrainer: FSDP and DeepSpeed are not supported; launch with torchrun or "
                "accelerate launch --multi_gpu (DDP)"
            )
        world = self.args.world_size
        self._cp, self._buckets, fields = _config_and_options(ring, world)
        self._dp = world // self._cp
        self._layout = fields["layout"]
        rates = fields.get("dilation_rates") or (1,)
        # Each shard must hold whole lattices of every branch's rate.
        self._multiple_of = self._cp * layout_of(self._layout).parts * math.lcm(*rates)
        if dist.is_available() and dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(self.args.device.type, (self._dp, self._cp), mesh_dim_names=("dp", "cp"))
            self._cp_group = self.mesh["cp"]
            self._dp_group = self.mesh["dp"].get_group()
        else:
            self.mesh, self._cp_group, self._dp_group = None, None, None
        model = self.model
        attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if attention not in ("sdpa", "eager"):
            raise ValueError(
                f"RingTrainer: the model's attention is {attention!r}; the ring rewrites SDPA and eager attention: "
                "build it with attn_implementation='sdpa'"
            )
        if not self.model_accepts_loss_kwargs:
            raise ValueError(
                f"RingTrainer: {type(model).__name__}.forward takes no loss kwargs (shift_labels, "
                "num_items_in_batch): its loss over a shard would be the shard's mean, not the sequence's"
            )
        checkpointing = getattr(type(model), "is_activation_checkpointing", None)
        if checkpointing is not None and model.is_activation_checkpointing:
            raise ValueError(
                "RingTrainer: the model has activation checkpointing on, which hides its attention from the "
                "rewrite; call model.gradient_checkpointing_disable()"
            )
        self.ring_backend = make_backend(sharding="sharded", group=self._cp_group, **fields)
        body = getattr(model, "base_model", model)
        body.compile(backend=self.ring_backend)
        self._shard_tokens = 0
        self._prepare_loaders_over_replicas()

    # ---- data: over the replicas ----------------------------------------------------------------

    def _prepare_loaders_over_replicas(self) -> None:
        """Make the accelerator deal every data loader it prepares over dp, not the world."""
        from accelerate.data_loader import prepare_data_loader

        accelerator = self.accelerator
        replica = self.args.process_index // self._cp

        def prepare(data_loader, device_placement=None, slice_fn_for_dispatch=None):
            if getattr(data_loader, "_is_accelerate_prepared", False):
                return data_loader
            prepared = prepare_data_loader(
                data_loader, accelerator.device, num_processes=self._dp, process_index=replica,
                split_batches=accelerator.split_batches,
                put_on_device=accelerator.device_placement if device_placement is None else device_placement,
                rng_types=accelerator.rng_types.copy(),
                dispatch_batches=False,  # NOTE: a dispatcher slices batches over every rank
                even_batches=accelerator.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
                use_seedable_sampler=accelerator.use_seedable_sampler,
                data_seed=accelerator.dataloader_config.data_seed, non_blocking=accelerator.non_blocking,
                use_stateful_dataloader=accelerator.use_stateful_dataloader,
            )  # fmt: skip
            accelerator._dataloaders.append(prepared)
            return prepared

        accelerator.prepare_data_loader = prepare

    def get_cp_size(self) -> int:
        return self._cp

    # ---- batches and the loss -----------------------------------------------------------------

    def _shard(self, inputs: Mapping[str, Any]) -> _ShardedBatch:
        if isinstance(inputs, _ShardedBatch):
            return inputs
        ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
            raise ValueError(
                f"RingTrainer: a batch with keys {sorted(inputs)} has no input_ids (B, N) to cut across the ring; "
                "use a data collator that returns input_ids (DataCollatorWithPadding, "
                "DataCollatorForLanguageModeling, DataCollatorWithFlattening, TRL's collators)"
            )
        labels = inputs.get("labels")
        if isinstance(labels, torch.Tensor) and (labels.dim() < 2 or labels.shape[1] != ids.shape[1]):
            raise ValueError(
                f"RingTrainer: labels of shape {tuple(labels.shape)} are not one per token of input_ids "
                f"{tuple(ids.shape)}; context parallel trains token-level losses (causal LM, masked LM, "
                "token classification)"
            )
        whole = {key: value for key, value in inputs.items() if key not in _VARLEN_KEYS}
        if "labels" in whole:
            whole.pop("shift_labels", None)  # shifted again over the whole sequence
        config = getattr(self.model, "config", None)
        pad = getattr(config, "pad_token_id", None)
        batch = shard_batch(
            whole, group=self._cp_group, layout=self._layout, shift_labels=getattr(self, "_loss_shifts_labels", True),
            buckets=self._buckets, multiple_of=self._multiple_of, pad_token_id=pad if isinstance(pad, int) else 0,
        )  # fmt: skip
        if getattr(config, "use_cache", None) is not None:
            batch.setdefault("use_cache", False)  # a cache of a shard is no cache of the sequence
        self._shard_tokens = batch["position_ids"].shape[1]
        return _ShardedBatch(batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if num_items_in_batch is None and not isinstance(inputs, _ShardedBatch) and "labels" in inputs:
            num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
        result = super().compute_loss(
            model, self._shard(inputs), return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if not any(record.rewritten for record in self.ring_backend.records):
            # NOTE: a sharded model whose attention the rewrite never saw attends within each shard only.
            raise RuntimeError(
                "RingTrainer: the model ran without a rewritten attention site (its body was not compiled, or "
                f"its attention is out of the rewrite's sight): {self.ring_backend.records or 'no site found'}"
            )
        return result

    # ---- evaluation: the whole sequence, once per replica -----------------------------------

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
        n = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else 0  # else _shard raises
        labelled = bool(self.label_names) and all(inputs.get(name) is not None for name in self.label_names)
        if not labelled:  # Trainer calls the model itself
            inputs = self._shard(self._prepare_inputs(inputs))
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if loss is not None and self._cp > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=self._cp_group.get_group())
            loss = loss / self._cp
        if logits is not None:
            logits = self._whole(logits, n)
        return loss, logits, labels

    def _whole(self, outputs, n: int):
        """Every tensor of ``outputs`` with this rank's tokens along dim 1, put back to the whole
        sequence and cut to its ``n`` tokens."""
        if isinstance(outputs, (tuple, list)):
            return type(outputs)(self._whole(x, n) for x in outputs)
        if isinstance(outputs, Mapping):
            return type(outputs)({k: self._whole(v, n) for k, v in outputs.items()})
        if isinstance(outputs, torch.Tensor) and outputs.dim() >= 2 and outputs.shape[1] == self._shard_tokens:
            return unshard(outputs.contiguous(), 1, group=self._cp_group, layout=self._layout)[:, :n]
        return outputs

    def evaluation_loop(self, *args, **kwargs):
        # NOTE: Trainer sets gather_function back to accelerate's gather at the end of the loop.
        gather_objects = self.args.eval_use_gather_object
        self.gather_function = functools.partial(self._gather_replicas, use_gather_object=gather_objects)
        return super().evaluation_loop(*args, **kwargs)

    def _gather_replicas(self, data, use_gather_object: bool = False):
        """``accelerator.gather_for_metrics`` over dp: the cp ranks of a replica hold the same values."""
        from accelerate.utils import recursively_apply

        def gather(t: torch.Tensor) -> torch.Tensor:
            t = t.contiguous() if t.dim() else t[None]
            out = [torch.empty_like(t) for _ in range(self._dp)]
            dist.all_gather(out, t, group=self._dp_group)
            return torch.cat(out)

        try:
            recursively_apply(lambda x: x, data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
        if self._dp == 1:
            gathered = data if use_gather_object else recursively_apply(lambda t: t if t.dim() else t[None], data)
        elif use_gather_object:
            parts: list = [None] * self._dp
            dist.all_gather_object(parts, data, group=self._dp_group)
            gathered = [x for part in parts for x in part]
        else:
            gathered = recursively_apply(gather, data)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # the last batches repeat samples to even out
            cut = lambda x: x[: state.remainder]  # noqa: E731
            return cut(gathered) if use_gather_object else recursively_apply(cut, gathered)
        return gathered


@functools.cache
def ring_trainer(base: type) -> type:
    """A subclass of the ``Trainer`` class ``base`` that trains with context parallel.

    The subclass takes ``base``'s arguments and one more, ``ring`` (as ``RingTrainer``'s); use it
    for a ``Trainer`` subclass such as TRL's ``SFTTrainer``. ``ring_trainer(transformers.Trainer)``
    is ``RingTrainer``.

    Args:
        base (type): ``transformers.Trainer`` or a subclass of it.

    Returns:
        type: the subclass, made once per ``base``.

    Raises:
        TypeError: ``base`` is not a ``transformers.Trainer`` class.

    Example::

        from trl import SFTConfig, SFTTrainer
        trainer = ring_rewrite.ring_trainer(SFTTrainer)(model=model, args=SFTConfig(..., packing=True),
                                                        train_dataset=rows, ring=dict(cp=2))
        trainer.train()

    .. warning::
        Tested on CPU over gloo only; NCCL process groups have never run.
    """
    if base is transformers.Trainer and "RingTrainer" in globals():
        return RingTrainer
    if not (isinstance(base, type) and issubclass(base, transformers.Trainer)):
        raise TypeError(f"ring_trainer: {base!r} is not a transformers.Trainer class")
    return type(f"Ring{base.__name__}", (_RingMixin, base), {"__module__": __name__, "__doc__": _RingMixin.__doc__})


class RingTrainer(_RingMixin, transformers.Trainer):
    """A ``transformers.Trainer`` that trains with context parallel: each sample's sequence cut
    across the ranks of a ring, attention rewritten into ring (dilated) attention.

    Run it under ``torchrun --nproc-per-node P`` with ``cp`` dividing ``P``. It takes
    ``Trainer``'s arguments and ``ring``; from them it builds a ``(dp, cp)`` mesh
    (``self.mesh``), deals the train and evaluation batches over the ``dp = P / cp`` replicas
    (every rank of a ``cp`` group gets the same batch), compiles the model's body in place with
    the ``ring_dilated`` backend in sharded mode on ``mesh["cp"]`` (``self.ring_backend`` keeps
    its site records), and cuts every batch with ``ring_rewrite.shard_batch`` (padding, packed
    ``position_ids``, next-token labels shifted over the whole sequence, the label count). DDP
    averages the gradients over every rank, and the losses are scaled so that the result is the
    gradient of one process on the whole global batch, with gradient accumulation too; the
    evaluation loss, predictions and metrics are those of the whole sequences; logs and
    checkpoints are written once, by rank 0 (Note [Trainer on a (dp, cp) mesh]).

    Args:
        *args, **kwargs: ``transformers.Trainer``'s (``model``, ``args``, ``data_collator``,
            ``train_dataset``, ``eval_dataset``, ...). ``args.torch_compile_backend`` may be
            ``"ring_dilated"``; the model's attention must be ``"sdpa"`` or ``"eager"``.
        ring (dict, optional): ``cp`` (the ranks that share a sequence; default: all of
            them), ``buckets`` (``shard_batch``'s: one compiled graph per bucket of lengths;
            default ``"shards"`` for exact attention on the ring, whose graph computes none of
            a shard's padding, else ``True``) and any ``RingDilatedConfig`` field but ``group`` and
            ``sharding``: ``segment_lengths``, ``dilation_rates``, ``layout`` (default
            ``"zigzag"`` here), ``compiler``, ``strict``, ``timeout``, ``disable_passes``.
            Default: ``None`` (exact ring attention over every rank).

    Raises:
        ValueError: what cannot compose, naming the fix: an unknown ``ring`` key, ``cp`` that
            does not divide the ranks, ``torch_compile_backend`` other than ``"ring_dilated"``
            (or the ring's compiler), FSDP, DeepSpeed, ``parallelism_config``, label smoothing,
            ``compute_loss_func``, ``train_sampling_strategy="batch_rebalance"``, a model
            without SDPA or eager attention or without loss kwargs; at the first batch, a batch
            without ``input_ids`` or with labels that are not one per token.

    Example::

        trainer = ring_rewrite.RingTrainer(model=model, args=TrainingArguments(...), train_dataset=rows,
                                           data_collator=collator, ring=dict(cp=2, segment_lengths=[2048, 8192],
                                                                             dilation_rates=[1, 4]))
        trainer.train()   # torchrun --nproc-per-node 4 train.py: dp = 2 replicas x rings of 2

    .. warning::
        Tested on CPU over gloo only; NCCL process groups have never run.
    """
