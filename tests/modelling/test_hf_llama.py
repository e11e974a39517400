"""HuggingFace Llama in and out (issue 40 item 3): a ``LlamaForCausalLM`` folder that
``transformers`` saved, imported with ``--hf_model``'s loader, gives HF's logits and loss; a
checkpoint exported with ``convert_checkpoint.py --hf_output`` loads in ``transformers`` alone
with our logits. Nothing is downloaded: HF models are random, built from a ``LlamaConfig``."""

from __future__ import annotations

import shlex

import pytest
import torch

from config.loading import ConfigError
from execution.checkpoint.load import load_hf_weights, read_weights, saved_model_shapes
from execution.checkpoint.logical import full_state
from execution.parallel.mesh import ParallelLayout
from execution.training.lr_schedule import learning_rate
from modelling.generation import KVCache, build_model, forward_logits
from modelling.gpt import GPTShapes
from modelling.hf_llama import hf_names, row_split
from modelling.hf_llama import llama_config as llama_config_of
from tests.checkpoints import export_hf, save_checkpoint
from tests.distributed import CPU, global_batches, planned_engine, replica_batch
from tests.finetuning_reference import hf_optimizer, initial_weights
from tests.reference import LLAMA_VARIANTS, relative_error, small_config

transformers = pytest.importorskip("transformers")
TOLERANCE = 1e-5
# Odd sizes: 3 layers, 4 query heads of 10 sharing 2 KV heads, intermediate 54, vocabulary 97.
SIZES = dict(layers=3, hidden=40, heads=4, kv_heads=2, intermediate=54, vocab=97, positions=24)
LLAMA_FLAGS = [*LLAMA_VARIANTS, "--rope_theta", "5000"]


def llama_config(*flags: str):
    """tests/reference.py's small config at :data:`SIZES` with the Llama variants."""
    s = SIZES
    sizes = shlex.split(
        f"--layers {s['layers']} --hidden_size {s['hidden']} --heads {s['heads']} "
        f"--kv_heads {s['kv_heads']} --intermediate_size {s['intermediate']} "
        f"--vocab_size {s['vocab']} --max_positional_length {s['positions']} "
        "--sequence_length 8 --global_batch_size 4 --micro_batch_size 2"
    )
    return small_config(*LLAMA_FLAGS, *sizes, *flags)


def hf_llama(seed: int = 0):
    """A random ``LlamaForCausalLM`` of :data:`SIZES`, its norm gains not all one."""
    torch.manual_seed(seed)
    s = SIZES
    config = transformers.LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=s["positions"],
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        tie_word_embeddings=False,
    )
    hf = transformers.LlamaForCausalLM(config).float().eval()
    hf.config._attn_implementation = "eager"
    with torch.no_grad():  # a mis-mapped norm cannot hide behind gains of one
        for p in hf.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.1)
    return hf


def _tokens() -> torch.Tensor:
    return torch.randint(0, SIZES["vocab"], (3, 9), generator=torch.Generator().manual_seed(5))


def test_an_imported_llama_exported_back_loads_in_transformers_with_its_logits(tmp_path):
    hf = hf_llama(seed=1)
    hf.save_pretrained(tmp_path / "hf")
    config = llama_config()
    engine = planned_engine(config, ParallelLayout.single(CPU))
    load_hf_weights(tmp_path / "hf", engine)
    save_checkpoint(tmp_path / "ckpt", engine, config, 0)
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        theirs, again = hf(input_ids=_tokens()).logits, back(input_ids=_tokens()).logits
    assert relative_error(again, theirs) <= TOLERANCE
    for name, p in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], p), name  # every tensor, bit for bit


