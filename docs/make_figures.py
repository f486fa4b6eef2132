"""Draw the figures of the README and docs/ from the project's own code.

    .venv/bin/python docs/make_figures.py          # writes docs/ring_schedule.svg

docs/ring_schedule.svg is the ring schedule of one attention site: the demo's config
(``make demo``: N = 16,384 tokens on 4 ranks, zigzag, causal; segments 1024, 4096, 16384 at
rates 1, 4, 16), planned by ``ring_rewrite.plan`` exactly as the rewrite plans it
(``ring_rewrite/schedule.py``, Note [Ring schedule]). One panel per branch; one row per rank,
one column per ring step. Each cell is the blocks that rank computes at that step: its query
chunks (rows) against the key chunks it holds (columns), a triangle where the block is causal.
Arrows are the K/V moving to the next rank of the ring between steps.

The SVG is written as text (no plotting library), so the file changes only when the plan does.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from xml.sax.saxutils import escape

import torch

import ring_rewrite
from ring_rewrite.layout import layout_of

HERE = Path(__file__).resolve().parent

# The demo's site (examples/train_longnet.py's defaults).
N, WORLD, LAYOUT, CAUSAL = 16384, 4, "zigzag", True
SEGMENTS, RATES = [1024, 4096, 16384], [1, 4, 16]

CELL = 64  # side of one cell (a rank's shard against the K/V it holds)
COL = 112  # column pitch: a cell and the gap the arrows cross
ROW = 96  # row pitch: a cell and the label above it
PANEL_GAP = 48
PANEL_MIN = 170  # the narrowest panel (a local branch's one step) still holds its heading
LEFT = 118  # rank labels
TOP = 96  # title and panel headings
COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]
FONT = 'font-family="Helvetica, Arial, sans-serif"'


def chunks(rank: int, world: int, layout: str) -> list[int]:
    """Global chunk index of each part a rank holds (``ring_rewrite/layout.py``)."""
    return [rank, 2 * world - 1 - rank] if layout == "zigzag" else [rank]


def text(x: float, y: float, s: str, size: int = 11, anchor: str = "middle", weight: str = "normal",
         fill: str = "#222") -> str:  # fmt: skip
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" {FONT} font-size="{size}" text-anchor="{anchor}" '
        f'font-weight="{weight}" fill="{fill}">{escape(s)}</text>'
    )


def block_shape(x: float, y: float, w: float, h: float, causal: bool, colour: str) -> str:
    """A block: a rectangle, or its lower-left triangle (keys up to the query) when causal."""
    if causal:
        pts = f"{x:.1f},{y:.1f} {x:.1f},{y + h:.1f} {x + w:.1f},{y + h:.1f}"
        return f'<polygon points="{pts}" fill="{colour}" fill-opacity="0.85"/>'
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{colour}" fill-opacity="0.85"/>'


def arrow(x0: float, y0: float, x1: float, y1: float) -> str:
    return (
        f'<line x1="{x0:.1f}" y1="{y0:.1f}" x2="{x1:.1f}" y2="{y1:.1f}" stroke="#555" '
        'stroke-width="1.3" marker-end="url(#head)"/>'
    )


def ring_schedule_svg() -> str:
    scale = ring_rewrite.plan(
        N, WORLD, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu",
        segment_lengths=SEGMENTS, dilation_rates=RATES, layout=LAYOUT, is_causal=CAUSAL,
    )  # fmt: skip
    plans = scale.plans  # one SitePlan per rank
    n_branches = len(plans[0].branches)
    parts = layout_of(LAYOUT).parts
    part = CELL / parts
    columns = [max(len(p.branches[i].steps) for p in plans) for i in range(n_branches)]
    panels = [max(c * COL, PANEL_MIN) for c in columns]
    width = LEFT + sum(panels) + PANEL_GAP * (n_branches - 1) + 16
    height = TOP + WORLD * ROW + 64

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">',
        '<defs><marker id="head" markerWidth="8" markerHeight="8" refX="7" refY="4" '
        'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#555"/></marker></defs>',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        text(
            16, 24, f"The ring schedule of one site: N = {N:,} tokens on {WORLD} ranks, "
            f"layout {LAYOUT}, causal (ring_rewrite.plan)", 14, "start", "bold",
        ),  # fmt: skip
        text(
            16, 44, "Each cell: the rank's query chunks (rows) against the key/value chunks it "
            "holds at that step (columns); a triangle is a causal block. Arrows: K/V to the "
            "next rank of the ring.", 11, "start", fill="#444",
        ),  # fmt: skip
    ]
    ty = TOP
    for rank in range(WORLD):
        cy = ty + rank * ROW + (ROW - CELL)
        q = ", ".join(str(c) for c in chunks(rank, WORLD, LAYOUT))
        out.append(text(LEFT - 14, cy + CELL / 2 - 2, f"rank {rank}", 12, "end", "bold"))
        out.append(text(LEFT - 14, cy + CELL / 2 + 13, f"q chunks {q}", 10, "end", fill="#555"))

    x0 = LEFT
    for i in range(n_branches):
        first = plans[0].branches[i]
        colour = COLOURS[i % len(COLOURS)]
        rings = sorted({p.branches[i].ring for p in plans})
        if first.is_local:
            where = "local: no transfer"
        elif len(rings) == 1:
            where = f"one ring of {len(rings[0])}"
        else:
            where = "rings " + ", ".join(f"{r[0]}-{r[-1]}" for r in rings)
        out.append(text(x0, TOP - 30, f"branch (w={first.w}, r={first.r})", 12, "start", "bold", colour))
        out.append(text(x0, TOP - 14, where, 11, "start", fill="#444"))
        for rank, site in enumerate(plans):
            branch = site.branches[i]
            cy = TOP + rank * ROW + (ROW - CELL)
            for s, blocks in enumerate(branch.steps):
                cx = x0 + s * COL
                holder = branch.ring[(branch.position - s) % len(branch.ring)]
                out.append(
                    f'<rect x="{cx}" y="{cy}" width="{CELL}" height="{CELL}" fill="#f4f4f4" '
                    'stroke="#999" stroke-width="1"/>'
                )
                if branch.is_local:
                    # Segments inside the shard: one causal (or full) block per segment.
                    n_local = N // WORLD
                    segs = max(1, min(n_local // branch.w, 16))
                    side = CELL / segs
                    for g in range(segs):
                        out.append(block_shape(cx + g * side, cy + g * side, side, side, CAUSAL, colour))
                    label = f"own {n_local // branch.w} segments of {branch.w}"
                else:
                    for b in blocks:
                        out.append(
                            block_shape(
                                cx + b.k0 * part, cy + b.q0 * part, (b.k1 - b.k0) * part,
                                (b.q1 - b.q0) * part, b.causal, colour,
                            )  # fmt: skip
                        )
                    kv = ",".join(str(c) for c in chunks(holder, WORLD, LAYOUT))
                    label = f"K/V of {holder} ({kv})" if holder != rank else f"own K/V ({kv})"
                    if parts > 1:  # part boundaries
                        out.append(
                            f'<line x1="{cx + CELL / 2}" y1="{cy}" x2="{cx + CELL / 2}" '
                            f'y2="{cy + CELL}" stroke="#ccc" stroke-width="0.8"/>'
                        )
                        out.append(
                            f'<line x1="{cx}" y1="{cy + CELL / 2}" x2="{cx + CELL}" '
                            f'y2="{cy + CELL / 2}" stroke="#ccc" stroke-width="0.8"/>'
                        )
                out.append(text(cx + CELL / 2, cy - 6, label, 9, fill="#333"))
                if not blocks:
                    out.append(text(cx + CELL / 2, cy + CELL / 2 + 4, "skipped", 9, fill="#888"))
                # The K/V this rank holds go to the next rank of the ring for step s + 1.
                if s + 1 < len(branch.steps):
                    to = branch.send_to
                    ty1 = TOP + to * ROW + (ROW - CELL)
                    out.append(arrow(cx + CELL + 2, cy + CELL / 2, cx + COL - 4, ty1 + CELL / 2))
        for s in range(columns[i]):
            out.append(text(x0 + s * COL + CELL / 2, TOP + WORLD * ROW + 18, f"step {s}", 11, fill="#444"))
        x0 += panels[i] + PANEL_GAP

    out.append(
        text(
            16, height - 14, "Generated by docs/make_figures.py from the plans the rewrite builds "
            "(ring_rewrite/schedule.py). The backward runs the same steps, dK/dV one step behind.",
            10, "start", fill="#666",
        )  # fmt: skip
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "ring_schedule.svg")
    args = parser.parse_args()
    args.out.write_text(ring_schedule_svg())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
