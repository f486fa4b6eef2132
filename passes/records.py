"""What the passes did with each attention site: one ``SiteRecord`` per site, in
``gm.meta["ring_rewrite_sites"]``, and the one rule for a site that must stay as it is."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch.fx as fx
from torch._dynamo.utils import counters

from ring_rewrite.comm.groups import resolve_group
from ring_rewrite.config import RingDilatedConfig
from ring_rewrite.program import Program, build
from ring_rewrite.site_plan import SitePlan

__all__ = ["SiteRecord", "TOUCHED", "UnsupportedSiteError", "leave_alone", "records", "sharded"]

log = logging.getLogger(__name__)

TOUCHED = "ring_rewrite_passes"
"""``node.meta`` key of an SDPA node: the normalising passes that made or changed it."""


class UnsupportedSiteError(RuntimeError):
    """An attention site that cannot be rewritten where leaving it alone is not allowed."""


@dataclasses.dataclass(frozen=True)
class SiteRecord:
    """What the passes did with one attention site (one row of the report)."""

    site: int
    location: str
    kind: str
    shapes: dict[str, Any]
    reason: str | None = None
    """Why the site is left alone; for a rewritten one, where its plan departs from the ring
    over every rank (Note [Whole on every rank]), or None."""
    plan: SitePlan | None = None
    passes: tuple[str, ...] = ()
    """The passes that changed the site, in pipeline order (``passes/pipeline.py``)."""
    decode: bool = False
    """A decode step rewritten without a plan: its rows computed on every rank
    (``ring_rewrite/decode.py``)."""

    @property
    def rewritten(self) -> bool:
        return self.plan is not None or self.decode

    @property
    def forward_program(self) -> Program:
        """What the site's forward does on this rank, step by step (Note [The site program])."""
        return build(self._planned(), "forward")

    @property
    def backward_program(self) -> Program:
        """What the site's backward does on this rank, step by step (Note [The site program])."""
        return build(self._planned(), "backward")

    def _planned(self) -> SitePlan:
        if self.plan is None:
            raise ValueError(f"site {self.site} ({self.location}) has no program: {self.reason or 'a decode step'}")
        return self.plan


def records(gm: fx.GraphModule) -> list[SiteRecord]:
    """The graph's site records so far (the list itself: passes append to it)."""
    return gm.meta.setdefault("ring_rewrite_sites", [])


def sharded(config: RingDilatedConfig) -> bool:
    """Whether the model runs on sequence shards of more than one rank."""
    return config.sharding == "sharded" and resolve_group(config.group)[1] > 1


def leave_alone(
    gm: fx.GraphModule, config: RingDilatedConfig, *, what: str, fate: str, location: str,
    kind: str, shapes: dict[str, Any], reason: str,
) -> None:  # fmt: skip
    """Record a site that stays as it is, or raise where that is not allowed.

    NOTE: in sharded mode a site left alone would attend within the local shard only: a
    different function. So it is always an error there, as with ``strict``
    (docs/semantics.md, Sites left alone).
    """
    if config.strict or sharded(config):
        why = "" if config.strict else "sharded mode cannot leave it alone: "
        raise UnsupportedSiteError(f"ring_rewrite: {what} at {location} cannot {fate}: {why}{reason}")
    # NOTE: logged, not warnings.warn: that shows a message once per process, and a site left
    # alone must say so at every compile.
    log.warning(
        "ring_rewrite: %s at %s is left alone: it runs as written (plain attention, not dilated, "
        "not across ranks): %s. strict=True makes this an error.", what, location, reason,
    )  # fmt: skip
    counters["ring_rewrite"]["skipped"] += 1
    sites = records(gm)
    sites.append(SiteRecord(len(sites), location, kind, shapes, reason=reason))
