"""ring_rewrite.testing: capture, graph_diff, the assertion helpers and the pytest fixture.

Each helper passes on a good rewrite and fails with a readable message when the rewrite is
broken on purpose (a site refused, a site not replaced, a rank-dependent ring schedule).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ring_rewrite import testing
from ring_rewrite.comm import ring
from ring_rewrite.testing import (
    ACCEPT_ENV,
    Transfer,
    assert_expected_graph,
    assert_left_alone,
    assert_rewritten,
    assert_same_p2p_schedule,
    capture,
    graph_diff,
    graph_text,
)

pytest_plugins = ["pytester"]

# The module, not the function of the same name that ``ring_rewrite.passes`` exports.
REWRITE = importlib.import_module("ring_rewrite.passes.rewrite_sdpa")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "test_graph_diff_example.py"
CONFIG = {"segment_lengths": [8, 32], "dilation_rates": [1, 2]}


class TwoAttentions(nn.Module):
    """A projection, a causal attention (rewritten) and one with a dense mask (left alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.register_buffer("bias", torch.randn(32, 32))

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # site A
        b = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)  # site B
        return a + b


def two_attentions(**config):
    return capture(TwoAttentions(), torch.randn(1, 32, 16), **{**CONFIG, **config})


def causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# ---- capture and graph_diff ------------------------------------------------------------------


def test_capture_keeps_the_graph_before_the_passes():
    cap = two_attentions()
    (before,), (after,) = cap.before, cap.after
    assert before is not after

    def sdpa(gm):
        return [n for n in gm.graph.nodes if testing.op_label(n) == "scaled_dot_product_attention"]

    assert len(sdpa(before)) == 2 and len(sdpa(after)) == 1
    assert not hasattr(before, "ring_rewrite_fwd_0") and hasattr(after, "ring_rewrite_fwd_0")
    assert [r.rewritten for r in cap.records] == [True, False]
    assert cap.report.rewritten == cap.records[:1]
    assert cap.output.shape == (1, 2, 32, 8)


def test_graph_diff_counts_removed_and_added_nodes():
    diff = two_attentions().diff()
    assert diff.removed_by_op == {"scaled_dot_product_attention": 1}
    assert [n.location for n in diff.removed] == [f"test_testing.py:{_line_of('# site A')}"]
    added = diff.added_by_op
    # The site node, its two subgraphs, and in each the call of its body.
    assert added["autograd_function_apply"] == 1 and added["invoke_subgraph"] == 2
    assert added["get_attr"] == 4
    # one per branch, forward and backward (float32 on CPU: the rows read in place)
    assert added["ring_rewrite.dilated_block_attention"] == 2
    assert added["ring_rewrite.dilated_block_backward"] == 2
    assert diff.ops_changed["scaled_dot_product_attention"] == (2, 1)
    roles = diff.added_by_role
    assert [n.role for n in diff.added if n.module == ""] == ["site"] * 3
    assert {"attention", "undilate", "merge", "attention_backward"} <= set(roles)
    rewritten, alone = diff.sites
    assert (rewritten.site, rewritten.rewritten, rewritten.attention) == (0, True, (2, 2))
    assert rewritten.removed == {"scaled_dot_product_attention": 1}
    assert rewritten.transfers == (0, 0)  # one device: every branch is local
    assert sum(rewritten.added_by_role.values()) == len(diff.added)
    assert (alone.rewritten, alone.removed, alone.added_by_role) == (False, {}, {})
    assert "dense attn_mask" in alone.reason


def test_removed_nodes_belong_to_the_site_that_replaced_them():
    def twice(q, k, v):
        for _ in range(2):
            q = causal(q, k, v) * 2  # two sites on one source line
        return q

    diff = capture(twice, *_qkv(), **CONFIG).diff()
    assert [s.removed for s in diff.sites] == [{"scaled_dot_product_attention": 1}] * 2
    assert [n.replaced_by for n in diff.removed] == [0, 1]
    assert len({s.location for s in diff.sites}) == 1

    torch._dynamo.reset()
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(1, 32, 16)
    diff = capture(lambda x: mha(x, x, x, need_weights=False)[0], x, **CONFIG).diff()
    (site,) = diff.sites
    assert site.removed == {"multi_head_attention_forward": 1, "getitem": 1}
    assert site.added_by_role["decompose"] > 0 and site.attention == (2, 2)


