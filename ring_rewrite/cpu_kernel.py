"""The CPU block kernel: ``csrc/flash_cpu.c``, built on first use, called through ctypes.

Note [The CPU block kernel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every block of a dilated site is a causal square of ``w / r`` rows (2048 in the LongNet configs of
``benchmarks/``). aten's CPU flash kernel tiles queries by 256 rows and keys by 512 and, causal,
runs each query tile's last key tile to its end: on a 2048-row block it computes a quarter more
pairs than the useful ones, and its share of ``torch.mm``'s rate falls from about 93 % on a full
square to 65 to 75 % on the causal one (forward + backward, this machine; blocks under 768 rows
fare worse: its 64-row tiles still run 512 keys, and a causal 512 square runs at 30 %).
``flash_cpu.c`` is the same algorithm (FlashAttention-2) with short query tiles (64 rows with
AVX-512) that stop at their last row's diagonal. It calls no BLAS: BLAS packs both operands of
every call, and a tile's products are small (a 64-row query tile against 256 keys of 64 dims), so
per-call packing would cost a large share of the kernel's time. Every product is a register tile
of its own (``tile`` in ``flash_cpu.c``: 6 rows by 4 vectors of 16 lanes with AVX-512), one operand
broadcast from where it lies, the other loaded by rows, so nothing is packed per call: forward,
S^T (keys by queries) from k's rows against the query tile transposed once, each query's max and
sum across vector lanes, out^T from v's rows; backward, key tile by key tile (K and V transposed
once a key tile), S and dP against every query tile that sees it, dV and dK summed in the key
tile's own scratch. Its rate against ``torch.mm`` is benchmarks/README.md's section 1.
No BLAS is called, so the build needs nothing of torch's. The vector width and tile follow the
target (AVX-512, AVX2, NEON, SSE), and a flag selects others (``VARIANTS``): AVX2's width on an
AVX-512 CPU (``-mno-avx512f``), register tiles of 2 vectors, so 32-row query tiles, with AVX-512
(``-DRR_QV=2``), key tiles of 128 (``-DRR_TK=128``). Which of these builds and aten's kernel runs
a block is measured on the machine (Note [Choosing the CPU block kernel]):
no one of them is fastest on every CPU. ``tests/test_kernel_choice.py`` checks every build this
CPU can run against float64 (SSE's, ``-mno-avx``, too); ``benchmarks/kernels.py`` times each.
Threads are torch's OpenMP runtime at ``torch.get_num_threads()``: forward, a task per (batch,
head, query tile); backward, per (batch, kv head), which owns its dK and dV. Backward tasks too few
to give every thread one (the local branches' head chunks run one head of a few segments: at 16k
tokens a chunk of the 16384-token branch is one task) are shared by all threads, each taking a
slice of the query tiles that see a key tile, the key tile's dK and dV then summed across them.
It writes ``out``, ``dq``, ``dk`` and ``dv`` contiguous (no copy out of another layout), reads
GQA's kv heads in place and takes ``d != dv`` as they are. Both ways it also reads and writes
every operand at a layout of the caller's: a local branch's lattice rows inside the
site's own tensors, segments as batches and each kernel head's offset of its own
(``forward_in_place``, ``backward_in_place``; Note [Local branches in place]);
forward it then merges its rows into the out and lse they hold, backward it adds its gradients to
theirs.

It can serve float32 blocks without a bias (``serves``): causal or full, which is every block of
a site without a key mask, padding or band; it runs those where it is measured the faster, and a
local branch in place always (aten has no such form). The rest (float64, a bias) runs aten's
kernel, as does everything where no C compiler builds the library (a warning says why, once).

Note [Non-finite values]
~~~~~~~~~~~~~~~~~~~~~~~~
A NaN or inf in q, k, v or a float mask reaches what it reaches in the function evaluated pair by
pair in float64 (docs/semantics.md, The function; ``tests/test_nonfinite.py``), forward and
backward, and nothing else. A row with a NaN or ``+inf`` score (a NaN anywhere in its q or in a
key it attends to; an inf in either, with a ``+inf`` product) is NaN, and so is its lse; a key
whose score is ``-inf`` drops out of that row, whose gradient ``dq`` then takes ``0 * inf``, NaN;
a value's NaN or inf reaches the rows that attend to it. Backward, a row whose lse is NaN has
P = NaN on every key it attends to: its dq, and the dk and dv of those keys, are NaN. Pairs that
are not connected (past the diagonal, another segment or lattice, a mask's ``-inf``, a row with
nothing to attend) pass nothing on, even where a plain product would multiply their 0 by a NaN
or inf. Where each path makes it so:

* ``flash_cpu.c``: a row whose sum is NaN reports lse NaN (not ``-inf``, which merges would take
  as a row holding nothing and the backward as a row with nothing to attend), and its in-place
  merge keeps a NaN on either side. Its products skip the pairs past the diagonal whose other
  factor is not finite, each checked once a tile: forward ``P V`` (value rows), backward ``dS K``
  (key rows, zeroed in the tile and added to the rows that see them) and ``dS^T Q`` (the q of a
  row whose lse is NaN taken as 0: its dS is NaN wherever it sees a key). Backward, a key
  whose inf makes it score ``-inf`` in a row that sees it has P = 0 there exactly (``exp_neg``
  gives about 1e-38, which would make that row's dq an inf, not NaN). Finite inputs pay one check
  of each key tile's rows and, per query row, a look at the tile's (empty) list of such keys.
* aten's kernel (float64, a bias, or no C compiler) multiplies within a block, which would reach
  rows before a NaN under ``is_causal`` and rows with nothing to attend. So a block whose inputs
  are not all finite (one sum each tells) runs ``kernels.nonfinite_forward`` /
  ``nonfinite_backward`` instead: the same attention in torch, in float64, in row chunks, each
  product over the connected pairs only (``kernels._pairs_product``). A block call whose q, k, v
  or bias are not all finite takes that path whichever kernel the CPU's choice names, forward
  and backward alike: the backward then recomputes the probabilities as its forward computed
  them (a float32 forward of one kernel and a backward of another put dq's cancelling terms, at
  scores of 169, 5e-5 off: campaign seed 310988). The in-place kernels above keep their own.
* Merges (``merge.py``, the ring's) keep a NaN lse (``torch.maximum`` propagates it), and the
  ring's dK/dV and dq sums are plain adds.

``reference_attention`` multiplies dense matrices, so its backward (and its forward, for an inf
in ``v``) also reaches pairs that are not connected (``0 * inf``; softmax's NaN over a row's
``-inf`` entries), as SDPA's math kernel does and its flash kernel within a block; and it marks
a row attending to a NaN value NaN whole, its gradients 0. Where a pair is connected they agree.

Each build is a library of its own, built with the C compiler inductor's CPU code needs anyway
(``$CC``, else ``cc``), about a second of CPU each (the builds the choice times compiled side by
side on first use), into ``ring_rewrite/`` under inductor's cache directory, named by a hash of
the source, the flags and this machine's CPU flags (``-march=native``); ranks building at once
each write their own file and rename it into place. The choices are kept beside them
(``choice_path``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Mapping

import torch

from . import cpu_choice

__all__ = [
    "Variant", "VARIANTS", "variants", "serves", "available", "candidates", "choose", "choice_path", "forward",
    "forward_in_place", "backward", "backward_in_place",
]  # fmt: skip

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "flash_cpu.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]


@dataclasses.dataclass(frozen=True)
class Variant:
    """A build of ``flash_cpu.c`` (Note [The CPU block kernel]): the target's, or one that a
    compiler flag gives another vector width or tile."""

    flags: tuple[str, ...]
    """Flags after the target's (``-march=native``)."""
    needs: str | None
    """The CPU flag (as ``/proc/cpuinfo`` names it) without which this build is the target's own
    or cannot run; None: a build of its own on every CPU."""


