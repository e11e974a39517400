"""Generate text from a checkpoint of any layout, on one device, streaming it to the console.

    python run_generation.py --load runs/ckpt --prompt "The Python tutorial" --max_new_tokens 40

Greedy with ``--temperature 0``; otherwise samples with optional ``--top_k`` / ``--top_p``.
The prompt is encoded with GPT-2's BPE, so the model must have GPT-2's vocabulary.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from config.command_line import exit_on_bad_input
from config.errors import ConfigError
from config.loading import OneLineParser
from data.tokenizer import GPT2_EOT_TOKEN, TokenizerSpec, load_tokenizer
from execution.checkpoint.load import read_weights, saved_model_shapes
from modelling.generation import build_model, generate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    summary = __doc__.split("\n")[0]
    parser = OneLineParser(prog="run_generation.py", description=summary, allow_abbrev=False)
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
    parser.add_argument(
        "--tokenizer",
        help="A HuggingFace tokenizer.json, the model's own (a Llama's); default: GPT-2's BPE.",
    )
    parser.add_argument(
        "--eot_token",
        default=GPT2_EOT_TOKEN,
        help="The tokenizer's end-of-text token, at which generation stops.",
    )
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    if not (0 <= args.temperature < math.inf):  # nan and inf would make every probability nan
        raise ConfigError(
            f"--temperature must be a finite number >= 0 (0 is greedy), got {args.temperature}"
        )
    if args.top_k < 0:
        raise ConfigError(f"--top_k must be >= 0 (0: every token), got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top_p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.seed < 2**64:
        raise ConfigError(f"--seed must be in [0, 2^64), got {args.seed}")
    check_prompt(args.prompt)
    return args


def check_prompt(prompt: str) -> None:
    """One line for a prompt that cannot be encoded: empty, or not UTF-8 (bytes that are not
    UTF-8 reach ``sys.argv`` as lone surrogates, which the tokenizer cannot take)."""
    if not prompt:
        raise ConfigError("--prompt is empty; give the text to continue")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(prompt[err.start])
        escaped = 0xDC80 <= code <= 0xDCFF  # Python's stand-in for the undecodable byte
        what = f"byte 0x{code - 0xDC00:02x}" if escaped else f"lone surrogate U+{code:04X}"
        raise ConfigError(
            f"--prompt is not valid UTF-8 ({what} at character {err.start + 1}); give the "
            "prompt as UTF-8 text"
        ) from None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but no GPU is available")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    try:
        tokenizer, eot, vocab = load_tokenizer(TokenizerSpec(args.tokenizer, args.eot_token))
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"--tokenizer: {err}") from None
    model_config, weights = read_weights(args.load)
    if model_config["vocab_size"] < vocab:
        which = args.tokenizer or "the GPT-2"
        raise ConfigError(
            f"the checkpoint's vocabulary has {model_config['vocab_size']} tokens; {which} "
            f"tokenizer needs {vocab}: give the model's own with --tokenizer"
        )
    prompt = tokenizer.encode(args.prompt).ids
    positions = model_config["max_positional_length"]
    if len(prompt) >= positions:
        raise ConfigError(
            f"--prompt has {len(prompt)} tokens; the model sees at most {positions} positions"
        )
    model = build_model(saved_model_shapes(model_config), weights, device)
    options = {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "generator": torch.Generator(device).manual_seed(args.seed),
        "use_cache": not args.no_cache,
        "stop_token": eot,
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
    exit_on_bad_input(main, "run_generation.py")