def test_graph_diff_prints_tables_and_a_stable_unified_diff():
    diff = two_attentions().diff()
    table = str(diff)
    assert table.startswith("ring_dilated graph diff: 1 of 2 attention sites rewritten; 1 node removed")
    assert "left alone: dense attn_mask" in table and "ring_rewrite.dilated_block_attention" in table
    lines = diff.text.splitlines()
    assert lines[:2] == ["--- before", "+++ after"]
    removed = [line for line in lines if line.startswith("-")]
    added = [line for line in lines if line.startswith("+")]
    assert any("scaled_dot_product_attention(q, k, v, is_causal = True)" in line for line in removed)
    assert any("autograd_function_apply(ring_rewrite_fwd_0" in line for line in added)
    assert "+    class ring_rewrite_fwd_0(torch.nn.Module):" in lines
    assert "0x" not in diff.text and str(ROOT) not in diff.text and "File " not in diff.text
    torch._dynamo.reset()
    assert two_attentions().diff().text == diff.text  # stable across runs


def test_graph_text_top_level_only():
    (after,) = two_attentions().after
    full, top = graph_text(after), graph_text(after, subgraphs=False)
    assert full.startswith(top) and "class ring_rewrite_fwd_0" in full
    assert "class ring_rewrite" not in top and "autograd_function_apply(" in top


def test_graph_diff_of_a_graph_without_attention():
    cap = capture(lambda x: x.relu() + 1, torch.randn(4))
    diff = graph_diff(cap.before[0], cap.after[0])
    assert (diff.removed, diff.added, diff.sites, diff.text) == ([], [], [], "")
    assert "0 of 0 attention sites" in str(diff) and "(no op count changed)" in str(diff)


def test_capture_aot_forward_and_backward_graphs():
    q, k, v = (torch.randn(1, 2, 32, 8, requires_grad=True) for _ in range(3))
    cap = capture(causal, q, k, v, aot=True, backward=True, **CONFIG)
    (fw,), (bw,) = cap.forward, cap.backward
    # A mutating op shows functionalized in AOT graphs: the in-place local branches, forward and
    # backward (float32 on CPU, Note [Local branches in place]).
    mutated = lambda gm: {  # noqa: E731  (the site bodies are invoke_subgraph modules)
        str(n.args[0]) for m in gm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes
        if testing.op_label(n) == "auto_functionalized_v2"
    }  # fmt: skip
    assert "ring_rewrite.dilated_block_attention.default" in mutated(fw)
    assert "ring_rewrite.dilated_block_backward.default" in mutated(bw)
    assert q.grad is not None
    with pytest.raises(ValueError, match="no output of the model requires grad"):
        capture(causal, *(t.detach() for t in (q, k, v)), backward=True)


def test_every_added_node_is_tagged_in_the_forward():
    diff = two_attentions().diff()
    assert [n for n in diff.untagged if "ring_rewrite_bwd_" not in n.module] == []


def test_every_added_node_is_tagged():
    assert two_attentions().diff().untagged == []


# ---- assert_rewritten / assert_left_alone ----------------------------------------------------


def test_assert_rewritten_and_left_alone_pass():
    cap = two_attentions()
    assert_rewritten(cap, 1)
    assert_rewritten(cap.records, 1)
    assert_rewritten(cap.report, 1)
    record = assert_left_alone(cap, site=1, reason="dense attn_mask")
    assert record.site == 1
    assert_left_alone(cap, reason="dense attn_mask")
    assert_left_alone(cap, site=f"test_testing.py:{_line_of('# site B')}")


def _refuse_every_site(monkeypatch):
    """Break the rewrite on purpose: the guard refuses every site."""
    monkeypatch.setattr(REWRITE, "sdpa_unsupported_reason", lambda site: "broken on purpose")


def test_assert_rewritten_fails_naming_the_site_and_reason(monkeypatch):
    _refuse_every_site(monkeypatch)
    cap = two_attentions()
    with pytest.raises(AssertionError) as info:
        assert_rewritten(cap, 1)
    message = str(info.value)
    line = _line_of("# site A")
    assert message.startswith("expected 1 attention site rewritten; ring_dilated rewrote 0 of 2\n")
    assert f"site 0 (test_testing.py:{line}) left alone: broken on purpose" in message
    assert "ring_rewrite: 0 of 2 attention sites rewritten" in message  # the report table
    with pytest.raises(AssertionError, match="expected every attention site rewritten"):
        assert_rewritten(cap)


