"""Checks that a config's sizes and choices fit together, each failing as one line that names
the flags involved (:class:`~config.errors.ConfigError`)."""

from __future__ import annotations

import math
from collections.abc import Collection
from pathlib import Path

from config.errors import ConfigError, refuse_ignored_flags
from config.schema import PretrainingConfig, plannable_recompute
from config.schema_model import check_rope_scaling, uneven_splits
from config.size_limits import MOST_DEVICES, validate_sizes

# The longest --collective_timeout, in seconds (30 days): a longer wait is a hang.
LONGEST_TIMEOUT_S = 30 * 24 * 3600


def validate(config: PretrainingConfig, given: Collection[str] = ()) -> None:
    """Checks that the sizes fit together; raises ConfigError naming the flags involved.

    Args:
        config: The whole tree, defaults, preset and flags applied.
        given: The dotted paths of the flags on the command line (``rigl.rigl_every``): a flag
            that would do nothing with the others given is refused rather than ignored.
    """
    _validate_counts(config)
    _validate_rates(config)
    _validate_machine(config)
    _validate_planning(config)
    _validate_data(config)
    _validate_checkpoint(config)
    _validate_model(config, given)
    validate_sizes(config)
    _validate_layout(config)
    _validate_pipeline(config)
    _validate_rigl(config, given)
    _validate_context_parallel(config)


def _validate_counts(config: PretrainingConfig) -> None:
    """Sizes and counts at least 1, amounts at least 0."""
    m, t, o, d = config.model, config.training, config.training.optimizer, config.data
    ex = config.execution
    positive = {
        "layers": m.layers,
        "hidden_size": m.hidden_size,
        "heads": m.heads,
        "sequence_length": m.sequence_length,
        "vocab_size": m.vocab_size,
        "max_positional_length": m.max_positional_length,
        "steps": t.steps,
        "global_batch_size": t.global_batch_size,
        "micro_batch_size": ex.micro_batch_size,
        "data_parallel": ex.data_parallel,
        "tensor_parallel_1": ex.tensor_parallel_1,
        "tensor_parallel_2": ex.tensor_parallel_2,
        "context_parallel": ex.context_parallel,
        "pipeline_parallel": ex.pipeline_parallel,
        "log_every": config.logging.log_every,
    }
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"--{name} must be at least 1, got {value}")
    non_negative = {
        "warmup_tokens": o.warmup_tokens,
        "decay_tokens": o.decay_tokens,
        "weight_decay": o.weight_decay,
        "gradient_clipping": o.gradient_clipping,
        "eval_every": d.eval_every,
        "eval_batches": d.eval_batches,
        "peak_tflops": ex.peak_tflops,
        "passes": ex.passes,
        "device_memory_gb": ex.device_memory_gb,
        "device_memory_cap_gb": ex.device_memory_cap_gb,
        "host_memory_gb": ex.host_memory_gb,
        "plan_for": config.planning.plan_for,
        "plan_workers": config.planning.plan_workers,
        "host_link_gb_per_s": config.planning.host_link_gb_per_s,
        "intra_node_gb_per_s": config.planning.intra_node_gb_per_s,
        "inter_node_gb_per_s": config.planning.inter_node_gb_per_s,
        "storage_gb_per_s": config.planning.storage_gb_per_s,
        "devices_per_node": config.planning.devices_per_node,
        "compute_efficiency": config.planning.compute_efficiency,
        "checkpoint_steps": config.checkpoint.checkpoint_steps,
        "keep_checkpoints": config.checkpoint.keep_checkpoints,
    }
    for name, value in non_negative.items():
        if value < 0 or (isinstance(value, float) and not math.isfinite(value)):
            raise ConfigError(f"--{name} must be a finite number >= 0, got {value}")
    timeout = ex.collective_timeout
    if not 0 < timeout <= LONGEST_TIMEOUT_S:  # nan and infinity too
        raise ConfigError(
            f"--collective_timeout is in seconds, more than 0 and at most {LONGEST_TIMEOUT_S}, "
            f"got {timeout}"
        )


