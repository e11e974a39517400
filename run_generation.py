"""Generate text from a checkpoint of any layout, on one device, streaming it to the console.

    python run_generation.py --load runs/ckpt --prompt "The Python tutorial" --max_new_tokens 40

Greedy with ``--temperature 0``; otherwise samples with optional ``--top_k`` / ``--top_p``.
The prompt is encoded with GPT-2's BPE, so the model must have GPT-2's vocabulary.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import NoReturn

import torch

from config.loading import ConfigError
from data.tokenizer import GPT2_EOT_ID, TokenizerSpec, load_tokenizer
from execution.checkpoint.load import read_weights
from modelling.generation import build_model, generate


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    summary = __doc__.split("\n")[0]
    parser = _Parser(prog="run_generation.py", description=summary, allow_abbrev=False)
    parser.add_argument("--load", required=True, help="A --save folder or one step_N in it.")
    parser.add_argument("--prompt", required=True, help="Text to continue.")
    parser.add_argument("--max_new_tokens", type=int, default=50, help="Tokens to generate.")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy.")
    parser.add_argument(
        "--top_k", type=int, default=0, help="Sample among the k likeliest; 0: all."
    )
    parser.add_argument("--top_p", type=float, default=1.0, help="Nucleus sampling mass (<= 1).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the sampler.")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--no_cache", action="store_true", help="Recompute the whole prefix.")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise ConfigError("--temperature and --top_k must be >= 0 and --top_p in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but no GPU is available")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    model_config, weights = read_weights(args.load)
    model = build_model(model_config, weights, device)
    tokenizer, _, vocab = load_tokenizer(TokenizerSpec())
    if model.shapes.vocab < vocab:
        raise ConfigError(
            f"the checkpoint's vocabulary has {model.shapes.vocab} tokens; the GPT-2 tokenizer "
            f"needs {vocab}"
        )
    prompt = tokenizer.encode(args.prompt).ids
    if not prompt:
        raise ConfigError("--prompt is empty")
    if len(prompt) >= model.shapes.positions:
        raise ConfigError(
            f"--prompt has {len(prompt)} tokens; the model sees at most "
            f"{model.shapes.positions} positions"
        )
    options = {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "generator": torch.Generator(device).manual_seed(args.seed),
        "use_cache": not args.no_cache,
        "stop_token": GPT2_EOT_ID,
    }
    ids = torch.tensor([prompt], device=device)
    print(args.prompt, end="", flush=True)
    new: list[int] = []
    shown = ""
    started = time.perf_counter()
    for token in generate(model, ids, args.max_new_tokens, **options):
        new.append(int(token[0]))
        text = tokenizer.decode(new)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[len(shown) :], end="", flush=True)
            shown = text
    seconds = time.perf_counter() - started
    print(
        f"\n[{len(new)} tokens in {seconds:.2f} s, {len(new) / seconds:.1f} tokens/s on {device}]"
    )


if __name__ == "__main__":
    try:
        main()
    except ConfigError as err:
        print(f"run_generation.py: error: {err}", file=sys.stderr)
        sys.exit(2)
