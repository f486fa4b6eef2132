"""The pass pipeline (``passes/pipeline.py``): order, which pass touched which site, disabling."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import ring_rewrite
from ring_rewrite.passes import NORMALISING, REWRITE, Pass, UnsupportedSiteError, pipeline
from ring_rewrite.passes.bucket_lengths import bucket
from ring_rewrite.passes.find_sdpa import find_sdpa_sites

from conftest import Capture, rel_err

B, L, E, H = 2, 16, 32, 4


def _mha_and_sdpa():
    mha = nn.MultiheadAttention(E, H, batch_first=True)

    def fn(x):
        a = mha(x, x, x, need_weights=False)[0]
        q = a.view(B, L, H, E // H).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    return fn


def test_the_pipeline_is_the_normalising_passes_then_the_rewrite():
    assert [p.name for p in NORMALISING] == ["attention_modules", "hand_written", "length_buckets"]
    assert REWRITE.name == "rewrite_sdpa"


def test_a_symbolic_length_is_bucketed_before_the_rewrite():
    recorder = Capture()
    attend = torch.compile(
        lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
        backend=recorder, fullgraph=True, dynamic=True,
    )  # fmt: skip
    attend(torch.randn(B, H, L - 3, E // H))
    (record,) = recorder.records
    assert record.passes == ("length_buckets", "rewrite_sdpa")
    assert record.plan.n == bucket(L - 3) == L
    (gm,) = recorder.graphs
    assert "bucket" in {n.meta.get("ring_rewrite", {}).get("role") for n in gm.graph.nodes}


def test_records_and_report_name_the_passes_that_touched_each_site():
    recorder = Capture()
    torch.compile(_mha_and_sdpa(), backend=recorder, fullgraph=True)(torch.randn(B, L, E))
    module, plain = recorder.records
    assert module.passes == ("attention_modules", "rewrite_sdpa")
    assert plain.passes == ("rewrite_sdpa",)
    assert (counters["ring_rewrite"]["decomposed"], counters["ring_rewrite"]["rewritten"]) == (1, 2)
    rows = ring_rewrite.Report(recorder.records).rows()
    assert [row["passes"] for row in rows] == ["attention_modules, rewrite_sdpa", "rewrite_sdpa"]


def test_a_disabled_pass_leaves_its_sites_alone_with_the_reason():
    recorder = Capture(disable_passes=["attention_modules"])
    torch.compile(_mha_and_sdpa(), backend=recorder, fullgraph=True)(torch.randn(B, L, E))
    module, plain = recorder.records
    assert not module.rewritten and module.kind == "multi_head_attention_forward"
    assert module.reason == "pass attention_modules is disabled (disable_passes)"
    assert module.passes == ()
    assert plain.rewritten and plain.passes == ("rewrite_sdpa",)
    assert counters["ring_rewrite"]["decomposed"] == 0


def test_a_disabled_pass_under_strict_raises():
    fn = _mha_and_sdpa()
    backend = ring_rewrite.backend(compiler="eager", strict=True, disable_passes=["attention_modules"])
    with pytest.raises(Exception, match="pass attention_modules is disabled") as info:
        torch.compile(fn, backend=backend, fullgraph=True)(torch.randn(B, L, E))
    assert isinstance(info.value.inner_exception, UnsupportedSiteError)


@pytest.mark.parametrize("name", ["rewrite_sdpa", "no_such_pass"])
def test_disabling_an_unknown_pass_names_the_field(name):
    with pytest.raises(ValueError, match=rf"disable_passes names \['{name}'\].*attention_modules"):
        ring_rewrite.backend(disable_passes=[name])


def _spell_out_scale(gm, example_inputs=None, *, config):
    """A normalising pass for the test: every SDPA gets its default scale written out (the same
    function, a changed node)."""
    for site in find_sdpa_sites(gm):
        if site.scale is None:
            site.node.kwargs = {**site.node.kwargs, "scale": site.shapes["query"][-1] ** -0.5}
            counters["ring_rewrite"]["scales"] += 1
    gm.recompile()
    return gm


def test_adding_a_pass_is_one_entry(monkeypatch):
    extra = Pass("explicit_scale", _spell_out_scale, "scales")
    monkeypatch.setattr(pipeline, "NORMALISING", (*pipeline.NORMALISING, extra))
    recorder = Capture()
    fn = _mha_and_sdpa()
    x = torch.randn(B, L, E)
    out = torch.compile(fn, backend=recorder, fullgraph=True)(x)
    module, plain = recorder.records
    assert module.passes == ("attention_modules", "explicit_scale", "rewrite_sdpa")
    assert plain.passes == ("explicit_scale", "rewrite_sdpa")
    assert counters["ring_rewrite"]["scales"] == 2
    assert rel_err(out, fn(x)) < 1e-5
    # Disabled, it touches nothing (and, without a leave_alone, records nothing).
    torch._dynamo.reset()
    recorder = Capture(disable_passes=["explicit_scale"])
    torch.compile(fn, backend=recorder, fullgraph=True)(x)
    passes = [r.passes for r in recorder.records]
    assert passes == [("attention_modules", "rewrite_sdpa"), ("rewrite_sdpa",)]
