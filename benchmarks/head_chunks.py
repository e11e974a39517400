"""The language model head on chunks of a micro-batch's tokens against the head run whole: the
bytes it allocates, its time and how far its numbers are from the whole run's.

    python -m benchmarks.head_chunks --config llama_tiny --vocab_size 128256 --sequence_length 256 --max_positional_length 256 --micro_batch_size 4
    python -m benchmarks.head_chunks --config llama3_8B --meta

One micro-batch's head forward and backward as the head phase runs it
(``execution/engine/phases/head.py: head_on_chunks``), on one device (tp1 = tp2 = 1) in the
run's precision, from random weights and a random residual stream: whole (one chunk: the head
before chunking) and on the chunks ``modelling.lm_heads.logits_chunks`` gives. "peak MiB" is
what the call allocates, the head's float32 gradient accumulators included (as the head phase
holds them), counted as the dry run counts a step (``StepMeter``); "s" the median of
``--repeats`` calls after one warm-up; the last columns the chunked run's distance from the
whole run's: the loss's relative difference, and dx's and the weight gradients' largest
difference relative to their largest element. ``--meta`` counts the bytes alone, on meta
tensors (any preset's size). A whole run's process memory: ``bench_step.py`` (its peak mem).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
from torch.func import functional_call

from config.command_line import exit_on_bad_input
from config.loading import OneLineParser, parse_config
from execution.engine.phases.head import head_on_chunks
from execution.engine.storage.buffers import DTYPES
from execution.planning.step_meter import StepMeter
from modelling.gpt import GPT, GPTShapes
from modelling.lm_heads import logits_chunks

MiB = 2**20


@dataclasses.dataclass
class HeadCall:
    """One micro-batch's head: its template, weights and inputs."""

    template: torch.nn.Module
    weights: dict[str, torch.Tensor]
    word: list[torch.Tensor]  # the tied word embedding, or none
    x: torch.Tensor
    labels: torch.Tensor
    vocab: int

    @classmethod
    def draw(cls, shapes: GPTShapes, micro_batch: int, sequence: int, dtype, device) -> HeadCall:
        with torch.device("meta"):  # the template, as the engine's: weights bound per call
            model = GPT(dataclasses.replace(shapes, layers=1))
        generator = torch.Generator().manual_seed(0)

        def draw(shape: torch.Size, std: float) -> torch.Tensor:
            if device.type == "meta":
                return torch.empty(shape, dtype=dtype, device=device)
            if len(shape) == 1:  # a norm's gain
                return torch.ones(shape, dtype=dtype, device=device)
            return (torch.randn(shape, generator=generator) * std).to(device, dtype)

        weights = {name: draw(p.shape, 0.02) for name, p in model.head.named_parameters()}
        word = [draw(model.embedding.word.weight.shape, 0.02)] if shapes.tied_head else []
        x = draw(torch.Size((micro_batch, sequence, shapes.hidden)), 1.0)
        labels = torch.randint(shapes.vocab, (micro_batch, sequence), generator=generator)
        return cls(model.head, weights, word, x, labels.to(device), shapes.vocab)

    def run(self, chunks: list[slice]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Loss, dx and the float32 gradients of the head's weights, on ``chunks``."""
        weights = {k: v.detach().requires_grad_() for k, v in self.weights.items()}
        word = [w.detach().requires_grad_() for w in self.word]
        params = [*word, *weights.values()]
        accumulators = [torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in params]
        filled = []

        def call(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return functional_call(self.template, weights, (x, *word, labels, self.vocab))

        def add_grads(grads: list[torch.Tensor]) -> None:  # as the engine's Accumulators
            for acc, grad in zip(accumulators, grads, strict=True):
                if filled:
                    acc.add_(grad)
                else:
                    acc.copy_(grad)
            filled.append(True)

        scale = torch.ones((), device=self.x.device)
        x = self.x.detach()
        loss, dx = head_on_chunks(call, params, x, self.labels, chunks, scale, add_grads)
        return loss, dx, accumulators


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest element of ``want``."""
    scale = want.abs().max().item()
    return (got.float() - want.float()).abs().max().item() / (scale or 1.0)


def measure(head: HeadCall, chunks: list[slice], repeats: int) -> dict:
    with StepMeter() as meter:
        loss, dx, grads = head.run(chunks)
    row = {"chunks": f"{len(chunks)} x {chunks[0].stop - chunks[0].start}", "peak": meter.peak}
    if head.x.device.type != "meta":
        seconds = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            head.run(chunks)
            seconds.append(time.perf_counter() - started)
        row.update(seconds=statistics.median(seconds[1:]), results=(loss, dx, grads))
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meta", action="store_true", help="count bytes on meta tensors only")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls (median reported)")
    args, flags = parser.parse_known_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    config, _ = parse_config(flags)
    shapes = GPTShapes.from_config(config.model)
    device = torch.device("meta" if args.meta else "cpu")
    micro_batch, sequence = config.execution.micro_batch_size, config.model.sequence_length
    dtype = DTYPES[config.training.precision]
    head = HeadCall.draw(shapes, micro_batch, sequence, dtype, device)
    tokens = micro_batch * sequence
    rows = {
        "whole": measure(head, [slice(0, tokens)], args.repeats),
        "chunks": measure(
            head,
            logits_chunks(tokens, shapes.vocab, shapes.vocab_padded, shapes.hidden),
            args.repeats,
        ),
    }
    print(
        f"{' '.join(flags)}: one micro-batch's head, {micro_batch} x {sequence} tokens over "
        f"{shapes.vocab:,} words ({shapes.vocab_padded:,} padded), hidden {shapes.hidden}, "
        f"{config.training.precision}, on {device.type}"
    )
    print(format_rows(rows))
    return list(rows.values())


def format_rows(rows: dict[str, dict]) -> str:
    header = ["head", "chunks x tokens", "peak MiB", "s", "loss", "loss diff", "dx", "grads"]
    lines = [header]
    whole = rows["whole"].get("results")
    for name, row in rows.items():
        cells = [name, row["chunks"], f"{row['peak'] / MiB:,.1f}"]
        if whole is not None:
            loss, dx, grads = row["results"]
            cells += [f"{row['seconds']:.3f}", f"{loss.item():.6f}"]
            cells += [f"{relative(loss, whole[0]):.1e}", f"{relative(dx, whole[1]):.1e}"]
            cells.append(f"{max(relative(g, w) for g, w in zip(grads, whole[2], strict=True)):.1e}")
        lines.append(cells + ["-"] * (len(header) - len(cells)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            f"{c:<{w}}" if i == 0 else f"{c:>{w}}"
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    )


if __name__ == "__main__":
    exit_on_bad_input(main, "benchmarks.head_chunks")
