"""Role tags for the nodes a rewrite inserts (``node.meta["ring_rewrite"]``;
docs/semantics.md, The rewritten graph).

The math modules mark what each stretch of code is (``with role("dilate", branch=0): ...``);
the tracer in ``ring_rewrite.passes`` stamps the current tag on every node it records. Outside a trace the
tags cost nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_CURRENT: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar(
    "ring_rewrite_role", default={}
)

ROLES = (
    "decompose",  # nn.MultiheadAttention / TransformerEncoderLayer ops spelled out around an SDPA
    "hand_written",  # attention written as ops, read into one SDPA call (passes/hand_written.py)
    "bucket",  # a symbolic sequence length padded to its bucket, and the result cut back
    "mask",  # key-padding mask to additive bias
    "dropout",  # the seed of a call's dropout
    "dilate",  # per-branch views / gathers into block layout
    "attention",  # block attention returning (out, lse)
    "attention_backward",  # fused block backward with the merged out / lse
    "undilate",  # scatter of block rows back to sequence layout
    "merge",  # LSE merges (ring steps, branches) and gradient sums
    "p2p",  # ring transfers
    "shard",  # replicated mode: take the local shard, re-assemble the result
    "decode",  # a decode step's rows of the site's function (ring_rewrite/decode.py)
)


@contextlib.contextmanager
def role(name: str, **info: Any) -> Iterator[None]:
    assert name in ROLES, name
    token = _CURRENT.set({**_CURRENT.get(), "role": name, **info})
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> dict[str, Any]:
    return dict(_CURRENT.get())
