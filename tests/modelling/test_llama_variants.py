"""The Llama family's variants on the GPT-3 engine: their parameters, their shards and the
presets (issue 40 item 1). Numerics against HuggingFace are tests/modelling/test_hf_llama.py's."""

from __future__ import annotations

import dataclasses
import shlex

import pytest
import torch

from config.loading import ConfigError, parse_config
from config.validation import kv_heads_note
from execution.parallel.sharding import init_part_shard, shard_part, unshard_part
from execution.planning.plan_search import layouts
from execution.planning.run_shape import RunShape
from modelling.gpt import EMBEDDING, GPT, HEAD, LAYERS, PARTS, GPTShapes, init_full_part
from modelling.lm_heads import logits_chunks
from tasks.specs import run_shapes
from utils.metrics import flops_per_token

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

# Odd sizes: 6 query heads of 8 sharing 2 KV heads, an intermediate size no tile divides.
LLAMA = GPTShapes(
    layers=2,
    hidden=48,
    heads=6,
    vocab=211,
    positions=64,
    dropout_prob=0.0,
    layer_norm_eps=1e-5,
    kv_heads=2,
    position_embedding="rotary",
    normalization="rms_norm",
    mlp_activation="swiglu",
    intermediate_size=70,
    linear_bias=False,
    tied_head=False,
)


def test_the_llama_parts_hold_exactly_their_parameters():
    names = {part: set(GPT(LLAMA).get_submodule(part).state_dict()) for part in PARTS}
    names[LAYERS] = set(GPT(LLAMA).layers[0].state_dict())
    assert names[EMBEDDING] == {"word.weight"}
    assert names[LAYERS] == {
        "ln_1.weight",
        "attn.qkv.weight",
        "attn.out.weight",
        "ln_2.weight",
        "mlp.gate_up.weight",
        "mlp.down.weight",
    }
    assert names[HEAD] == {"ln_f.weight", "output.weight"}
    layer = init_full_part(LLAMA, LAYERS, 0, 1, 0.02)
    assert layer["attn.qkv.weight"].shape == (48 + 2 * 2 * 8, 48)
    assert layer["mlp.gate_up.weight"].shape == (2 * 70, 48)
    assert layer["mlp.down.weight"].shape == (48, 70)


