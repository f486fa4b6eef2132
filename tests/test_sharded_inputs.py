"""What a model needs from outside in sharded mode: ``shard_batch`` (a batch cut for each rank,
with global positions, labels shifted over the whole sequence and the loss's denominator), and
the rewrite's refusal of positions counted from 0 over a rank's own shard."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

import ring_rewrite
from ring_rewrite.layout import LAYOUTS, assemble, layout_of
from ring_rewrite.testing import capture_ranks


@contextlib.contextmanager
def fake_rank(rank: int, world: int):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _batch(b: int = 2, n: int = 10, **extra) -> dict:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(3, 50, (b, n), generator=g)
    labels[0, :2] = -100  # a prompt the loss skips
    return {"input_ids": torch.randint(3, 50, (b, n), generator=g), "labels": labels, **extra}


def _every_rank(batch: dict, world: int, layout: str, **kwargs) -> list[dict]:
    shards = []
    for rank in range(world):
        with fake_rank(rank, world):
            shards.append(ring_rewrite.shard_batch(batch, layout=layout, **kwargs))
    return shards


def _whole(shards: list[dict], key: str, layout: str) -> torch.Tensor:
    """The ranks' ``key`` put back in sequence order."""
    parts = [s[key].expand(shards[0]["input_ids"].shape[0], -1) for s in shards]
    return assemble(torch.stack(parts), 1, parts[0].shape[1], world=len(shards), layout=layout)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_layout_cuts_every_token_to_one_rank_and_puts_it_back(world, layout):
    lay = layout_of(layout)
    n = world * lay.parts * 3
    x = torch.arange(n).view(1, n, 1).expand(2, n, 3)
    held = [lay.take(x, 1, n, world, rank) for rank in range(world)]
    for rank, part in enumerate(held):
        starts = lay.starts(n, world, rank)
        assert part[0, :: n // (world * lay.parts), 0].tolist() == list(starts), (rank, starts)
        assert torch.equal(part[0, :, 0], ring_rewrite.positions(n, world=world, rank=rank, layout=layout))
    assert sorted(torch.cat([p[0, :, 0] for p in held]).tolist()) == list(range(n))
    assert torch.equal(lay.assemble(torch.stack(held), 1, n // world, world), x)
    if world > 1:
        with pytest.raises(ValueError, match="cannot be cut"):
            lay.take(x[:, :-1], 1, n - 1, world, 0)
    with pytest.raises(ValueError, match="layout must be one of"):
        layout_of("striped")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 4])
def test_shards_put_back_are_the_padded_batch(world, layout):
    batch = _batch(attention_mask=torch.ones(2, 10, dtype=torch.long))
    shards = _every_rank(batch, world, layout, pad_token_id=1)
    length = 16  # 10 -> the next power of two, a multiple of 2P chunks
    assert {tuple(s["input_ids"].shape) for s in shards} == {(2, length // world)}
    ids = _whole(shards, "input_ids", layout)
    assert torch.equal(ids[:, :10], batch["input_ids"]) and bool((ids[:, 10:] == 1).all())
    mask = _whole(shards, "attention_mask", layout)
    assert bool((mask[:, :10] == 1).all()) and bool((mask[:, 10:] == 0).all())
    assert torch.equal(_whole(shards, "position_ids", layout), torch.arange(length).expand(2, length))
    labels = _whole(shards, "labels", layout)
    assert torch.equal(labels[:, :10], batch["labels"]) and bool((labels[:, 10:] == -100).all())
    # Next-token targets over the whole sequence: a shard's last token keeps its label.
    shifted = _whole(shards, "shift_labels", layout)
    assert torch.equal(shifted[:, :9], batch["labels"][:, 1:]) and bool((shifted[:, 9:] == -100).all())
    counted = (batch["labels"][:, 1:] != -100).sum()
    assert all(torch.equal(s["num_items_in_batch"], counted) for s in shards)


def test_losses_of_the_shards_add_up_to_the_batch_mean():
    """transformers' causal-LM loss on each rank's shard (``shift_labels`` and
    ``num_items_in_batch`` as ``shard_batch`` gives them) sums to the loss of the whole batch."""
    loss_function = pytest.importorskip("transformers.loss.loss_utils").ForCausalLMLoss
    batch = _batch(n=12)
    logits = torch.randn(2, 12, 50, generator=torch.Generator().manual_seed(1))
    expected = loss_function(logits, batch["labels"], 50)
    for layout in ("contiguous", "zigzag"):
        total = 0.0
        for rank, shard in enumerate(_every_rank({**batch, "logits": logits}, 2, layout, buckets=False)):
            total += loss_function(
                shard["logits"], shard["labels"], 50, num_items_in_batch=shard["num_items_in_batch"],
                shift_labels=shard["shift_labels"],
            )  # fmt: skip
        assert torch.allclose(total, expected, rtol=1e-6), (layout, total, expected)


def test_lengths():
    def length(n, world=2, layout="zigzag", extra=None, **kwargs):
        (shard, *_) = _every_rank(_batch(n=n, **(extra or {})), world, layout, **kwargs)
        return shard["input_ids"].shape[1] * world

    assert [length(n) for n in (100, 128, 129, 1000)] == [128, 128, 256, 1024]
    assert length(100, buckets=False) == 100 and length(101, buckets=False) == 104
    assert length(100, buckets=False, multiple_of=3) == 108  # a multiple of 4 chunks and of 3
    assert length(5, world=4, layout="contiguous") == 8
    # "shards": to the shards only (the graph pads each shard); with packed positions, whole.
    assert length(100, buckets="shards") == 100 and length(101, buckets="shards") == 104
    positions = torch.arange(101).expand(2, 101)
    assert length(101, buckets="shards", extra={"position_ids": positions}) == 128
    with pytest.raises(ValueError, match="buckets must be True, False or 'shards'"):
        length(100, buckets="yes")


def test_padding_masks_what_it_adds():
    # No mask, no positions: a mask is made, zeros on the padding.
    (shard,) = _every_rank(_batch(n=6), 1, "contiguous")
    assert torch.equal(shard["attention_mask"][0], torch.tensor([1] * 6 + [0] * 2))
    # Packed positions and no mask: the padding's positions restart, a document of its own; no
    # mask is made (transformers reads documents from the positions only without one).
    positions = torch.tensor([0, 1, 2, 0, 1, 2]).expand(2, 6)
    (shard,) = _every_rank(_batch(n=6, position_ids=positions), 1, "contiguous")
    assert "attention_mask" not in shard
    assert torch.equal(shard["position_ids"][1], torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))
    # Nothing to pad: nothing added; with buckets="shards" a mask all the same, so that
    # transformers builds a key mask its compiled graph can pad per shard, not documents.
    (shard,) = _every_rank(_batch(n=8), 1, "contiguous")
    assert "attention_mask" not in shard and shard["input_ids"].shape == (2, 8)
    (shard,) = _every_rank(_batch(n=8), 1, "contiguous", buckets="shards")
    assert torch.equal(shard["attention_mask"], torch.ones(2, 8, dtype=torch.long))


def test_labels_of_their_own_token_are_not_shifted():
    (shard,) = _every_rank(_batch(n=8), 1, "contiguous", shift_labels=False)
    assert "shift_labels" not in shard
    assert torch.equal(shard["num_items_in_batch"], (_batch(n=8)["labels"] != -100).sum())


def test_a_batch_without_tokens_raises():
    with pytest.raises(ValueError, match="input_ids"):
        ring_rewrite.shard_batch({"labels": torch.zeros(2, 8)})


# ---- positions counted over the shard -------------------------------------------------------------

DIM, HEADS = 16, 2


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x (B, H, n, D)`` at positions ``pos (n,)`` (RoFormer, section 3.4.2)."""
    d = x.shape[-1]
    angles = pos.float()[:, None] * 10000.0 ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class Block(nn.Module):
    """Causal attention with RoPE at ``pos``, or, without it, at ``arange`` over the tokens it
    sees; or with a learned position embedding of ``arange`` (``embed``)."""

    def __init__(self, embed: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.embed = nn.Embedding(64, DIM) if embed else None

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        if self.embed is not None:
            x = x + self.embed(torch.arange(x.shape[1]))
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, -1)).permute(2, 0, 3, 1, 4)
        if self.embed is None:
            pos = torch.arange(x.shape[1]) if pos is None else pos
            q, k = rope(q, pos), rope(k, pos)
        # The mask's own arange over the tokens builds no position of q or k: no error for it.
        i = torch.arange(x.shape[1])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=i[None, :] <= i[:, None])


def _sharded(model: nn.Module, *, with_positions: bool) -> list:
    """The site records of ``model`` compiled on each rank of a fake group of 2, sharded."""
    x = torch.randn(1, 8, DIM)
    inputs = lambda rank: (x, ring_rewrite.positions(16, world=2, rank=rank, layout="zigzag")) if with_positions else (x,)  # noqa: E731
    captures = capture_ranks(model, inputs, world=2, aot=False, backward=False, sharding="sharded", layout="zigzag")
    return [record for cap in captures for record in cap.records]


@pytest.mark.parametrize("embed", [False, True], ids=["rope", "position-embedding"])
def test_positions_counted_over_the_shard_raise(embed):
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="positions counted over this rank") as error:
        _sharded(Block(embed), with_positions=False)
    assert "shard_batch" in str(error.value) and "test_sharded_inputs.py" in str(error.value)


def test_global_positions_are_rewritten():
    records = _sharded(Block(), with_positions=True)
    assert len(records) == 2 and all(r.rewritten for r in records), records


def test_one_process_counts_positions_as_it_likes():
    """At P = 1 the shard is the sequence: positions from the model's own arange are global."""
    backend = ring_rewrite.backend(compiler="eager", sharding="sharded")
    torch.compile(Block(), backend=backend)(torch.randn(1, 8, DIM))
    assert backend.records[0].rewritten


def _encoder(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{name}Config")(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    return getattr(transformers, f"{name}Model")(config)


@pytest.mark.parametrize(
    "name, how", [("Bert", "a slice of a module's buffer"), ("Roberta", "a cumulative sum along the tokens")]
)
def test_encoder_positions_counted_over_the_shard_raise(name, how):
    """BERT slices its ``position_ids`` buffer to the tokens it sees, RoBERTa counts them from
    its padding: both local positions in sharded mode, unless ``position_ids`` are passed."""
    ids = torch.randint(3, 64, (1, 8))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="positions counted") as error:
        capture_ranks(_encoder(name), (ids,), world=2, aot=False, backward=False, sharding="sharded")
    assert how in str(error.value)
    positions = lambda rank: (ids, None, None, ring_rewrite.positions(16, world=2, rank=rank, layout="contiguous")[None] + 2)  # noqa: E731
    captures = capture_ranks(_encoder(name), positions, world=2, aot=False, backward=False, sharding="sharded")
    assert all(record.rewritten for cap in captures for record in cap.records)
