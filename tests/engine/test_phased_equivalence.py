"""The phased step must equal an ordinary autograd training step with gradient accumulation."""

from __future__ import annotations

import functools
import itertools
import shlex

import pytest
import torch

from execution.checkpoint.logical import full_state
from execution.engine.engine import PhasedEngine
from execution.engine.phases import head
from execution.engine.phases.step import dropout_seeds
from execution.engine.update.optimizer import clip_coefficient
from execution.parallel.mesh import ParallelLayout
from modelling import lm_heads
from tests.distributed import planned_engine
from tests.reference import (
    LLAMA_VARIANTS,
    chunk_every_head,
    reference_model,
    reference_optimizer,
    reference_step,
    relative_error,
    small_config,
    unpadded,
)

TOLERANCE = 1e-5
CPU = torch.device("cpu")


def random_tokens(config, steps: int, seed: int = 0) -> torch.Tensor:
    """[steps, accumulation, micro_batch, seq + 1] token ids of the whole (dp = 1) batch."""
    ex, seq = config.execution, config.model.sequence_length
    shape = (steps, config.gradient_accumulation, ex.micro_batch_size, seq + 1)
    return torch.randint(
        0, config.model.vocab_size, shape, generator=torch.Generator().manual_seed(seed)
    )


def shadow_optimizer(
    weights: dict[str, torch.Tensor], config
) -> tuple[dict[str, torch.nn.Parameter], torch.optim.AdamW]:
    """torch's AdamW over copies of ``weights``, grouped as :func:`reference_optimizer`
    groups the model's parameters (2-D tensors decayed): it replays the engine's updates from
    the engine's own gradients (:func:`assert_matches_reference`)."""
    params = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items()}
    o = config.training.optimizer
    groups = [
        {"params": [p for p in params.values() if p.dim() == 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params.values() if p.dim() != 2], "weight_decay": 0.0},
    ]
    betas = (o.beta1, o.beta2)
    return params, torch.optim.AdamW(groups, lr=o.learning_rate, betas=betas, eps=o.eps)


def assert_matches_reference(config, steps: int = 2, seeds: bool = False) -> None:
    """Loss, gradient norm and gradients of each step against autograd's; the updated weights
    against torch's AdamW replaying the step from the engine's own gradients.

    The weights are not compared with the autograd model's: AdamW divides each gradient by
    its own running magnitude, so on an element whose gradient is small against its history a
    last-bit difference in the gradient (another CPU's matmul kernel, another summation
    order) moves the update by a large share of ``lr``, whatever the tolerance on the
    gradients; on an AVX-512 machine such an element alone was 1.09e-5 of its tensor's scale
    off. Replayed from the same gradients and weights, the update is the same arithmetic, and
    both sides round each of AdamW's ~10 float32 operations per element once: a few units of
    2^-24 of the weight, far inside ``TOLERANCE``. (The tolerance on gradients holds on every
    CPU: they are sums of products whose rounding is relative to their own scale.)
    """
    engine = planned_engine(config, ParallelLayout.single(CPU))
    seeds_of = functools.partial(dropout_seeds, engine.plan, 0)  # one replica
    model = reference_model(config)
    optimizer = reference_optimizer(model, config)
    shadow, shadow_adamw = shadow_optimizer(full_state(engine, "weights"), config)
    tokens = random_tokens(config, steps)
    clip = config.training.optimizer.gradient_clipping
    for step in range(steps):
        lr = 1e-3 * (step + 1)
        seed_fn = None
        if seeds:

            def seed_fn(m, step=step):
                layer_seeds = [seeds_of(step, n, m) for n in range(config.model.layers)]
                return (seeds_of(step, -1, m).attention_residual, layer_seeds)

        result = engine.train_step(tokens[step], step, lr)
        loss, grads, norm = reference_step(model, optimizer, tokens[step], lr, clip, seed_fn)

        assert not result.skipped
        assert abs(result.loss - loss) <= TOLERANCE * abs(loss), (step, result.loss, loss)
        assert abs(result.grad_norm - norm) <= TOLERANCE * norm, (step, result.grad_norm, norm)
        phased_grads = full_state(engine, "grads")
        phased_weights = full_state(engine, "weights")
        params = dict(model.named_parameters())
        assert phased_grads.keys() == params.keys() == shadow.keys()
        for name in params:
            err = relative_error(phased_grads[name], unpadded(name, grads[name], config))
            assert err <= TOLERANCE, f"step {step} grad {name}: relative error {err:.2e}"

        coefficient = clip_coefficient(result.grad_norm, clip)
        for name, param in shadow.items():
            param.grad = phased_grads[name] * coefficient
        for group in shadow_adamw.param_groups:
            group["lr"] = lr
        shadow_adamw.step()
        for name, param in shadow.items():
            err = relative_error(phased_weights[name], param.detach())
            assert err <= TOLERANCE, f"step {step} weight {name}: relative error {err:.2e}"


