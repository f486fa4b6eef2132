"""Which kernel runs a CPU block (``ring_rewrite/cpu_choice.py``, Note [Choosing the CPU block
kernel]): every build of ours this CPU can run against float64, and the choice with injected
timings and a fake clock. Nothing here asserts on a measured time.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_cpu_kernel import _inputs, _reference

import ring_rewrite
from ring_rewrite import cpu_choice, cpu_kernel, kernels
from ring_rewrite.reference import reference_attention

CHOICE_PATH = cpu_kernel.choice_path.__wrapped__  # the function, uncached
_FLAGS = set(cpu_choice.machine()[1].split())
SSE = cpu_kernel.Variant(("-mno-avx",), "avx")
"""The build of a CPU without AVX (4 lanes, 6 x 2 vectors): not a candidate where AVX is, built
here to test that path of ``flash_cpu.c``."""
BUILDS = cpu_kernel.variants() + (["ours-sse"] if "avx" in _FLAGS else [])


@pytest.fixture
def sse(monkeypatch):
    monkeypatch.setitem(cpu_kernel.VARIANTS, "ours-sse", SSE)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No decision of this process or of this machine's file: decisions go to ``tmp_path``."""
    monkeypatch.setattr(cpu_choice, "_decided", {})
    monkeypatch.setattr(cpu_choice, "_warned", set())
    monkeypatch.delenv(cpu_choice.ENV, raising=False)
    path = str(tmp_path / "choice.json")
    monkeypatch.setattr(cpu_kernel, "choice_path", lambda: path)
    return path


def test_the_builds_here():
    """AVX-512 CPUs (this project's machines) get the width and tile variants; every CPU the
    target's own and the key-tile one."""
    assert cpu_kernel.variants()[0] == "ours" and "ours-tk128" in cpu_kernel.variants()
    assert ("avx512f" in _FLAGS) == ("ours-avx2" in cpu_kernel.variants()) == ("ours-6x2" in cpu_kernel.variants())


ODD = [
    # b, hq, hkv, L, S, d, dv, causal: no multiple of a vector or tile (query tiles of 16 to 64
    # rows, key tiles of 128 or 256)
    (1, 3, 1, 130, 130, 17, 5, True),
    (1, 2, 1, 200, 530, 16, 24, False),
    (1, 2, 2, 530, 200, 16, 16, True),
    (2, 4, 2, 300, 300, 64, 64, True),
]


@pytest.mark.parametrize("case", ODD, ids=lambda c: "b{}h{}/{}L{}S{}d{}/{}{}".format(*c[:7], "c" if c[7] else ""))
@pytest.mark.parametrize("build", BUILDS)
def test_every_build_against_float64(build, case, sse):
    b, hq, hkv, length, keys, d, dv, causal = case
    q, k, v = _inputs(b, hq, hkv, length, keys, d, dv, "dilated")
    dout = torch.randn(b, hq, length, dv, generator=torch.Generator().manual_seed(1))
    scale = d**-0.5
    out, lse = cpu_kernel.forward(q, k, v, scale, causal, variant=build)
    grads = cpu_kernel.backward(dout, q, k, v, out, lse, scale, causal, variant=build)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = _reference(qr, kr, vr, scale, causal)
    torch.testing.assert_close(out.double(), ref_out.detach(), rtol=0, atol=2e-6)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=0, atol=2e-6)
    for got, want in zip(grads, torch.autograd.grad(ref_out, (qr, kr, vr), dout.double())):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * max(1.0, want.abs().max().item()))


def test_every_candidate_passes_its_check():
    for name, candidate in {**cpu_kernel.candidates(), **kernels._ATEN}.items():
        assert cpu_choice.check(candidate) is None, name


def _ours(name: str = "ours") -> cpu_choice.Candidate:
    return cpu_kernel.candidates()[name]


def _off(scale: float) -> cpu_choice.Candidate:
    """Ours with its out off by a factor."""
    ours = _ours()
    return cpu_choice.Candidate(lambda *a: (lambda o, l: (o * scale, l))(*ours.forward(*a)), ours.backward)


def _raises(*args):
    raise RuntimeError("no such kernel")


def test_the_check_names_what_is_wrong():
    assert "out off float64" in cpu_choice.check(_off(1.001))
    assert cpu_choice.check(cpu_choice.Candidate(_raises, _raises)) == "RuntimeError: no such kernel"


CLS = cpu_choice.BlockClass.of(8, 8, 2048, 2048, 64, 64, True)


class Timer:
    """Injected timings: ``seconds[name] = (forward, backward)``; records what it timed."""

    def __init__(self, **seconds):
        self.seconds, self.calls = seconds, []

    def __call__(self, cls, candidates):
        self.calls.append((cls, sorted(candidates)))
        return {name: self.seconds[name] for name in candidates}


