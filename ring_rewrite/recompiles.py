"""A call past dynamo's recompile limit raises instead of running un-rewritten, for the frames
this backend compiled only.

Note [Recompile limit]
~~~~~~~~~~~~~~~~~~~~~~
Past ``torch._dynamo.config.recompile_limit`` compiles of one function (8: eight sequence
lengths, say; or ``accumulated_recompile_limit``), dynamo runs the call *uncompiled*: the
original SDPA, a different function (undilated; in sharded mode, attention within the local
shard), with one generic log line. A call is rewritten or it raises (docs/semantics.md,
Sites left alone).

Dynamo's switch for that, ``config.fail_on_recompile_limit_hit``, is process-wide, and torch
2.13 offers no per-backend one: a backend is not called on a cache miss past the limit, and its
``backend_ctx_ctor`` does not reach ``torch.compile``. So ``install`` wraps dynamo's
``convert_frame._compile`` (once, at import): every compile runs with its ``(code, compiler)``
pair in a context variable, ``RingDilatedBackend`` records the pair it compiled
(``mark_compiled``), and a later compile of a recorded pair runs with
``fail_on_recompile_limit_hit`` patched on for that compile only. Dynamo's own check, warning
and recompile reasons are kept; its ``FailOnRecompileLimitHit`` becomes a
``RecompileLimitError`` that says what running uncompiled would mean and what to do. Every
other frame, of any other backend, compiles and falls back as dynamo has it.

Limits: ``suppress_errors=True`` swallows the error as it swallows every compile error; and a
function whose cache another backend filled before this one first compiled it is recognised
from this backend's first compile of it on.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import weakref
from types import CodeType
from typing import Any

from torch._dynamo import config as dynamo_config
from torch._dynamo import convert_frame
from torch._dynamo.cache_size import exceeds_recompile_limit
from torch._dynamo.exc import FailOnRecompileLimitHit

__all__ = ["RecompileLimitError", "install", "mark_compiled"]

log = logging.getLogger(__name__)


class RecompileLimitError(RuntimeError):
    """A call of a function the ``ring_dilated`` backend compiled went past dynamo's recompile limit.

    Past ``torch._dynamo.config.recompile_limit`` compiles of one function (or
    ``accumulated_recompile_limit``), dynamo would run the call uncompiled: plain SDPA, a
    different function from the one the compiled calls compute (undilated; in sharded mode,
    within this rank's shard only). For the functions this backend compiled it raises this
    instead, at every such call; the lengths already compiled still run. The message names the
    limit and its value, the function and its ``file:line``, and what to do: raise the limit
    (or ``torch.compile(..., recompile_limit=...)``) above the number of distinct shapes run, or
    pad inputs to a few lengths. It is raised from dynamo's ``FailOnRecompileLimitHit``
    (``__cause__``). Other backends' functions fall back as dynamo has it (Note [Recompile
    limit]); with ``torch._dynamo.config.suppress_errors=True``
    dynamo swallows it, as it swallows every compile error. A subclass of ``RuntimeError``.

    Example::

        try:
            out = model(x)
        except ring_rewrite.RecompileLimitError:
            ...  # pad x to one of the lengths compiled before
    """


_COMPILING: contextvars.ContextVar[tuple[CodeType, Any] | None] = contextvars.ContextVar(
    "ring_rewrite_compiling", default=None
)
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # compiler -> {code}


def mark_compiled() -> None:
    """Record that this backend compiled the frame being compiled now."""
    current = _COMPILING.get()
    if current is not None:
        code, compiler = current
        _COMPILED.setdefault(compiler, weakref.WeakSet()).add(code)


def install() -> None:
    """Wrap dynamo's frame compile (idempotent)."""
    original = convert_frame._compile
    if getattr(original, "_ring_rewrite", False):
        return
    signature = inspect.signature(original)
    if not {"code", "compiler_fn", "cache_size", "compile_id"} <= set(signature.parameters):
        log.warning(
            "ring_rewrite: this torch's dynamo compiles frames differently; past "
            "torch._dynamo.config.recompile_limit a call may run un-rewritten"
        )
        return

    @functools.wraps(original)
    def _compile(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs).arguments
        code, compiler = bound["code"], bound["compiler_fn"]
        token = _COMPILING.set((code, compiler))
        try:
            if code not in _COMPILED.get(compiler, ()):
                return original(*args, **kwargs)
            try:
                with dynamo_config.patch(fail_on_recompile_limit_hit=True):
                    return original(*args, **kwargs)
            except FailOnRecompileLimitHit as error:
                limit = exceeds_recompile_limit(bound["cache_size"], bound["compile_id"])[1]
                raise RecompileLimitError(_message(code, limit or "recompile_limit")) from error
        finally:
            _COMPILING.reset(token)

    _compile._ring_rewrite = True  # type: ignore[attr-defined]
    convert_frame._compile = _compile


def _message(code: CodeType, limit: str) -> str:
    knob = f"torch._dynamo.config.{limit}"
    per_call = " (or torch.compile(..., recompile_limit=...))" if limit == "recompile_limit" else ""
    return (
        f"ring_rewrite: dynamo hit {knob} ({getattr(dynamo_config, limit)}) recompiling "
        f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno}). Past the limit dynamo would "
        "run this call uncompiled: its attention un-rewritten, as plain SDPA (undilated, and in "
        "sharded mode within this rank's shard only), a different function from the one the "
        "compiled calls compute, so ring_dilated raises instead. Each sequence length compiles "
        "its own plan (in replicated mode, each power-of-two range of lengths once dynamo makes "
        f"the length dynamic). Raise {knob}{per_call} above the number of distinct shapes you "
        "run, or pad inputs to a few lengths."
    )