def _validate_rates(config: PretrainingConfig) -> None:
    """Rates, fractions and seeds in their ranges; sizes that fit in int32."""
    m, t, o, d = config.model, config.training, config.training.optimizer, config.data
    for name, value in {"learning_rate": o.learning_rate, "eps": o.eps}.items():
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"--{name} must be a finite number > 0, got {value}")
    if not (t.loss_scaling > 0 and math.isfinite(t.loss_scaling)):
        raise ConfigError(f"--loss_scaling must be a finite number > 0, got {t.loss_scaling}")
    if t.loss_scaling != 1.0 and t.precision != "float16":
        raise ConfigError(
            f"--loss_scaling {t.loss_scaling:g} only applies to --precision float16 "
            f"(got {t.precision}); bfloat16 and float32 need no loss scaling"
        )
    ranges = {
        "dropout_prob": (m.dropout_prob, 0.0, 1.0),
        "beta1": (o.beta1, 0.0, 1.0),
        "beta2": (o.beta2, 0.0, 1.0),
        "validation_fraction": (d.validation_fraction, 0.0, 1.0),
    }
    for name, (value, low, high) in ranges.items():
        if not low <= value < high:
            raise ConfigError(f"--{name} must be in [{low:g}, {high:g}), got {value}")
    if not 0.0 <= o.min_learning_rate_ratio <= 1.0:
        raise ConfigError(
            f"--min_learning_rate_ratio must be in [0, 1], got {o.min_learning_rate_ratio}"
        )
    for name, value in {"layer_norm_eps": m.layer_norm_eps, "init_std": m.init_std}.items():
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"--{name} must be a finite number > 0, got {value}")
    if not 0 <= t.seed < 2**32:
        raise ConfigError(f"--seed must be in [0, 2^32), got {t.seed}")
    int32_sizes = {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "max_positional_length": m.max_positional_length,
        "sequence_length": m.sequence_length,
    }
    for name, value in int32_sizes.items():
        if value >= 2**31:
            raise ConfigError(f"--{name} {value} is too large (the limit is 2^31 - 1)")


def _validate_machine(config: PretrainingConfig) -> None:
    """Device figures within what any machine has."""
    ex = config.execution
    # Sizes and rates no machine has would make the plan search run without end or the time
    # model divide by next to nothing: a typo, said so in one line.
    bounded = {
        "plan_for": (config.planning.plan_for, 1, MOST_DEVICES),
        "peak_tflops": (ex.peak_tflops, 1e-3, 1e6),
        "device_memory_gb": (ex.device_memory_gb, 1e-3, 1e6),
        "device_memory_cap_gb": (ex.device_memory_cap_gb, 1e-3, 1e6),
        "host_memory_gb": (ex.host_memory_gb, 1e-3, 1e8),
        "host_link_gb_per_s": (config.planning.host_link_gb_per_s, 1e-3, 1e5),
        "intra_node_gb_per_s": (config.planning.intra_node_gb_per_s, 1e-3, 1e5),
        "inter_node_gb_per_s": (config.planning.inter_node_gb_per_s, 1e-3, 1e5),
        "storage_gb_per_s": (config.planning.storage_gb_per_s, 1e-3, 1e5),
    }
    for name, (value, least, most) in bounded.items():
        if value and not least <= value <= most:  # 0: not given, the device spec's
            raise ConfigError(
                f"--{name} {_number(value)} is outside what any machine has ({_number(least)} to "
                f"{_number(most)}); "
                "check the number, or leave it out for the device spec's"
            )


def _validate_planning(config: PretrainingConfig) -> None:
    """--dry_run and --plan_for, and the device spec they read."""
    if config.planning.compute_efficiency > 1:
        raise ConfigError(
            f"--compute_efficiency is a fraction of the peak, at most 1, got "
            f"{config.planning.compute_efficiency}"
        )
    spec_file = config.planning.device_spec_file
    if spec_file and not Path(spec_file).is_file():
        raise ConfigError(f"--device_spec_file {spec_file}: no such file")
    if config.planning.dry_run and config.planning.plan_for:
        raise ConfigError("give either --dry_run or --plan_for N, not both")
    if config.planning.dry_run or config.planning.plan_for:
        ck = config.checkpoint
        used = [f"--{n}" for n in ("load", "save", "hf_model", "eval_only") if getattr(ck, n)]
        if used:
            mode = "--dry_run" if config.planning.dry_run else "--plan_for"
            reason = f"{mode} plans without training"
            raise ConfigError(f"{reason}, so {' and '.join(used)} would do nothing; leave them out")


