"""A Hugging Face KV cache that stays sharded: each rank keeps the keys and values of its own part
of the sequence, and decode steps merge the ranks' partial results (Note [A sharded KV cache]).

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
import torch.distributed as dist
from transformers.cache_utils import Cache, DynamicLayer

from .comm.groups import resolve_group
from .decode import sharded_keys
from .layout import positions, shard_batch

__all__ = ["ShardedCache", "prefill"]


# Note [An even cache]
# ~~~~~~~~~~~~~~~~~~~~
# The prefill pads the prompt (to a bucket, and to a multiple of the shards) and cuts it by the
# layout, so the padding lands on some ranks only: a contiguous cut of 516 tokens padded to 1,024
# over 4 ranks leaves ranks 0 and 1 256 prompt tokens each, rank 3 none. A decode step attends
# each rank's keys at the positions the cache names (Note [A sharded KV cache]),
# so which rank holds a key changes nothing but the order of a sum. After the prefill the ranks
# even out: every rank keeps at most ``ceil(N / P)`` prompt tokens (N those the prefill ran), a
# rank above it sends its surplus to the ranks below (one batch of point-to-point transfers per
# cache, every layer's keys and values; ``_moves`` plans it the same on every rank from the
# layout alone), and every rank pads its part with its own padding keys (position -1) up to
# ``ceil(N / P)`` so that the ranks' shapes match and their decode steps compile alike. The
# padding is dropped: the cache per rank is ``ceil(N / P)`` keys, not the padded shard.


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

    def place(self, keys: torch.Tensor, values: torch.Tensor, at: torch.Tensor, length: int, attends: bool, layout: str, world: int) -> None:
        """Hold the prefill's ``keys`` and ``values`` at positions ``at`` (-1: padding) of a
        prompt of ``length`` tokens, cut by ``layout`` over ``world`` ranks."""
        self.keys, self.values, self.positions = keys, values, at
        self.layout, self.world = layout, world
        self.length = torch.tensor(length, device=at.device)
        self.attends = torch.tensor(attends, device=at.device)


class ShardedCache(Cache):
    """A transformers ``Cache`` whose every layer holds this rank's part of the keys and values
    (Note [A sharded KV cache]). Made and filled by ``prefill``;
    ``model.generate(..., cache=cache)`` goes on from it."""

    def __init__(self, *, group=None, layout: str = "contiguous"):
        super().__init__(layer_class_to_replicate=ShardedLayer)
        self.group, self.world, self.rank = resolve_group(group)
        self.layout = layout

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Where the step's tokens go in this rank's keys (its keys so far): transformers builds
        masks in that frame, and with one new token and no padding builds none."""
        if layer_idx < len(self.layers) and self.layers[layer_idx].is_initialized:
            return self.layers[layer_idx].keys.shape[-2]
        return 0

    def _place(self, padded: int, length: int) -> None:
        """After the prefill of ``padded`` tokens of which the first ``length`` are the prompt:
        even out the ranks' parts (Note [An even cache]) and name each key's position."""
        device = self.layers[0].keys.device
        held = [positions(padded, world=self.world, rank=r, layout=self.layout, device=device) for r in range(self.world)]
        real = [at[at < length] for at in held]  # each rank's prompt positions, in its order
        share = -(-length // self.world)
        moves = _moves([len(x) for x in real], share)
        mine, count = held[self.rank], len(real[self.rank])
        order = torch.argsort((mine >= length).to(torch.int8), stable=True)  # its prompt first, then padding
        sent = [(dst, start, k) for src, dst, start, k in moves if src == self.rank]
        got = [(src, start, k) for src, dst, start, k in moves if dst == self.rank]
        kept = order[: min(count, share)]
        pad = order[count:][: share - len(kept) - sum(k for *_, k in got)]
        at = torch.cat([mine[kept], *(real[src][start : start + k] for src, start, k in got), mine[pad].fill_(-1)])

        ops, parts = [], []
        for i, layer in enumerate(self.layers):
            for j, x in enumerate((layer.keys, layer.values)):
                for dst, start, k in sent:
                    part = x[:, :, order[start : start + k]].contiguous()
                    ops.append(dist.P2POp(dist.isend, part, group=self.group, group_peer=dst, tag=2 * i + j))
                for src, _, k in got:
                    part = x.new_empty(*x.shape[:2], k, *x.shape[3:])
                    ops.append(dist.P2POp(dist.irecv, part, group=self.group, group_peer=src, tag=2 * i + j))
                    parts.append(part)
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

        received = iter(parts)
        for layer in self.layers:
            keys, values = (
                torch.cat([x[:, :, kept], *(next(received) for _ in got), x[:, :, pad]], 2)
                for x in (layer.keys, layer.values)
            )  # fmt: skip
            # NOTE: a tensor of positions per layer, as each layer's step appends its own: layers
            # that shared one would reach the first step's graph as one input, the next as two.
            layer.place(keys, values, at.clone(), length, attends=self.rank == 0, layout=self.layout, world=self.world)


def _moves(counts: list[int], share: int) -> list[tuple[int, int, int, int]]:
    """``(src, dst, start, k)``: rank ``src`` sends its prompt tokens ``start .. start + k - 1``
    (in its order) to ``dst``, so that no rank holds more than ``share`` and the ranks below it
    fill up in rank order."""
    spare = [[r, share, c - share] for r, c in enumerate(counts) if c > share]
    moves = []
    for dst, c in enumerate(counts):
        need = share - c
        while need > 0 and spare:
            src, start, left = spare[0]
            k = min(need, left)
            moves.append((src, dst, start, k))
            need -= k
            spare[0][1:] = [start + k, left - k]
            if left == k:
                spare.pop(0)
    return moves


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
    values of its part, the ranks evened out so that each holds ``ceil((N - 1) / P)`` of the
    prompt's tokens whatever the padding (Note [An even cache]). The prefill computes the padded
    length (a power of two with ``buckets``, one compiled prefill per bucket; ``buckets=False``
    pads only to a multiple of the shards, at one compiled prefill per prompt length).
    ``model.generate(input_ids, cache=cache, ...)``
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
