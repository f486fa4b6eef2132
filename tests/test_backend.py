"""The user-facing entry points: backend registration, options, the decorator, explain, logging."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import ring_rewrite
from ring_rewrite.reference import reference_attention

from conftest import rel_err

SEGMENTS, RATES = [8, 16], [1, 2]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Attend(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def qkv():
    return [torch.randn(1, 2, 32, 8) for _ in range(3)]


def expected(q, k, v):
    return reference_attention(q, k, v, segment_lengths=SEGMENTS, dilation_rates=RATES, is_causal=True)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**environ, **env},
        timeout=300,
    )


def test_entry_point_registers_without_import():
    result = run_python(
        """
        import sys, torch, torch.nn.functional as F
        q = torch.randn(1, 2, 16, 8)
        f = lambda q: F.scaled_dot_product_attention(q, q, q)
        out = torch.compile(f, backend="ring_dilated", options={"compiler": "eager"})(q)
        from torch._dynamo.utils import counters
        assert "ring_rewrite" in sys.modules
        assert counters["ring_rewrite"]["rewritten"] == 1, counters
        torch.testing.assert_close(out, f(q))
        print("ok")
        """
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_import_then_entry_point_lookup_is_not_a_duplicate():
    result = run_python(
        """
        import torch._dynamo
        import ring_rewrite
        ring_rewrite.register()
        assert "ring_dilated" in torch._dynamo.list_backends()
        import torch, torch.nn.functional as F
        q = torch.randn(1, 2, 16, 8)
        torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend="ring_dilated",
                      options={"compiler": "eager"})(q)
        print("ok")
        """
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_options_become_the_config():
    q, k, v = qkv()
    options = {"segment_lengths": SEGMENTS, "dilation_rates": RATES, "compiler": "aot_eager"}
    out = torch.compile(Attend(), backend="ring_dilated", options=options)(q, k, v)
    assert rel_err(out, expected(q, k, v)) < 1e-5
    assert counters["ring_rewrite"]["rewritten"] == 1


def test_unknown_option_is_an_error():
    with pytest.raises(Exception, match="unknown ring_dilated option"):
        torch.compile(Attend(), backend="ring_dilated", options={"segment": [8]})(*qkv())


def test_backend_callable():
    q, k, v = qkv()
    be = ring_rewrite.backend(segment_lengths=SEGMENTS, dilation_rates=RATES, compiler="aot_eager")
    out = torch.compile(Attend(), backend=be)(q, k, v)
    assert rel_err(out, expected(q, k, v)) < 1e-5
    assert [r.rewritten for r in be.records] == [True]
    with pytest.raises(TypeError, match="either"):
        ring_rewrite.backend(ring_rewrite.RingDilatedConfig(), strict=True)


def _check(model_or_fn):
    q, k, v = qkv()
    out = model_or_fn(q, k, v)
    assert rel_err(out, expected(q, k, v)) < 1e-5
    assert counters["ring_rewrite"]["rewritten"] >= 1


def test_decorate_class():
    @ring_rewrite.ring_dilated(segment_lengths=SEGMENTS, dilation_rates=RATES, compiler="eager")
    class Decorated(Attend):
        pass

    model = Decorated()
    assert isinstance(model, Attend)
    _check(model)


def test_decorate_instance_in_place():
    model = Attend()
    same = ring_rewrite.ring_dilated(
        model, segment_lengths=SEGMENTS, dilation_rates=RATES, compiler="eager"
    )
    assert same is model
    assert list(model.state_dict()) == list(Attend().state_dict())
    _check(model)


def test_decorate_function():
    @ring_rewrite.ring_dilated(segment_lengths=SEGMENTS, dilation_rates=RATES, compiler="eager")
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    _check(attend)


def test_decorator_validates_config_at_once():
    with pytest.raises(ValueError, match="no rate 1"):
        ring_rewrite.ring_dilated(segment_lengths=[8], dilation_rates=[2])
    with pytest.raises(TypeError, match="decorates"):
        ring_rewrite.ring_dilated(3)


def test_explain_report():
    def two(q, k, v):
        bias = torch.randn(q.shape[2], k.shape[2])  # a dense mask: left alone
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias) + Attend()(q, k, v)

    report = ring_rewrite.explain(two, *qkv(), segment_lengths=SEGMENTS, dilation_rates=RATES)
    assert isinstance(report, ring_rewrite.Report)
    assert [r.rewritten for r in report.records] == [False, True]
    text = str(report)
    assert text.startswith("ring_rewrite: 1 of 2 attention sites rewritten")
    assert "left alone: dense attn_mask" in text
    assert "(8,1) local (16,2) local" in text
    assert "test_backend.py:" in text


def test_graphs_logged_through_torch_logs():
    code = """
        import torch, torch.nn.functional as F, ring_rewrite
        q = torch.randn(1, 2, 16, 8)
        torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q),
                      backend=ring_rewrite.backend(compiler="eager"))(q)
    """
    logged = run_python(code, TORCH_LOGS="+ring_rewrite")
    assert "before ring_dilated rewrite" in logged.stderr
    assert "after ring_dilated rewrite" in logged.stderr
    assert "block_attention" in logged.stderr
    quiet = run_python(code)
    assert quiet.returncode == 0 and "ring_dilated rewrite" not in quiet.stderr


@pytest.mark.parametrize("sharding", ["replicated", "sharded"])
def test_recompile_limit_raises_instead_of_running_unrewritten(sharding):
    # Past dynamo's limit a function would run uncompiled: plain SDPA (docs/semantics.md, Sites
    # left alone: it raises), for our frames only (Note [Recompile limit]).
    from torch._dynamo.testing import CompileCounter

    def lengths(fn, *ns):
        return [fn(torch.randn(1, 2, n, 8)) for n in ns]

    with torch._dynamo.config.patch(recompile_limit=2):
        backend = ring_rewrite.backend(
            compiler="eager", segment_lengths=[8, 16], dilation_rates=[1, 2], sharding=sharding
        )
        attend = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend=backend, dynamic=False)
        for n in (16, 32):
            q = torch.randn(1, 2, n, 8)
            expected = reference_attention(q, q, q, segment_lengths=[8, 16], dilation_rates=[1, 2])
            assert rel_err(attend(q), expected) < 1e-5
        for _ in range(2):  # every call past the limit, not only the first
            with pytest.raises(ring_rewrite.RecompileLimitError) as info:
                attend(torch.randn(1, 2, 48, 8))
        message = str(info.value)
        assert "torch._dynamo.config.recompile_limit (2)" in message
        assert "as plain SDPA" in message and "pad inputs to a few lengths" in message
        assert len(backend.records) == 2
        lengths(attend, 16, 32)  # the compiled lengths still run
        # Another backend's function in the same process still falls back, as dynamo has it.
        counter = CompileCounter()
        plain = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q) + 1, backend=counter, dynamic=False)
        lengths(plain, 16, 32, 48, 64)
        assert counter.frame_count == 2
        assert not torch._dynamo.config.fail_on_recompile_limit_hit


def test_sites_named_by_layer_and_line():
    """Issue 18: the report, warnings and errors name a site by its module path and line."""

    class Layers(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Attend() for _ in range(2))

        def forward(self, q, k, v):
            for layer in self.layers:
                q = layer(q, k, v)
            return q

    report = ring_rewrite.explain(Layers(), *qkv(), segment_lengths=SEGMENTS, dilation_rates=RATES)
    line = Attend.forward.__code__.co_firstlineno + 1
    assert [r.location for r in report.records] == [f"layers.{i} (test_backend.py:{line})" for i in (0, 1)]
    assert f"layers.1 (test_backend.py:{line})" in str(report)


def test_errors_through_a_backend_object_name_the_backend():
    backend = ring_rewrite.backend(strict=True, compiler="eager")
    dense = lambda q: F.scaled_dot_product_attention(q, q, q, attn_mask=torch.rand(32, 32))  # noqa: E731
    with pytest.raises(Exception) as info:
        torch.compile(dense, backend=backend)(qkv()[0])
    message = str(info.value)
    assert "backend='ring_dilated' raised" in message and " object at 0x" not in message
    assert "ring_rewrite: SDPA at test_backend.py:" in message and "dense attn_mask" in message


def test_a_users_post_grad_pass_runs_and_the_cache_still_keys_on_the_ring_lowering(monkeypatch):
    """The FX graph cache key hashes the ring lowering's ``uuid`` whatever the user set in
    ``post_grad_custom_post_pass``, and their pass still runs: a compile runs their pass, the
    same compile again hits the cache, and after the lowering changed it compiles again."""
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.utils import fresh_cache

    from ring_rewrite.backend import _inductor_patches
    from ring_rewrite.inductor_fixes import cache_key
    from ring_rewrite.comm.lowering import inductor_lowering

    ran = []

    class Theirs(CustomGraphPass):
        def __call__(self, graph) -> None:
            ran.append(graph)

        def uuid(self) -> bytes:
            return b"theirs"

    ours, theirs = inductor_lowering()["post_grad_custom_post_pass"], Theirs()
    assert _inductor_patches()["post_grad_custom_post_pass"] == (ours, cache_key())

    def compile_and_run():
        torch._dynamo.reset()
        add_one = torch.compile(lambda x: x.sin() + 1, backend=ring_rewrite.backend(compiler="inductor"))
        assert torch.allclose(add_one(torch.ones(4)), torch.ones(4).sin() + 1)
        return len(ran)

    with fresh_cache(), inductor_config.patch(post_grad_custom_post_pass=theirs, fx_graph_cache=True):
        assert _inductor_patches()["post_grad_custom_post_pass"] == (theirs, ours, cache_key())
        compiled = compile_and_run()
        assert compiled > 0  # their pass ran
        assert compile_and_run() == compiled  # the same key: a cache hit, nothing compiled
        monkeypatch.setattr(type(ours), "uuid", lambda self: b"another ring lowering")
        assert compile_and_run() > compiled  # another key: compiled again, their pass ran


def test_the_cache_key_changes_with_our_op_schemas(monkeypatch):
    """Inductor's compiled code calls our ops with every argument of their schemas: code cached
    under other schemas (an older ring_rewrite) would call them with arguments they no longer
    take, so the key hashes them."""
    from ring_rewrite.inductor_fixes import cache_key

    key = cache_key().uuid()
    assert cache_key().uuid() == key
    schemas = torch._C._jit_get_all_schemas()
    changed = [s for s in schemas if s.name != "ring_rewrite::block_attention"]
    assert len(changed) == len(schemas) - 1  # the op is there, and is the one dropped
    monkeypatch.setattr(torch._C, "_jit_get_all_schemas", lambda: changed)
    assert cache_key().uuid() != key
