"""Generation: the key/value cache changes nothing but the cost, and the CLI streams text.

References: the model's training forward (its loss), generation without the cache (the whole
prefix recomputed for every token), and the tokenizer's decoding of the generated ids.
"""

from __future__ import annotations

import shlex

import pytest
import torch
import torch.nn.functional as F

import run_generation
from execution.parallel.mesh import ParallelLayout
from modelling.generation import KVCache, forward_logits, generate, sample_next
from tests.checkpoints import save_checkpoint
from tests.distributed import CPU, planned_engine
from tests.entry_points import assert_refused, run_script
from tests.reference import reference_model, relative_error, small_config


def _model():
    """A random model whose greedy continuations vary (wide weights, non-trivial biases)."""
    config = small_config("--max_positional_length", "40", "--init_std", "0.3")
    model = reference_model(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "ln" in name and "weight" in name else 0.0, 0.2)
    return model


def test_logits_agree_with_the_training_forward_and_the_cache():
    model = _model()
    ids = torch.randint(0, 307, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = forward_logits(model, ids)
        labels = torch.roll(ids, -1, 1)
        loss = F.cross_entropy(full.reshape(-1, full.shape[-1]), labels.reshape(-1))
        assert abs(loss.item() - model(ids, labels).item()) <= 1e-5 * loss.item()
        cache = KVCache(model, 2, 12)
        pieces = [forward_logits(model, ids[:, :5], cache)]  # a prompt, then token by token
        pieces += [forward_logits(model, ids[:, t : t + 1], cache) for t in range(5, 12)]
    assert relative_error(torch.cat(pieces, 1), full) <= 1e-5


def test_greedy_with_the_cache_gives_exactly_the_tokens_without_it():
    model = _model()
    prompt = torch.randint(0, 307, (2, 4), generator=torch.Generator().manual_seed(1))
    cached = torch.stack(list(generate(model, prompt, 30, use_cache=True)), 1)
    uncached = torch.stack(list(generate(model, prompt, 30, use_cache=False)), 1)
    assert cached.shape == (2, 30)
    assert torch.equal(cached, uncached)
    assert len(set(cached.flatten().tolist())) >= 5, "a degenerate continuation proves little"
    # The position table (40) bounds the length.
    assert len(list(generate(model, prompt, 100))) == 36


def test_sampling_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    gen = torch.Generator().manual_seed(0)
    assert sample_next(logits, 0.0).item() == 1
    assert {sample_next(logits, 1.0, top_k=1, generator=gen).item() for _ in range(20)} == {1}
    assert {sample_next(logits, 1.0, top_p=0.5, generator=gen).item() for _ in range(20)} == {1}
    two = {sample_next(logits, 1.0, top_k=2, generator=gen).item() for _ in range(200)}
    assert two == {1, 3}


def test_the_cli_streams_the_greedy_continuation(tmp_path, capsys):
    config = small_config("--vocab_size", "50257", "--layers", "1")
    engine = planned_engine(config, ParallelLayout.single(CPU))
    save_checkpoint(tmp_path, engine, config, 0)
    flags = shlex.split('--prompt "Hello world" --temperature 0 --max_new_tokens 6 --device cpu')
    run_generation.main(["--load", str(tmp_path), *flags])
    out = capsys.readouterr().out
    # The reference: the same model's greedy ids (without the cache), decoded at once.
    from data.tokenizer import TokenizerSpec, load_tokenizer
    from execution.checkpoint.load import read_weights, saved_model_shapes
    from modelling.generation import build_model

    tokenizer = load_tokenizer(TokenizerSpec())[0]
    model_section, weights = read_weights(tmp_path)
    model = build_model(saved_model_shapes(model_section), weights)
    prompt = torch.tensor([tokenizer.encode("Hello world").ids])
    ids = [int(t[0]) for t in generate(model, prompt, 6, use_cache=False)]
    assert out.startswith("Hello world" + tokenizer.decode(ids) + "\n[6 tokens in ")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # nan and inf made every probability nan: torch.multinomial raised.
        (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
        (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
        # Bytes that are not UTF-8 reach sys.argv as lone surrogates, as here for 0xff.
        (["--prompt", "ab\udcff"], "--prompt is not valid UTF-8 (byte 0xff at character 3)"),
        (["--seed", str(2**64)], "--seed must be in [0, 2^64)"),
    ],
)
def test_bad_sampling_flags_and_prompts_exit_2_before_loading(tmp_path, flags, message):
    missing = tmp_path / "no_checkpoint"  # never read: the flags are checked first
    result = run_script("run_generation.py", "--load", str(missing), "--prompt", "Hi", *flags)
    assert_refused(result, "run_generation.py", message)
    assert result.stdout == "" and "Traceback" not in result.stderr


def _word_tokenizer(path) -> None:
    """A HuggingFace tokenizer.json of its own (not GPT-2's): 30 words split at whitespace,
    ``<eot>`` among them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<eot>", "<unk>", *(f"w{n}" for n in range(28))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))


def test_the_cli_tokenizes_with_the_model_s_own_tokenizer_json(tmp_path, capsys):
    """--tokenizer and --eot_token: the prompt is the given tokenizer's ids, the continuation
    its decoding, and generation stops at its end-of-text id (a model of a vocabulary of its
    own, as an imported Llama's)."""
    config = small_config("--layers", "1")
    engine = planned_engine(config, ParallelLayout.single(CPU))
    save_checkpoint(tmp_path / "ckpt", engine, config, 0)
    _word_tokenizer(tmp_path / "tokenizer.json")
    flags = ["--prompt", "w3 w7 w1", "--temperature", "0", "--max_new_tokens", "5"]
    flags += ["--tokenizer", str(tmp_path / "tokenizer.json"), "--eot_token", "<eot>"]
    run_generation.main(["--load", str(tmp_path / "ckpt"), *flags, "--device", "cpu"])
    out = capsys.readouterr().out
    from tokenizers import Tokenizer

    from execution.checkpoint.load import read_weights, saved_model_shapes
    from modelling.generation import build_model

    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    model_section, weights = read_weights(tmp_path / "ckpt")
    model = build_model(saved_model_shapes(model_section), weights)
    prompt = tokenizer.encode("w3 w7 w1").ids
    assert prompt == [5, 9, 3]
    ids = [int(t[0]) for t in generate(model, torch.tensor([prompt]), 5, stop_token=0)]
    assert out.startswith("w3 w7 w1" + tokenizer.decode(ids) + "\n[")


def test_a_tokenizer_that_is_not_one_or_lacks_the_end_token_is_one_line(tmp_path):
    (tmp_path / "bad.json").write_text("{}")
    _word_tokenizer(tmp_path / "words.json")
    for flags, message in (
        (["--tokenizer", str(tmp_path / "none.json")], "--tokenizer: tokenizer file"),
        (["--tokenizer", str(tmp_path / "bad.json")], "is not a HuggingFace tokenizer.json"),
        (["--tokenizer", str(tmp_path / "words.json")], "has no end-of-text token"),
    ):
        result = run_script(
            "run_generation.py", "--load", str(tmp_path / "none"), "--prompt", "w1", *flags
        )
        assert_refused(result, "run_generation.py", message)
