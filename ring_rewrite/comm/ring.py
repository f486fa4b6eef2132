"""The ``Rotater`` through which the attention code moves K/V and dK/dV around the ring,
and its ``Ring`` per branch.

Note [Ordering the ring's messages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The attention code (``ring_rewrite/attention.py``) sees one ``Rotater`` per site call and,
from it, one ``Ring`` per branch (``rotater.ring(branch, send_to, recv_from)``). It says what
moves and when: ``flight = ring.start(xs, KV, step, chunk)`` before the compute a transfer
overlaps, ``ring.wait(flight, after=that compute)`` after it, and ``rotater.all_gather(x, world,
index)``. Tags, tokens, the order of the messages and the lifetime of their buffers are the
rotater's business, below, never the call sites'.

On torch 2.13 a P2P op whose result one rank does not use is dead-code eliminated on that rank
only; inductor may order independent P2P calls differently on different ranks, and equal-shaped
messages then pair up wrong without an error. So every op of ``ring_rewrite/comm/``

* is marked side-effectful (``torch.fx.node.has_side_effect``, which inductor honours too):
  never eliminated, even where a rank does not use what it received,
* takes the previous transfer's ``token`` and returns the next one: all transfers of a site form
  one data-dependency chain, so every rank runs them in the same order. The backward's transfers
  all sit in the site's backward body, one ``invoke_subgraph`` call that takes ``dout``: AOT's
  partitioner cannot hoist one into the forward (where it would save every rotated K/V block),
* waits after the compute it overlaps, by data: ``ring_shift_wait`` takes that compute's results
  (``after``) and ignores them. The chain orders transfers, not the compute between them, and
  inductor's peak-memory reordering moved every dK/dV wait of the backward ahead of the block it
  overlaps (a wait frees the buffers it sent), leaving each of those transfers bare,
* sends each message under its own tag: the transfer's place in its site (``Tag``: branch,
  kind, head chunk, step) plus the call's number, which the token carries with the
  site (``site_token``). A schedule that still went wrong fails loudly (a timeout naming the
  transfer) instead of pairing the wrong buffers.

Why not ``EffectType.ORDERED``: a rewritten site is one ``invoke_subgraph`` body shared by every
layer with the same plan (Note [One body per plan]), and on torch
2.13 an effectful op inside ``invoke_subgraph`` drops the gradients of the whole call (its
output no longer requires grad), or fails AOT with a missing ``tangents_token`` when the call
sits in a backward graph. The site index cannot be a constant of a shared body, nor the call
number a constant of any graph: hence the token.
"""

from __future__ import annotations

import dataclasses

import torch

from .tags import EXCHANGE, GATHER, transfer_tag

__all__ = ["InFlight", "Ring", "Rotater"]


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A started transfer: what it sends (its wait reads them again) and its tag."""

    sent: list
    tag: int


class Rotater:
    """The transfers of one site call, in the order they are made (Note [Ordering the ring's
    messages]). ``token`` is the chain's current token: a site's calls pass the last one on
    (the forward's to the backward).

    Traced by the rewrite with FX proxies for tensors; it also runs on real tensors.
    """

    def __init__(self, group_name: str, token) -> None:
        self.group_name = group_name
        self.token = token

    @classmethod
    def resume(cls, group_name: str, token) -> Rotater:
        """The backward's rotater, from the token the forward's chain ended with: the backward
        is a call of its own (``resume_token``)."""
        return cls(group_name, torch.ops.ring_rewrite.resume_token(token, group_name))

    def ring(self, branch: int, send_to: int, recv_from: int) -> Ring:
        """Branch ``branch``'s ring, in which this rank sends to ``send_to`` and receives from
        ``recv_from`` (ranks of the group, Note [Group ranks])."""
        return Ring(self, branch, send_to, recv_from)

    def wait(self, flight: InFlight, after: list = ()) -> list:
        """What arrived for ``flight``, once ``after`` (the compute it overlaps) is done."""
        got = torch.ops.ring_rewrite.ring_shift_wait(
            flight.sent, self.token, flight.tag, list(after)
        )
        received = [got[j] for j in range(len(flight.sent))]
        self.token = got[len(flight.sent)]
        return received

    def close(self, after: list) -> None:
        """The call's last op: ``after`` (its results) are done (``close_call``)."""
        if self.token is not None:
            self.token = torch.ops.ring_rewrite.close_call(self.token, self.group_name, list(after))

    def all_gather(self, x, world: int, index: int, same=None):
        """Every rank's ``x`` stacked on a new leading dim (``all_gather_seq``): the site's
        ``index``-th gather."""
        stacked, self.token = torch.ops.ring_rewrite.all_gather_seq(
            x, self.token, self.group_name, world, transfer_tag(0, GATHER, index), same
        )
        return stacked

    def all_to_all(self, x, world: int, index: int, first: int = 0):
        """``x[j]`` sent to rank ``first + j``, and what each of those ``world`` ranks sent this
        one, stacked (``all_to_all_seq``): the site's ``index``-th all-to-all."""
        got, self.token = torch.ops.ring_rewrite.all_to_all_seq(
            x, self.token, self.group_name, world, transfer_tag(EXCHANGE, GATHER, 0, index), first
        )
        return got


@dataclasses.dataclass(frozen=True)
class Ring:
    """One branch's ring within a site call: ``start`` sends one step along it."""

    rotater: Rotater
    branch: int
    send_to: int
    recv_from: int

    def start(self, xs: list, kind: int, step: int, chunk: int = 0) -> InFlight:
        """Start sending ``xs`` (``kind``: ``KV``, ``KV_BACK`` or ``DKV``) one step along the
        ring, and receiving their like; ``self.wait`` after the compute it overlaps."""
        tag = transfer_tag(self.branch, kind, step, chunk)
        r = self.rotater
        r.token = torch.ops.ring_rewrite.ring_shift_start(
            xs, r.token, r.group_name, self.send_to, self.recv_from, tag
        )
        return InFlight(list(xs), tag)

    def wait(self, flight: InFlight, after: list = ()) -> list:
        return self.rotater.wait(flight, after)
