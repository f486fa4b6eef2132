"""The ``ring_dilated`` torch.compile backend and the ``ring_dilated`` decorator."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.fx as fx
import torch.nn as nn

from . import recompiles
from .config import RingDilatedConfig
from .p2p import inductor_lowering
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
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    # NOTE: a user's own post-grad pass keys the FX graph cache instead of ours.
    patches = {} if inductor_config.post_grad_custom_post_pass else inductor_lowering()
    return compile_fx(gm, example_inputs, config_patches=patches)


class lazy_print:
    def __init__(self, gm: fx.GraphModule, title: str) -> None:
        self.gm, self.title = gm, title

    def __str__(self) -> str:
        parts = [f"===== {self.title} =====", self.gm.print_readable(print_output=False)]
        return "\n".join(parts)


def backend(config: RingDilatedConfig | None = None, **fields: Any) -> RingDilatedBackend:
    """A backend callable for ``torch.compile(model, backend=ring_rewrite.backend(...))``."""
    if config is not None and fields:
        raise TypeError("pass either a RingDilatedConfig or config fields, not both")
    return RingDilatedBackend(config or RingDilatedConfig(**fields))


def ring_dilated_backend(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any):
    """The registered ``"ring_dilated"`` backend: ``options=`` become the config."""
    config = RingDilatedConfig.from_options(kwargs.get("options"))
    return RingDilatedBackend(config)(gm, example_inputs)


def ring_dilated(obj: Any = None, /, **fields: Any) -> Any:
    """Compile with the ``ring_dilated`` backend; a decorator or a plain call.

    ``@ring_dilated(segment_lengths=[...], dilation_rates=[...])`` on an ``nn.Module`` class
    compiles every instance, on a module instance compiles it in place (``Module.compile``) and
    returns it, on a function returns the compiled function. ``ring_dilated(model, **config)``
    is the same as a plain call.
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
    """Register ``"ring_dilated"`` with dynamo unless the entry point is about to (or did)."""
    from torch._dynamo.backends import registry

    recompiles.install()

    if BACKEND_NAME in registry._COMPILER_FNS:
        return
    if registry._BACKENDS.get(BACKEND_NAME) is not None:
        # Discovered through the torch_dynamo_backends entry point, which is loading us now
        # and registers the name itself right after: registering here would be a duplicate.
        return
    registry.register_backend(ring_dilated_backend, name=BACKEND_NAME)
