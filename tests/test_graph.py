"""Graph shape of the rewrite: what replaces an SDPA node, and what is left alone
(docs/semantics.md, The rewritten graph)."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._functorch.autograd_function import autograd_function_apply

from ring_rewrite import RingDilatedConfig, testing
from ring_rewrite.passes import UnsupportedSiteError, rewrite_sdpa
from ring_rewrite.passes.find_sdpa import SDPA_TARGETS, bind_sdpa, decode_reason, sdpa_unsupported_reason
from ring_rewrite.testing import assert_expected_graph, assert_left_alone, assert_rewritten, site_body

from conftest import Capture

ATTN = torch.ops.ring_rewrite.block_attention
ATTN_BWD = torch.ops.ring_rewrite.block_attention_backward
IN_PLACE = torch.ops.ring_rewrite.dilated_block_attention
IN_PLACE_BWD = torch.ops.ring_rewrite.dilated_block_backward


def capture(fn, *args, **config) -> testing.Capture:
    return testing.capture(fn, *args, fullgraph=True, **config)


def calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def sdpa_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]


def attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2


def qkv(b=1, hq=4, hkv=2, n=32, d=8):
    return torch.randn(b, hq, n, d), torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)


@pytest.mark.parametrize(
    "segments, rates", [(None, None), ([32], [1]), ([8, 16], [1, 2]), ([8, 16, 32], [1, 2, 4])]
)
def test_rewritten_site_shape(segments, rates):
    cap = capture(attention, *qkv(), segment_lengths=segments, dilation_rates=rates)
    (gm,) = cap.after
    branches = 1 if segments is None else len(segments)
    assert_rewritten(cap, 1)
    assert sdpa_nodes(gm) == []
    diff = cap.diff()
    assert diff.removed_by_op == {"scaled_dot_product_attention": 1}
    (summary,) = diff.sites
    assert summary.attention == (branches, branches) and summary.transfers == (0, 0)
    (site,) = calls(gm, autograd_function_apply)
    assert site.meta["ring_rewrite"] == {"site": 0, "role": "site"}
    assert [getattr(gm, a.target).body for a in site.args[:2]] == [
        site_body(gm, 0), site_body(gm, 0, "bwd")
    ]  # fmt: skip
    fwd, bwd = site_body(gm, 0), site_body(gm, 0, "bwd")
    # float32 on CPU: every local branch reads its rows in place, one call each forward and
    # backward (Note [Local branches in place]).
    fwd_attn = calls(fwd, IN_PLACE)
    assert len(fwd_attn) == branches and calls(fwd, ATTN) == calls(fwd, IN_PLACE_BWD) == []
    assert len(calls(bwd, IN_PLACE_BWD)) == branches and calls(bwd, ATTN) == calls(bwd, ATTN_BWD) == []
    assert [n.meta["ring_rewrite"]["branch"] for n in fwd_attn] == list(range(branches))
    for sub in (fwd, bwd):
        for node in sub.graph.nodes:
            if node.op == "output":
                continue
            assert node.meta["ring_rewrite"]["site"] == 0
            assert "test_graph.py" in node.meta["stack_trace"]
    roles = {n.meta["ring_rewrite"]["role"] for n in fwd.graph.nodes if n.op != "output"}
    assert roles == {"input", "attention", "merge"}  # the branches merge as they attend
    assert counters["ring_rewrite"]["rewritten"] == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_forward_order_per_branch(dtype):
    """Each branch dilates, attends, then undilates; the merge comes after every branch. In
    float32 on CPU each branch reads its rows in place and merges into the running out and lse
    as it attends (Note [Local branches in place]): they come first, the output's cast last."""
    cap = capture(attention, *(x.to(dtype) for x in qkv()), segment_lengths=[8, 16], dilation_rates=[1, 2])
    (gm,) = cap.after
    fwd = site_body(gm, 0)
    sequence = []
    for node in fwd.graph.nodes:
        tag = node.meta.get("ring_rewrite", {})
        step = (tag.get("role"), tag.get("branch"))
        if node.op != "output" and tag.get("role") != "input" and (not sequence or sequence[-1] != step):
            sequence.append(step)
    if dtype == torch.float32:
        assert sequence == [("merge", None), ("attention", 0), ("attention", 1), ("merge", None)]
        return
    assert sequence == [
        ("dilate", 0), ("attention", 0), ("undilate", 0), ("dilate", 1), ("attention", 1), ("undilate", 1),
        ("merge", None),
    ]  # fmt: skip