def _validate_data(config: PretrainingConfig) -> None:
    """Evaluation data: one source, and a schedule that reads it."""
    d = config.data
    if d.data_blend and d.input_files:
        raise ConfigError("give either --input_files or --data_blend, not both")
    if d.validation_files and d.validation_fraction:
        raise ConfigError("give either --validation_files or --validation_fraction, not both")
    if d.validation_files and not d.eval_every and not config.EVALUATES_AT_END:
        raise ConfigError("--validation_files is only used with --eval_every N (N > 0)")


def _validate_checkpoint(config: PretrainingConfig) -> None:
    """What --load, --hf_model, --save and --eval_only need of each other."""
    c = config.checkpoint
    if c.load and c.hf_model:
        raise ConfigError("give either --load (a checkpoint) or --hf_model (HuggingFace weights)")
    if c.checkpoint_steps and not c.save:
        raise ConfigError("--checkpoint_steps needs --save DIR, the folder to write them to")
    if c.keep_checkpoints and not c.save:
        raise ConfigError("--keep_checkpoints needs --save DIR, the folder to prune")
    if c.eval_only and not (c.load or c.hf_model):
        raise ConfigError("--eval_only evaluates saved weights: give --load CKPT or --hf_model DIR")
    if c.eval_only and c.save:
        raise ConfigError("--eval_only trains nothing, so there is nothing to --save")


def _validate_model(config: PretrainingConfig, given: Collection[str]) -> None:
    """Heads of one width, and positions for every token."""
    m = config.model
    if m.hidden_size % m.heads and not m.head_dim:
        raise ConfigError(
            f"--hidden_size {m.hidden_size} is not divisible by --heads {m.heads}; "
            "pick sizes so that every head has the same width, or give it as --head_dim"
        )
    if m.kv_heads < 0 or m.intermediate_size < 0 or m.head_dim < 0:
        raise ConfigError(
            f"--kv_heads {m.kv_heads}, --intermediate_size {m.intermediate_size} and --head_dim "
            f"{m.head_dim} must be at least 0 (0: as many as --heads, 4 x --hidden_size, "
            "--hidden_size / --heads)"
        )
    if m.kv_heads and m.heads % m.kv_heads:
        raise ConfigError(
            f"--heads {m.heads} is not divisible by --kv_heads {m.kv_heads}; each key/value "
            "head serves an equal group of query heads"
        )
    head_dim = m.head_dim or m.hidden_size // m.heads
    if m.position_embedding == "rotary" and head_dim % 2:
        width = f"--hidden_size {m.hidden_size} / --heads {m.heads} = {head_dim}"
        width = f"--head_dim {m.head_dim}" if m.head_dim else width
        raise ConfigError(f"--position_embedding rotary needs an even head width, got {width}")
    if not (m.rope_theta > 1 and math.isfinite(m.rope_theta)):
        raise ConfigError(f"--rope_theta must be a finite number > 1, got {m.rope_theta}")
    check_rope_scaling(m, given)
    if m.sequence_length > m.max_positional_length:
        raise ConfigError(
            f"--sequence_length {m.sequence_length} exceeds --max_positional_length "
            f"{m.max_positional_length}; the position embedding has no rows for later tokens"
        )