@pytest.mark.parametrize("shard_size", [None, "20KB"])
def test_import_a_llama_folder_gives_its_logits_and_loss(tmp_path, shard_size):
    hf = hf_llama()
    options = {"max_shard_size": shard_size} if shard_size else {}
    hf.save_pretrained(tmp_path / "hf", **options)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == bool(shard_size)
    config = llama_config()
    engine = planned_engine(config, ParallelLayout.single(CPU))
    load_hf_weights(tmp_path / "hf", engine)
    ours_model = build_model(GPTShapes.from_config(config.model), full_state(engine))
    tokens = _tokens()
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
        ours = forward_logits(ours_model, tokens)
    assert ours.shape == theirs.shape == (3, 9, SIZES["vocab"])
    assert relative_error(ours, theirs) <= TOLERANCE
    # The engine's own loss (the training path: its shards, its phases) equals HF's.
    batch = tokens[:2]  # [micro_batch 2, sequence_length 8 + 1]
    with torch.no_grad():
        hf_loss = hf(input_ids=batch, labels=batch).loss.item()
    assert abs(engine.evaluate([batch]) - hf_loss) <= TOLERANCE * hf_loss


def test_generation_with_the_kv_cache_gives_the_whole_sequence_s_logits():
    hf = hf_llama()
    shapes = GPTShapes.from_config(llama_config().model)
    weights = {
        "embedding.word.weight": hf.model.embed_tokens.weight.detach(),
        "head.ln_f.weight": hf.model.norm.weight.detach(),
        "head.output.weight": hf.lm_head.weight.detach(),
    }
    for n, layer in enumerate(hf.model.layers):
        a, m = layer.self_attn, layer.mlp
        weights |= {
            f"layers.{n}.ln_1.weight": layer.input_layernorm.weight.detach(),
            f"layers.{n}.attn.qkv.weight": torch.cat(
                [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]
            ).detach(),
            f"layers.{n}.attn.out.weight": a.o_proj.weight.detach(),
            f"layers.{n}.ln_2.weight": layer.post_attention_layernorm.weight.detach(),
            f"layers.{n}.mlp.gate_up.weight": torch.cat(
                [m.gate_proj.weight, m.up_proj.weight]
            ).detach(),
            f"layers.{n}.mlp.down.weight": m.down_proj.weight.detach(),
        }
    model = build_model(shapes, weights)
    tokens = _tokens()
    cache = KVCache(model, batch=3, max_length=9)
    assert cache.keys.shape[2] == SIZES["kv_heads"]  # the cache holds the KV heads only
    with torch.no_grad():
        whole = forward_logits(model, tokens)
        pieces = [forward_logits(model, tokens[:, :5], cache)]
        pieces += [forward_logits(model, tokens[:, i : i + 1], cache) for i in range(5, 9)]
        theirs = hf(input_ids=tokens).logits
    assert relative_error(torch.cat(pieces, 1), whole) <= TOLERANCE
    assert relative_error(whole, theirs) <= TOLERANCE


def test_export_loads_in_transformers_alone_with_our_logits(tmp_path):
    config = llama_config()
    engine = planned_engine(config, ParallelLayout.single(CPU))
    batches = global_batches(config, 2)
    for step in range(2):  # trained: the norms are no longer one
        engine.train_step(replica_batch(config, batches[step], 0), step, 1e-2)
    save_checkpoint(tmp_path / "ckpt", engine, config, 2)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")

    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = _tokens()
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
    model, weights = read_weights(tmp_path / "ckpt")
    with torch.no_grad():
        ours = forward_logits(build_model(saved_model_shapes(model), weights), tokens)
    assert relative_error(ours, theirs) <= TOLERANCE
    # and back in: the exported folder imports to the same weights
    again = planned_engine(config, ParallelLayout.single(CPU))
    load_hf_weights(tmp_path / "hf", again)
    for name, t in full_state(again).items():
        assert torch.equal(t, weights[name]), name


