"""ring_rewrite: a torch.compile backend that rewrites SDPA into ring dilated attention.

The ``ring_dilated`` backend finds every ``F.scaled_dot_product_attention`` call dynamo captures
(directly, or inside ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer``) and rewrites it
into dilated attention (LongNet's branches of segment length and dilation rate, merged exactly)
whose sequence is sharded across the ranks of a process group, the far keys and values passed
around a ring. With no branches configured it is exact attention (ring attention). What a
rewritten site computes is docs/semantics.md; every public name is listed in docs/api.md.

* Compiling: ``backend``, ``ring_dilated``, ``ring_dilated_backend`` (registered with dynamo
  as ``"ring_dilated"`` when this package is imported).
* Configuring: ``RingDilatedConfig``.
* Sharding inputs (``sharding="sharded"``): ``shard``, ``unshard``, ``shard_batch``,
  ``positions``.
* Generating from a sharded prompt: ``prefill`` and ``ShardedCache`` (a KV cache that stays
  sharded; they need ``transformers``, imported on first use).
* Training with Hugging Face ``Trainer``: ``RingTrainer`` and ``ring_trainer`` (context parallel
  by one argument; they need ``transformers`` and ``accelerate``, imported on first use).
* Planning and checking: ``explain`` and ``Report`` (what the rewrite did), ``plan`` and
  ``ScalePlan`` (what a config needs per rank at any scale), ``reference_attention`` (the
  float64 reference).
* Errors: ``RecompileLimitError``, ``RingOutOfStep``, ``TransferTimeout``.
* Testing: ``ring_rewrite.testing`` (graph diffs and assertions on what the rewrite did).

Example::

    import ring_rewrite
    model = torch.compile(model, backend="ring_dilated",
                          options={"segment_lengths": [2048, 8192], "dilation_rates": [1, 4]})
"""

from . import ops  # noqa: F401  (registers the ring_rewrite custom ops)
from .backend import backend, register, ring_dilated, ring_dilated_backend
from .comm.errors import RingOutOfStep, TransferTimeout
from .config import RingDilatedConfig
from .layout import positions, shard, shard_batch, unshard
from .recompiles import RecompileLimitError
from .reference import reference_attention
from .report import Report, explain
from .scale import ScalePlan, plan

__all__ = [
    "RecompileLimitError",
    "Report",
    "RingDilatedConfig",
    "RingOutOfStep",
    "RingTrainer",
    "ScalePlan",
    "ShardedCache",
    "TransferTimeout",
    "backend",
    "explain",
    "plan",
    "positions",
    "prefill",
    "reference_attention",
    "ring_dilated",
    "ring_dilated_backend",
    "ring_trainer",
    "shard",
    "shard_batch",
    "unshard",
]



def __getattr__(name: str):
    # NOTE: ring_rewrite/cache.py subclasses transformers' Cache: imported when first asked for,
    # so that the package imports without transformers.
    if name in ("ShardedCache", "prefill"):
        from . import cache

        return getattr(cache, name)
    # NOTE: ring_rewrite/hf.py subclasses transformers' Trainer: the same.
    if name in ("RingTrainer", "ring_trainer"):
        from . import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'ring_rewrite' has no attribute {name!r}")


register()