@pytest.mark.parametrize(
    ("layers", "accumulation"), [(1, 1), (2, 4), (3, 2), (4, 3)], ids=lambda v: str(v)
)
def test_phased_step_equals_autograd_with_accumulation(layers, accumulation):
    config = small_config("--layers", str(layers), "--global_batch_size", str(2 * accumulation))
    assert config.gradient_accumulation == accumulation
    assert_matches_reference(config)


@pytest.mark.parametrize("variant", [(), tuple(LLAMA_VARIANTS)], ids=["tied", "untied"])
def test_a_head_on_chunks_of_tokens_equals_autograd(monkeypatch, variant):
    """With every head on chunks, a micro-batch of 4 x 16 tokens runs its head on 4 chunks of 16 (half
    the weight's 32 columns): the chunks' losses weighted by their share of the tokens, their
    dx put together and their gradients accumulated give autograd's step on the whole
    micro-batch, within the same tolerance (only the order of sums differs)."""
    chunk_every_head(monkeypatch)
    seen = []

    def logits_chunks(*args):
        seen.append(lm_heads.logits_chunks(*args))
        return seen[-1]

    monkeypatch.setattr(head, "logits_chunks", logits_chunks)
    config = small_config(*variant, "--micro_batch_size", "4", "--global_batch_size", "8")
    assert_matches_reference(config)
    assert seen and all(len(chunks) == 4 for chunks in seen), seen


def test_phased_dropout_recomputes_the_forward_masks():
    """With dropout on, backward recomputation must reuse exactly the forward's masks."""
    config = small_config("--dropout_prob", "0.2", "--global_batch_size", "4")
    assert_matches_reference(config, seeds=True)


def test_without_clipping_or_weight_decay():
    config = small_config("--gradient_clipping", "0", "--weight_decay", "0")
    assert_matches_reference(config, steps=1)


def test_resident_placement_is_bitwise_equal_to_remote():
    runs = {}
    for placement in ("remote", "resident"):
        config = small_config("--placement", placement, "--dropout_prob", "0.1")
        engine = planned_engine(config, ParallelLayout.single(CPU))
        tokens = random_tokens(config, 2)
        losses = [engine.train_step(tokens[s], s, 1e-3).loss for s in range(2)]
        runs[placement] = (losses, full_state(engine), full_state(engine, "exp_avg_sq"))
    (remote_losses, remote_w, remote_v), (res_losses, res_w, res_v) = runs.values()
    assert remote_losses == res_losses
    for name in remote_w:
        assert torch.equal(remote_w[name], res_w[name]), name
        assert torch.equal(remote_v[name], res_v[name]), name