def test_import_checks_the_shape_in_one_line(tmp_path):
    hf_llama().save_pretrained(tmp_path / "hf")
    engine = planned_engine(llama_config("--kv_heads", "4"), ParallelLayout.single(CPU))
    with pytest.raises(ConfigError, match="has num_key_value_heads 2 but this run has --kv_heads"):
        load_hf_weights(tmp_path / "hf", engine)
    engine = planned_engine(llama_config("--layers", "2"), ParallelLayout.single(CPU))
    with pytest.raises(ConfigError, match="num_hidden_layers 3 but this run has --layers 2"):
        load_hf_weights(tmp_path / "hf", engine)
    engine = planned_engine(small_config(), ParallelLayout.single(CPU))
    with pytest.raises(ConfigError, match="is a Llama model but this run has --position_embedding"):
        load_hf_weights(tmp_path / "hf", engine)


def _hf_from_ours(shapes: GPTShapes, weights: dict[str, torch.Tensor]):
    """HF's ``LlamaForCausalLM`` of ``shapes`` holding our logical ``weights`` (through the same
    name map as ``--hf_model``), in float32 and training mode."""
    model_section = {
        "vocab_size": shapes.vocab,
        "hidden_size": shapes.hidden,
        "intermediate_size": shapes.ffn,
        "layers": shapes.layers,
        "heads": shapes.heads,
        "kv_heads": shapes.kv_heads,
        "max_positional_length": shapes.positions,
        "init_std": 0.02,
        "layer_norm_eps": shapes.layer_norm_eps,
        "tied_head": shapes.tied_head,
        "rope_theta": shapes.rope_theta,
    }
    hf = transformers.LlamaForCausalLM(llama_config_of(model_section)).float()
    hf.config._attn_implementation = "eager"
    state = {}
    for ours, t in weights.items():
        pieces = t.split(row_split(ours, tuple(t.shape), model_section))
        state |= dict(zip(hf_names(ours), pieces, strict=True))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return hf.train()


def test_six_steps_beside_huggingface_with_adamw_and_clipping_give_its_losses():
    """Our engine (one process, its phases, host AdamW) and HF's model trained by the textbook
    loop (micro-batches accumulated, clip_grad_norm_, torch.optim.AdamW) from the same initial
    weights: losses within 1e-6, gradient norms (which decide the clipping) within 1e-5."""
    config = llama_config(
        "--learning_rate", "2e-3", "--warmup_tokens", "32", "--decay_tokens", "0",
        "--gradient_clipping", "1.0", "--steps", "6",
    )  # fmt: skip
    shapes = GPTShapes.from_config(config.model)
    hf = _hf_from_ours(shapes, initial_weights(shapes, config.training.seed, 0.02))
    optimizer = hf_optimizer(hf, config.training.optimizer)
    engine = planned_engine(config, ParallelLayout.single(CPU))
    rows = global_batches(config, 6)
    t = config.training
    for step in range(6):
        lr = learning_rate(step, t.optimizer, config.tokens_per_step, t.steps)
        result = engine.train_step(replica_batch(config, rows[step], 0), step, lr)
        optimizer.zero_grad()
        batches = rows[step].split(config.execution.micro_batch_size)
        total = 0.0
        for batch in batches:
            loss = hf(input_ids=batch, labels=batch).loss
            (loss / len(batches)).backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0).item()
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        assert result.loss == pytest.approx(total / len(batches), abs=1e-6), step
        assert result.grad_norm == pytest.approx(norm, rel=1e-5), step


def test_a_model_neither_gpt2_nor_llama_is_not_exported(tmp_path):
    config = small_config("--kv_heads", "2")  # GPT-3 otherwise: no HuggingFace class holds it
    engine = planned_engine(config, ParallelLayout.single(CPU))
    save_checkpoint(tmp_path / "ckpt", engine, config, 0)
    with pytest.raises(ConfigError, match="the model's --kv_heads are not GPT-2's"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_gpt2_folder_does_not_start_a_llama_run(tmp_path):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=40, n_head=4))
    hf.save_pretrained(tmp_path / "hf")
    engine = planned_engine(llama_config(), ParallelLayout.single(CPU))
    message = (
        r"is a GPT-2 model \(position_embedding learned\) but this run has --position_embedding "
        "rotary; pass --position_embedding learned"
    )
    with pytest.raises(ConfigError, match=message):
        load_hf_weights(tmp_path / "hf", engine)