def _validate_layout(config: PretrainingConfig) -> None:
    """Batches that split over the replicas and passes, shapes over the tensor axes."""
    m, t, ex = config.model, config.training, config.execution
    per_step = ex.micro_batch_size * ex.data_parallel
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"--global_batch_size {t.global_batch_size} is not divisible by --micro_batch_size "
            f"{ex.micro_batch_size} x --data_parallel {ex.data_parallel} = {per_step}"
        )
    if ex.passes > config.gradient_accumulation:
        raise ConfigError(
            f"--passes {ex.passes} exceeds the {config.gradient_accumulation} micro-batches each "
            f"replica runs per step (--global_batch_size {t.global_batch_size} / "
            f"(--micro_batch_size {ex.micro_batch_size} x --data_parallel {ex.data_parallel})); "
            "each pass needs at least one micro-batch"
        )
    uneven = _uneven_splits(config)
    if "heads" in uneven:
        raise ConfigError(
            f"--heads {m.heads} is not divisible by --tensor_parallel_1 {ex.tensor_parallel_1}; "
            "each tensor_parallel_1 shard holds whole heads"
        )
    if "hidden" in uneven:
        raise ConfigError(
            f"--hidden_size {m.hidden_size} is not divisible by --tensor_parallel_2 "
            f"{ex.tensor_parallel_2}"
        )
    if "kv_heads" in uneven:
        raise ConfigError(
            f"--kv_heads {m.kv_heads} is not divisible by --tensor_parallel_1 "
            f"{ex.tensor_parallel_1}; each tensor_parallel_1 shard holds whole key/value heads"
        )
    if "intermediate" in uneven:
        ffn = m.intermediate_size or 4 * m.hidden_size
        raise ConfigError(
            f"--intermediate_size {ffn} is not divisible by --tensor_parallel_1 "
            f"{ex.tensor_parallel_1}; each tensor_parallel_1 shard holds an equal slice of it"
        )


def _validate_context_parallel(config: PretrainingConfig) -> None:
    """A sequence and its heads split evenly over the context axis."""
    m, ex = config.model, config.execution
    cp, uneven = ex.context_parallel, _uneven_splits(config)
    if "sequence" in uneven:
        raise ConfigError(
            f"--sequence_length {m.sequence_length} is not divisible by --context_parallel "
            f"{cp}; every rank of a sequence holds an equal piece of it"
        )
    if "context_heads" in uneven:
        raise ConfigError(
            f"--heads {m.heads} / --tensor_parallel_1 {ex.tensor_parallel_1} = "
            f"{m.heads // ex.tensor_parallel_1} heads per tensor_parallel_1 rank is not "
            f"divisible by --context_parallel {cp}; attention gives each context rank an equal "
            "share of them"
        )
    if ex.recompute != "auto" and ex.recompute not in plannable_recompute(cp):
        raise ConfigError(
            f"--recompute {ex.recompute} with --context_parallel {cp} is not supported yet; use "
            "--recompute full (or auto, which picks it for context-parallel layouts)"
        )


def _uneven_splits(config: PretrainingConfig) -> list[str]:
    m, ex = config.model, config.execution
    return uneven_splits(
        m.heads,
        m.hidden_size,
        m.sequence_length,
        ex.tensor_parallel_1,
        ex.tensor_parallel_2,
        ex.context_parallel,
        m.kv_heads,
        m.intermediate_size,
    )


def kv_heads_note(config: PretrainingConfig) -> str | None:
    """The one line a run prints where context parallelism cannot split the KV heads of
    grouped-query attention (they are repeated for their query heads instead), else None."""
    m, ex = config.model, config.execution
    local = (m.kv_heads or m.heads) // ex.tensor_parallel_1
    if local % ex.context_parallel == 0:
        return None
    return (
        f"note: {local} KV head(s) per tensor_parallel_1 rank (--kv_heads {m.kv_heads}) do not "
        f"split over --context_parallel {ex.context_parallel}; each is repeated for its query "
        "heads before attention's all-to-all, which sends as much as without grouped-query "
        "attention"
    )


