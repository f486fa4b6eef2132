"""Graph-diff tests for a model of your own: copy this file next to your tests and adapt it.

    pytest examples/test_graph_diff_example.py            # check
    RING_REWRITE_ACCEPT=1 pytest examples/...             # (re)write the stored graphs

The ``ring_graphs`` fixture comes with ``ring_rewrite`` (a ``pytest11`` entry point; where plugin
autoloading is off, add ``-p ring_rewrite.pytest_plugin``). Each test fails with a readable
message when an upgrade stops rewriting an attention site, rewrites one it should not, or
changes the rewritten graph. Everything runs on CPU in a few seconds (``compiler="eager"``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# The options you pass to torch.compile(model, backend="ring_dilated", options=...).
CONFIG = {"segment_lengths": [16, 64], "dilation_rates": [1, 2]}


class DecoderBlock(nn.Module):
    """Causal GQA self-attention, cross-attention to a short memory, an MLP."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.out = nn.Linear(dim, dim)
        self.cross_q, self.cross_kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)
        self.cross_out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)  # (B, H, N, D)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        b, n, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1
        )
        q, k, v = self._split(q, self.heads), self._split(k, self.kv_heads), self._split(v, self.kv_heads)
        # Site 0: causal self-attention over the whole sequence -> rewritten.
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, n, dim))
        cq = self._split(self.cross_q(self.norm2(x)), self.heads)
        ck, cv = (self._split(t, self.heads) for t in self.cross_kv(memory).chunk(2, -1))
        # Site 1: cross-attention (64 queries, 8 memory keys) -> left alone, with its reason.
        c = F.scaled_dot_product_attention(cq, ck, cv)
        x = x + self.cross_out(c.transpose(1, 2).reshape(b, n, dim))
        return x + self.mlp(self.norm3(x))


def inputs(rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)  # the same sequence on every rank
    return torch.randn(2, 64, 32, generator=generator), torch.randn(2, 8, 32, generator=generator)


def test_self_attention_rewritten_cross_attention_left_alone(ring_graphs):
    cap = ring_graphs.capture(DecoderBlock(), *inputs(), **CONFIG)
    ring_graphs.assert_rewritten(cap, 1)
    ring_graphs.assert_left_alone(cap, site=1, reason="cross attention")


def test_what_replaced_the_attention(ring_graphs):
    cap = ring_graphs.capture(DecoderBlock(), *inputs(), **CONFIG)
    diff = cap.diff()
    print(diff)  # the per-site table and op counts; `pytest -s` shows it, so does a failure
    assert diff.removed_by_op == {"scaled_dot_product_attention": 1}
    assert diff.added_by_op["autograd_function_apply"] == 1  # one node per rewritten site
    (site, _) = diff.sites
    assert site.attention == (2, 2)  # a block attention per branch, forward and backward
    # float32 on CPU: the kernel reads each branch's dilated rows in place (no "dilate" nodes)
    assert {"attention", "undilate", "merge"} <= set(site.added_by_role)


def test_rewritten_graph_is_the_stored_one(ring_graphs):
    cap = ring_graphs.capture(DecoderBlock(), *inputs(), **CONFIG)
    # Stored in expected/test_graph_diff_example/<this test>.txt; RING_REWRITE_ACCEPT=1 rewrites
    # it. subgraphs=False keeps the top-level graph only: which SDPA calls became site nodes.
    ring_graphs.assert_expected_graph(cap.after, subgraphs=False)


def test_every_rank_runs_the_same_ring(ring_graphs):
    # Compiled once per rank of a fake 4-rank process group (no communication): every rank must
    # issue the same transfers in the same order, forward and backward.
    ring_graphs.assert_same_p2p_schedule(DecoderBlock(), inputs, world=4, **CONFIG)
