"""Model and batch sizes refused by arithmetic, before anything is built or allocated.

A typo in a size (``--intermediate_size 4294967296``) must not reach the code that builds
the model: it would die in the allocator, overflow, or run for minutes. Each limit is about
sizes that cannot run at all, never about a big but real model (GPT-3 175B, Llama 3 405B and
models a hundred times larger pass them all); a model that some layout could hold is the
dry run's to report on, with its advice.

- What the tensor library can count (:func:`validate_sizes`, every run). torch's sizes,
  strides and byte counts are int64; config.loading refuses a flag past 2^63 - 1, and here a
  tensor the run would hold whose bytes would pass it. The largest are, at one rank of the
  smallest layout: a state of the model's weights (each state of every parameter, 4 bytes
  of float32 each, lies in tensors that together hold no more), and one micro-batch's widest
  activation (the float32 logits, or the MLP's intermediate values) or, where attention is
  written out (``--dropout_parity``; dropout on a CPU runs the math kernel), its scores. A
  layout has at most :data:`MOST_DEVICES`.
- What no layout of the device planned for could hold (:func:`refuse_unholdable`,
  ``--dry_run`` and ``--plan_for``, which plan for a device of known memory):
  - The training state, 16 bytes a parameter, is split over every device of a layout
    (tensor and pipeline axes split the weights, and replicated-tensor sharding splits each
    split over the data and context axes), so over :data:`MOST_DEVICES` at the most. Where
    that share passes a device's memory and its host's, no layout holds the model.
  - One device computes one micro-batch, of one sequence at least, through whole decoder
    layers and the head: the MLP's intermediate values of its tokens (gate and up for
    SwiGLU) over tensor_parallel_1 and, for the language model's head, its float32 logits
    over the vocabulary shard. tensor_parallel_1 divides the heads and context_parallel the
    heads of a tensor_parallel_1 rank, so no layout splits a sequence's tokens times those
    widths over more than ``--heads`` devices. Where that share alone passes the device's
    memory, no layout fits; the planner would say so only after weighing every plan.
"""

from __future__ import annotations

from config.errors import ConfigError