def test_assert_rewritten_fails_when_the_graph_disagrees_with_the_records(monkeypatch):
    # Broken differently: the site is planned (recorded as rewritten) but its node not replaced.
    monkeypatch.setattr(REWRITE, "_rewrite_site", lambda *args: None)
    cap = capture(causal, *_qkv(), **CONFIG)
    with pytest.raises(AssertionError) as info:
        assert_rewritten(cap, 1)
    message = str(info.value)
    assert message.startswith(
        "the site records say 1 rewritten and 0 left alone, but the rewritten graphs hold "
        "0 rewritten site node(s) and 1 attention node(s) left in place"
    )
    assert "ring_dilated graph diff: 1 of 1 attention sites rewritten; 0 nodes removed, 0 added" in message


def test_assert_left_alone_fails_readably():
    cap = two_attentions()
    line = _line_of("# site A")
    rewritten = rf"expected attention site 0 left alone, but site 0 \(test_testing.py:{line}\) was rewritten"
    with pytest.raises(AssertionError, match=rewritten):
        assert_left_alone(cap, site=0)
    with pytest.raises(AssertionError) as info:
        assert_left_alone(cap, site=1, reason="cross attention")
    assert str(info.value).startswith(
        "expected attention site 1 left alone with a reason containing 'cross attention', but "
        f"site 1 (test_testing.py:{_line_of('# site B')}) was left alone because: dense attn_mask of shape (32, 32)"
    )
    with pytest.raises(AssertionError, match="expected attention site 7 left alone, but no site matches"):
        assert_left_alone(cap, site=7)


# ---- assert_expected_graph -------------------------------------------------------------------


def test_expected_graph_file_written_on_accept_then_checked(tmp_path, monkeypatch):
    (after,) = capture(causal, *_qkv(), **CONFIG).after
    path = tmp_path / "expected" / "causal.txt"
    monkeypatch.delenv(ACCEPT_ENV, raising=False)
    with pytest.raises(AssertionError, match=f"no expected graph at {path}; run with RING_REWRITE_ACCEPT=1"):
        assert_expected_graph(after, path)
    monkeypatch.setenv(ACCEPT_ENV, "1")
    assert_expected_graph(after, path)
    assert path.read_text() == graph_text(after)
    monkeypatch.delenv(ACCEPT_ENV)
    assert_expected_graph(after, path)  # passes against the stored text

    torch._dynamo.reset()
    (other,) = capture(causal, *_qkv(), segment_lengths=[8, 16, 32], dilation_rates=[1, 2, 4]).after
    with pytest.raises(AssertionError) as info:
        assert_expected_graph(other, path)
    message = str(info.value)
    assert message.startswith(
        f"graph differs from {path} (-expected +actual); if the change is intended, run with "
        "RING_REWRITE_ACCEPT=1"
    )
    assert f"--- {path}\n+++ actual\n@@" in message
    assert "\n+                dilated_block_attention_2 = torch.ops.ring_rewrite.dilated_block_attention(" in message
    monkeypatch.setenv(ACCEPT_ENV, "1")
    assert_expected_graph(other, path)
    assert path.read_text() == graph_text(other)


def test_expected_graph_inline():
    cap = capture(causal, *_qkv(), **CONFIG)
    text = graph_text(cap.after, subgraphs=False)
    assert_expected_graph(cap.after, expected=text, subgraphs=False)
    wrong = text.replace("return (autograd_function_apply,)", "return (nothing,)")
    with pytest.raises(AssertionError, match=r"(?s)differs from the inline expectation.*-        return \(nothing,\)"):
        assert_expected_graph(cap.after, expected=wrong, subgraphs=False)
    with pytest.raises(TypeError, match="exactly one of path or expected="):
        assert_expected_graph(cap.after)


# ---- assert_same_p2p_schedule ----------------------------------------------------------------


def _qkv(n=32, requires_grad=False):
    return [torch.randn(1, 4, n, 8, requires_grad=requires_grad) for _ in range(3)]


SHARDED = {"segment_lengths": [8, 32, 64], "dilation_rates": [1, 2, 4], "sharding": "sharded"}


def _shard(rank):
    return _qkv(16, requires_grad=True)


def test_same_p2p_schedule_at_four_ranks():
    captures = assert_same_p2p_schedule(causal, _shard, world=4, **SHARDED)
    assert [c.rank for c in captures] == [0, 1, 2, 3] and {c.world for c in captures} == {4}
    schedule = captures[1].schedule()
    forward = [t for t in schedule if t.graph == "forward"]
    backward = [t for t in schedule if t.graph == "backward"]
    # Branch (32, 2) rings 2 ranks, (64, 4) all 4; (8, 1) is local. Backward: K/V round again,
    # and dK/dV as many hops, the last one home.
    assert len(forward) == (2 - 1) + (4 - 1)
    assert len(backward) == 2 * (2 - 1) + 2 * (4 - 1)
    assert {t.kind for t in schedule} == {"send_recv"}
    assert all(t.shapes and t.dtypes for t in schedule)