@pytest.mark.parametrize(("tp1", "tp2"), [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("part", PARTS)
def test_llama_shards_are_slices_of_the_whole_and_make_it_back(part: str, tp1: int, tp2: int):
    shapes = dataclasses.replace(LLAMA, tp1=tp1, tp2=tp2)
    full = init_full_part(LLAMA, part, 1, 7, 0.02)
    shards = {}
    for i in range(tp1):
        for j in range(tp2):
            want = shard_part(part, full, shapes, i, j)
            got = init_part_shard(shapes, part, 1, 7, 0.02, i, j)
            assert got.keys() == want.keys()
            for name, t in want.items():
                assert torch.equal(got[name], t), (name, i, j)
            shards[i, j] = got
    back = unshard_part(part, shards, shapes)
    for name, t in full.items():
        assert torch.equal(back[name], t), name


def test_a_tp1_shard_holds_its_query_heads_with_their_kv_heads_and_paired_gate_up_rows():
    shapes = dataclasses.replace(LLAMA, tp1=2)
    full = init_full_part(LLAMA, LAYERS, 0, 3, 0.02)
    shard = shard_part(LAYERS, full, shapes, 1, 0)
    q, k, v = full["attn.qkv.weight"].split([48, 16, 16])
    want = torch.cat([q[24:], k[8:], v[8:]])  # heads 3..5, KV head 1 of 0..1
    assert torch.equal(shard["attn.qkv.weight"], want)
    gate, up = full["mlp.gate_up.weight"].chunk(2)
    assert torch.equal(shard["mlp.gate_up.weight"], torch.cat([gate[35:], up[35:]]))


def test_the_llama3_8B_preset_has_its_8_billion_parameters():
    config, _ = parse_config(["--config", "llama3_8B"])
    assert run_shapes(config).num_parameters == 8_030_261_248


def test_the_gpt3_presets_keep_their_architecture():
    config, _ = parse_config(["--config", "gpt3_125M"])
    shapes = run_shapes(config)
    assert shapes.ties_word_embedding and shapes.key_value_heads == shapes.heads
    assert shapes.num_parameters == 125_226_240  # as main counted it


def test_a_cp_split_that_cannot_split_the_kv_heads_says_so_in_one_line():
    split, _ = parse_config(["--config", "llama_tiny", "--context_parallel", "2"])
    assert kv_heads_note(split) is None  # 2 KV heads, one per context rank
    repeated, _ = parse_config(
        ["--config", "llama_tiny", "--context_parallel", "2", "--tensor_parallel_1", "2"]
    )
    note = kv_heads_note(repeated)
    assert note.startswith("note: 1 KV head(s) per tensor_parallel_1 rank") and "\n" not in note


def test_plan_for_offers_only_tensor_layouts_that_split_the_kv_heads():
    config, _ = parse_config(["--config", "llama3_8B", "--plan_across_nodes", "true"])
    candidates = layouts(RunShape.of(config), 64, across_nodes=True)
    tp1_sizes = {candidate.mesh.tp1 for candidate in candidates}
    assert tp1_sizes == {1, 2, 4, 8}  # 32 query heads, but 8 KV heads


def test_an_untied_word_embedding_does_no_flops():
    config, _ = parse_config(["--config", "llama3_8B"])
    shapes = run_shapes(config)
    attention = 12 * 32 * 4096 * 8192
    embedding = 128256 * 4096
    assert flops_per_token(shapes, 8192) == 6 * (8_030_261_248 - embedding) + attention


def test_an_explicit_head_dim_widens_q_and_the_output_and_shards_by_whole_heads():
    """6 heads of 10 on a hidden size of 48 (HF's explicit ``head_dim``): q and attention's
    output are 60 wide, and a tp1 shard holds whole heads of 10 at every split."""
    wide = dataclasses.replace(LLAMA, explicit_head_dim=10)
    layer = init_full_part(wide, LAYERS, 0, 3, 0.02)
    assert layer["attn.qkv.weight"].shape == (60 + 2 * 2 * 10, 48)
    assert layer["attn.out.weight"].shape == (48, 60)
    shards = {}
    for i in range(2):
        for j in range(2):
            shards[i, j] = shard_part(LAYERS, layer, dataclasses.replace(wide, tp1=2, tp2=2), i, j)
    q, k, v = layer["attn.qkv.weight"].split([60, 20, 20])
    want = torch.cat([q[30:], k[10:], v[10:]])[:, 24:]  # heads 3..5, KV head 1; columns 24..47
    assert torch.equal(shards[1, 1]["attn.qkv.weight"], want)
    assert torch.equal(shards[1, 0]["attn.out.weight"], layer["attn.out.weight"][:24, 30:])
    back = unshard_part(LAYERS, shards, dataclasses.replace(wide, tp1=2, tp2=2))
    for name, t in layer.items():
        assert torch.equal(back[name], t), name
    model = GPT(wide)  # its modules hold the shapes the initial weights have
    assert model.layers[0].attn.qkv.weight.shape == (100, 48)
    assert model.layers[0].attn.out.weight.shape == (48, 60)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--rope_factor 2", "--rope_factor only applies to --rope_type llama3; add --rope_type"),
        ("--config tiny --rope_type llama3", "scales rotary frequencies; add --position_embedding"),
        ("--rope_type llama3 --rope_factor 0.5", "--rope_factor must be a finite number >= 1"),
        ("--rope_type llama3 --rope_low_freq_factor 0", "--rope_low_freq_factor must be a finite"),
        (
            "--rope_type llama3 --rope_high_freq_factor 1",
            "--rope_high_freq_factor must be a finite number above --rope_low_freq_factor 1.0",
        ),
        ("--rope_type llama3 --rope_original_max_positions 0", "must be at least 1 (Llama 3.1"),
        ("--head_dim 7", "needs an even head width, got --head_dim 7"),
        ("--head_dim -2", "and --head_dim -2 must be at least 0"),
        ("--heads 5", "is not divisible by --heads 5; pick sizes so that every head has the same"),
    ],
)
def test_rope_scaling_and_head_dim_flags_that_cannot_compute_are_one_line(flags, message):
    with pytest.raises(ConfigError) as err:
        parse_config(["--config", "llama_tiny", *shlex.split(flags)])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_hidden_size_need_not_divide_into_heads_of_an_explicit_width():
    config, _ = parse_config(["--config", "llama_tiny", "--heads", "6", "--head_dim", "16"])
    assert run_shapes(config).attention_width == 96  # beside a hidden size of 128


@pytest.mark.parametrize(
    ("tokens", "vocab", "local_vocab", "hidden", "sizes"),
    [
        (512, 50257, 50304, 128, [512]),  # GPT-2's vocabulary: whole
        (8192, 50257, 50304, 4096, [8192]),
        # 128,256 x 128: half the weight is 64 tokens; the floor's 2^23 elements 65.4.
        (1024, 128256, 128256, 128, [64] * 16),
        (8192, 128256, 128256, 4096, [2048] * 4),  # llama3_8B: half of 4096 columns
        (8192, 128256, 64128, 2048, [1024] * 8),  # at tp1 2 x tp2 2: half its shard's 2048
        (1000, 128256, 128256, 128, [63] * 15 + [55]),  # 16 chunks that cannot all be equal
        (40, 128256, 128256, 128, [40]),  # within the floor: whole
    ],
)
def test_a_large_vocabulary_s_head_runs_on_chunks_of_half_its_weight(
    tokens, vocab, local_vocab, hidden, sizes
):
    """Hand counts: chunks of at most max(local_vocab x hidden / 2, 2^23) / local_vocab tokens,
    as few as that allows and as equal as can be, covering every token once in order."""
    chunks = logits_chunks(tokens, vocab, local_vocab, hidden)
    assert [c.stop - c.start for c in chunks] == sizes
    assert [c.start for c in chunks] == [sum(sizes[:i]) for i in range(len(sizes))]