# torch's largest size or byte count (int64).
TENSOR_LIMIT = 2**63 - 1
# Bytes of a float32 value: the model's states, and the logits the loss reads.
FLOAT32 = 4
# Bytes of a parameter's training state: float32 weights, two AdamW moments and gradients.
STATE_BYTES = 16
# Bytes of an activation in each compute precision.
COMPUTE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The most devices a layout has (--plan_for's bound too): more than any machine has. A larger
# mesh would have the dry run walk a billion ranks to group them.
MOST_DEVICES = 1 << 20
GiB = 1 << 30
# A vocabulary shard's rows are a multiple of this (modelling.gpt.VOCAB_SHARD_MULTIPLE).
VOCAB_MULTIPLE = 16


def validate_sizes(config) -> None:
    """Refuses, in one line naming the flags, a layout of more than :data:`MOST_DEVICES` and a
    tensor that torch could not count (see the module docstring). Runs after the checks of
    single values, so every size is at least 1."""
    ex = config.execution
    if config.world_size > MOST_DEVICES:
        raise ConfigError(
            f"--data_parallel {ex.data_parallel} x --pipeline_parallel {ex.pipeline_parallel} x "
            f"--context_parallel {ex.context_parallel} x --tensor_parallel_1 "
            f"{ex.tensor_parallel_1} x --tensor_parallel_2 {ex.tensor_parallel_2} = "
            f"{config.world_size:,} devices, more than any machine has (at most "
            f"{MOST_DEVICES:,}); check the numbers"
        )
    _validate_weights(config)
    _validate_activations(config)


def _validate_weights(config) -> None:
    total = parameters(config.model)
    if total * FLOAT32 > TENSOR_LIMIT:
        raise ConfigError(
            f"{_parameters_named(config.model)} make {total:,} parameters, whose float32 weights "
            f"({_bytes(total * FLOAT32)}) are past the {_bytes(TENSOR_LIMIT)} torch can count "
            "(int64); check the sizes"
        )


def _parameters_named(m) -> str:
    """The flags that make most of the model's parameters, with their values."""
    layer = layer_parameters(m)
    if m.layers * layer >= outside_parameters(m):
        return (
            f"--layers {m.layers:,} of {layer:,} parameters each (--hidden_size "
            f"{m.hidden_size:,}, --intermediate_size {ffn_width(m):,})"
        )
    named = f"--vocab_size {m.vocab_size:,} x --hidden_size {m.hidden_size:,}"
    if m.position_embedding == "learned":
        named += f" and --max_positional_length {m.max_positional_length:,} of them"
    return named


def _validate_activations(config) -> None:
    m, mb = config.model, config.execution.micro_batch_size
    tokens = mb * m.sequence_length
    widths = {f"--intermediate_size {ffn_width(m)}": mlp_rows(m)}
    if not config.task:  # the language model's head: logits of the padded vocabulary
        padded = -(-m.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        widths[f"--vocab_size {m.vocab_size} padded to {padded}"] = padded
    for flag, width in widths.items():
        if tokens * width * FLOAT32 > TENSOR_LIMIT:
            raise ConfigError(
                f"one micro-batch (--micro_batch_size {mb:,} x --sequence_length "
                f"{m.sequence_length:,} tokens) x {width:,} values a token ({flag}) is "
                f"{_bytes(tokens * width * FLOAT32)} in float32, past the "
                f"{_bytes(TENSOR_LIMIT)} torch can count (int64); check the sizes"
            )
    scores = tokens * m.heads * m.sequence_length * FLOAT32
    if (m.dropout_parity or m.dropout_prob > 0) and scores > TENSOR_LIMIT:
        raise ConfigError(
            f"attention written out (--dropout_parity, or --dropout_prob {m.dropout_prob:g} "
            f"on a CPU) holds --micro_batch_size {mb:,} x --heads {m.heads:,} x "
            f"--sequence_length {m.sequence_length:,} squared scores, {_bytes(scores)} in "
            f"float32, past the {_bytes(TENSOR_LIMIT)} torch can count (int64); check the sizes"
        )


def refuse_unholdable(config, device: str, device_gib: float, host_gib: float) -> None:
    """Refuses, in one line, sizes no layout of devices of ``device_gib`` GiB, each with
    ``host_gib`` GiB of host memory (a ``device``), could hold (see the module docstring)."""
    _refuse_unholdable_state(config, device, device_gib + host_gib)
    _refuse_unholdable_sequence(config, device, device_gib)


def _refuse_unholdable_state(config, device: str, gib: float) -> None:
    """The model's training state, spread over :data:`MOST_DEVICES` devices and their hosts."""
    m = config.model
    state, memory = parameters(m) * STATE_BYTES, gib * GiB
    if state > memory * MOST_DEVICES:  # an int against a float: compared exactly
        raise ConfigError(
            f"{_parameters_named(m)} make {parameters(m):,} parameters, whose float32 weights, "
            f"AdamW moments and gradients ({_bytes(state)}) need "
            f"{_bytes(state / MOST_DEVICES)} on each of "
            f"the {MOST_DEVICES:,} devices of the largest layout, more than the {_bytes(memory)} "
            f"of device and host memory of the {device} planned for; check the sizes"
        )


def _refuse_unholdable_sequence(config, device: str, device_gib: float) -> None:
    """One sequence's MLP values, or logits, on the finest split the heads allow."""
    m = config.model
    memory = device_gib * GiB
    tokens, finest = m.sequence_length, m.heads
    whole = tokens * mlp_rows(m) * COMPUTE_BYTES[config.training.precision]
    what = (
        f"through a decoder layer's MLP (--intermediate_size {ffn_width(m):,}: "
        f"{mlp_rows(m):,} values a token, in {config.training.precision})"
    )
    logits = tokens * m.vocab_size * FLOAT32
    if not config.task and logits > whole:
        whole, what = logits, f"through the head (--vocab_size {m.vocab_size:,} float32 logits)"
    if whole > memory * finest:  # an int against a float: compared exactly
        raise ConfigError(
            f"one sequence of --sequence_length {tokens:,} tokens {what} needs "
            f"{_bytes(whole / finest)} on each device however the model is split (over at most "
            f"--heads {finest:,} devices: tensor_parallel_1 x context_parallel), more than the "
            f"{_bytes(memory)} of the {device} planned for; check the sizes, or plan for a "
            "larger device with --device_memory_gb"
        )


def ffn_width(model) -> int:
    """The MLP's intermediate width (0: 4 x hidden_size)."""
    return model.intermediate_size or 4 * model.hidden_size


def mlp_rows(model) -> int:
    """Values a token holds between the MLP's two projections: gate and up for SwiGLU."""
    return ffn_width(model) * (2 if model.mlp_activation == "swiglu" else 1)


def parameters(model) -> int:
    """Parameters of the model as a language model (modelling.gpt.GPTShapes.num_parameters)."""
    return model.layers * layer_parameters(model) + outside_parameters(model)


def layer_parameters(model) -> int:
    """Parameters of one decoder layer (modelling.gpt.part_inits counts the same)."""
    h = model.hidden_size
    qkv_rows = h + 2 * (model.kv_heads or model.heads) * (h // model.heads)
    norms = 2 * h * (1 if model.normalization == "rms_norm" else 2)
    matrices = qkv_rows * h + h * h + mlp_rows(model) * h + h * ffn_width(model)
    biases = qkv_rows + h + mlp_rows(model) + h if model.linear_bias else 0
    return norms + matrices + biases


def outside_parameters(model) -> int:
    """Parameters of the embedding and the language model's head."""
    h = model.hidden_size
    tables = model.vocab_size * h
    if model.position_embedding == "learned":
        tables += model.max_positional_length * h
    if not model.tied_head:
        tables += model.vocab_size * h
    return tables + h * (1 if model.normalization == "rms_norm" else 2)


def _bytes(count: float) -> str:
    """A byte count in the binary unit that keeps it under 1024 (``1.0 TiB``)."""
    units = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")
    value, unit = float(count), 0
    while value >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:,.0f} bytes" if unit == 0 else f"{value:,.1f} {units[unit]}"