def test_same_p2p_schedule_fails_when_one_rank_tags_differently(monkeypatch):
    # Break the ring on purpose: rank 2 sends its second step's messages under another tag.
    tag = ring.transfer_tag

    def rank_dependent(branch, kind, step, chunk=0):
        return tag(branch, kind, step, chunk) + (dist.get_rank() == 2 and step == 1)

    monkeypatch.setattr(ring, "transfer_tag", rank_dependent)
    with pytest.raises(AssertionError) as info:
        assert_same_p2p_schedule(causal, _shard, world=4, **SHARDED)
    message = str(info.value)
    assert message.startswith(
        "the ring's P2P schedule is not the same on every rank (world=4, forward then backward "
        "transfers):\n  rank 2 differs from rank 0 at transfer #2:\n    rank 0: forward send_recv "
    )
    assert "rank 1" not in message.split("\n\n")[0] and "rank 3" not in message.split("\n\n")[0]
    assert "(fw/bw: forward/backward graph, kind, tag, shapes sent, peers; << where ranks differ)" in message
    assert "<<" in message


def test_same_p2p_schedule_fails_on_unpaired_messages():
    def fake(rank, peers):
        steps = [Transfer("forward", "send_recv", 7, ((2, 3),), (torch.float32,), *p) for p in peers]
        return SimpleNamespace(rank=rank, records=[], schedule=lambda: steps)

    good = [fake(r, [((r + 1) % 3, (r - 1) % 3)]) for r in range(3)]
    assert_same_p2p_schedule(good)
    bad = [fake(0, [(1, 2)]), fake(1, [(2, 2)]), fake(2, [(0, 1)])]  # rank 1 expects rank 2
    unpaired = r"transfer #0 \(forward, tag 7\): rank 0 sends to rank 1, but rank 1 receives from rank 2"
    with pytest.raises(AssertionError, match=unpaired):
        assert_same_p2p_schedule(bad)


def test_same_p2p_schedule_refuses_a_schedule_without_transfers():
    with pytest.raises(AssertionError, match="no ring transfer on any of 2 ranks"):
        assert_same_p2p_schedule(
            causal, _shard, world=2, segment_lengths=[8], dilation_rates=[1], sharding="sharded"
        )


# ---- the pytest fixture ----------------------------------------------------------------------


def test_example_passes_through_the_fixture(pytester):
    result = pytester.runpytest_inprocess(str(EXAMPLE), "-p", "no:logging", "-q")
    result.assert_outcomes(passed=4)


FIXTURE_TEST = """
import torch, torch.nn.functional as F

def f(q):
    return F.scaled_dot_product_attention(q, q, q, is_causal=True)

def test_it(ring_graphs):
    cap = ring_graphs.capture(f, torch.randn(1, 2, 16, 8), segment_lengths=[8], dilation_rates=[1])
    ring_graphs.assert_rewritten(cap, 1)
    ring_graphs.assert_expected_graph(cap.after, subgraphs=False)
"""


def test_fixture_stores_expected_graphs_next_to_the_test(pytester, monkeypatch):
    pytester.makepyfile(test_mine=FIXTURE_TEST)
    monkeypatch.delenv(ACCEPT_ENV, raising=False)
    result = pytester.runpytest_inprocess("-p", "no:logging")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*no expected graph at *expected/test_mine/test_it.txt; run with RING_REWRITE_ACCEPT=1*"]
    )
    monkeypatch.setenv(ACCEPT_ENV, "1")
    pytester.runpytest_inprocess("-p", "no:logging").assert_outcomes(passed=1)
    stored = pytester.path / "expected" / "test_mine" / "test_it.txt"
    assert "autograd_function_apply(ring_rewrite_fwd_0" in stored.read_text()
    monkeypatch.delenv(ACCEPT_ENV)
    pytester.runpytest_inprocess("-p", "no:logging").assert_outcomes(passed=1)


@pytest.mark.parametrize("autoload", [True, False])
def test_fixture_from_entry_point_or_explicit_opt_in(pytester, monkeypatch, autoload):
    pytester.makepyfile(test_mine="def test_it(ring_graphs):\n    assert ring_graphs.capture\n")
    if not autoload:
        monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        pytester.runpytest_inprocess("-p", "no:logging").assert_outcomes(errors=1)  # off
    else:
        monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
        pytester.runpytest_inprocess("-p", "no:logging").assert_outcomes(passed=1)
    # Asking for it explicitly also works where the entry point loaded it already.
    explicit = pytester.runpytest_inprocess("-p", "no:logging", "-p", "ring_rewrite.pytest_plugin")
    explicit.assert_outcomes(passed=1)


