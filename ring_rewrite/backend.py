"""The ``ring_dilated`` torch.compile backend and the ``ring_dilated`` decorator."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.fx as fx
import torch.nn as nn

from . import inductor_fixes, recompiles
from .comm.lowering import inductor_lowering
from .config import RingDilatedConfig
from .passes import check_disabled, run_passes

__all__ = ["backend", "ring_dilated", "ring_dilated_backend", "RingDilatedBackend"]

log = logging.getLogger(__name__)
BACKEND_NAME = "ring_dilated"
_GRAPHS_ARTIFACT = "ring_rewrite_graphs"
# TORCH_LOGS="+ring_rewrite" (module form, parsed when torch is imported) turns these on; in
# process, torch._logging.set_logs(modules={"ring_rewrite_graphs": True}) does.
torch._logging._internal.register_log("ring_rewrite", "ring_rewrite")
torch._logging._internal.register_artifact(
    _GRAPHS_ARTIFACT, "The dynamo graph before and after the ring_dilated rewrite"
)
graph_log = torch._logging.getArtifactLogger(__name__, _GRAPHS_ARTIFACT)

T = TypeVar("T")


class RingDilatedBackend:
    """A dynamo backend: the passes (``passes/pipeline.py``), then the lowering compiler.

    ``records`` collects one ``SiteRecord`` per attention site of every graph it compiled.
    ``inner``, a dynamo backend, replaces ``config.compiler`` for the lowering (tests use it
    to look at the AOT forward and backward graphs).
    """

    def __init__(self, config: RingDilatedConfig | None = None, *, inner: Callable | None = None) -> None:
        self.config = config or RingDilatedConfig()
        check_disabled(self.config)
        # NOTE: dynamo names a failing backend by its __name__: "backend='ring_dilated' raised".
        self.__name__ = BACKEND_NAME
        self.inner = inner
        self.records: list[Any] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any):
        inductor_lowering()  # whichever compiler lowers the graph, inductor must know the ring
        recompiles.mark_compiled()  # past the recompile limit this frame raises (Note [Recompile limit])
        config = self.config
        if kwargs.get("options") is not None:
            config = RingDilatedConfig.from_options(kwargs["options"])
        graph_log.debug("%s", lazy_print(gm, "before ring_dilated rewrite"))
        gm = run_passes(gm, example_inputs, config=config)
        graph_log.debug("%s", lazy_print(gm, "after ring_dilated rewrite"))
        self.records.extend(gm.meta.get("ring_rewrite_sites", ()))
        if self.inner is not None:
            return self.inner(gm, example_inputs)
        return _lower(gm, example_inputs, config.compiler)


def _lower(gm: fx.GraphModule, example_inputs: list[Any], compiler: str):
    if compiler == "eager":
        return gm.forward
    if compiler == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    inductor_fixes.install()
    return compile_fx(gm, example_inputs, config_patches=_inductor_patches())


def _inductor_patches() -> dict[str, Any]:
    """The inductor config our compiles run under: ``inductor_lowering``'s patch, with the
    user's own post-grad passes kept.

    The patch's ``post_grad_custom_post_pass`` changes nothing; its ``uuid`` keys inductor's FX
    graph cache (and AOT autograd's) to the ring's lowering, so code compiled under another
    lowering is never reused; so does ``inductor_fixes.cache_key()``'s, to our corrections of
    inductor (Note [Inductor's loop split]). Where the user set ``post_grad_custom_post_pass`` too, theirs run
    first, then ours: the key hashes every pass's ``uuid`` (a pass without one turns the cache
    off), so it changes with our lowering and with theirs, whichever inductor options they set.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import get_custom_graph_passes

    patches = dict(inductor_lowering())
    ours = patches["post_grad_custom_post_pass"]
    theirs = get_custom_graph_passes(inductor_config.post_grad_custom_post_pass)
    theirs = tuple(p for p in theirs if p is not ours and p is not inductor_fixes.cache_key())
    patches["post_grad_custom_post_pass"] = (*theirs, ours, inductor_fixes.cache_key())
    return patches


class lazy_print:
    def __init__(self, gm: fx.GraphModule, title: str) -> None:
        self.gm, self.title = gm, title

    def __str__(self) -> str:
        parts = [f"===== {self.title} =====", self.gm.print_readable(print_output=False)]
        return "\n".join(parts)


def backend(config: RingDilatedConfig | None = None, **fields: Any) -> RingDilatedBackend:
    """A ``ring_dilated`` backend object for ``torch.compile(model, backend=...)``.

    Builds the backend from a ``RingDilatedConfig``, or from config fields given as keyword
    arguments (none: the exact config). Dynamo hands it every graph it captures; the backend
    runs the normalising passes and the SDPA rewrite on it, then lowers it with
    ``config.compiler``. It keeps one site record per attention site of every graph it compiled
    in ``.records`` (``str(ring_rewrite.Report(be.records))`` is the report's table). Dynamo's
    errors name it ``backend='ring_dilated'``, and an error raised while it compiles reaches the
    caller wrapped in ``torch._dynamo.exc.BackendCompilerFailed``.

    Args:
        config (RingDilatedConfig, optional): the config. Default: ``None``.
        **fields: ``RingDilatedConfig`` fields, when ``config`` is not given.

    Returns:
        RingDilatedBackend: a dynamo backend, ``(gm, example_inputs) -> compiled callable``.

    Raises:
        TypeError: both ``config`` and fields are given, or a field does not exist.
        ValueError: a bad field value, or ``disable_passes`` names no normalising pass.

    Example::

        be = ring_rewrite.backend(segment_lengths=[2048, 8192], dilation_rates=[1, 4])
        model = torch.compile(model, backend=be)
        out = model(x)
        print(ring_rewrite.Report(be.records))

    .. warning::
        Every test runs on CPU over gloo. The CUDA block kernel has run on one GPU only
        (``P = 1``); rings across GPUs over NCCL have never run.
    """
    if config is not None and fields:
        raise TypeError("pass either a RingDilatedConfig or config fields, not both")
    return RingDilatedBackend(config or RingDilatedConfig(**fields))


def ring_dilated_backend(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any):
    """The backend registered with dynamo as ``"ring_dilated"``.

    ``torch.compile(model, backend="ring_dilated", options={...})`` calls it with each graph
    dynamo captures, and ``options`` arrives as a keyword argument: its keys are
    ``RingDilatedConfig`` fields (``RingDilatedConfig.from_options``; no options is the exact
    config). Every call builds a new backend object, so the site records are not kept: compile
    with ``ring_rewrite.backend(...)`` to read them, or call ``ring_rewrite.explain``. It is
    registered at ``import ring_rewrite`` and by the package's ``torch_dynamo_backends`` entry
    point.

    Args:
        gm (torch.fx.GraphModule): the graph dynamo captured; the passes rewrite it in place.
        example_inputs (list): its example inputs.
        **kwargs: ``options`` (Mapping[str, Any] or RingDilatedConfig, optional): the config
            fields by name; other keyword arguments are ignored.

    Returns:
        Callable: the rewritten graph, as ``config.compiler`` lowered it.

    Raises:
        ValueError: an option that names no field, or a bad value (under ``torch.compile``,
            wrapped in ``torch._dynamo.exc.BackendCompilerFailed``).

    Example::

        model = torch.compile(model, backend="ring_dilated",
                              options={"segment_lengths": [2048, 8192], "dilation_rates": [1, 4]})

    .. warning::
        Every test runs on CPU over gloo. The CUDA block kernel has run on one GPU only
        (``P = 1``); rings across GPUs over NCCL have never run.
    """
    config = RingDilatedConfig.from_options(kwargs.get("options"))
    return RingDilatedBackend(config)(gm, example_inputs)


def ring_dilated(obj: Any = None, /, **fields: Any) -> Any:
    """Compile a module class, a module or a function with the ``ring_dilated`` backend.

    A decorator or a plain call. The config is built from ``fields`` first. On an
    ``nn.Module`` subclass it wraps ``__init__`` so that every instance compiles itself
    (``Module.compile``) when built, and returns the class; on a module instance it compiles
    the module in place and returns it; on any other callable it returns
    ``torch.compile(obj, backend=ring_rewrite.backend(config))``. Without ``obj`` it returns a
    decorator that does the same.

    Args:
        obj (type, nn.Module or Callable, optional): what to compile (positional only).
            Default: ``None`` (return a decorator).
        **fields: ``RingDilatedConfig`` fields.

    Returns:
        ``obj`` compiled as above, or a decorator when ``obj`` is ``None``.

    Raises:
        TypeError: ``obj`` is neither an ``nn.Module`` class, a module nor callable, or a field
            does not exist.
        ValueError: a bad field value, or ``disable_passes`` names no normalising pass (for a
            class, when an instance is built).

    Example::

        @ring_rewrite.ring_dilated(segment_lengths=[2048, 8192], dilation_rates=[1, 4])
        class Block(nn.Module):
            ...

        model = ring_rewrite.ring_dilated(model, segment_lengths=[2048, 8192], dilation_rates=[1, 4])

    .. warning::
        Every test runs on CPU over gloo. The CUDA block kernel has run on one GPU only
        (``P = 1``); rings across GPUs over NCCL have never run.
    """
    config = RingDilatedConfig(**fields)
    if obj is None:
        return functools.partial(_apply, config=config)
    return _apply(obj, config=config)


def _apply(obj: T, *, config: RingDilatedConfig) -> T:
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        init = obj.__init__

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.compile(backend=backend(config))

        obj.__init__ = __init__  # type: ignore[misc]
        return obj
    if isinstance(obj, nn.Module):
        obj.compile(backend=backend(config))
        return obj
    if callable(obj):
        return torch.compile(obj, backend=backend(config))  # type: ignore[return-value]
    raise TypeError(f"ring_dilated decorates an nn.Module class, a module or a function, not {obj!r}")


def register() -> None:
    """Register the ``"ring_dilated"`` backend with dynamo; ``import ring_rewrite`` calls it.

    Installs the recompile-limit check first (Note [Recompile limit]),
    then registers ``ring_dilated_backend`` under the name
    ``"ring_dilated"`` unless the name is registered already or the package's
    ``torch_dynamo_backends`` entry point is loading it now (it registers the name itself).
    Calling it again does nothing.

    Args:
        None.

    Returns:
        None.

    Example::

        import ring_rewrite  # registers "ring_dilated"
        model = torch.compile(model, backend="ring_dilated")
    """
    from torch._dynamo.backends import registry

    recompiles.install()

    if BACKEND_NAME in registry._COMPILER_FNS:
        return
    if registry._BACKENDS.get(BACKEND_NAME) is not None:
        # Discovered through the torch_dynamo_backends entry point, which is loading us now
        # and registers the name itself right after: registering here would be a duplicate.
        return
    registry.register_backend(ring_dilated_backend, name=BACKEND_NAME)
