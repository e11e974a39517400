"""The sections of the configuration tree about what surrounds a run's steps: planning for
other machines (``--dry_run``, ``--plan_for``), logging, and checkpoints. Part of the tree of
:mod:`config.schema`, which holds the root."""

from __future__ import annotations

from dataclasses import dataclass, field

from config.field_help import doc as _doc

DEVICE_SPECS = ("h100_sxm", "h200", "a100_80gb")


@dataclass
class PlanningConfig:
    """Plan and check a run without launching it (one CPU process, no data, no weights)."""

    dry_run: bool = field(
        default=False,
        metadata=_doc(
            "Run set-up and one training step of every kind of rank on a fake process group "
            "and meta tensors; print each rank's memory, traffic, FLOPs and estimated step "
            "time for --device_spec, write plan.json to --output_dir, and exit."
        ),
    )
    plan_for: int = field(
        default=0,
        metadata=_doc(
            "List the layouts (parallelism, micro-batch, passes, placements) of this many "
            "devices of --device_spec that fit the preset's model and global batch, fastest "
            "first, and exit. 0: off."
        ),
    )
    plan_across_nodes: bool = field(
        default=False,
        metadata=_doc(
            "--plan_for also weighs layouts whose tensor or context groups span nodes (their "
            "per-layer collectives then cross the network; the search takes several times as "
            "long)."
        ),
    )
    plan_workers: int = field(
        default=0,
        metadata=_doc(
            "Processes --plan_for measures layouts in, side by side. 0: one per CPU core this "
            "process may use."
        ),
    )
    device_spec: str = field(
        default="h100_sxm",
        metadata=_doc(
            "Device the dry run and --plan_for estimate for; --peak_tflops, --device_memory_gb, "
            "--host_memory_gb and the bandwidth flags override its numbers.",
            choices=DEVICE_SPECS,
        ),
    )
    device_spec_file: str = field(
        default="",
        metadata=_doc(
            "JSON file of measured device numbers (written by python -m benchmarks.calibrate) that "
            "replace --device_spec's data-sheet numbers; fields it lacks keep those. Empty: none."
        ),
    )
    host_link_gb_per_s: float = field(
        default=0.0, metadata=_doc("Host<->device bandwidth per device in GB/s; 0: the spec's.")
    )
    intra_node_gb_per_s: float = field(
        default=0.0,
        metadata=_doc("Collective bandwidth within a node per device in GB/s; 0: the spec's."),
    )
    inter_node_gb_per_s: float = field(
        default=0.0,
        metadata=_doc("Collective bandwidth between nodes per device in GB/s; 0: the spec's."),
    )
    storage_gb_per_s: float = field(
        default=0.0,
        metadata=_doc(
            "Checkpoint write bandwidth each rank gets from storage in GB/s, for the dry run's "
            "save-time estimate; 0: the spec's."
        ),
    )
    devices_per_node: int = field(
        default=0, metadata=_doc("Devices per node (where groups leave the node); 0: the spec's.")
    )
    compute_efficiency: float = field(
        default=0.0,
        metadata=_doc(
            "Fraction of the dense peak the model's matmuls reach, for step-time estimates; 0: "
            "the spec's."
        ),
    )


@dataclass
class LoggingConfig:
    """Where metrics go."""

    output_dir: str = field(
        default="", metadata=_doc("Folder for metrics.jsonl and config.yml; default runs/<time>.")
    )
    log_every: int = field(default=1, metadata=_doc("Console line every N steps."))
    wandb: bool = field(default=False, metadata=_doc("Log metrics to Weights & Biases."))
    wandb_project: str = field(default="gpt3-phased", metadata=_doc("W&B project name."))
    wandb_mode: str = field(
        default="online",
        metadata=_doc("W&B mode: online or offline.", choices=("online", "offline")),
    )


@dataclass
class CheckpointConfig:
    """Saving, resuming and importing model state."""

    load: str = field(
        default="",
        metadata=_doc(
            "Resume from a checkpoint: a --save folder (its latest checkpoint) or one step_N "
            "folder in it. Any layout, placement and precision can load it."
        ),
    )
    save: str = field(
        default="",
        metadata=_doc(
            "Folder for checkpoints (step_N subfolders, written atomically and in the "
            "background); a checkpoint is always written at the end of the run."
        ),
    )
    checkpoint_steps: int = field(
        default=0, metadata=_doc("Also save every N steps (with --save); 0: only at the end.")
    )
    keep_checkpoints: int = field(
        default=0, metadata=_doc("Keep only the last K checkpoints in --save; 0 keeps all.")
    )
    hf_model: str = field(
        default="",
        metadata=_doc(
            "Start from the weights of a local HuggingFace GPT-2 folder (config.json and "
            "model.safetensors or pytorch_model.bin); its shape must match the model flags."
        ),
    )
    eval_only: bool = field(
        default=False,
        metadata=_doc(
            "Only evaluate the --load (or --hf_model) weights on the validation data: print "
            "validation loss and perplexity, train nothing."
        ),
    )
