"""Sequence layouts across ranks: cut a sequence into this rank's shard and put it back.

A layout cuts a sequence of N tokens into ``P * parts`` equal chunks and names the chunks each
rank holds, in order (``Layout.chunks``): ``"contiguous"``, rank k holds chunk k, tokens
``[kN/P, (k+1)N/P)``; ``"zigzag"``, rank k holds chunks k and 2P-1-k of 2P (balances causal
work). Everything else follows from that one method, here alone: the size of a chunk and the
check that N cuts evenly, where a rank's chunks start, a rank's tokens of a tensor (``take``), the
whole from every rank's (``assemble``), a group of ranks' tokens from theirs and back
(``regroup``, ``split``), positions. The site plan, the schedule, the program,
the rewrite, ``shard_batch`` and ``prefill`` ask ``layout_of(name)``; a new layout is one class.

``shard`` / ``unshard`` are inverses; ``take_shard`` / ``assemble`` are their static, traceable
cores (ranks and sizes as ints) used inside rewritten graphs. ``shard_batch`` cuts a whole batch
as a data loader hands it to a Hugging Face model (Note [A batch across ranks]).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .comm.groups import resolve_group

__all__ = [
    "LAYOUTS", "Layout", "assemble", "layout_of", "positions", "shard", "shard_batch", "take_shard", "unshard",
]  # fmt: skip


class Layout:
    """How a sequence is cut across ranks: ``world * parts`` equal chunks, rank ``rank`` holding
    ``chunks(rank, world)`` one after another."""

    name = ""
    parts = 1
    """Chunks per rank."""

    def chunks(self, rank: int, world: int) -> tuple[int, ...]:
        raise NotImplementedError

    def chunk_size(self, n: int, world: int) -> int:
        """Tokens per chunk of a sequence of ``n``; raises ValueError where ``n`` does not cut
        into equal chunks."""
        pieces = world * self.parts
        if n % pieces:
            raise ValueError(
                f"a sequence of {n} tokens cannot be cut into {pieces} equal "
                f"{'chunks' if self.parts > 1 else 'shards'} ({world} ranks, layout={self.name!r})"
            )
        return n // pieces

    def starts(self, n: int, world: int, rank: int) -> tuple[int, ...]:
        """The position of the first token of each chunk ``rank`` holds."""
        size = self.chunk_size(n, world)
        return tuple(c * size for c in self.chunks(rank, world))

    def take(self, x: torch.Tensor, dim: int, n: int, world: int, rank: int) -> torch.Tensor:
        """This rank's tokens of ``x`` (``n`` tokens along ``dim``): a view for one chunk."""
        size = self.chunk_size(n, world)
        pieces = [x.narrow(dim, start, size) for start in self.starts(n, world, rank)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

    def assemble(self, gathered: torch.Tensor, dim: int, n_local: int, world: int) -> torch.Tensor:
        """The inverse of ``take`` over all ranks: ``gathered`` stacks every rank's tokens on
        dim 0 (so ``dim`` of a rank's is ``dim`` of ``gathered[rank]``)."""
        return self.regroup(gathered, dim, n_local, world, world, 0)

    def regroup(
        self, gathered: torch.Tensor, dim: int, n_local: int, world: int, group: int, index: int
    ) -> torch.Tensor:
        """The tokens of ``group`` consecutive ranks of ``world`` (``gathered`` stacks the
        shards of ranks ``index * group`` on) as shard ``index`` of ``world // group`` ranks:
        a hybrid's all-to-all group holds the shard of its rank in the ring across the groups
        (Note [Heads across ranks]). ``group == world``: the whole sequence."""
        size = n_local // self.parts
        held = {
            c: (j, slot) for j in range(group) for slot, c in enumerate(self.chunks(index * group + j, world))
        }  # fmt: skip
        shards = [gathered[j] for j in range(group)]
        pieces = []
        for c in self._grouped(world, group, index):
            j, slot = held[c]
            pieces.append(shards[j] if self.parts == 1 else shards[j].narrow(dim, slot * size, size))
        return torch.cat(pieces, dim)

    def split(self, x: torch.Tensor, dim: int, n_local: int, world: int, group: int, index: int) -> list[torch.Tensor]:
        """The inverse of ``regroup``: ``x``, shard ``index`` of ``world // group`` ranks, cut
        into the shards (of ``n_local`` tokens) of its ``group`` ranks of ``world``."""
        size = n_local // self.parts
        at = {c: j for j, c in enumerate(self._grouped(world, group, index))}
        cut = [[x.narrow(dim, at[c] * size, size) for c in self.chunks(index * group + j, world)] for j in range(group)]
        return [pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim) for pieces in cut]

    def _grouped(self, world: int, group: int, index: int) -> list[int]:
        """The chunks (of ``world``'s) of shard ``index`` of ``world // group`` ranks, in order:
        each of its chunks is ``group`` of ``world``'s. Those are the chunks that ranks
        ``index * group`` to ``(index + 1) * group - 1`` hold, as every layout here cuts."""
        return [c * group + j for c in self.chunks(index, world // group) for j in range(group)]

    def __repr__(self) -> str:
        return f"layout {self.name!r}"


class Contiguous(Layout):
    name = "contiguous"

    def chunks(self, rank: int, world: int) -> tuple[int, ...]:
        return (rank,)


class Zigzag(Layout):
    name = "zigzag"
    parts = 2

    def chunks(self, rank: int, world: int) -> tuple[int, ...]:
        return (rank, 2 * world - 1 - rank)


LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in (Contiguous(), Zigzag())}


def layout_of(name: str) -> Layout:
    """The layout named ``name`` (the backend's ``layout``); raises ValueError for another name."""
    if name not in LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(LAYOUTS)}, got {name!r}")
    return LAYOUTS[name]