def test_same_graph_module_returned_when_nothing_rewritten():
    def no_attention(x):
        return x.relu() + 1

    cap = capture(no_attention, torch.randn(4))
    (gm,) = cap.after
    code = gm.code
    assert rewrite_sdpa(gm, [], config=RingDilatedConfig()) is gm
    assert gm.code == code


def test_expected_graph_small_case():
    def f(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    cap = capture(f, torch.randn(1, 2, 8, 4))
    assert_expected_graph(cap.after, expected=EXPECTED_SMALL)


EXPECTED_SMALL = """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[1, 2, 8, 4]"):
        l_q_ = L_q_

        ring_rewrite_fwd_0 = self.ring_rewrite_fwd_0
        ring_rewrite_bwd_0 = self.ring_rewrite_bwd_0
        autograd_function_apply: "f32[1, 2, 8, 4]" = torch.ops.higher_order.autograd_function_apply(ring_rewrite_fwd_0, ring_rewrite_bwd_0, l_q_, l_q_, l_q_, non_differentiable_idx = [], saved_for_backward_idx = [0, 1, 2, 3, 4]);  ring_rewrite_fwd_0 = ring_rewrite_bwd_0 = l_q_ = None
        return (autograd_function_apply,)

    class ring_rewrite_fwd_0(torch.nn.Module):
        def forward(self, q, k, v):
            body = self.body
            invoke_subgraph = torch.ops.higher_order.invoke_subgraph(body, 'ring_rewrite_site_forward_0', q, k, v);  body = None
            getitem = invoke_subgraph[0]
            getitem_1 = invoke_subgraph[1];  invoke_subgraph = None
            return (getitem, [q, k, v, getitem, getitem_1])

        class body(torch.nn.Module):
            def forward(self, q, k, v):
                new_empty = q.new_empty((1, 2, 8, 4))
                new_empty_1 = q.new_empty((1, 2, 8), dtype = torch.float32)
                dilated_block_attention = torch.ops.ring_rewrite.dilated_block_attention(new_empty, new_empty_1, q, k, v, [8, 1, 8, 1, 2, 2, 0], 0.5, True, True);  q = k = v = dilated_block_attention = None
                to = new_empty.to(torch.float32);  new_empty = None
                return (to, new_empty_1)

    class ring_rewrite_bwd_0(torch.nn.Module):
        def forward(self, dout, q, k, v, out, lse):
            body = self.body
            invoke_subgraph = torch.ops.higher_order.invoke_subgraph(body, 'ring_rewrite_site_backward_0', dout, q, k, v, out, lse);  body = dout = q = k = v = out = lse = None
            getitem = invoke_subgraph[0]
            getitem_1 = invoke_subgraph[1]
            getitem_2 = invoke_subgraph[2];  invoke_subgraph = None
            return (getitem, getitem_1, getitem_2)

        class body(torch.nn.Module):
            def forward(self, dout, q, k, v, out, lse):
                empty_like = torch.empty_like(q, memory_format = torch.contiguous_format)
                empty_like_1 = torch.empty_like(k, memory_format = torch.contiguous_format)
                empty_like_2 = torch.empty_like(v, memory_format = torch.contiguous_format)
                dilated_block_backward = torch.ops.ring_rewrite.dilated_block_backward(empty_like, empty_like_1, empty_like_2, dout, q, k, v, out, lse, [8, 1, 8, 1, 2, 2, 0], 0.5, True, True);  dout = q = k = v = out = lse = dilated_block_backward = None
                to = empty_like.to(torch.float32);  empty_like = None
                to_1 = empty_like_1.to(torch.float32);  empty_like_1 = None
                to_2 = empty_like_2.to(torch.float32);  empty_like_2 = None
                return (to, to_1, to_2)
"""


# ---- sites left alone, one test each --------------------------------------------------------


def _dense_mask(q, k, v):
    # Every query sees the keys of the same parity: no band, and no key mask.
    pos = torch.arange(q.shape[2])
    mask = (pos.view(-1, 1) + pos.view(1, -1)) % 2 == 0
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _cross_attention(q, k, v):
    return F.scaled_dot_product_attention(q[:, :, :16], k, v)


def _three_d(q, k, v):
    return F.scaled_dot_product_attention(q[0], k[0], v[0])


def _mask_requires_grad(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def _one_query_head(q, k, v):
    # SDPA broadcasts the query's one head over the key/value heads: an output of their heads.
    return F.scaled_dot_product_attention(q[:, :1], k, v)


def _empty(q, k, v):
    return F.scaled_dot_product_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], is_causal=True)


