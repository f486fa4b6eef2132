"""The backend's passes, in the order they run: normalising passes, then the one SDPA rewrite.

::

    dynamo graph
      -> attention_modules   nn.MultiheadAttention / TransformerEncoderLayer -> SDPA (decompose_mha.py)
      -> hand_written        softmax(q @ k^T * scale + mask) @ v written as ops -> SDPA (hand_written.py)
      -> length_buckets      a symbolic sequence length -> padded to a static bucket (bucket_lengths.py)
      -> rewrite_sdpa        every supported SDPA -> ring dilated attention (rewrite_sdpa.py)
      -> the lowering compiler (inductor by default)

A normalising pass brings one more form of attention to a plain SDPA node; only the rewrite
turns SDPA into the ring. Each is ``(gm, example_inputs, *, config) -> gm``, bumps
``counters["ring_rewrite"][counter]`` once per site it changed, and records the sites it must
leave alone (``records.leave_alone``). Adding a form is one function and one entry in
``NORMALISING``. ``RingDilatedConfig(disable_passes=[name])`` turns one off; its
``leave_alone``, if it has one, then records the sites it would have changed as left alone
(a form the rewrite could not see otherwise, like an opaque module node, must have one).

Attention inside a higher-order op's body (``torch.utils.checkpoint``'s region, as transformers'
gradient checkpointing and TRL's default make it) is out of the passes' reach: each such site is
recorded as left alone, with that reason, before the passes run (``_nested_sites``), so that it is
never silently plain attention (sharded mode and ``strict`` raise).

Which pass touched which site needs nothing from the passes: the pipeline notes, on every SDPA
node a normalising pass added or changed, the pass's name (``records.TOUCHED``), and the rewrite
copies the names into the site's record (the report's ``passes`` column).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from ring_rewrite.config import RingDilatedConfig

from .bucket_lengths import NAME as BUCKETS_NAME
from .bucket_lengths import bucket_lengths
from .decompose_mha import decompose_attention_modules, leave_attention_modules_alone
from ._fx import location
from .find_sdpa import SDPA_TARGETS, find_sdpa_sites
from .hand_written import NAME as HAND_WRITTEN_NAME
from .hand_written import hand_written_to_sdpa, leave_hand_written_alone
from .records import TOUCHED, leave_alone
from .rewrite_sdpa import NAME as REWRITE_NAME
from .rewrite_sdpa import rewrite_sdpa

__all__ = ["NORMALISING", "REWRITE", "Pass", "check_disabled", "run_passes"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[..., fx.GraphModule]
    """``(gm, example_inputs, *, config) -> gm``."""
    counter: str
    """Its count: ``counters["ring_rewrite"][counter]``, one per site it changed."""
    leave_alone: Callable[..., None] | None = None
    """``(gm, *, config, reason)``, run in a normalising pass's place when it is disabled: the
    sites it would have changed are recorded as left alone, so sharded mode and ``strict`` raise."""


NORMALISING: tuple[Pass, ...] = (
    Pass(
        "attention_modules", decompose_attention_modules, "decomposed",
        leave_attention_modules_alone,
    ),  # fmt: skip
    # NOTE: before length_buckets, so that the SDPA nodes it makes are bucketed too.
    Pass(HAND_WRITTEN_NAME, hand_written_to_sdpa, "hand_written", leave_hand_written_alone),
    Pass(BUCKETS_NAME, bucket_lengths, "bucketed"),
)
REWRITE = Pass(REWRITE_NAME, rewrite_sdpa, "rewritten")


def check_disabled(config: RingDilatedConfig) -> None:
    """Raise naming the field unless ``config.disable_passes`` names normalising passes only."""
    names = [p.name for p in NORMALISING]
    unknown = [name for name in config.disable_passes if name not in names]
    if unknown:
        raise ValueError(
            f"disable_passes names {unknown}, which are no normalising passes; they are {names} "
            f"({REWRITE.name} is the backend itself: compile without it instead)"
        )


def run_passes(gm: fx.GraphModule, example_inputs: Any, *, config: RingDilatedConfig) -> fx.GraphModule:
    """``gm`` through every enabled normalising pass, then the rewrite."""
    check_disabled(config)
    for node, op in _nested_sites(gm):
        leave_alone(
            gm, config, what="attention", fate="be rewritten", location=location(node), kind="nested",
            shapes={}, reason=(
                f"it runs inside {op}'s body (torch.utils.checkpoint: activation or gradient "
                "checkpointing), which the passes do not enter; checkpoint without the attention "
                "(or not at all) to rewrite it"
            ),
        )  # fmt: skip
    for p in NORMALISING:
        if p.name in config.disable_passes:
            if p.leave_alone is not None:
                reason = f"pass {p.name} is disabled (disable_passes)"
                p.leave_alone(gm, config=config, reason=reason)
            continue
        before = _sdpa_calls(gm)
        gm = _run(p, gm, example_inputs, config)
        for node, call in _sdpa_calls(gm).items():
            if before.get(node) != call:
                node.meta[TOUCHED] = (*node.meta.get(TOUCHED, ()), p.name)
    return _run(REWRITE, gm, example_inputs, config)


def _run(p: Pass, gm: fx.GraphModule, example_inputs: Any, config: RingDilatedConfig) -> fx.GraphModule:
    count = counters["ring_rewrite"][p.counter]
    gm = p.run(gm, example_inputs, config=config)
    log.debug("ring_dilated pass %s: %d site(s)", p.name, counters["ring_rewrite"][p.counter] - count)
    return gm


def _nested_sites(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """Every attention call (SDPA, ``multi_head_attention_forward``) inside the body of a
    higher-order op of ``gm``, at any depth, with the op's name."""
    targets = (*SDPA_TARGETS, torch.nn.functional.multi_head_attention_forward)
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        for arg in node.args:
            body = getattr(gm, arg.target, None) if isinstance(arg, fx.Node) and arg.op == "get_attr" else None
            if isinstance(body, fx.GraphModule):
                inner = [n for n in body.graph.nodes if n.op == "call_function" and n.target in targets]
                found += [(n, node.target.name()) for n in inner] + _nested_sites(body)
    return found


def _sdpa_calls(gm: fx.GraphModule) -> dict[fx.Node, tuple]:
    return {site.node: (site.node.args, site.node.kwargs) for site in find_sdpa_sites(gm)}
