"""The section of the configuration tree about dynamic sparsity: RigL ("Rigging the Lottery",
Evci et al. 2020) on the decoder layers' matrices. Part of the tree of :mod:`config.schema`."""

from __future__ import annotations

from dataclasses import dataclass, field

from config.field_help import doc as _doc

SPARSITY_DISTRIBUTIONS = ("erk", "uniform")


@dataclass
class RigLConfig:
    """Sparse training of the decoder layers' qkv, out, fc and proj (or SwiGLU's gate_up and
    down) weights (embeddings, biases and norms stay dense)."""

    sparsity: float = field(
        default=0.0,
        metadata=_doc(
            "Fraction of the decoder layers' matrix weights that are zero, in [0, 1); 0 trains "
            "densely. The connectivity changes every --rigl_every steps (RigL)."
        ),
    )
    sparsity_distribution: str = field(
        default="erk",
        metadata=_doc(
            "How the density is spread over the matrices: erk (Erdos-Renyi-Kernel: density "
            "proportional to (rows + columns) / (rows x columns), so narrow matrices keep "
            "more) or uniform (every matrix 1 - sparsity). Either way the density over all "
            "sparse weights is 1 - sparsity.",
            choices=SPARSITY_DISTRIBUTIONS,
        ),
    )
    rigl_every: int = field(
        default=100,
        metadata=_doc("Steps between connectivity updates (RigL's delta T), at least 1."),
    )
    rigl_drop_fraction: float = field(
        default=0.3,
        metadata=_doc(
            "Fraction of each matrix's active weights dropped (smallest |w|) and regrown "
            "(largest |dense gradient|) at the first update, in (0, 1]; it decays to 0 along a "
            "cosine by --rigl_end_fraction of the run."
        ),
    )
    rigl_end_fraction: float = field(
        default=0.75,
        metadata=_doc(
            "Fraction of --steps after which the connectivity stops changing, in (0, 1]."
        ),
    )

    @property
    def enabled(self) -> bool:
        return self.sparsity > 0.0