UNSUPPORTED = [
    pytest.param(_empty, "an empty sequence (q (1, 2, 0, 8)", id="empty"),
    pytest.param(_dense_mask, "dense attn_mask of shape (32, 32) that depends on", id="dense-mask"),
    pytest.param(_cross_attention, "query length 16 != key/value length 32", id="cross-attention"),
    pytest.param(_three_d, "3-D", id="three-d"),
    pytest.param(
        _one_query_head, "query has 1 head and key/value 2 without enable_gqa (SDPA broadcasts the query's head)",
        id="one-query-head",
    ),
]


def _inputs(fn):
    q, k, v = torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8)
    if fn is _mask_requires_grad:
        return q, k, v, torch.zeros(1, 1, 1, 32, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize(
    "fn, reason",
    [*UNSUPPORTED, pytest.param(_mask_requires_grad, "attn_mask requires grad", id="learned-mask")],
)
def test_unsupported_site_left_alone(fn, reason):
    cap = capture(fn, *_inputs(fn))
    (gm,) = cap.after
    assert len(sdpa_nodes(gm)) == 1
    assert_rewritten(cap, 0)
    record = assert_left_alone(cap, site=0, reason=reason)
    assert "test_graph.py" in record.location
    assert counters["ring_rewrite"]["skipped"] == 1


@pytest.mark.parametrize("fn, reason", UNSUPPORTED)
def test_unsupported_site_strict_raises(fn, reason):
    with pytest.raises(Exception, match="cannot be rewritten") as info:
        capture(fn, *_inputs(fn), strict=True)
    chain = [info.value, getattr(info.value, "inner_exception", None)]
    assert any(isinstance(e, UnsupportedSiteError) and reason in str(e) for e in chain)


@contextlib.contextmanager
def _logged(name="ring_rewrite.passes.records"):
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_site_left_alone_warns_at_every_compile():
    with _logged() as records:
        capture(_dense_mask, *_inputs(_dense_mask))
        capture(_dense_mask, *_inputs(_dense_mask))  # dynamo reset: a second compile
    messages = [r.getMessage() for r in records]
    assert len(messages) == 2 and messages[0] == messages[1], messages
    assert "SDPA at " in messages[0] and "test_graph.py:" in messages[0]
    assert "is left alone" in messages[0] and "dense attn_mask of shape (32, 32) that" in messages[0]


class _DropoutInTraining(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)


def test_dropout_in_training_and_eval_both_rewritten():
    """What is supported does not depend on training vs eval. Training draws a seed per
    call (role "dropout") that every block call and its backward take."""
    model = _DropoutInTraining()
    with _logged() as records:
        trained = capture(model.train(), *qkv(hkv=4), strict=True)
        evaluated = capture(model.eval(), *qkv(hkv=4), strict=True)
    assert not records
    assert [r.plan.dropout for r in trained.records + evaluated.records] == [0.1, 0.0]
    (gm,) = trained.after
    (seed,) = [n for n in gm.graph.nodes if n.meta.get("ring_rewrite", {}).get("role") == "dropout"]
    assert seed.target is torch.randint
    (gm,) = evaluated.after
    assert not [n for n in gm.graph.nodes if n.meta.get("ring_rewrite", {}).get("role") == "dropout"]


def test_only_supported_sites_rewritten():
    def two(q, k, v):
        return _dense_mask(q, k, v) + F.scaled_dot_product_attention(q, k, v)

    cap = capture(two, *_inputs(two))
    (gm,) = cap.after
    assert len(sdpa_nodes(gm)) == 1
    assert len(calls(gm, autograd_function_apply)) == 1
    assert_rewritten(cap, 1)
    assert_left_alone(cap, site=0, reason="dense attn_mask")
    assert dict(counters["ring_rewrite"]) == {"skipped": 1, "rewritten": 1}


@pytest.mark.parametrize("segments, rates", [(None, None), ([8, 16], [1, 2])], ids=["exact", "dilated"])
def test_one_key_value_head_without_enable_gqa_is_rewritten(segments, rates):
    """Multi-query attention as Falcon calls it: one key/value head and no ``enable_gqa``, which
    SDPA broadcasts over the query's heads. That is grouped-query attention with one group, and
    is rewritten as such."""

    def multi_query(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    cap = capture(multi_query, *qkv(hq=4, hkv=1), segment_lengths=segments, dilation_rates=rates, strict=True)
    (gm,) = cap.after
    assert_rewritten(cap, 1)
    assert sdpa_nodes(gm) == []
    assert len(calls(gm, autograd_function_apply)) == 1
    plan = cap.records[0].plan
    assert (plan.hq, plan.hkv) == (4, 1)


def _bound_site(hq: int, hkv: int, nq: int, enable_gqa: bool):
    """An SDPA node of a hand-built graph (shapes dynamo would refuse to trace included)."""
    graph = fx.Graph()
    q, k, v = (graph.placeholder(name) for name in "qkv")
    for node, heads, n in ((q, hq, nq), (k, hkv, 32), (v, hkv, 32)):
        node.meta["example_value"] = torch.empty(1, heads, n, 8)
    out = graph.call_function(F.scaled_dot_product_attention, (q, k, v), {"enable_gqa": enable_gqa})
    graph.output(out)
    return bind_sdpa(out)


@pytest.mark.parametrize(
    "hq, hkv, enable_gqa, reason",
    [
        (4, 1, False, None),  # one key/value head, broadcast
        (4, 1, True, None),
        (4, 2, True, None),
        (1, 2, False, "query has 1 head and key/value 2 without enable_gqa (SDPA broadcasts the query's head)"),
        (4, 2, False, "query has 4 heads and key/value 2 without enable_gqa (SDPA broadcasts a single key/value head only)"),
        (6, 4, True, "query heads 6 not a multiple of key/value heads 4"),
    ],
    ids=["one-kv-head", "one-kv-head-gqa", "gqa", "one-query-head", "no-gqa", "gqa-no-multiple"],
)  # fmt: skip
@pytest.mark.parametrize("nq", [32, 1], ids=["site", "decode-step"])
def test_heads_guard(hq, hkv, enable_gqa, reason, nq):
    """Which head counts a site (``sdpa_unsupported_reason``) and a decode step (``decode_reason``)
    accept: the same, with the same reason."""
    site = _bound_site(hq, hkv, nq, enable_gqa)
    guard = sdpa_unsupported_reason if nq == 32 else decode_reason
    assert guard(site) == reason


def test_key_padding_mask_becomes_bias_input():
    def masked(q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    q, k, v = qkv(hkv=4)
    keep = torch.ones(1, 1, 1, 32, dtype=torch.bool)
    cap = capture(masked, q, k, v, keep, segment_lengths=[8, 32], dilation_rates=[1, 2])
    (gm,) = cap.after
    assert cap.diff().added_by_role["mask"] >= 1
    (site,) = calls(gm, autograd_function_apply)
    assert len(site.args) == 6  # fwd, bwd, q, k, v, bias
    bias = site.args[5]
    assert bias.meta["ring_rewrite"]["role"] == "mask"
    fwd = getattr(gm, site.args[0].target).body
    assert all(n.args[3] is not None for n in calls(fwd, ATTN))


def test_chained_sites_both_rewritten():
    """A site whose query is the previous site's output is bound after that rewrite."""

    def chained(q, k, v):
        return F.scaled_dot_product_attention(F.scaled_dot_product_attention(q, k, v), k, v)

    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    be = Capture(compiler="aot_eager")
    out = torch.compile(chained, backend=be, fullgraph=True)(q, k, v)
    assert [r.rewritten for r in be.records] == [True, True]
    torch.testing.assert_close(out, chained(q, k, v), rtol=1e-5, atol=1e-6)


def test_sites_with_one_plan_share_one_body():
    """Note [One body per plan]: layers with the same plan and input strides call one traced
    body, which AOT and inductor compile once; the diff still counts every site's own nodes."""

    def four_sites(q, k, v):
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b = F.scaled_dot_product_attention(a * 2, k, v, is_causal=True)  # same plan: shared
        short = [x[:, :, :8] for x in (b, k, v)]  # N = 8: another plan
        c = F.scaled_dot_product_attention(*short, is_causal=True)
        strided = (b * 2).transpose(2, 3).contiguous().transpose(2, 3)  # other strides
        return c, F.scaled_dot_product_attention(strided, k, v, is_causal=True)

    cap = capture(four_sites, *qkv(hkv=4), segment_lengths=[8, 16], dilation_rates=[1, 2])
    (gm,) = cap.after
    assert_rewritten(cap, 4)
    for which in ("fwd", "bwd"):
        bodies = [site_body(gm, i, which) for i in range(4)]
        assert bodies[0] is bodies[1] and len({id(b) for b in bodies}) == 3
        identifiers = [
            n.args[1]
            for i in range(4)
            for n in calls(getattr(gm, f"ring_rewrite_{which}_{i}"), torch.ops.higher_order.invoke_subgraph)
        ]
        assert identifiers[0] == identifiers[1] and len(set(identifiers)) == 3
    summaries = cap.diff().sites
    assert [s.attention for s in summaries] == [(2, 2)] * 4
    assert summaries[0].added_by_role == summaries[1].added_by_role


@pytest.mark.parametrize("options", [{}, {"segment_lengths": [16], "dilation_rates": [1]}], ids=["exact", "dilated"])
def test_an_empty_sequence_returns_sdpas_empty_result(options):
    """N = 0: the site is left alone, and the compiled call returns SDPA's empty ``(B, H, 0, D)``
    and its empty gradients, under inductor."""
    q, k, v = (torch.randn(2, 3, 0, 8, requires_grad=True) for _ in range(3))
    attend = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                           backend="ring_dilated", options=options)  # fmt: skip
    out = attend(q, k, v)
    assert out.shape == (2, 3, 0, 8)
    assert all(g.shape == (2, 3, 0, 8) for g in torch.autograd.grad(out.sum(), (q, k, v)))


def _checkpointed(q, k, v):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q * 2, k, v,
                      use_reentrant=False)  # fmt: skip


def test_attention_inside_a_checkpoint_region_is_left_alone_with_its_reason():
    """SDPA inside ``torch.utils.checkpoint`` (transformers' gradient checkpointing) sits in a
    higher-order op's body that the passes do not enter: recorded as left alone with that reason,
    never silently plain attention; ``strict`` raises."""
    q, k, v = _inputs(_checkpointed)
    cap = capture(_checkpointed, q, k, v, segment_lengths=[8, 32], dilation_rates=[1, 2])
    record = assert_left_alone(cap, site=0, reason="inside tag_activation_checkpoint's body")
    assert record.kind == "nested" and counters["ring_rewrite"]["skipped"] == 1
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="cannot be rewritten"):
        capture(_checkpointed, q, k, v, strict=True)