VARIANTS: dict[str, Variant] = {
    "ours": Variant((), None),  # the target's width and tile
    "ours-avx2": Variant(("-mno-avx512f",), "avx512f"),  # AVX2's 8 lanes, 6 x 2 vectors
    "ours-6x2": Variant(("-DRR_QV=2",), "avx512f"),  # 16 lanes, 6 x 2 vectors: 32-row query tiles
    "ours-tk128": Variant(("-DRR_TK=128",), None),  # key tiles of 128
}
"""The builds of ours that may run a block, by name (``RING_REWRITE_CPU_KERNEL`` takes these)."""


def variants() -> list[str]:
    """The names of ``VARIANTS`` that are builds of their own on this CPU."""
    flags = set(cpu_choice.machine()[1].split())
    return [name for name, v in VARIANTS.items() if v.needs is None or v.needs in flags]


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    return compiler


def _folder() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "ring_rewrite")


@functools.cache
def _source_digest() -> bytes:
    with open(_SOURCE, "rb") as f:
        return hashlib.sha256(f.read()).digest()


def _path(compiler: str, flags: tuple[str, ...]) -> str:
    """The library of a build: named by the source, the compiler, its flags and the CPU's."""
    parts = [_source_digest(), " ".join([*_FLAGS, *flags]).encode(), compiler.encode()]
    parts.append(cpu_choice.machine()[1].encode())
    key = hashlib.sha256(b"\0".join(parts))
    return os.path.join(_folder(), f"flash_cpu_{key.hexdigest()[:16]}.so")


