"""A Hugging Face KV cache that stays sharded: each rank keeps the keys and values of its own part
of the sequence, and decode steps merge the ranks' partial results (Note [A sharded KV cache] in
``ring_rewrite/decode.py``).

``prefill`` runs a model compiled in sharded mode over a prompt cut across the ranks and returns
the ``ShardedCache`` it filled; ``model.generate`` then continues from it, every rank feeding the
same tokens::

    cache = ring_rewrite.prefill(model, input_ids, group=group, layout="zigzag")
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), cache=cache, max_new_tokens=64)

Needs ``transformers`` (imported here only).
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .decode import sharded_keys
from .layout import positions, shard_batch
from .p2p import resolve_group

__all__ = ["ShardedCache", "prefill"]


class ShardedLayer(DynamicLayer):
    """One layer of a ``ShardedCache``: this rank's keys and values, ``positions`` the place of
    each in the whole sequence (-1: attended on another rank, or padding), ``length`` the tokens
    of the sequence so far and ``attends`` whether new tokens are attended here (tensors: numbers
    would specialise the compiled step)."""

    is_croppable = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.layout, self.world = "contiguous", 1  # the cache's, set by ``place``
        self.positions: torch.Tensor | None = None
        self.length: torch.Tensor | None = None
        self.attends: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:  # the prefill: this rank's shard, placed by ``prefill``
            self.keys, self.values, self.is_initialized = key_states, value_states, True
            return key_states, value_states
        if self.positions is None:
            raise RuntimeError(
                "ring_rewrite: a ShardedCache is filled by ring_rewrite.prefill, which places its keys "
                "across the ranks; it was updated twice before that"
            )
        new = self.length + torch.arange(key_states.shape[-2], device=self.positions.device)
        self.keys = torch.cat([self.keys, key_states], -2)
        self.values = torch.cat([self.values, value_states], -2)
        self.positions = torch.cat([self.positions, torch.where(self.attends, new, -1)])
        self.length = self.length + key_states.shape[-2]
        return sharded_keys(self.keys, self.positions, new, self.layout, self.world), self.values

    def get_seq_length(self) -> int:
        """The tokens of the sequence so far, over every rank: where ``generate`` goes on from."""
        if self.length is not None:
            return int(self.length)
        return super().get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """This rank's keys once the step's are appended (a sharded step takes no mask:
        ``passes/rewrite_sdpa.py`` raises on one)."""
        return self.keys.shape[-2] + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ring_rewrite: a ShardedCache cannot be cropped")

    def place(self, at: torch.Tensor, length: int, attends: bool, layout: str, world: int) -> None:
        """Name the prefill's tokens' positions ``at`` (those ``>= length`` are padding), cut by
        ``layout`` over ``world`` ranks."""
        self.layout, self.world = layout, world
        self.positions = torch.where(at < length, at, -1)
        self.length = torch.tensor(length, device=at.device)
        self.attends = torch.tensor(attends, device=at.device)


class ShardedCache(Cache):
    """A transformers ``Cache`` whose every layer holds this rank's part of the keys and values
    (Note [A sharded KV cache] in ``ring_rewrite/decode.py``). Made and filled by ``prefill``;
    ``model.generate(..., cache=cache)`` goes on from it."""

    def __init__(self, *, group=None, layout: str = "contiguous"):
        super().__init__(layer_class_to_replicate=ShardedLayer)
        _, self.world, self.rank = resolve_group(group)
        self.layout = layout

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Where the step's tokens go in this rank's keys (its keys so far): transformers builds
        masks in that frame, and with one new token and no padding builds none."""
        if layer_idx < len(self.layers) and self.layers[layer_idx].is_initialized:
            return self.layers[layer_idx].keys.shape[-2]
        return 0

    def _place(self, padded: int, length: int) -> None:
        """After the prefill of ``padded`` tokens of which the first ``length`` are the prompt."""
        at = positions(padded, world=self.world, rank=self.rank, layout=self.layout, device=self.layers[0].keys.device)
        for layer in self.layers:
            layer.place(at, length, attends=self.rank == 0, layout=self.layout, world=self.world)


def prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    group=None,
    layout: str = "contiguous",
    multiple_of: int = 1,
    buckets: bool = True,
) -> ShardedCache:
    """Prefill a prompt across the ranks and keep its KV cache sharded, for ``model.generate``.

    Runs ``model`` (compiled with the ``ring_dilated`` backend, ``sharding="sharded"``) once on
    this rank's part of the prompt less its last token (cut by ``shard_batch``), under
    ``torch.no_grad``, and returns the ``ShardedCache`` it filled: each rank keeps the keys and
    values of its own part. The prefill's padding (up to a power of two with ``buckets``) stays
    in the cache at position -1, never attended, so that every rank's shapes match: a prompt just
    over a power of two nearly doubles the cache; ``buckets=False`` pads only to a multiple of
    the shards, at one compiled prefill per prompt length. ``model.generate(input_ids, cache=cache, ...)``
    (with ``attention_mask`` a tensor of ones: without one, ``generate`` reads any
    ``pad_token_id`` among the ids as padding, and a decode step over a sharded cache takes no
    mask) then feeds the last prompt token and every new one on every rank; each decode step attends
    each rank's part of the cache and merges the ranks' results exactly (one all-gather per
    layer and step), so the tokens equal those of the whole model on one process.

    Args:
        model: a Hugging Face causal LM whose forward is compiled in sharded mode.
        input_ids: the whole prompt ``(B, N)``, the same on every rank, every row of length ``N``
            (no padding: a decode step over a sharded cache takes no attention mask).
        group: the ranks that share the sequence, as the backend's ``group``. Default: ``None``.
        layout: ``"contiguous"`` or ``"zigzag"``, as the backend's ``layout``.
        multiple_of: as ``shard_batch``'s (a dilated config: every ring branch's rate).
        buckets: as ``shard_batch``'s: pad the prefill to a power of two (one graph per bucket).

    Returns:
        ShardedCache: this rank's part; pass it to ``generate`` as ``cache`` with the whole
        ``input_ids``.

    Raises:
        ValueError: a prompt of fewer than 2 tokens.

    Example::

        cache = ring_rewrite.prefill(model, input_ids, layout="zigzag")
        ones = torch.ones_like(input_ids)  # else generate reads any pad_token_id as padding
        out = model.generate(input_ids, attention_mask=ones, cache=cache, max_new_tokens=64, do_sample=False)

    .. warning::
        Tested on CPU over gloo only; NCCL process groups have never run.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"prefill: input_ids must be (B, N) with N >= 2, got {tuple(input_ids.shape)}")
    length = input_ids.shape[1] - 1
    batch = shard_batch(
        {"input_ids": input_ids[:, :length]}, group=group, layout=layout, shift_labels=False,
        buckets=buckets, multiple_of=multiple_of,
    )  # fmt: skip
    cache = ShardedCache(group=group, layout=layout)
    forward = inspect.signature(type(model).forward).parameters
    batch["cache" if "cache" in forward else "past_key_values"] = cache
    if "logits_to_keep" in forward:
        batch["logits_to_keep"] = 1  # the prefill's logits are not used
    with torch.no_grad():
        model(**batch, use_cache=True)
    cache._place(batch["input_ids"].shape[1] * cache.world, length)
    return cache
