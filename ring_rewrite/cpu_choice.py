"""Which kernel runs a CPU block: the fastest on the CPU it runs on, chosen by measurement.

Note [Choosing the CPU block kernel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Machines of one kind are not all the same CPU, and no kernel is fastest on all of them: on an AMD
EPYC ``csrc/flash_cpu.c`` runs a causal 2048-row block at 1.0 to 1.6x ``torch.mm``'s rate, on an
Intel Xeon with AVX-512 at 41 to 49 %, no faster than aten's flash kernel. So where both serve a
block (float32 without a bias: ``cpu_kernel.serves``), which runs it is measured on the machine:

* The candidates (``decide``'s ``candidates``): aten's
  ``_scaled_dot_product_flash_attention_for_cpu`` as ``kernels.py``'s CPU entry calls it (its
  finiteness check and copies included), and ours in each build ``cpu_kernel.variants()`` lists
  for this CPU (the target's own vector width and tile, and others a compiler flag selects: Note
  [The CPU block kernel]). Each is checked once against float64 (``check``: out, lse, dq, dk, dv
  on odd shapes, GQA, ``d != dv``); one whose error is above ``TOLERANCE``, or that raises, is
  never chosen.
* A block's class (``BlockClass``): causal or not, its rows and keys each rounded up to a power of
  two (16 to 4096), its head size likewise (16 to 256), its GQA group (1 to 8) and torch's thread
  count. The first block of a class times every candidate on the class's shape (``measure``),
  forward and backward, with a query head a thread at least, so that each kernel's tasks share the
  threads as a block of many heads does, and heads for ``PAIRS`` query-key pairs at least, so that
  a call outlasts the scheduler's time slices (a small block's would otherwise time its
  interruptions): a warm-up call each, which rules out any ``SLOWER`` than the
  fastest both ways, then rounds in which each of the others runs once, the order rotated, for
  ``BUDGET`` seconds (2 to 9 rounds), and the medians. Forward and backward each run their own
  fastest: a block's backward reads the merged out and lse, whichever kernel made them. A class
  costs 2 to 3 s on 2 shared cores (a 4096-row class of 128-dim heads about 5 s), once a machine;
  the first also checks every candidate (half a second) and builds ours' variants (a second of
  CPU each, side by side).
* The decisions are cached beside the built libraries (``cpu_kernel.choice_path``: named by the
  CPU's model name and flags, torch's version, the kernel's source and this file's), read and
  written under a file lock, so that the ranks of a machine measure one at a time (the others wait, then read)
  and later processes only read.
* ``RING_REWRITE_CPU_KERNEL=aten`` or ``ours`` (or a build's name, ``ours-tk128``) forces one;
  nothing is measured.

The choice is made at run time, per block, inside the ops, so a compiled graph does not depend on
it, and ranks need not share it: every candidate computes the same function to float32's rounding
(the check), so ranks that chose differently still compute one site. It covers the blocks of
``block_attention`` and its backward (ring steps, gathered local branches). A local branch run in
place (Note [Local branches in place]) has no aten form: it runs the fastest
build of ours for its class, measured among those alone (``ours`` where aten is forced). Float64
blocks and blocks with a bias have one candidate, aten's. ``explain()`` prints the decisions of
the process (``describe``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping

import torch

__all__ = [
    "ENV", "Candidate", "BlockClass", "Decision", "decide", "forced", "check", "measure", "machine", "decisions",
    "describe", "float64_block",
]  # fmt: skip

ENV = "RING_REWRITE_CPU_KERNEL"
"""The environment variable that forces a candidate by name (``aten``, ``ours``, a build's name)."""

BUDGET = 1.0
"""Seconds a class's timed rounds may take (2 rounds at least, 9 at most)."""

SLOWER = 2.0
"""A candidate this many times the fastest's time in its warm-up call, forward and backward, is
ruled out then."""

PAIRS = 1 << 23
"""Query-key pairs of a class's timed inputs at least, over their heads (four causal 2048-row
blocks': a call of ours takes 10 to 20 ms on 2 cores, several of the scheduler's time slices)."""

MAX_ELEMENTS = 1 << 24
"""Elements of any one of a class's timed inputs at most (64 MiB): fewer heads where they would
be more."""

TOLERANCE = 1e-5
"""The largest error against float64 a candidate may have (max-abs error over max-abs value)."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A kernel that runs one CPU block, as ``decide`` times and checks it."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """``(q, k, v, scale, is_causal) -> (out, lse)``."""
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """``(dout, q, k, v, out, lse, scale, is_causal) -> (dq, dk, dv)``."""


def _bucket(n: int, lo: int, hi: int) -> int:
    """``n`` rounded up to a power of two within ``[lo, hi]``."""
    return min(hi, max(lo, 1 << max(0, n - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class BlockClass:
    """What decides which kernel is fastest for a block (Note [Choosing the CPU block kernel])."""

    causal: bool
    rows: int
    """Query rows, a power of two from 16 to 4096 (a block's rounded up)."""
    keys: int
    """Keys, likewise."""
    head: int
    """Head size (the larger of q's and v's), a power of two from 16 to 256."""
    group: int
    """Query heads a kv head (GQA), a power of two from 1 to 8."""
    threads: int

    @classmethod
    def of(cls, hq: int, hkv: int, rows: int, keys: int, d: int, dv: int, causal: bool) -> BlockClass:
        """The class of a block of these sizes, at torch's current thread count."""
        return cls(
            bool(causal), _bucket(rows, 16, 4096), _bucket(keys, 16, 4096), _bucket(max(d, dv), 16, 256),
            _bucket(hq // hkv, 1, 8), torch.get_num_threads(),
        )  # fmt: skip

    @property
    def key(self) -> str:
        """The class in the cache and in ``describe``: ``causal 2048x2048 d64 g1 t2``."""
        kind = "causal" if self.causal else "full"
        return f"{kind} {self.rows}x{self.keys} d{self.head} g{self.group} t{self.threads}"

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """``q, k, v, dout`` of this class's shape, from a generator of their own (the global one
        is left as it is): batch 1, a query head a thread at least, so that both kernels' tasks
        (aten's per query head, ours' per query tile forward and per kv head backward) share the
        threads as a block of many heads does, and heads for ``PAIRS`` query-key pairs at least
        (within ``MAX_ELEMENTS``), so that a call outlasts the scheduler's time slices, whose
        interruptions a short call's time would be all noise of (a site's calls of small blocks
        hold many segments); whole kv heads' groups."""
        pairs = sum(min(i + 1, self.keys) for i in range(self.rows)) if self.causal else self.rows * self.keys
        g = self.group
        room = min(MAX_ELEMENTS // (self.rows * self.head), g * (MAX_ELEMENTS // (self.keys * self.head)))
        hq = min(max(g, room // g * g), -(-max(self.threads, -(-PAIRS // pairs)) // g) * g)
        shapes = [(hq, self.rows), (hq // g, self.keys), (hq // g, self.keys), (hq, self.rows)]
        gen = torch.Generator().manual_seed(0)
        return tuple(torch.randn(1, h, n, self.head, generator=gen) for h, n in shapes)


@dataclasses.dataclass(frozen=True)
class Decision:
    """Which candidate runs a class's blocks forward and backward, and why."""

    forward: str
    backward: str
    why: str
    """``measured``, ``forced`` (``RING_REWRITE_CPU_KERNEL``) or ``only candidate``."""
    seconds: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    """Each candidate's median forward and backward seconds on the class's inputs, where measured."""


# ---- measurement and the float64 check -------------------------------------------------------


def measure(cls: BlockClass, candidates: Mapping[str, Candidate]) -> dict[str, tuple[float, float]]:
    """Median seconds of each candidate's forward and backward on ``cls.inputs()``: a warm-up call
    each, which rules out those ``SLOWER`` than the fastest both ways (their time is that call's),
    then rounds in which each of the others runs once, the order rotated, for ``BUDGET`` seconds
    (2 to 9 rounds). Every candidate's backward reads the same out and lse (the first's)."""
    q, k, v, dout = cls.inputs()
    scale = cls.head**-0.5
    names = list(candidates)
    with torch.no_grad():
        out, lse = candidates[names[0]].forward(q, k, v, scale, cls.causal)

        def once(name: str) -> tuple[float, float]:
            kernel = candidates[name]
            t0 = time.perf_counter()
            kernel.forward(q, k, v, scale, cls.causal)
            t1 = time.perf_counter()
            kernel.backward(dout, q, k, v, out, lse, scale, cls.causal)
            return t1 - t0, time.perf_counter() - t1

        warm = {name: once(name) for name in names}
        best = [min(t[i] for t in warm.values()) for i in (0, 1)]
        racing = [n for n in names if warm[n][0] <= SLOWER * best[0] or warm[n][1] <= SLOWER * best[1]]
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        start = time.perf_counter()
        for r in range(9 if len(racing) > 1 else 0):
            if r >= 2 and time.perf_counter() - start > BUDGET:
                break
            for name in racing[r % len(racing) :] + racing[: r % len(racing)]:
                times[name].append(once(name))
    result = {}
    for name, got in times.items():
        got = got or [warm[name]]  # ruled out, or alone
        result[name] = (statistics.median(f for f, _ in got), statistics.median(b for _, b in got))
    return result


CHECKS = (
    # b, hq, hkv, L, S, d, dv, causal
    (1, 4, 2, 77, 77, 40, 24, True),
    (2, 2, 1, 50, 130, 17, 64, False),
)
"""The odd shapes ``check`` runs each candidate on: no multiple of a vector or a tile, GQA,
``d != dv``, ``L != S``."""


def _check_inputs(case: tuple) -> tuple[torch.Tensor, ...]:
    b, hq, hkv, length, keys, d, dv, _ = case
    g = torch.Generator().manual_seed(0)
    shapes = [(b, hq, length, d), (b, hkv, keys, d), (b, hkv, keys, dv), (b, hq, length, dv)]
    return tuple(torch.randn(shape, generator=g) for shape in shapes)


@functools.cache
def _float64(case: tuple) -> list[torch.Tensor]:
    """``float64_block`` of a case of ``CHECKS``."""
    return float64_block(*_check_inputs(case), case[5] ** -0.5, case[-1])


def float64_block(q, k, v, dout, scale: float, causal: bool) -> list[torch.Tensor]:
    """``out, lse, dq, dk, dv`` of one block in float64, GQA by head groups, causal top-left; the
    gradients written out (FlashAttention-2's backward, as ``flash_cpu.c``'s header gives it),
    since a kernel's op may run where autograd does not record."""
    q, k, v, dout = (x.double() for x in (q, k, v, dout))
    group = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ kx.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), float("-inf"))
    lse = s.logsumexp(-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = p @ vx
    ds = p * (dout @ vx.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    dk = (ds.transpose(-1, -2) @ q * scale).unflatten(1, (k.shape[1], group)).sum(2)
    dv = (p.transpose(-1, -2) @ dout).unflatten(1, (k.shape[1], group)).sum(2)
    return [out, lse, ds @ kx * scale, dk, dv]


def check(candidate: Candidate) -> str | None:
    """None if ``candidate`` computes ``CHECKS``' blocks within ``TOLERANCE`` of float64 (out,
    lse, dq, dk, dv, each max-abs error over max-abs value), else what it got wrong."""
    names = ("out", "lse", "dq", "dk", "dv")
    for case in CHECKS:
        q, k, v, dout = _check_inputs(case)
        scale, causal = case[5] ** -0.5, case[-1]
        try:
            with torch.no_grad():
                out, lse = candidate.forward(q, k, v, scale, causal)
                got = [out, lse, *candidate.backward(dout, q, k, v, out, lse, scale, causal)]
        except Exception as e:  # noqa: BLE001 (a candidate that raises is no candidate)
            return f"{type(e).__name__}: {e}"
        for name, x, want in zip(names, got, _float64(case)):
            if x.shape != want.shape:
                return f"{name} of shape {tuple(x.shape)}, not {tuple(want.shape)}"
            err = ((x.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            if not err <= TOLERANCE:
                return f"{name} off float64 by {err:.3g} (> {TOLERANCE:g}) at {case}"
    return None


# ---- the decision ----------------------------------------------------------------------------


def forced(candidates: Mapping[str, Candidate]) -> str | None:
    """The candidate ``RING_REWRITE_CPU_KERNEL`` names, None where it is unset; raises naming
    the candidates where it names none. ``aten`` with no aten among ``candidates`` (a local
    branch in place) is ``ours``."""
    name = os.environ.get(ENV, "").strip()
    if not name:
        return None
    if name == "aten" and name not in candidates and "ours" in candidates:
        return "ours"
    if name not in candidates:
        raise ValueError(f"{ENV}={name!r} names no CPU block kernel here (have {', '.join(sorted(candidates))})")
    return name


_decided: dict[tuple[str | None, str, frozenset[str]], tuple[BlockClass, Decision]] = {}
"""This process's decisions by (cache file, class, candidates)."""

_warned: set[str] = set()
"""The candidates this process has warned of (failed their check)."""


def decide(
    cls: BlockClass,
    candidates: Mapping[str, Candidate],
    *,
    path: str | None,
    timer: Callable[[BlockClass, Mapping[str, Candidate]], Mapping[str, tuple[float, float]]] | None = None,
) -> Decision:
    """Which of ``candidates`` runs blocks of ``cls`` (Note [Choosing the CPU block kernel]):
    forced by ``RING_REWRITE_CPU_KERNEL``, the only one, or the fastest that passed its float64
    check, as ``timer`` (by default ``measure``) times them. Decided once a process; with
    ``path``, once a machine: the checks and timings are read from and written to that JSON file,
    under a lock (a file that cannot be written is left as it is)."""
    name = forced(candidates)
    if name is not None:
        return Decision(name, name, "forced")
    if len(candidates) == 1:
        (name,) = candidates
        return Decision(name, name, "only candidate")
    memo = (path, cls.key, frozenset(candidates))
    if memo not in _decided:
        _decided[memo] = (cls, _decide(cls, candidates, path, timer or measure))
    return _decided[memo][1]


def _decide(cls, candidates, path, timer) -> Decision:
    with _locked(path):
        record = _read(path)
        checks, classes = record.setdefault("checks", {}), record.setdefault("classes", {})
        fresh = [name for name in candidates if name not in checks]
        for name in fresh:
            checks[name] = check(candidates[name])
        passed = [name for name in candidates if checks[name] is None]
        for name in candidates:
            if checks[name] is not None and name not in _warned:
                _warned.add(name)
                warnings.warn(f"ring_rewrite: CPU block kernel {name} is never chosen: {checks[name]}")
        if not passed:
            raise RuntimeError(f"ring_rewrite: no CPU block kernel passed its float64 check: {checks}")
        seconds = classes.get(cls.key, {})
        if len(passed) > 1 and not set(passed) <= set(seconds):
            seconds = {name: list(t) for name, t in timer(cls, {n: candidates[n] for n in passed}).items()}
            classes[cls.key] = seconds
            fresh.append(cls.key)
        if fresh:
            _write(path, record)
    if len(passed) == 1:
        return Decision(passed[0], passed[0], "only candidate")
    times = {name: (float(seconds[name][0]), float(seconds[name][1])) for name in passed}
    return Decision(
        min(passed, key=lambda n: times[n][0]), min(passed, key=lambda n: times[n][1]), "measured", times
    )


def machine() -> tuple[str, str]:
    """This CPU's model name and flags, as ``/proc/cpuinfo`` gives them (``Features`` on Arm)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = info.get("model name") or info.get("Model") or platform.processor() or platform.machine()
    return model, info.get("flags") or info.get("Features", "")


@contextlib.contextmanager
def _locked(path: str | None) -> Iterator[None]:
    """``path``'s lock file held (where ``fcntl`` exists): one process of the machine at a time."""
    if path is None:
        yield
        return
    try:
        import fcntl
    except ImportError:  # not POSIX: each process measures for itself, the last write stays
        yield
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(path + ".lock", "a")
    except OSError:  # a folder this process cannot write: it measures for itself
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read(path: str | None) -> dict:
    if path is None or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}  # unreadable: measured again and written anew


def _write(path: str | None, record: dict) -> None:
    if path is None:
        return
    model, flags = machine()
    record["machine"] = {"cpu": model, "flags": flags, "torch": torch.__version__}
    try:
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(path))
    except OSError:
        return
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


# ---- what the report prints ------------------------------------------------------------------


def decisions() -> list[tuple[BlockClass, tuple[str, ...], Decision]]:
    """Every decision this process measured or read: its class, its candidates, the decision."""
    return [(cls, tuple(sorted(names)), d) for (_, _, names), (cls, d) in _decided.items()]


def describe() -> str:
    """One line: which kernel runs this process's float32 CPU blocks and why: forced, or for
    each class measured, the kernels chosen forward and backward (and aten's time over theirs)."""
    name = os.environ.get(ENV, "").strip()
    if name:
        return f"{name}, forced ({ENV}={name}{'; a local branch in place runs ours' if name == 'aten' else ''})"
    made = decisions()
    if not made:
        return f"the fastest of aten's and ours for each block shape, measured on {machine()[0]} where one first runs"
    parts = []
    for cls, names, d in made:
        where = "" if "aten" in names else " (in place)"
        if d.why != "measured":
            parts.append(f"{cls.key}{where}: {d.forward} ({d.why})")
            continue
        slower = ""
        if "aten" in d.seconds:
            fwd, bwd = (d.seconds["aten"][i] / d.seconds[n][i] for i, n in enumerate((d.forward, d.backward)))
            slower = f"; aten {fwd:.2f}x / {bwd:.2f}x their time"
        fastest = f"forward / backward, fastest of {len(d.seconds)}{slower}"
        parts.append(f"{cls.key}{where}: {d.forward} / {d.backward} ({fastest})")
    return f"measured on {machine()[0]}: " + "; ".join(parts)