def _validate_pipeline(config: PretrainingConfig) -> None:
    """One line for a pipeline that cannot split the decoder layers."""
    m, ex = config.model, config.execution
    stages = ex.pipeline_parallel
    if stages > m.layers:
        raise ConfigError(
            f"--pipeline_parallel {stages} exceeds the {m.layers} decoder layers (--layers); "
            "every stage needs at least one layer"
        )
    if not ex.pipeline_layers.strip():
        return
    try:
        sizes = [int(n) for n in ex.pipeline_layers.split(",")]
    except ValueError:
        raise ConfigError(
            f"--pipeline_layers {ex.pipeline_layers!r} must be comma-separated layer counts, "
            "one per stage (e.g. 10,12,12,10)"
        ) from None
    if len(sizes) != stages:
        raise ConfigError(
            f"--pipeline_layers {ex.pipeline_layers} gives {len(sizes)} stage(s), but "
            f"--pipeline_parallel is {stages}; give one layer count per stage"
        )
    if min(sizes) < 1:
        raise ConfigError(
            f"--pipeline_layers {ex.pipeline_layers} has a stage without layers; every stage "
            "needs at least one"
        )
    if sum(sizes) != m.layers:
        raise ConfigError(
            f"--pipeline_layers {ex.pipeline_layers} sums to {sum(sizes)} layers, but --layers "
            f"is {m.layers}; the stages must hold every decoder layer once"
        )


def _validate_rigl(config: PretrainingConfig, given: Collection[str]) -> None:
    """One line for a sparsity or RigL schedule that cannot train, or that a dense run would
    ignore."""
    r = config.rigl
    if not (0.0 <= r.sparsity < 1.0):
        raise ConfigError(
            f"--sparsity must be in [0, 1) (0 trains densely), got {r.sparsity}; "
            "e.g. 0.9 keeps 10% of the decoder layers' matrix weights"
        )
    if not (0.0 < r.rigl_drop_fraction <= 1.0):
        raise ConfigError(
            f"--rigl_drop_fraction must be in (0, 1], got {r.rigl_drop_fraction}; "
            "RigL's default is 0.3"
        )
    if r.rigl_every < 1:
        raise ConfigError(f"--rigl_every must be at least 1 step, got {r.rigl_every}")
    if not (0.0 < r.rigl_end_fraction <= 1.0):
        raise ConfigError(
            f"--rigl_end_fraction must be in (0, 1], got {r.rigl_end_fraction}; "
            "the default 0.75 stops changing the connectivity after 3/4 of the steps"
        )
    if not r.enabled:
        unused = [f"--{name}" for name in SPARSE_ONLY_FLAGS if f"rigl.{name}" in given]
        dense = "sparse training, and --sparsity is 0 (dense)"
        refuse_ignored_flags(unused, dense, "add --sparsity S (e.g. 0.9) or leave {them} out")
        return
    _validate_kept_weights(config)


# The RigL flags that a dense run (--sparsity 0) has no use for.
SPARSE_ONLY_FLAGS = (
    "sparsity_distribution",
    "rigl_every",
    "rigl_drop_fraction",
    "rigl_end_fraction",
)


def _validate_kept_weights(config: PretrainingConfig) -> None:
    """Every sparse matrix keeps at least one weight: a matrix rounded to none would train as
    a constant zero, and RigL could never grow it back (it replaces as many as it keeps)."""
    from modelling.gpt import GPTShapes  # torch: only for a sparse run
    from modelling.sparsity import active_counts, highest_sparsity_keeping_every_matrix

    r = config.rigl
    shapes = GPTShapes.from_config(config.model)
    counts = active_counts(shapes, r.sparsity, r.sparsity_distribution)
    empty = [name for name, count in counts.items() if count < 1]
    if empty:
        which = "every sparse matrix" if len(empty) == len(counts) else ", ".join(empty)
        highest = highest_sparsity_keeping_every_matrix(shapes, r.sparsity_distribution)
        raise ConfigError(
            f"--sparsity {r.sparsity} leaves {which} without a single weight "
            f"({r.sparsity_distribution} densities at --hidden_size {config.model.hidden_size}); "
            f"the highest that keeps one in every matrix is {_floored(highest)}: lower --sparsity"
        )


def _floored(fraction: float) -> str:
    """``fraction`` (< 1) rounded down, with two digits past its first one below 1."""
    digits = max(2, math.ceil(-math.log10(1.0 - fraction)) + 2)
    return f"{math.floor(fraction * 10**digits) / 10**digits:.{digits}f}"


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
