"""Absurd sizes are refused by arithmetic in one line (config/size_limits.py, config.loading's
int64 bound), and what is not refused is planned without allocating the model: a shard's
indices are runs (execution/parallel/index_runs.py), the norm's chunks are bounded."""

from __future__ import annotations

import itertools
import json
import shlex
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from config.loading import ConfigError, parse_config
from config.size_limits import (
    layer_parameters,
    outside_parameters,
    refuse_unholdable,
    validate_sizes,
)
from execution.checkpoint.chunks import held_chunks
from execution.engine.phases import step as engine_step
from execution.engine.storage.buffers import flat_specs
from execution.parallel.index_runs import IndexRuns
from execution.parallel.sharding import rts_sizes, shard_sizes
from modelling.gpt import EMBEDDING, GPTShapes
from tests.entry_points import ROOT, assert_refused, run_script

PROGRAM = "run_pretraining.py"


@pytest.mark.parametrize(
    "flags, message",
    [
        # issue 54's: each died in the allocator, with an OverflowError or a traceback
        (
            "--config llama_tiny --intermediate_size 4294967296 --dry_run",
            "needs 1.0 TiB on each device however the model is split",
        ),
        (
            "--config llama_tiny --vocab_size 2147483647 --dry_run",
            "(--vocab_size 2,147,483,647 float32 logits) needs 256.0 GiB on each device",
        ),
        (
            "--config llama_tiny --intermediate_size 99999999999999999999 --dry_run",
            "--intermediate_size 99999999999999999999 does not fit a 64-bit integer",
        ),
        (
            "--config tiny --layers 99999999999999999999 --dry_run",
            "--layers 99999999999999999999 does not fit a 64-bit integer",
        ),
        # and the others of the model and the batch
        ("--config tiny --layers 100000000000000 --dry_run", "past the 8.0 EiB torch can count"),
        (
            "--config tiny --hidden_size 67108864 --heads 4 --dry_run",
            "need 1.5 TiB on each of the 1,048,576 devices of the largest layout",
        ),
        (
            "--config tiny --hidden_size 2147483520 --heads 4",
            "--hidden_size 2,147,483,520, --intermediate_size 8,589,934,080) make",
        ),
        ("--config tiny --heads 99999999999999999999", "--heads 99999999999999999999 does not fit"),
        (
            "--config llama_tiny --kv_heads 9223372036854775808",
            "--kv_heads 9223372036854775808 does not fit a 64-bit integer",
        ),
        (
            "--config tiny --sequence_length 2147483647 --max_positional_length 2147483647 "
            "--heads 1 --dry_run",
            "one sequence of --sequence_length 2,147,483,647 tokens through the head",
        ),
        ("--config tiny --max_positional_length 1e20", "--max_positional_length 1e20 does not"),
        (
            "--config tiny --micro_batch_size 1099511627776 --global_batch_size 1099511627776",
            "one micro-batch (--micro_batch_size 1,099,511,627,776 x --sequence_length 128",
        ),
        ("--config tiny --global_batch_size 1e19", "--global_batch_size 1e19 does not fit"),
        (
            "--config tiny --data_parallel 1073741824 --micro_batch_size 1 "
            "--global_batch_size 1073741824 --dry_run",
            "= 1,073,741,824 devices, more than any machine has (at most 1,048,576)",
        ),
        (
            "--config llama_tiny --intermediate_size 4294967296 --plan_for 8",
            "needs 1.0 TiB on each device however the model is split",
        ),
        # without --dry_run the planner says it, from the same sizes (~7 s: it weighs plans)
        pytest.param(
            "--config llama_tiny --intermediate_size 4294967296 --steps 1",
            "no single change of passes, placement, micro-batch size or parallelism",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_absurd_sizes_are_refused_in_one_line(tmp_path, flags, message):
    """One line, exit 2, nothing written; the timeout guards the allocator's minutes."""
    out = tmp_path / "out"
    result = run_script(PROGRAM, *shlex.split(flags), "--output_dir", str(out), timeout=60)
    assert_refused(result, PROGRAM, message)
    assert not out.exists()


def _config(*flags: str):
    return parse_config(["--config", "llama_tiny", *flags])[0]


def test_the_sequence_limit_is_exact():
    """llama_tiny: 128 tokens, 4 heads, SwiGLU in float32. One sequence's gate and up values,
    128 x 2F x 4 bytes over at most 4 devices, are 256 F bytes: on a 1 GiB device, F = 2^22
    fills it exactly, and one more is refused. The logits of V words, 128 x V x 4 bytes over
    4 devices, fill it at V = 2^23."""
    refuse_unholdable(_config("--intermediate_size", str(2**22)), "test", 1.0, 0.0)
    with pytest.raises(ConfigError, match=r"needs 1\.0 GiB on each device .* than the 1\.0 GiB"):
        refuse_unholdable(_config("--intermediate_size", str(2**22 + 1)), "test", 1.0, 0.0)
    refuse_unholdable(_config("--vocab_size", str(2**23)), "test", 1.0, 0.0)
    with pytest.raises(ConfigError, match="--vocab_size 8,388,609 float32 logits"):
        refuse_unholdable(_config("--vocab_size", str(2**23 + 1)), "test", 1.0, 0.0)


# tiny (hidden 128, 4 x 128 MLP, GPT-3's layers with biases): per layer 2 layer norms (2 x 256),
# qkv 3 x 128 x 128 + 384, out 128 x 128 + 128, fc 512 x 128 + 512, proj 128 x 512 + 128:
# 12 x 128^2 + 13 x 128 = 198,272. Outside the layers: 50,257 + 128 rows of 128 and ln_f's 256.
TINY_LAYER, TINY_OUTSIDE = 198_272, 50_257 * 128 + 128 * 128 + 256


def _tiny(*flags: str):
    return parse_config(["--config", "tiny", *flags])[0]


def test_the_parameter_counts_are_the_model_s():
    """The limits' parameter counts against modelling's (part_inits), for each architecture."""
    assert layer_parameters(_tiny().model) == TINY_LAYER
    assert outside_parameters(_tiny().model) == TINY_OUTSIDE
    variants = ["--kv_heads 1", "--tied_head false", "--normalization rms_norm"]
    variants += ["--linear_bias false", "--position_embedding rotary --mlp_activation swiglu"]
    for preset in ("tiny", "llama_tiny", "llama3_8B", "gpt3_175B"):
        for variant in ["", *variants]:
            model = parse_config(["--config", preset, *shlex.split(variant)])[0].model
            count = model.layers * layer_parameters(model) + outside_parameters(model)
            assert count == GPTShapes.from_config(model).num_parameters, (preset, variant)


def test_the_state_limit_is_exact():
    """16 bytes a parameter over 2^20 devices of 0.5 + 0.5 GiB: at most 2^46 parameters."""
    layers = (2**46 - TINY_OUTSIDE) // TINY_LAYER
    refuse_unholdable(_tiny("--layers", str(layers)), "test", 0.5, 0.5)
    with pytest.raises(ConfigError, match="on each of the 1,048,576 devices of the largest"):
        refuse_unholdable(_tiny("--layers", str(layers + 1)), "test", 0.5, 0.5)


def test_the_int64_limits_are_exact():
    """Float32 weights of at most 2^63 - 1 bytes: 2^61 - 1 parameters; a micro-batch's logits
    (128 tokens x 50,257 words padded to 50,272, float32) as many bytes; a flag of at most
    2^63 - 1."""
    layers = (2**61 - 1 - TINY_OUTSIDE) // TINY_LAYER
    validate_sizes(_tiny("--layers", str(layers)))
    with pytest.raises(ConfigError, match=r"float32 weights .* past the 8\.0 EiB torch can count"):
        _tiny("--layers", str(layers + 1))
    batch = (2**63 - 1) // (128 * 50_272 * 4)
    _tiny("--micro_batch_size", str(batch), "--global_batch_size", str(batch))
    with pytest.raises(ConfigError, match=r"one micro-batch .* x 50,272 values a token"):
        _tiny("--micro_batch_size", str(batch + 1), "--global_batch_size", str(batch + 1))
    assert _tiny("--steps", str(2**63 - 1)).training.steps == 2**63 - 1
    with pytest.raises(ConfigError, match="--steps 9223372036854775808 does not fit a 64-bit"):
        _tiny("--steps", str(2**63))
    # digits are read exactly, not through a float (which rounds past 2^53)
    assert _tiny("--steps", str(2**53 + 1)).training.steps == 2**53 + 1


def test_index_runs_do_what_torch_does_to_an_arange():
    """Every operation a sharding rule uses, against the same on torch's index tensors (an
    uneven chunk leaves out chunks as torch.chunk does; -1 is padding)."""
    for n, parts, unit in itertools.product(range(13), range(1, 6), (1, 2, 3)):
        if n % unit:
            continue
        full = torch.arange(n)
        padded = full.clone()
        padded[n // 2 :] = -1
        for runs, tensor in (
            (IndexRuns.arange(n), full),
            (IndexRuns.arange(n).padded_from(n // 2), padded),
        ):
            assert torch.equal(runs.tensor(), tensor)
            pieces = tensor.view(-1, unit).chunk(parts) if n else tensor.chunk(parts)
            chunks = runs.chunk(parts, unit)
            assert [c.tensor().tolist() for c in chunks] == [p.reshape(-1).tolist() for p in pieces]
            assert torch.equal(
                IndexRuns.cat(chunks[::-1]).tensor(), torch.cat(pieces[::-1]).reshape(-1)
            )
            assert torch.equal(runs[1 : n - 1].tensor(), tensor[1 : n - 1])
            sizes = [n // 3, n - n // 3]
            assert [p.tensor().tolist() for p in runs.split(sizes)] == [
                p.tolist() for p in tensor.split(sizes)
            ]
            located = [(int(p), int(tensor[p])) for p in range(n) if tensor[p] >= 0]
            assert [
                (p + k, first + k) for p, length, first in runs.located() for k in range(length)
            ] == located


def test_a_shard_s_shape_and_chunks_cost_no_index_tensor():
    """A vocabulary of 2^40 rows on tp1 2 (a 4 TiB index tensor, were it built): its shard's
    shape, and the chunks a rank's buffer holds of it, are a few runs."""
    shapes = GPTShapes(2, 64, 4, 2**40, 16, 0.0, 1e-5, tp1=2, tp2=2)
    assert shard_sizes(EMBEDDING, shapes, 1, 1)["word.weight"] == (2**39, 32)
    specs = flat_specs(shapes, rts_sizes(2, 2, 2))[EMBEDDING]
    chunks = held_chunks(EMBEDDING, specs, shapes, (1, 1), {k: 1 for k in specs}, 1 << 62)
    # The packed shard is the word table's 2^39 x 32 and the position table's 8 x 32; RTS rank
    # 1 of 2 holds its second half, from element 2^43 + 128 (row 2^38 + 4 of the word shard,
    # which starts at row 2^39 of the vocabulary; its columns are 32-63), and the positions.
    expected = [("word.weight", (2**39 + 2**38 + 4, 32), (2**38 - 4, 32))]
    expected += [("position.weight", (8, 32), (8, 32))]
    assert [(c.name, c.offsets, c.sizes) for c in chunks] == expected


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("elements", [2**24, 2**35])
def test_the_norm_of_a_shard_is_a_bounded_number_of_ops(elements):
    """Off a CPU a chunk is DEVICE_NORM_CHUNK (one of 2^24 here); past 1024 of them, at most
    1024 chunks: a dry run meters each op, and a 2^34-element shard would be 1,024 all the same
    (16,384 of the CPU's chunks)."""
    chunks = min(elements // engine_step.DEVICE_NORM_CHUNK, engine_step.MOST_NORM_CHUNKS)
    shard = torch.empty(elements, device="meta")
    with _OpCount() as count:
        engine_step.sum_of_squares(shard)
    # reshape, split; per chunk a float64 copy, its square and its sum; stack and sum
    assert count.ops == 2 + 3 * chunks + 2


def _peak_rss_gib(flags: str, out) -> float:
    """Peak RSS of a fresh interpreter running the entry point with ``flags``."""
    code = (
        "import resource, runpy, sys; sys.argv = sys.argv[1:]\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "finally:\n"
        "    print('peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)"
    )
    argv = [sys.executable, "-c", code, PROGRAM, *shlex.split(flags), "--output_dir", str(out)]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "plan.json").read_text())["world_size"] >= 1
    return int(result.stderr.rsplit("peak ", 1)[1]) / 2**20  # Linux counts KiB


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        # 256 kinds of rank to group, the largest figures of the presets' dry runs
        "--config gpt3_175B_h100x256 --dry_run",
        # a position table of 2^26 rows: its index tensors and their lists were 3.5 GiB
        "--config tiny --max_positional_length 67108864 --dry_run",
    ],
)
def test_a_dry_run_holds_what_it_plans_not_the_model(tmp_path, flags):
    """Peak RSS under 2 GiB, torch's own ~0.4 GiB included."""
    assert _peak_rss_gib(flags, tmp_path / "out") < 2.0