def take_shard(x: torch.Tensor, dim: int, n: int, *, world: int, rank: int, layout: str) -> torch.Tensor:
    """This rank's tokens of ``x`` (``n`` tokens along ``dim``)."""
    return layout_of(layout).take(x, dim, n, world, rank)


def assemble(gathered: torch.Tensor, dim: int, n_local: int, *, world: int, layout: str) -> torch.Tensor:
    """Inverse of ``take_shard`` over all ranks: ``gathered`` stacks every rank's shard on dim 0."""
    return layout_of(layout).assemble(gathered, dim, n_local, world)


def positions(n: int, *, world: int, rank: int, layout: str, device=None) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens of a sequence of ``n``.

    In sharded mode a model sees ``n / world`` tokens per rank, and code that numbers its
    tokens (RoPE, ``position_ids``, a position embedding) must get their positions in the whole
    sequence, not ``0 .. n/world - 1``. ``positions`` is ``shard`` applied to ``arange(n)``
    with the rank and world size given as numbers, so it needs no process group.

    Args:
        n (int): the length of the whole sequence.
        world (int): the number of ranks that share it.
        rank (int): this rank, ``0 <= rank < world``, in the ring's group.
        layout (str): ``"contiguous"`` or ``"zigzag"``, as the backend's ``layout``.
        device (torch.device, optional): where the result lives. Default: ``None`` (the
            default device).

    Returns:
        Tensor: an int64 tensor of ``n / world`` positions.

    Raises:
        ValueError: an unknown ``layout``, or ``n`` that does not cut into ``world`` equal
            shards (``2 * world`` equal chunks for zigzag).

    Shapes:
        - Output: :math:`(n / world,)`.

    Example::

        >>> ring_rewrite.positions(8, world=2, rank=0, layout="zigzag")
        tensor([0, 1, 6, 7])
    """
    return take_shard(torch.arange(n, device=device), 0, n, world=world, rank=rank, layout=layout)


def shard(x: torch.Tensor, dim: int, *, group=None, layout: str = "contiguous") -> torch.Tensor:
    """This rank's shard of a whole sequence ``x`` along ``dim``.

    Cuts ``x`` as the backend cuts a sequence across the ranks of ``group``: with
    ``"contiguous"`` rank ``k`` takes tokens ``[kN/P, (k+1)N/P)`` (a view of ``x``), with
    ``"zigzag"`` it takes chunks ``k`` and ``2P-1-k`` of ``2P`` (one copy). Use it in sharded
    mode to cut a model's inputs (and a key-padding mask, along its key dim); ``unshard`` is
    its inverse. Without an initialised process group it is one rank: ``x`` itself (zigzag:
    a copy). Differentiable.

    Args:
        x (Tensor): the whole sequence, the same on every rank.
        dim (int): the sequence dim of ``x``.
        group (ProcessGroup or DeviceMesh, optional): the ranks that share the sequence, as the
            backend's ``group`` (a 1-D ``DeviceMesh`` such as ``mesh["cp"]``; ``None``: WORLD).
            Default: ``None``.
        layout (str): ``"contiguous"`` or ``"zigzag"``, as the backend's ``layout``.
            Default: ``"contiguous"``.

    Returns:
        Tensor: this rank's ``N / P`` tokens of ``x`` along ``dim``.

    Raises:
        ValueError: an unknown ``layout``, or ``N`` that does not cut into ``P`` equal shards
            (``2P`` equal chunks for zigzag).

    Shapes:
        - ``x``: :math:`(..., N, ...)`, ``N`` at ``dim``.
        - Output: :math:`(..., N / P, ...)`, ``P`` the size of ``group``.

    Example::

        x_local = ring_rewrite.shard(x, 1, group=mesh["cp"], layout="zigzag")  # (B, N / P, D)
        out = model(x_local)
        out = ring_rewrite.unshard(out, 1, group=mesh["cp"], layout="zigzag")  # (B, N, D)

    .. warning::
        Tested on CPU over gloo only; NCCL process groups have never run.
    """
    _, world, rank = resolve_group(group)
    return take_shard(x, dim, x.shape[dim], world=world, rank=rank, layout=layout)


def unshard(x: torch.Tensor, dim: int, *, group=None, layout: str = "contiguous") -> torch.Tensor:
    """The whole sequence from every rank's shard ``x`` along ``dim``; the inverse of ``shard``.

    An all-gather over ``group`` (``all_gather_single_autograd``, so gradients flow back to
    each rank's shard), then the shards put back in sequence order for ``layout``. Every rank
    of ``group`` must call it with a shard of the same shape. Without an initialised process
    group (one rank) it returns ``x`` itself.

    Args:
        x (Tensor): this rank's shard.
        dim (int): the sequence dim of ``x``.
        group (ProcessGroup or DeviceMesh, optional): the ranks that share the sequence, as the
            backend's ``group``. Default: ``None`` (WORLD).
        layout (str): ``"contiguous"`` or ``"zigzag"``: the layout ``x`` was cut with.
            Default: ``"contiguous"``.

    Returns:
        Tensor: the whole sequence, the same on every rank.

    Shapes:
        - ``x``: :math:`(..., N / P, ...)`, ``N / P`` at ``dim``.
        - Output: :math:`(..., N, ...)`.

    Example::

        logits = ring_rewrite.unshard(model(ring_rewrite.shard(x, 1)), 1)

    .. warning::
        Tested on CPU over gloo only; NCCL process groups have never run.
    """
    group, world, _ = resolve_group(group)
    if world == 1:
        return x
    from torch.distributed._functional_collectives import all_gather_single_autograd

    stacked = all_gather_single_autograd(x.contiguous().unsqueeze(0), 0, group)
    return assemble(stacked, dim, x.shape[dim], world=world, layout=layout)


# Note [A batch across ranks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# In sharded mode a model sees N / P tokens of each sample, and three things a Hugging Face model
# derives from the whole sequence must come in from outside, or each rank would derive them from
# its shard alone:
#
# * positions: without ``position_ids`` a model numbers its tokens from 0 on every rank (RoPE, a
#   position embedding), silently wrong, so ``shard_batch`` always passes the global ones;
# * next-token labels: a causal LM shifts ``labels`` by one inside its shard, so the label of a
#   shard's last token (the next rank's first) would be lost; ``shard_batch`` shifts them over the
#   whole sequence first and passes them as ``shift_labels``, which transformers' loss reads
#   instead of shifting;
# * the loss's denominator: each rank's loss is a sum over its tokens divided by
#   ``num_items_in_batch``, the labelled tokens of the whole batch, so the ranks' losses (and
#   gradients) add up to the mean over the whole sequence.
#
# The length must be cut into P equal shards (2P chunks for zigzag). Batches padded to their
# longest row come in every length; two ways keep them to one compiled graph per bucket:
#
# * ``buckets=True`` pads the end of the sequence up to the next power of two (then a multiple
#   of the shards and of ``multiple_of``). Any model; the padding is computed.
# * ``buckets="shards"`` pads only to a multiple of the shards, and the compiled graph pads each
#   shard to its own bucket, computing none of that padding (Note [Padding shards to a bucket],
#   ``passes/bucket_lengths.py``): for exact attention on the ring with causal or key-padding
#   masks. The shard's length is then a symbol (dynamo's automatic dynamic shapes, from the
#   second length on). A batch with ``position_ids`` (packed documents) is padded as with
#   ``True``: its documents are not told apart per shard.
#
# Padded tokens carry label ``ignore_index`` and are masked as keys: with an ``attention_mask``
# it gets zeros there; without one and without ``position_ids`` one is made (ones, then zeros;
# with ``"shards"`` always, so that transformers builds a key mask rather than reading documents
# from the positions); with ``position_ids`` and no mask (packed sequences, whose documents
# transformers reads from the positions) the padding's positions restart at 0, a document of
# its own. Either way no real token attends to a padded one.


def shard_batch(
    batch: Mapping[str, Any],
    *,
    group=None,
    layout: str = "contiguous",
    shift_labels: bool = True,
    buckets: bool | str = True,
    multiple_of: int = 1,
    pad_token_id: int = 0,
    ignore_index: int = -100,
) -> dict[str, Any]:
    """This rank's part of a Hugging Face batch, for a model compiled in sharded mode.

    Pads the sequence to a length ``N'``, then cuts every tensor of ``B`` rows and ``N``
    tokens to this rank's ``N' / P`` tokens along dim 1, and adds what a model cannot derive
    from its shard alone: the global ``position_ids``, labels shifted over the whole sequence,
    and the labelled tokens of the whole batch as the loss's denominator (Note [A batch across
    ranks]). ``N'`` is the next power of two ``>= N`` with ``buckets=True`` (else ``N``),
    rounded up to a multiple of ``P`` (``2P`` for zigzag) and of ``multiple_of``. Padded tokens get
    ``pad_token_id``, label ``ignore_index``, and no real token attends to them: an
    ``attention_mask`` gets zeros there; without one and without ``position_ids``, one is made;
    with ``position_ids`` and no mask, the padding's positions restart at 0 (a packed document
    of its own).

    Args:
        batch: what a data loader gives the model: ``input_ids`` (or ``inputs_embeds``),
            optionally ``attention_mask``, ``labels``, ``position_ids``, ``token_type_ids``, and
            any other tensor whose first two dims are ``(B, N)``. Every rank of ``group`` passes
            the same whole batch. Other values pass through unchanged.
        group: the ranks that share the sequence, as the backend's ``group`` (a ``ProcessGroup``,
            a 1-D ``DeviceMesh`` such as ``mesh["cp"]``, or None for WORLD). Default: ``None``.
        layout: ``"contiguous"`` or ``"zigzag"``, as the backend's ``layout``.
            Default: ``"contiguous"``.
        shift_labels: ``labels`` are next-token targets (a causal LM): shift them over the whole
            sequence and pass them as ``shift_labels`` too. False for labels of their own token
            (masked LM, token classification). Default: ``True``.
        buckets: ``True``: pad the length up to the next power of two (one compiled graph per
            bucket, the padding computed); ``"shards"``: pad only to a multiple of the shards
            and let the compiled graph plan each shard for its bucket and run it at its real
            length (one graph per bucket for exact attention on the ring with causal or key-padding masks;
            an ``attention_mask`` is always given; a batch with ``position_ids`` is padded as
            with ``True``); ``False``: pad only to a multiple of the shards. Default: ``True``.
        multiple_of: the padded length is also a multiple of this (a dilated config needs each
            shard to be a multiple of every ring branch's rate). Default: 1.
        pad_token_id: the id of padded ``input_ids``. Default: 0.
        ignore_index: the label of tokens the loss skips. Default: -100.

    Returns:
        A new dict: every ``(B, N, ...)`` tensor padded and cut to this rank's tokens along dim 1,
        ``position_ids`` (global, ``(B, N' / P)``), and with ``labels``: ``shift_labels`` (if
        ``shift_labels``) and ``num_items_in_batch``, the labelled tokens of the whole batch (a
        tensor, so that it does not specialise the compiled graph).

    Raises:
        ValueError: no ``input_ids`` ``(B, N)`` or ``inputs_embeds`` ``(B, N, D)`` tensor, an
            unknown ``layout``, ``buckets`` other than ``True``, ``False`` or ``"shards"``, or
            ``multiple_of < 1``.

    Shapes:
        - ``input_ids``, ``attention_mask``, ``labels``, ``position_ids``: :math:`(B, N)` in,
          :math:`(B, N' / P)` out (a tensor of one row, :math:`(1, N)`, stays one row).
        - ``inputs_embeds``: :math:`(B, N, D)` in, :math:`(B, N' / P, D)` out.
        - ``shift_labels``: :math:`(B, N' / P)`; ``num_items_in_batch``: :math:`()`.

    Example::

        batch = shard_batch(next(loader), group=mesh["cp"], layout="zigzag")
        loss = model(**batch, use_cache=False).loss   # this rank's share of the batch's mean
        loss.backward()                               # then sum gradients over the ring's ranks

    .. warning::
        Tested on CPU over gloo only; NCCL process groups have never run.
    """
    _, world, rank = resolve_group(group)
    ids = batch.get("input_ids")
    if ids is None:
        ids = batch.get("inputs_embeds")
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        raise ValueError("shard_batch: the batch needs input_ids (B, N) or inputs_embeds (B, N, D)")
    b, n = ids.shape[:2]
    if layout not in LAYOUTS:
        raise ValueError(f"shard_batch: layout must be one of {tuple(LAYOUTS)}, got {layout!r}")
    pieces = world * LAYOUTS[layout].parts
    if multiple_of < 1:
        raise ValueError(f"shard_batch: multiple_of must be at least 1, got {multiple_of}")
    if buckets not in (True, False, "shards"):
        raise ValueError(f"shard_batch: buckets must be True, False or 'shards', got {buckets!r}")
    positions_given = batch.get("position_ids") is not None
    per_shard = buckets == "shards" and not positions_given
    length = 1 << max(n - 1, 0).bit_length() if buckets and not per_shard else n
    step = math.lcm(pieces, multiple_of)
    length = -(-length // step) * step
    pad = length - n

    out: dict[str, Any] = {}
    mask = batch.get("attention_mask")
    for key, value in batch.items():
        if not _along(value, b, n):
            out[key] = value
            continue
        fill = {"input_ids": pad_token_id, "labels": ignore_index}.get(key, 0)
        if key == "position_ids":
            value = _pad_positions(value, pad)
        else:
            value = _pad(value, pad, fill)
        out[key] = value
    if (pad or per_shard) and mask is None and not positions_given:
        keep = torch.ones(b, length, dtype=torch.long, device=ids.device)
        keep[:, n:] = 0
        out["attention_mask"] = keep
    if not positions_given:
        out["position_ids"] = torch.arange(length, device=ids.device).expand(b, length)
    labels = out.get("labels")
    if isinstance(labels, torch.Tensor):
        if shift_labels:
            after = labels[:, 1:]
            out["shift_labels"] = torch.cat([after, after.new_full((after.shape[0], 1), ignore_index)], 1)
        read = out["shift_labels"] if shift_labels else labels
        out["num_items_in_batch"] = (read != ignore_index).sum()
    for key, value in out.items():
        if _along(value, b, length):
            # NOTE: contiguous: transformers' losses view labels and logits flat.
            out[key] = take_shard(value, 1, length, world=world, rank=rank, layout=layout).contiguous()
    return out


def _along(x, b: int, n: int) -> bool:
    """Whether ``x`` is a tensor of ``n`` tokens along dim 1 for a batch of ``b`` (or 1)."""
    return isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == n and x.shape[0] in (1, b)


def _pad(x: torch.Tensor, pad: int, fill) -> torch.Tensor:
    if not pad:
        return x
    return torch.cat([x, x.new_full((x.shape[0], pad, *x.shape[2:]), fill)], 1)


def _pad_positions(positions: torch.Tensor, pad: int) -> torch.Tensor:
    """``position_ids`` padded with ``0, 1, ...``: the padding is a packed document of its own."""
    if not pad:
        return positions
    tail = torch.arange(pad, dtype=positions.dtype, device=positions.device)
    return torch.cat([positions, tail.expand(positions.shape[0], pad)], 1)
