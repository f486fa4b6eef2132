"""Assertions on what the rewrite did: sites rewritten or left alone, one ring schedule on all ranks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from ..backend import RingDilatedBackend
from ..passes import location
from ..report import Report
from ..site_plan import SitePlan
from .capture import Capture, capture_ranks
from .graphs import op_label, walk
from .schedule import first_difference, planned_transfers, schedule_table, unpaired

__all__ = ["assert_left_alone", "assert_rewritten", "assert_same_p2p_schedule"]

_SDPA = ("scaled_dot_product_attention",)
# What a site left alone still shows: its SDPA node, its attention-module node, or the softmax
# of attention written by hand.
_LEFT_ALONE = (
    *_SDPA, "multi_head_attention_forward", "_transformer_encoder_layer_fwd", "softmax",
    "Tensor.softmax",
)  # fmt: skip


def _records(obj: Any) -> list[Any]:
    if isinstance(obj, (Capture, Report, RingDilatedBackend)):
        return list(obj.records)
    return list(obj)


def _report(records: list[Any]) -> str:
    return str(Report(records))


def _site_name(record: Any) -> str:
    return f"site {record.site} ({record.location})"


def _left_alone_locations(gm: fx.GraphModule) -> list[str]:
    return [location(n) for _, n in walk(gm) if op_label(n) in _LEFT_ALONE]


def assert_rewritten(result: Any, n: int | None = None) -> None:
    """Assert that ``n`` attention sites were rewritten (``None``: every site, at least one).

    Counts the rewritten site records of ``result``. With a ``Capture`` the graphs must agree
    with the records too: one rewritten site node (``autograd_function_apply``, or a decode
    step's node) per rewritten site, and an SDPA (or attention-module) node still in place for
    each site left alone. Fails with the sites left alone and their reasons, then the report's
    table (or the graph diff when graphs and records disagree), so a test shows why when an
    upgrade of torch or of a model stops the rewrite.

    Args:
        result (Capture, Report, RingDilatedBackend or list[SiteRecord]): what to look at.
        n (int, optional): the number of sites that must be rewritten. Default: ``None``
            (every site, and at least one).

    Returns:
        None.

    Raises:
        AssertionError: a different number of sites was rewritten, or a ``Capture``'s graphs
            disagree with its records.

    Example::

        cap = capture(model, x, segment_lengths=[64, 256], dilation_rates=[1, 4])
        assert_rewritten(cap, 2)
    """
    __tracebackhide__ = True
    records = _records(result)
    done = [r for r in records if r.rewritten]
    alone = [r for r in records if not r.rewritten]
    expected = len(records) if n is None else n
    if len(done) != expected or (n is None and not records):
        want = "every attention site" if n is None else f"{n} attention site{'s' * (n != 1)}"
        lines = [f"expected {want} rewritten; ring_dilated rewrote {len(done)} of {len(records)}"]
        lines += [f"  {_site_name(r)} left alone: {r.reason}" for r in alone]
        lines += ["", _report(records)]
        raise AssertionError("\n".join(lines))
    if isinstance(result, Capture):
        site_nodes = [
            node
            for gm in result.after
            for _, node in walk(gm)
            if (node.meta.get("ring_rewrite") or {}).get("role") == "site"
            and (op_label(node) == "autograd_function_apply" or node.meta["ring_rewrite"].get("decode"))
        ]
        left = sum(len(_left_alone_locations(gm)) for gm in result.after)
        if len(site_nodes) != len(done) or left < len(alone):
            raise AssertionError(
                f"the site records say {len(done)} rewritten and {len(alone)} left alone, but the "
                f"rewritten graphs hold {len(site_nodes)} rewritten site node(s) and {left} "
                f"attention node(s) left in place\n\n{result.diff()}"
            )


def assert_left_alone(result: Any, site: int | str | None = None, reason: str | None = None) -> Any:
    """Assert that an attention site was left alone (not rewritten), and return its record.

    Chooses the sites by ``site`` and passes when one of them was left alone with a reason
    that contains ``reason``; the first such record is returned. With a ``Capture`` that
    site's SDPA (or attention-module) node must also still be in its graph (not checked for a
    site whose location is unknown, ``"?"``). Fails naming what happened to the chosen sites,
    then the report's table.

    Args:
        result (Capture, Report, RingDilatedBackend or list[SiteRecord]): what to look at.
        site (int or str, optional): a site id, or a substring of its location
            (``layers.3.self_attn (model.py:12)``: module path and ``file:line``).
            Default: ``None`` (any site).
        reason (str, optional): a substring of the reason it was left alone.
            Default: ``None`` (any reason).

    Returns:
        SiteRecord: the record of the site left alone.

    Raises:
        AssertionError: no site matches ``site``, none of them was left alone for ``reason``,
            or a ``Capture``'s graph no longer holds the site's attention node.

    Example::

        cap = capture(model, x)
        record = assert_left_alone(cap, "layers.0.attn", reason="dropout")
    """
    __tracebackhide__ = True
    records = _records(result)
    if isinstance(site, int):
        chosen = [r for r in records if r.site == site]
    elif isinstance(site, str):
        chosen = [r for r in records if site in r.location]
    else:
        chosen = records
    which = "any attention site" if site is None else f"attention site {site!r}"
    want = f"left alone{f' with a reason containing {reason!r}' if reason else ''}"
    if not chosen:
        raise AssertionError(f"expected {which} {want}, but no site matches\n\n{_report(records)}")
    alone = [r for r in chosen if not r.rewritten]
    matching = [r for r in alone if reason is None or reason in (r.reason or "")]
    if not matching:
        if not alone:
            found = "; ".join(f"{_site_name(r)} was rewritten" for r in chosen)
        else:
            found = "; ".join(f"{_site_name(r)} was left alone because: {r.reason}" for r in alone)
        raise AssertionError(f"expected {which} {want}, but {found}\n\n{_report(records)}")
    record = matching[0]
    if isinstance(result, Capture) and record.location != "?":
        for index, rec in result.sites():
            if rec is record and record.location not in _left_alone_locations(result.after[index]):
                raise AssertionError(
                    f"{_site_name(record)} is recorded as left alone ({record.reason}), but graph "
                    f"{index} no longer holds its attention node\n\n{result.diff()}"
                )
    return record


def assert_same_p2p_schedule(
    model: Callable[..., Any] | Sequence[Capture],
    inputs: Sequence[Any] | Callable[[int], Sequence[Any]] | None = None,
    *,
    world: int = 4,
    backward: bool = True,
    expect_transfers: bool = True,
    **config: Any,
) -> list[Capture]:
    """Assert that every rank issues the same ring transfers in the same order.

    Compiles ``model`` once per rank of a fake process group of ``world`` ranks
    (``capture_ranks``, with ``aot=True``: no communication, nothing runs across ranks), or
    takes a list of per-rank captures already made, or every rank's ``SitePlan`` (then nothing
    compiles: their programs' transfers are compared, ``planned_transfers``, at any size).
    Every rank's forward then backward graphs
    must issue the same transfers (op, tag, sent shapes and dtypes) in the same order, and each
    send must meet a receive from its sender at the same position on the peer: what a real
    ring needs not to deadlock or pair the wrong messages (Note [Ordering the ring's messages]).
    Fails with the first difference and the ranks' transfers side
    by side.

    Args:
        model (Callable, Sequence[Capture] or Sequence[SitePlan]): the model or function to
            compile, or the per-rank captures or site plans (then leave ``inputs`` out).
        inputs (Sequence or Callable[[int], Sequence], optional): the model's arguments on
            every rank, or a function of the rank that returns them (the rank's shard in
            sharded mode). Default: ``None`` (``model`` is a list of captures).
        world (int): the number of fake ranks. Default: 4.
        backward (bool): also run backward, so the backward graphs are compared.
            Default: ``True``.
        expect_transfers (bool): fail when no rank transfers anything (a rewrite that became
            local, or none at all, would otherwise pass vacuously). Default: ``True``.
        **config: ``RingDilatedConfig`` fields (``compiler`` defaults to ``"eager"``).

    Returns:
        list[Capture]: the captures, one per rank (the plans, where given plans).

    Raises:
        TypeError: ``model`` is not a list of captures and ``inputs`` is ``None``.
        AssertionError: the schedules differ or do not pair up, or (with
            ``expect_transfers``) no rank transfers anything.
        RuntimeError: a process group is already initialised (``capture_ranks``).

    Example::

        assert_same_p2p_schedule(model, (x,), world=4, segment_lengths=[64, 256],
                                 dilation_rates=[1, 4], sharding="replicated")
    """
    __tracebackhide__ = True
    if inputs is None and isinstance(model, Sequence):
        captures = list(model)
    else:
        if inputs is None:
            raise TypeError("assert_same_p2p_schedule needs the model's inputs (or a list of captures)")
        captures = capture_ranks(model, inputs, world=world, backward=backward, **config)
    plans = all(isinstance(c, SitePlan) for c in captures)
    if plans:
        schedules = [planned_transfers(p, "forward") + planned_transfers(p, "backward") for p in captures]
    else:
        schedules = [c.schedule() for c in captures]
    ranks = [c.rank for c in captures]
    if expect_transfers and not any(schedules):
        report = "" if plans else f"\n\n{_report(captures[0].records)}"
        raise AssertionError(
            f"no ring transfer on any of {len(captures)} ranks, so there is no schedule to compare "
            f"(every branch local, or no site rewritten?){report}"
        )
    problems = []
    for rank, schedule in zip(ranks[1:], schedules[1:]):
        mismatch = first_difference(schedules[0], schedule)
        if mismatch is not None:
            i, mine, theirs = mismatch
            problems.append(
                f"  rank {rank} differs from rank {ranks[0]} at transfer #{i}:\n"
                f"    rank {ranks[0]}: {mine}\n    rank {rank}: {theirs}"
            )
    if not problems:
        problems = unpaired(ranks, schedules)
    if problems:
        table = schedule_table(ranks, schedules)
        raise AssertionError(
            f"the ring's P2P schedule is not the same on every rank (world={len(captures)}, "
            "forward then backward transfers):\n" + "\n".join(problems) + f"\n\n{table}"
        )
    return captures