def test_plugin_defines_a_fixture_and_no_hooks():
    """Loaded in every pytest session once installed, so it must do nothing unless asked."""
    import ring_rewrite.pytest_plugin as plugin

    assert [name for name in dir(plugin) if name.startswith("pytest_")] == []
    assert plugin.ring_graphs is not None


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    (line,) = [i for i, text in enumerate(lines, 1) if text.endswith(marker)]
    return line


def test_assert_rewritten_counts_a_module_left_alone():
    """A left-alone nn.MultiheadAttention keeps its module node, not an SDPA node."""
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)

    def mixer(x):
        a = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        out, weights = mha(a[0], a[0], a[0])  # weights used: left alone
        return out + weights.sum()

    cap = testing.capture(mixer, torch.randn(1, 2, 16, 16))
    testing.assert_rewritten(cap, 1)
    record = testing.assert_left_alone(cap, reason="attention weights")
    assert record.kind == "multi_head_attention_forward"


def test_site_named_by_module_path_and_line():
    """A site is named by its layer's module path and the user's line; inside a library module
    (nn.TransformerEncoder, say) dynamo keeps no user frame: the module path alone names it, the
    same way in the records and in the graph checks."""
    from ring_rewrite.passes import location

    node = torch.fx.Graph().placeholder("x")
    node.meta["stack_trace"] = ""
    node.meta["nn_module_stack"] = {"a": ("L['self'].layers.0", None), "b": ("L['self'].layers.0.self_attn", None)}
    assert location(node) == "layers.0.self_attn"
    node.meta["stack_trace"] = '  File "/home/me/model.py", line 12, in forward\n    x = attn(x)\n'
    assert location(node) == "layers.0.self_attn (model.py:12)"  # by layer, and line
    node.meta["nn_module_stack"] = {"a": ("L['self']", None)}  # the root module: no path
    assert location(node) == "model.py:12"


# ---- inductor's generated code -----------------------------------------------------------------

_WRAPPER = """
buf3 = empty_strided_cpu((2, 8), (8, 1), torch.float32)
buf4 = torch.ops.ring_rewrite.ring_shift_start.default([buf3], arg0_1, '0', 1, 1, 5)
buf5 = torch.ops.ring_rewrite.block_attention.default(arg1_1, arg2_1, arg3_1, None, 0.5, True)
buf6 = torch.ops.ring_rewrite.ring_shift_wait.default([buf3], buf4, 5, [buf5])
"""


def test_check_code_passes_on_the_order_it_names():
    testing.check_code(
        _WRAPPER,
        """
        CHECK: ring_shift_start.default([buf3]
        CHECK-NOT: ring_shift_wait
        # CHECK: block_attention.default(
        CHECK: ring_shift_wait.default([buf3]
        """,
    )


def test_check_code_fails_naming_what_it_did_not_find():
    with pytest.raises(AssertionError) as info:
        testing.check_code(_WRAPPER, "CHECK: ring_shift_wait\nCHECK: block_attention")
    message = str(info.value)
    assert message.startswith("inductor's code fails the checks\n# CHECK: ring_shift_wait\n")
    assert 'Expected to find "block_attention" but did not find it' in message


def test_check_code_refuses_lines_that_are_no_directives():
    with pytest.raises(ValueError, match="not a FileCheck directive"):
        testing.check_code(_WRAPPER, "ring_shift_start")


def test_inductor_code_returns_the_result_and_the_wrapper_code():
    fn = torch.compile(lambda x: x.sin() + 1)
    torch._dynamo.reset()
    out, codes = testing.inductor_code(lambda: fn(torch.ones(3)))
    assert torch.equal(out, torch.ones(3).sin() + 1)
    (code,) = codes
    testing.check_code(code, "CHECK: def call(")


def test_buffers_in_flight_violations_names_a_buffer_reused_in_flight():
    assert testing.buffers_in_flight_violations(_WRAPPER) == []
    reused = _WRAPPER.replace("buf5 = torch", "buf7 = buf3; del buf3  # reuse\nbuf5 = torch")
    (problem,) = testing.buffers_in_flight_violations(reused)
    assert problem.startswith("buf3, in flight (tag 5), is freed or written, line 4: buf7 = buf3")
