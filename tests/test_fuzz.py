"""A fixed sample of the random campaign (``tests/fuzz.py``; docs/testing.md, The random
campaign): for every mask construction the first seed of one rank that builds it, the seeds the
campaign found wrong once (``FOUND``, ``FOUND_TWO``), and the first seeds of two ranks, all in one spawn of two
gloo ranks. Each seed is its own test; a failure
names the seed and the case, and ``python tests/fuzz.py --seed S`` runs it again."""

from __future__ import annotations

import logging

import pytest

import fuzz

TWO_RANKS = 6  # cases on two ranks (one spawn; about 10 s each)
FOUND = {
    5002: "a NaN in a float key mask reached rows the causal band masks (float64, aten's path)",
    10680: "the same in a dilated branch (float32)",
    10391: "a scale of 0 with a causal block: aten's CPU flash forward returns NaN rows",
    21814: "a negative scale with a causal block and a bias: aten's CPU flash forward returns NaN rows",
    20241: "the same, its backward then recomputed other weights than the careful forward's",
    21466: "ALiBi written relative and cast to bfloat16 was read without its rounding",
    310988: "a NaN in k, scores to 169: the block's forward took the careful path in float32, its "
    "backward the C kernel, whose probabilities differ by rounding: dq 5e-5 off where dq's terms cancel",
}
"""Seeds of one rank the campaign found wrong, and what was wrong."""
FOUND_TWO = {
    80388: "replicated mode's padded query rows, zeros, met an infinite key (0 * inf): their NaN "
    "probabilities reached the real keys' dk, dv",
    81902: "inductor wrote into the user's v on the rank whose rows are all padding: a subgraph's "
    "lowering took its arguments as the backward's donated buffers",
    81508: "position values that step by 2, sharded: the run-time check raised as it must, and the "
    "campaign did not count its reason among the expected ones",
    200671: "dynamic=True made the scale a symbol, and sharded mode refused the site as computed at run time",
    360057: "replicated all_to_all with heads that do not split and a mask it cannot read: left alone for "
    "the mask, and the campaign counted only the heads' reason",
    400629: "dynamic, replicated zigzag, a dilated site computed whole on every rank: its key bias was cut "
    "back to the real keys as a zigzag shard's two parts (an index out of bounds at an odd length, "
    "other keys than the real ones at an even one)",
}
"""The same, of two ranks."""


def _sample() -> tuple[list[int], list[int]]:
    first: dict[str, int] = {}
    two: list[int] = []
    for seed in range(100_000):
        c = fuzz.case(seed)
        if c.world == 1:
            first.setdefault(c.mask, seed)
        elif len(two) < TWO_RANKS:
            two.append(seed)
        if len(first) == len(fuzz.CONSTRUCTIONS) and len(two) == TWO_RANKS:
            break
    return sorted(first.values()), [*two, *FOUND_TWO]


ONE_RANK, TWO_RANK = _sample()


@pytest.fixture
def quiet():
    """``fuzz.quiet()`` for one test: the loggers' levels are put back after it (later tests
    assert on the warnings of sites left alone)."""
    loggers = [logging.getLogger(name) for name in ("ring_rewrite", "torch._dynamo", "torch._inductor")]
    levels = [x.level for x in loggers]
    fuzz.quiet()
    yield
    for x, level in zip(loggers, levels):
        x.setLevel(level)


@pytest.mark.parametrize("seed", sorted({*ONE_RANK, *FOUND}))
def test_one_rank(seed, quiet):
    result = fuzz.run(fuzz.case(seed))
    assert result.ok, result.message


@pytest.fixture(scope="module")
def two_rank_results() -> dict[int, fuzz.Result]:
    return {r.seed: r for r in fuzz.run_pairs([fuzz.case(seed) for seed in TWO_RANK])}


@pytest.mark.parametrize("seed", TWO_RANK)
def test_two_ranks(seed, two_rank_results):
    result = two_rank_results[seed]
    assert result.ok, result.message
