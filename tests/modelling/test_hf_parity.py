"""Our GPT must compute HuggingFace GPT-2's loss and gradients from the same weights.

GPT-3 is GPT-2's architecture (pre-layer-norm, learned positions, tanh-GELU, tied embedding); HF's
``GPT2LMHeadModel`` is the independent reference. Its Conv1D weights are stored [in, out], ours
[out, in] like ``nn.Linear``.
"""

from __future__ import annotations

import pytest
import torch

from modelling.gpt import GPT, GPTShapes
from tests.reference import relative_error

transformers = pytest.importorskip("transformers")

# Our name -> (HF name, transpose) for the parameters of decoder layer n.
LAYER_MAP = {
    "ln_1.weight": ("ln_1.weight", False),
    "ln_1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),
    "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.out.weight": ("attn.c_proj.weight", True),
    "attn.out.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False),
    "ln_2.bias": ("ln_2.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True),
    "mlp.fc.bias": ("mlp.c_fc.bias", False),
    "mlp.proj.weight": ("mlp.c_proj.weight", True),
    "mlp.proj.bias": ("mlp.c_proj.bias", False),
}


def hf_name(ours: str, layers: int) -> tuple[str, bool]:
    if ours == "embedding.word.weight":
        return "transformer.wte.weight", False
    if ours == "embedding.position.weight":
        return "transformer.wpe.weight", False
    if ours.startswith("head.ln_f."):
        return "transformer." + ours.removeprefix("head."), False
    _, n, rest = ours.split(".", 2)
    name, transpose = LAYER_MAP[rest]
    return f"transformer.h.{n}.{name}", transpose


@pytest.mark.parametrize("vocab", [50257, 211])
def test_loss_and_gradients_equal_huggingface_gpt2(vocab):
    torch.manual_seed(0)
    layers, hidden, heads, seq, positions = 2, 64, 4, 24, 32
    hf_config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
    )
    hf = transformers.GPT2LMHeadModel(hf_config).float()
    hf.config._attn_implementation = "eager"
    with torch.no_grad():  # non-trivial biases and norms, so a mis-mapped one cannot hide
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "ln" in name and "weight" in name else 0.0, 0.1)

    shapes = GPTShapes(layers, hidden, heads, vocab, positions, 0.0, 1e-5)
    ours = GPT(shapes)
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            source, transpose = hf_name(name, layers)
            value = hf_params[source].t() if transpose else hf_params[source]
            p.zero_()[: value.shape[0]].copy_(value)  # rows past vocab/positions stay zero

    tokens = torch.randint(0, vocab, (3, seq + 1), generator=torch.Generator().manual_seed(1))
    # HF shifts labels itself: feeding seq + 1 tokens scores the same seq predictions as ours.
    hf_loss = hf(input_ids=tokens, labels=tokens).loss
    our_loss = ours(tokens[:, :-1], tokens[:, 1:])
    assert abs(our_loss.item() - hf_loss.item()) <= 1e-5 * hf_loss.item()

    hf_loss.backward()
    our_loss.backward()
    for name, p in ours.named_parameters():
        source, transpose = hf_name(name, layers)
        expected = hf_params[source].grad
        expected = expected.t() if transpose else expected
        err = relative_error(p.grad[: expected.shape[0]], expected)
        assert err <= 1e-5, f"{name} vs {source}: relative error {err:.2e}"
        assert not p.grad[expected.shape[0] :].any(), f"padding rows of {name} got gradient"