@pytest.mark.parametrize("passes", [1, 2, 8])
def test_each_layer_is_loaded_once_per_phase(monkeypatch, passes):
    """Weights of a part are loaded once per phase whatever the gradient accumulation; each
    pass walks the model once more."""
    run = shlex.split(
        f"--layers 3 --global_batch_size 8 --micro_batch_size 1 --passes {passes} "
        "--placement remote"
    )
    config = small_config(*run)
    engine = planned_engine(config, ParallelLayout.single(CPU))
    loads = []
    original = engine.state.load_weight_vectors  # under load_weights too

    def load_weight_vectors(part, row, dtype):
        loads.append((part, row))
        return original(part, row, dtype)

    monkeypatch.setattr(engine.state, "load_weight_vectors", load_weight_vectors)
    engine.train_step(random_tokens(config, 1)[0], 0, 1e-3)
    layer_loads = [row for part, row in loads if part == "layers"]
    # forward 0..2 then backward 2..0, each exactly once per pass, despite 8 micro-batches
    assert layer_loads == [0, 1, 2, 2, 1, 0] * passes
    assert loads.count(("embedding", 0)) == 3 * passes  # forward, tied head, backward
    assert loads.count(("head", 0)) == passes


def test_bfloat16_step_tracks_float32():
    config32 = small_config()
    config16 = small_config("--precision", "bfloat16")
    tokens = random_tokens(config32, 1)[0]
    r32 = planned_engine(config32, ParallelLayout.single(CPU)).train_step(tokens, 0, 1e-3)
    r16 = planned_engine(config16, ParallelLayout.single(CPU)).train_step(tokens, 0, 1e-3)
    assert abs(r16.loss - r32.loss) <= 2e-2 * r32.loss
    assert abs(r16.grad_norm - r32.grad_norm) <= 5e-2 * r32.grad_norm


def test_float16_loss_scaling_unscales_gradients_and_skips_overflow():
    def engine(*flags: str) -> PhasedEngine:
        return planned_engine(small_config(*flags), ParallelLayout.single(CPU))

    tokens = random_tokens(small_config(), 1)[0]
    ref = engine()
    ref_result = ref.train_step(tokens, 0, 1e-3)
    scaled = engine("--precision", "float16", "--loss_scaling", "1024")
    result = scaled.train_step(tokens, 0, 1e-3)
    assert not result.skipped
    assert abs(result.grad_norm - ref_result.grad_norm) <= 2e-2 * ref_result.grad_norm
    grads, ref_grads = full_state(scaled, "grads"), full_state(ref, "grads")
    assert (
        relative_error(grads["layers.0.mlp.fc.weight"], ref_grads["layers.0.mlp.fc.weight"]) < 2e-2
    )

    overflow = engine("--precision", "float16", "--loss_scaling", "1e30")
    before = full_state(overflow)
    result = overflow.train_step(tokens, 0, 1e-3)
    assert result.skipped and overflow.optimizer_steps == 0
    after = full_state(overflow)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_evaluate_equals_reference_loss_without_changing_weights():
    config = small_config("--dropout_prob", "0.3")
    engine = planned_engine(config, ParallelLayout.single(CPU))
    model = reference_model(config).eval()
    batches = [*random_tokens(config, 1)[0], random_tokens(config, 1, seed=1)[0, 0]]
    before = full_state(engine)
    loss = engine.evaluate(batches)
    with torch.no_grad():
        expected = sum(model(b[:, :-1], b[:, 1:]).item() for b in batches) / len(batches)
    assert abs(loss - expected) <= TOLERANCE * expected
    assert all(torch.equal(before[k], v) for k, v in full_state(engine).items())


def test_dropout_seeds_differ_across_steps_layers_and_micro_batches():
    """Masks must never repeat: a seed that ignored step, layer or micro-batch would pass the
    recomputation test above but train with correlated dropout."""
    engine = planned_engine(small_config("--dropout_prob", "0.1"), ParallelLayout.single(CPU))
    keys = itertools.product(range(3), range(-1, 2), range(4))  # (step, layer, micro-batch)
    seeds = [dropout_seeds(engine.plan, 0, step, layer, micro) for step, layer, micro in keys]
    flat = [s for block in seeds for s in block]
    assert len(set(flat)) == len(flat)
    assert dropout_seeds(engine.plan, 0, None, 0, 0) is None  # evaluation: no dropout
    dropout_free = planned_engine(small_config(), ParallelLayout.single(CPU))
    assert dropout_seeds(dropout_free.plan, 0, 0, 0, 0) is None