def _build(names: list[str]) -> dict[str, str | Exception]:
    """The library of each of ``names`` (``VARIANTS``), or why it could not be built: those not
    built yet compiled at once, each into a file of its own renamed into place."""
    try:
        compiler = _compiler()
    except RuntimeError as e:
        return dict.fromkeys(names, e)
    result: dict[str, str | Exception] = {}
    running = {}
    for name in names:
        path = result[name] = _path(compiler, VARIANTS[name].flags)
        if os.path.exists(path):
            continue
        os.makedirs(_folder(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=_folder())
        os.close(fd)
        cmd = [compiler, *_FLAGS, *VARIANTS[name].flags, _SOURCE, "-o", tmp, "-lm"]
        try:
            running[name] = (tmp, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        except OSError as e:
            os.remove(tmp)
            result[name] = e
    for name, (tmp, proc) in running.items():
        _, err = proc.communicate()
        try:
            if proc.returncode:
                result[name] = RuntimeError(f"{compiler} failed on {_SOURCE}:\n{err.strip()}")
            else:
                os.replace(tmp, result[name])
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return result


@functools.cache
def _library(name: str = "ours") -> ctypes.CDLL | None:
    """The built library of build ``name``, or None (with a warning) where it cannot be built."""
    try:
        built = _build([name])[name]
        if isinstance(built, Exception):
            raise built
        lib = ctypes.CDLL(built)
    except (OSError, RuntimeError) as e:
        if name == "ours":
            warnings.warn(f"ring_rewrite: the CPU block kernel is not available ({e}); blocks run aten's flash kernel")
        else:
            warnings.warn(f"ring_rewrite: the CPU block kernel's build {name} is not available ({e}); not a candidate")
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rr_flash_forward.argtypes = [ptr] * 10 + [i64] * 8 + [ctypes.c_float] + [ctypes.c_int] * 3
    lib.rr_flash_backward.argtypes = [ptr] * 18 + [i64] * 8 + [ctypes.c_float] + [ctypes.c_int] * 3
    return lib


def available() -> bool:
    """Whether ``flash_cpu.c`` is built (building it on the first call)."""
    return _library() is not None


def serves(*tensors: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``flash_cpu.c`` can run this block: float32 on CPU, no bias, nothing empty. Builds
    the library on the first call that would use it."""
    if bias is not None or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return False
    if any(t.numel() == 0 for t in tensors):
        return False
    return _library() is not None


@functools.cache
def candidates() -> dict[str, cpu_choice.Candidate]:
    """Ours in each build of ``variants()`` that builds here, as ``cpu_choice`` times them (those
    not built yet compiled side by side)."""
    names = variants()
    _build(names)
    found = {}
    for name in names:
        if _library(name) is not None:
            run = functools.partial(forward, variant=name), functools.partial(backward, variant=name)
            found[name] = cpu_choice.Candidate(*run)
    return found


@functools.cache
def choice_path() -> str:
    """The file of this machine's kernel choices (Note [Choosing the CPU block kernel]):
    beside the libraries, named by the CPU's model name and flags, torch's
    version, the kernel's source and the choice's own (how it measures)."""
    model, flags = cpu_choice.machine()
    with open(cpu_choice.__file__, "rb") as f:
        how = f.read()
    parts = [model.encode(), flags.encode(), torch.__version__.encode(), _source_digest(), how]
    key = hashlib.sha256(b"\0".join(parts))
    return os.path.join(_folder(), f"choice_{key.hexdigest()[:16]}.json")


def choose(cls: cpu_choice.BlockClass, others: Mapping[str, cpu_choice.Candidate]) -> cpu_choice.Decision:
    """Which of ours (every build of ``candidates()``) and ``others`` runs blocks of ``cls``
    (``cpu_choice.decide``, cached in ``choice_path()``)."""
    return cpu_choice.decide(cls, {**candidates(), **others}, path=choice_path())


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _strides(x: torch.Tensor, layout: list[int] | None = None) -> ctypes.Array:
    """``x``'s layout as the kernel reads it (``flash_cpu.c``'s header): by default its own
    batch, row and head strides."""
    if layout is None:
        s0, s1, s2 = x.stride()[:3]
        layout = [s0, 0, s2, *(h * s1 for h in range(x.shape[1]))]
    return (ctypes.c_int64 * len(layout))(*layout)


def _sizes(q, k, v) -> list[int]:
    (b, hq, length, d), (hkv, keys), dv = q.shape, k.shape[1:3], v.shape[-1]
    return [b, hq, hkv, length, keys, d, dv]


def forward(q, k, v, scale: float, is_causal: bool, variant: str = "ours") -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one block by build ``variant``: ``out (B, Hq, L, Dv)`` contiguous,
    ``lse (B, Hq, L)``."""
    q, k, v = (_unit_stride(x) for x in (q, k, v))
    sizes = _sizes(q, k, v)
    b, hq, _, length, _, _, dv = sizes
    out, lse = q.new_empty((b, hq, length, dv)), q.new_empty((b, hq, length))
    tensors = (q, k, v, out, lse)
    _forward(variant, [(t, _strides(t)) for t in tensors], sizes, 1, scale, is_causal, False)
    return out, lse


def forward_in_place(results, inputs, layouts: list[list[int]], sizes: list[int], nseg: int, scale: float,
                     is_causal: bool, merge: bool) -> None:  # fmt: skip
    """``forward`` of one branch's blocks, every operand read and written where it lies:
    ``inputs`` ``(q, k, v)`` and ``results`` ``(out, lse)`` (written, or with ``merge`` merged
    into: the attention over both key sets, a row of lse ``-inf`` holding none) at the
    ``layouts`` of ``flash_cpu.c``'s header (``backward_in_place``'s); ``sizes`` of the kernel
    layout. Runs the fastest build of ours for the blocks' class (Note [Choosing the CPU block
    kernel])."""
    tensors = (*inputs, *results)
    variant = _fastest(sizes, is_causal).forward
    _forward(variant, [(t, _strides(t, s)) for t, s in zip(tensors, layouts)], sizes, nseg, scale, is_causal, merge)


def _fastest(sizes: list[int], is_causal: bool) -> cpu_choice.Decision:
    """Which build of ours runs blocks of ``sizes`` (``_sizes``') in place: aten has no such form."""
    _, hq, hkv, length, keys, d, dv = sizes
    return choose(cpu_choice.BlockClass.of(hq, hkv, length, keys, d, dv, is_causal), {})


def _forward(variant: str, operands, sizes: list[int], nseg: int, scale: float, is_causal: bool, merge: bool) -> None:
    _library(variant).rr_flash_forward(
        *(a for t, st in operands for a in (t.data_ptr(), st)), *sizes, nseg, scale, is_causal, merge,
        torch.get_num_threads(),
    )  # fmt: skip


def backward(dout, q, k, v, out, lse, scale: float, is_causal: bool, variant: str = "ours"):
    """This block's ``dq, dk, dv`` by build ``variant``, contiguous, from the merged ``out`` and
    ``lse`` (``+inf`` where a row has nothing to attend)."""
    dout, q, k, v, out, lse = (_unit_stride(x) for x in (dout, q, k, v, out, lse))
    dq = torch.empty(q.shape, dtype=q.dtype)
    dk = torch.empty(k.shape, dtype=k.dtype)
    dv = torch.empty(v.shape, dtype=v.dtype)
    tensors = (dout, q, k, v, out, lse, dq, dk, dv)
    _backward(variant, [(t, _strides(t)) for t in tensors], _sizes(q, k, v), 1, scale, is_causal, False)
    return dq, dk, dv


def backward_in_place(grads, inputs, layouts: list[list[int]], sizes: list[int], nseg: int, scale: float,
                      is_causal: bool, accumulate: bool) -> None:  # fmt: skip
    """One branch's blocks backward, every operand read and written where it lies: ``inputs``
    ``(dout, q, k, v, out, lse)`` and ``grads`` ``(dq, dk, dv)`` (written, or with
    ``accumulate`` added to) at the ``layouts`` of ``flash_cpu.c``'s header (``BranchLayout.
    lattice``: the segments as batches, each kernel head's lattice offset); ``sizes`` as
    ``_sizes`` gives them, of the kernel layout. Operands with unit stride in their last dim. Runs
    the fastest build of ours for the blocks' class, as ``forward_in_place``."""
    tensors = (*inputs, *grads)
    variant = _fastest(sizes, is_causal).backward
    operands = [(t, _strides(t, s)) for t, s in zip(tensors, layouts)]
    _backward(variant, operands, sizes, nseg, scale, is_causal, accumulate)


def _backward(variant: str, operands, sizes: list[int], nseg: int, scale: float, is_causal: bool,
              accumulate: bool) -> None:  # fmt: skip
    _library(variant).rr_flash_backward(
        *(a for t, st in operands for a in (t.data_ptr(), st)), *sizes, nseg, scale, is_causal,
        accumulate, torch.get_num_threads(),
    )  # fmt: skip
