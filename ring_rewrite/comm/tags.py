"""Transfer tags: a transfer's place in its site call (``Tag``), as graphs, errors and the
wire carry it."""

from __future__ import annotations

import dataclasses

__all__ = ["DKV", "EXCHANGE", "KV", "KV_BACK", "MAX_BRANCHES", "Tag", "transfer_tag"]


# Transfer kinds, a field of a tag.
KV, KV_BACK, DKV, GATHER = range(4)
EXCHANGE = 1  # the branch field of an all-to-all's tags (kind GATHER)
_KINDS = ("K/V", "K/V (backward)", "dK/dV", "gather")
# A tag's fields and their widths in bits, from the low bits up (Tag.encode).
_TAG_LAYOUT = (("step", 10), ("chunk", 6), ("kind", 2), ("branch", 4))
_TAG_BITS = sum(bits for _, bits in _TAG_LAYOUT)  # 22: a transfer's tag within its call
MAX_BRANCHES = 1 << dict(_TAG_LAYOUT)["branch"]  # 16
_CALL_BITS = 6  # the call number's low bits above it; 8 * (wire tag) + message < 2**31 (gloo)


@dataclasses.dataclass(frozen=True)
class Tag:
    """A transfer's place in its site call: which branch, kind (``KV``, ``KV_BACK``, ``DKV``,
    ``GATHER``), ring step and head chunk. A gather's is branch 0, its step the gather's index
    in the call or, for each of its messages, the distance it goes (``all_gather_seq``); an
    all-to-all's is branch ``EXCHANGE`` (kind ``GATHER`` too), its chunk the exchange's index in
    the call and, for each message, its step the distance (``all_to_all_seq``).

    Graphs, ``_PENDING`` and the messages carry it as one int, ``encode()``: from the low bits
    up the step (10 bits), head chunk (6), kind (2) and branch (4), below ``2**22``; on the wire
    the call number's low bits go above it (``_wire``). ``decode`` is its inverse, and ``str``
    is how errors name the transfer. Nothing else reads the bits.

    Example::

        >>> Tag(branch=1, kind=DKV, step=5, chunk=7).encode()
        400389
        >>> str(Tag.decode(400389))
        'branch 1, step 5, dK/dV, head chunk 7'
    """

    branch: int
    kind: int
    step: int
    chunk: int = 0

    def __post_init__(self) -> None:
        for name, bits in _TAG_LAYOUT:
            value = getattr(self, name)
            if not 0 <= value < 1 << bits:
                raise ValueError(f"Tag.{name} must be in [0, {1 << bits}), got {value}")

    def encode(self) -> int:
        """The tag as one int, below ``2**22``."""
        tag, shift = 0, 0
        for name, bits in _TAG_LAYOUT:
            tag |= getattr(self, name) << shift
            shift += bits
        return tag

    @classmethod
    def decode(cls, tag: int) -> Tag:
        """The ``Tag`` whose ``encode()`` is ``tag``."""
        if not 0 <= tag < 1 << _TAG_BITS:
            raise ValueError(f"a transfer tag is in [0, {1 << _TAG_BITS}), got {tag}")
        fields = {}
        for name, bits in _TAG_LAYOUT:
            fields[name], tag = tag & ((1 << bits) - 1), tag >> bits
        return cls(**fields)

    def __str__(self) -> str:
        if self.kind == GATHER:
            if self.branch == EXCHANGE:
                return f"all-to-all {self.chunk} at distance {self.step}"
            return f"gather at distance {self.step}"
        return f"branch {self.branch}, step {self.step}, {_KINDS[self.kind]}, head chunk {self.chunk}"


def transfer_tag(branch: int, kind: int, step: int, chunk: int = 0) -> int:
    """A transfer's tag within its site call, as graphs carry it: ``Tag(...).encode()``."""
    return Tag(branch, kind, step, chunk).encode()


def _describe(site: int, call: int, tag: int) -> str:
    return f"site {site}, {Tag.decode(tag)} (tag {tag}, call {call})"


def _wire(call: int, tag: int) -> int:
    """A transfer's wire tag: its tag within the call, the call number's low bits above it."""
    return (call % (1 << _CALL_BITS)) << _TAG_BITS | tag