def test_the_fastest_runs_forward_and_backward_each(fresh):
    candidates = {"a": _ours(), "b": _ours("ours-tk128"), "c": kernels._ATEN["aten"]}
    timer = Timer(a=(3.0, 1.0), b=(1.0, 3.0), c=(2.0, 2.0))
    decision = cpu_choice.decide(CLS, candidates, path=fresh, timer=timer)
    assert (decision.forward, decision.backward, decision.why) == ("b", "a", "measured")
    assert decision.seconds == {"a": (3.0, 1.0), "b": (1.0, 3.0), "c": (2.0, 2.0)}
    assert cpu_choice.decide(CLS, candidates, path=fresh, timer=timer) == decision
    assert len(timer.calls) == 1  # once a process
    other = cpu_choice.BlockClass.of(8, 8, 2048, 2048, 64, 64, False)
    cpu_choice.decide(other, candidates, path=fresh, timer=timer)
    assert [c.key for c, _ in timer.calls] == [CLS.key, other.key]  # each class its own


def test_a_candidate_off_float64_is_never_chosen(fresh):
    candidates = {"ours": _ours(), "broken": _off(1.01), "aten": kernels._ATEN["aten"]}
    timer = Timer(ours=(2.0, 2.0), broken=(1.0, 1.0), aten=(3.0, 3.0))
    with pytest.warns(UserWarning, match="CPU block kernel broken is never chosen: out off float64"):
        decision = cpu_choice.decide(CLS, candidates, path=fresh, timer=timer)
    assert (decision.forward, decision.backward) == ("ours", "ours")
    assert timer.calls == [(CLS, ["aten", "ours"])]  # not even timed
    assert json.load(open(fresh))["checks"]["broken"].startswith("out off float64")
    # Alone with its check failed, ours is the only candidate; none passing is an error.
    cpu_choice._decided.clear()
    alone = cpu_choice.decide(CLS, {"ours": _ours(), "broken": _off(1.01)}, path=fresh, timer=timer)
    assert (alone.forward, alone.why) == ("ours", "only candidate")
    with pytest.raises(RuntimeError, match="no CPU block kernel passed its float64 check"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cpu_choice.decide(CLS, {"broken": _off(1.01), "raises": cpu_choice.Candidate(_raises, _raises)}, path=None)


def test_a_forced_choice_is_honoured(fresh, monkeypatch):
    candidates = {"ours": _ours(), "aten": kernels._ATEN["aten"]}
    timer = Timer(ours=(1.0, 1.0), aten=(2.0, 2.0))
    monkeypatch.setenv(cpu_choice.ENV, "aten")
    assert cpu_choice.decide(CLS, candidates, path=fresh, timer=timer) == cpu_choice.Decision("aten", "aten", "forced")
    assert cpu_choice.decide(CLS, {"ours": _ours()}, path=fresh).forward == "ours"  # in place: no aten
    assert "aten, forced" in cpu_choice.describe()
    monkeypatch.setenv(cpu_choice.ENV, "ours-tk128")
    with pytest.raises(ValueError, match="names no CPU block kernel here"):
        cpu_choice.decide(CLS, candidates, path=fresh, timer=timer)
    assert not timer.calls


def test_a_lone_candidate_is_not_timed(fresh):
    timer = Timer()
    assert cpu_choice.decide(CLS, {"aten": kernels._ATEN["aten"]}, path=fresh, timer=timer).why == "only candidate"
    assert not timer.calls


@pytest.mark.parametrize("forced", ["aten", "ours-tk128", None])
def test_the_cpu_entry_runs_what_is_chosen(fresh, monkeypatch, forced):
    """``kernels.py``'s entry, forward and backward, runs the build or aten's kernel the decision
    names, and computes the same function either way."""
    ran = []
    real_forward, real_backward = cpu_kernel.forward, cpu_kernel.backward
    spy = lambda real: lambda *a, variant: ran.append(variant) or real(*a, variant=variant)  # noqa: E731
    monkeypatch.setattr(cpu_kernel, "forward", spy(real_forward))
    monkeypatch.setattr(cpu_kernel, "backward", spy(real_backward))
    aten_forward, aten_backward = kernels._aten_forward, kernels._aten_backward
    monkeypatch.setattr(kernels, "_aten_forward", lambda *a: ran.append("aten") or aten_forward(*a))
    monkeypatch.setattr(kernels, "_aten_backward", lambda *a: ran.append("aten") or aten_backward(*a))
    if forced:
        monkeypatch.setenv(cpu_choice.ENV, forced)
    else:  # measured: aten fastest forward, ours-tk128 backward (checked already: not recorded)
        times = {name: (5.0, 5.0) for name in cpu_kernel.candidates()}
        monkeypatch.setattr(cpu_choice, "measure", Timer(**{**times, "aten": (1.0, 6.0), "ours-tk128": (5.0, 2.0)}))
        with open(fresh, "w") as f:
            json.dump({"checks": dict.fromkeys([*times, "aten"])}, f)
    q, k, v = _inputs(1, 4, 2, 100, 100, 16, 16)
    dout = torch.randn(1, 4, 100, 16, generator=torch.Generator().manual_seed(1))
    out, lse = kernels.KERNELS["cpu"].forward(q, k, v, None, 0.25, True)
    grads = kernels.KERNELS["cpu"].backward(dout, q, k, v, out, lse, None, 0.25, True)
    assert ran == ([forced, forced] if forced else ["aten", "ours-tk128"])
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, _ = _reference(qr, kr, vr, 0.25, True)
    torch.testing.assert_close(out.double(), ref_out.detach(), rtol=0, atol=2e-6)
    for got, want in zip(grads, torch.autograd.grad(ref_out, (qr, kr, vr), dout.double())):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_decisions_are_read_back_and_keyed_by_cpu_model_and_flags(fresh, monkeypatch, tmp_path):
    candidates = {"ours": _ours(), "aten": kernels._ATEN["aten"]}
    cpu_choice.decide(CLS, candidates, path=fresh, timer=Timer(ours=(2.0, 1.0), aten=(1.0, 2.0)))
    record = json.load(open(fresh))
    assert record["classes"][CLS.key] == {"ours": [2.0, 1.0], "aten": [1.0, 2.0]}
    assert record["machine"]["cpu"] == cpu_choice.machine()[0] and record["machine"]["torch"] == torch.__version__
    cpu_choice._decided.clear()  # a later process (or another rank) of this machine: read, not timed
    again = cpu_choice.decide(CLS, candidates, path=fresh, timer=Timer())
    assert (again.forward, again.backward, again.why) == ("aten", "ours", "measured")
    # A candidate the file has not timed for the class: timed again, every candidate.
    timer = Timer(ours=(2.0, 1.0), aten=(1.0, 2.0), **{"ours-tk128": (0.5, 0.5)})
    more = {**candidates, "ours-tk128": _ours("ours-tk128")}
    assert cpu_choice.decide(CLS, more, path=fresh, timer=timer).forward == "ours-tk128"
    assert timer.calls == [(CLS, ["aten", "ours", "ours-tk128"])]

    # The file's name: this CPU's model and flags (and torch's version, the kernel's source).
    monkeypatch.setattr(cpu_kernel, "_folder", lambda: str(tmp_path))
    real = cpu_choice.machine()
    paths = set()
    for model, flags in [real, ("Intel(R) Xeon(R) CPU @ 2.50GHz", real[1]), (real[0], real[1] + " amx_tile")]:
        monkeypatch.setattr(cpu_choice, "machine", lambda model=model, flags=flags: (model, flags))
        paths.add(CHOICE_PATH())
    assert len(paths) == 3 and all(p.startswith(str(tmp_path)) for p in paths)


def test_the_in_place_path_runs_the_fastest_of_ours(fresh, monkeypatch):
    """A local branch in place has no aten form: its blocks run the build of ours measured
    fastest among ours alone."""
    times = {name: (5.0, 5.0) for name in cpu_kernel.candidates()}
    timer = Timer(**{**times, "ours-tk128": (1.0, 6.0), "aten": (9.0, 9.0)})
    monkeypatch.setattr(cpu_choice, "measure", timer)
    decision = cpu_kernel._fastest([2, 4, 4, 64, 64, 16, 16], True)
    assert decision.forward == "ours-tk128" and decision.backward == "ours"
    assert timer.calls == [(cpu_choice.BlockClass.of(4, 4, 64, 64, 16, 16, True), sorted(times))]
    # The same in the ops: a site whose local branches run in place, against float64.
    config = dict(segment_lengths=[64, 256], dilation_rates=[1, 4])
    q, k, v = (torch.randn(1, 4, 256, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    site = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    compiled = torch.compile(site, backend=ring_rewrite.backend(**config, compiler="eager"))
    got = [x.requires_grad_() for x in (q, k, v)]
    compiled(*got).sum().backward()
    want = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*want, **config, is_causal=True)
    ref.sum().backward()
    torch.testing.assert_close(compiled(*got).double(), ref, rtol=0, atol=2e-6)
    for x, y in zip(got, want):
        torch.testing.assert_close(x.grad.double(), y.grad, rtol=0, atol=1e-5)
    assert "(in place): ours-tk128 / ours" in cpu_choice.describe()


def test_classes_round_up_and_inputs_fill_the_threads():
    cls = cpu_choice.BlockClass.of(32, 4, 2100, 700, 40, 24, False)
    assert (cls.causal, cls.rows, cls.keys, cls.head, cls.group) == (False, 4096, 1024, 64, 8)
    threads = torch.get_num_threads()
    assert cpu_choice.BlockClass.of(2, 2, 5, 9000, 300, 8, True).key == f"causal 16x4096 d256 g1 t{threads}"
    for threads, group, rows, keys in [(2, 1, 4096, 4096), (3, 2, 4096, 4096), (16, 8, 2048, 2048), (2, 1, 512, 512),
                                       (2, 4, 16, 4096), (2, 1, 16, 16)]:  # fmt: skip
        cls = cpu_choice.BlockClass(True, rows, keys, 64, group, threads)
        q, k, v, dout = cls.inputs()
        heads = q.shape[1]
        assert heads >= threads and heads % group == 0 and k.shape[1] == heads // group
        assert q.shape[2:] == (rows, 64) and k.shape[2:] == v.shape[2:] == (keys, 64) and dout.shape == q.shape
        per_head = sum(min(i + 1, keys) for i in range(rows))
        full = max(x.numel() for x in (q, k, v)) > cpu_choice.MAX_ELEMENTS - max(rows, keys) * 64 * group
        assert heads * per_head >= cpu_choice.PAIRS or full  # a call long enough, or the inputs as large as allowed
        assert heads - group < max(threads, -(-cpu_choice.PAIRS // per_head))  # and no longer than that takes
        assert max(x.numel() for x in (q, k, v)) <= cpu_choice.MAX_ELEMENTS or heads == group


class Clock:
    """``time.perf_counter`` for ``measure``: each call of a fake kernel moves it on."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def kernel(self, forward: float, backward: float, calls: list) -> cpu_choice.Candidate:
        def fwd(q, k, v, scale, causal):
            self.now += forward
            calls.append("f")
            return q, q[..., 0]

        def bwd(*args):
            self.now += backward
            calls.append("b")

        return cpu_choice.Candidate(fwd, bwd)


def test_measure_races_round_robin_within_its_budget(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(cpu_choice, "time", clock)
    calls = {name: [] for name in "abc"}
    candidates = {
        "a": clock.kernel(0.010, 0.030, calls["a"]),
        "b": clock.kernel(0.012, 0.020, calls["b"]),
        "c": clock.kernel(0.050, 0.070, calls["c"]),  # over SLOWER times a's forward and b's backward
    }
    seconds = cpu_choice.measure(cpu_choice.BlockClass(True, 16, 16, 16, 1, 1), candidates)
    want = {"a": (0.010, 0.030), "b": (0.012, 0.020), "c": (0.050, 0.070)}
    assert seconds.keys() == want.keys() and all(seconds[n] == pytest.approx(want[n]) for n in want)
    assert len(calls["c"]) == 2  # its warm-up only
    assert len(calls["a"]) == 1 + 2 + 2 * 9  # the out and lse every backward reads; all 9 rounds
    assert len(calls["b"]) == 2 + 2 * 9
    slow = {"a": clock.kernel(1.0, 1.0, []), "b": clock.kernel(1.0, 1.5, calls["b"])}
    calls["b"].clear()
    cpu_choice.measure(cpu_choice.BlockClass(True, 16, 16, 16, 1, 1), slow)
    assert len(calls["b"]) == 2 + 2 * 2  # BUDGET spent after two rounds


def test_describe_and_explain_say_which_kernel_runs_and_why(fresh, monkeypatch):
    model = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    monkeypatch.setattr(cpu_choice, "measure", Timer(**{name: (1.0, 1.0) for name in cpu_kernel.candidates()}))
    assert cpu_choice.describe().startswith("the fastest of aten's and ours for each block shape, measured on")
    text = str(ring_rewrite.explain(model, q, k, v, segment_lengths=[128], dilation_rates=[1]))
    line = text.splitlines()[1]
    assert line.startswith(f"CPU block kernel: measured on {cpu_choice.machine()[0]}: causal 128x128 d16 g1"), line
    monkeypatch.setenv(cpu_choice.ENV, "aten")
    text = str(ring_rewrite.explain(model, q, k, v, segment_lengths=[128], dilation_rates=[1]))
    forced = f"CPU block kernel: aten, forced ({cpu_choice.ENV}=aten; a local branch in place runs ours)"
    assert text.splitlines()[1] == forced
    text = str(ring_rewrite.explain(model, *(x.double() for x in (q, k, v)), segment_lengths=[128], dilation_rates=[1]))
    assert "aten's flash kernel, the only candidate" in text.splitlines()[1]
