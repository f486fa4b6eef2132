"""ring_rewrite: a torch.compile backend that rewrites SDPA into ring dilated attention."""

from . import ops  # noqa: F401  (registers the ring_rewrite custom ops)
from .backend import backend, register, ring_dilated, ring_dilated_backend
from .config import RingDilatedConfig
from .layout import positions, shard, shard_batch, unshard
from .p2p import RingOutOfStep, TransferTimeout
from .recompiles import RecompileLimitError
from .reference import reference_attention
from .report import Report, explain
from .scale import ScalePlan, plan

__all__ = [
    "RecompileLimitError",
    "Report",
    "RingDilatedConfig",
    "RingOutOfStep",
    "ScalePlan",
    "TransferTimeout",
    "backend",
    "explain",
    "plan",
    "positions",
    "reference_attention",
    "ring_dilated",
    "ring_dilated_backend",
    "shard",
    "shard_batch",
    "unshard",
]

register()
