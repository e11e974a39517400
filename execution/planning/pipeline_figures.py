"""What planning needs to know of a pipeline: which stages decide whether a plan fits, and the
share of a step its stages idle (the bubble: of a step's ``P + S - 1`` pass-times each of the
``S`` stages idles for ``S - 1``, execution/engine/phases/pipeline.py)."""

from __future__ import annotations


def deciding_stages(stage_layers: tuple[int, ...]) -> list[int]:
    """The stages whose memory decides whether a plan fits every stage: the first and the
    last (they hold the embedding, and the head), and each middle stage with more layers than
    every middle stage before it (a later one with no more layers holds fewer passes)."""
    count = len(stage_layers)
    out, most = sorted({0, count - 1}), 0
    for index in range(1, count - 1):
        if stage_layers[index] > most:
            out.append(index)
            most = stage_layers[index]
    return sorted(out)


def bubble_fraction(stages: int, passes: int) -> float:
    """The share of a step each stage idles: (S - 1) / (P + S - 1)."""
    return (stages - 1) / (passes + stages - 1)


def step_stretch(stages: int, passes: int) -> float:
    """How much longer than its passes' own time a step takes: (P + S - 1) / P pass-times."""
    return (passes + stages - 1) / passes
