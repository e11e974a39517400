"""GPT-3 building blocks, written once for a single device and for every 2D tensor-parallel shard.

Shapes are per shard (docs/design.md, "Sharding rules"): the residual stream is ``[B, S, h/tp2]`` (sharded over
tp2, identical over tp1); attention and the FFN hidden layer are sharded over tp1. Local sizes
come from the weights, and every collective is a call into :mod:`modelling.parallel`, so with
size-1 axes this is a plain GPT-2/GPT-3 block. Attention also takes the Llama family's
grouped KV heads and rotary positions (:mod:`modelling.variants`); the language model's heads
are :mod:`modelling.lm_heads`'s.

Dropout draws from explicit seeds rather than the global generator (:mod:`modelling.dropout`):
the phased engine recomputes each layer in backward and must reproduce the forward's masks
exactly.

Context parallelism (axis ``cp``): outside attention a rank holds piece ``cp.rank`` of
``cp.size`` equal pieces of every sequence (dim 1). Attention swaps the sequence split for a
head split with an all-to-all and back (DeepSpeed-Ulysses, :func:`sequence_to_heads`).

A residual or embedding dropout mask is the single process's in every layout: it is drawn for
the whole ``[B, S, h]`` tensor and each rank keeps its piece of the sequence (cp) and block of
the hidden size (tp2). Attention-probability dropout is drawn by the fused kernel, seeded by the
global index of the shard's first head: the same on every tp2 replica and in every recompute,
but another layout's shards draw other masks. ``dropout_parity`` draws each head's mask from its
own global index instead (written out, with a ``[B, heads, S, S]`` tensor), so that a tp1 shard
or a cp head group draws exactly the single process's masks: for the layout-parity tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from modelling.attention_kernel import HeadByHeadDropout, SDPAKernel, TorchSDPA
from modelling.dropout import BlockSeeds, dropout
from modelling.grad_sinks import NO_SINKS, GradSink, embedding, linear
from modelling.parallel import (
    LOCAL,
    Axis,
    all_reduce_sum,
    copy_to,
    heads_to_sequence,
    reduce_from,
    sequence_to_heads,
)
from modelling.tiles import NORMAL, ONES, ZEROS, ParamInit


class LayerNorm(nn.Module):
    """Layer norm over a hidden dimension sharded across ``tp2``.

    Mean and variance are fp32 sums all-reduced over tp2 (two passes, so the variance does not
    suffer the cancellation of E[x^2] - E[x]^2). With tp2 of size 1 this is ``F.layer_norm``.
    """

    def __init__(self, local_hidden: int, tp2: Axis, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_hidden))
        self.bias = nn.Parameter(torch.zeros(local_hidden))
        self.tp2 = tp2
        self.eps = eps

    @staticmethod
    def inits(hidden: int) -> dict[str, ParamInit]:
        """Its unsharded gain (ones) and bias (zeros)."""
        return {"weight": ParamInit((hidden,), ONES), "bias": ParamInit((hidden,), ZEROS)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp2.size == 1:
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        full_hidden = x.shape[-1] * self.tp2.size
        xf = x.float()
        mean = all_reduce_sum(xf.sum(-1, keepdim=True), self.tp2) / full_hidden
        centered = xf - mean
        var = all_reduce_sum(centered.square().sum(-1, keepdim=True), self.tp2) / full_hidden
        normed = (centered * torch.rsqrt(var + self.eps)).to(x.dtype)
        return normed * self.weight + self.bias


class ParallelLinear(nn.Module):
    """``y = g(x W^T) + b``: a matmul whose partial sums are summed over ``reduce_axis``.

    The input features are sharded over ``reduce_axis``; the bias is added after the reduction,
    so it is added once, not once per shard. Unsharded it goes into the matmul (one op, and no
    add in the backward: a layer's four linears at a small width are host-bound).
    """

    def __init__(self, local_in: int, local_out: int, reduce_axis: Axis, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(local_out, local_in))
        self.bias = nn.Parameter(torch.zeros(local_out)) if bias else None
        self.reduce_axis = reduce_axis

    def forward(self, x: torch.Tensor, grad_sink: GradSink | None = None) -> torch.Tensor:
        """``grad_sink``: where the weight's gradient is summed (:mod:`modelling.grad_sinks`)."""
        if self.reduce_axis.size == 1 and grad_sink is None:
            return F.linear(x, self.weight, self.bias)
        y = reduce_from(linear(x, self.weight, grad_sink), self.reduce_axis)
        return y if self.bias is None else y + self.bias


class Attention(nn.Module):
    """Causal self-attention for the heads of this tp1 shard, replicated over tp2.

    With a context axis, q, k and v of this rank's sequence piece are exchanged for those of
    the whole sequence and 1/cp of the heads (which the cp size must divide), attention runs
    on them whole, and its output is exchanged back (:func:`sequence_to_heads`).

    Grouped-query attention (``local_kv_heads`` < ``local_heads``): ``qkv`` gives this shard's
    q heads, then its k heads, then its v heads, each KV head serving ``local_heads /
    local_kv_heads`` consecutive q heads. The cp exchange splits the KV heads too where cp
    divides them; where it does not, each KV head is repeated for its q heads before the
    exchange. ``rotary`` rotates q and k once the sequence is whole (positions are global).
    ``kernel`` runs the core (:mod:`modelling.attention_kernel`; torch's choice without one),
    given here and never changed after.
    """

    def __init__(
        self,
        local_hidden: int,
        local_heads: int,
        head_dim: int,
        dropout_prob: float,
        tp1: Axis,
        tp2: Axis,
        cp: Axis = LOCAL,
        dropout_parity: bool = False,
        local_kv_heads: int | None = None,
        rotary: nn.Module | None = None,
        bias: bool = True,
        kernel: SDPAKernel | None = None,
    ):
        super().__init__()
        kv_heads = local_kv_heads or local_heads
        width = local_heads * head_dim
        # Rows hold [q | k | v] of the same local heads so a shard never splits a head.
        self.qkv = ParallelLinear(local_hidden, width + 2 * kv_heads * head_dim, tp2, bias)
        self.out = ParallelLinear(width, local_hidden, reduce_axis=tp1, bias=bias)
        self.local_heads, self.head_dim = local_heads, head_dim
        self.dropout_prob = dropout_prob
        self.tp1, self.tp2, self.cp = tp1, tp2, cp
        # Rotary positions (modelling.variants.Rotary), or none where the embedding adds them.
        self.position = rotary if rotary is not None else _unrotated
        self.split_heads = self._split_heads
        # Each KV head repeated for its query heads inside the core (selective recompute keeps
        # k and v as they come, one per KV head), or not at all without grouped-query attention.
        self.repeat_kv: Callable[[torch.Tensor], torch.Tensor] = _unrepeated
        if kv_heads != local_heads:
            group = local_heads // kv_heads
            before = 1 if kv_heads % cp.size == 0 else group  # repeated before the exchange
            self.split_heads = functools.partial(self._split_grouped_heads, kv_heads, before)
            self.repeat_kv = functools.partial(
                torch.repeat_interleave, repeats=group // before, dim=1
            )
        # What runs softmax(q k^T) v, chosen by whoever builds the model (modelling/
        # attention_kernel.py): the engine's fused kernel, pinned, or torch's own choice.
        kernel = kernel if kernel is not None else TorchSDPA()
        self.kernel: SDPAKernel = HeadByHeadDropout(kernel) if dropout_parity else kernel

    @classmethod
    def of(
        cls, s, tp1: Axis, tp2: Axis, cp: Axis, rotary: nn.Module | None, kernel: SDPAKernel | None
    ) -> Attention:
        """This shard's, for the model's shapes ``s`` (:class:`modelling.gpt.GPTShapes`)."""
        return cls(
            s.hidden // s.tp2,
            s.heads // s.tp1,
            s.head_dim,
            s.dropout_prob,
            tp1,
            tp2,
            cp,
            dropout_parity=s.dropout_parity,
            local_kv_heads=s.key_value_heads // s.tp1,
            rotary=rotary,
            bias=s.linear_bias,
            kernel=kernel,
        )

    @staticmethod
    def inits(s, std: float, residual_std: float) -> dict[str, ParamInit]:
        """Its unsharded parameters: the output projection (to the residual stream) drawn
        with ``residual_std``, q, k and v with ``std``, biases zero."""
        h, width = s.hidden, s.attention_width  # of q and of attention's output
        rows = width + 2 * s.key_value_heads * s.head_dim
        return {
            "qkv.weight": ParamInit((rows, h), NORMAL, std),
            "qkv.bias": ParamInit((rows,), ZEROS),
            "out.weight": ParamInit((h, width), NORMAL, residual_std),
            "out.bias": ParamInit((h,), ZEROS),
        }

    def forward(self, x: torch.Tensor, seeds: BlockSeeds | None) -> torch.Tensor:
        B, S, _ = x.shape
        qkv = self.qkv(copy_to(x, self.tp1))  # (B, S, (heads + 2 kv_heads) * head_dim)
        q, k, v = self.split_heads(qkv)  # (B, heads / cp or kv_heads / cp, S * cp, head_dim)
        q, k = self.position(q, k)
        y = self.core(q, k, v, seeds)  # (B, local_heads / cp, S * cp, head_dim)
        y = heads_to_sequence(y.transpose(1, 2), self.cp)  # (B, S, local_heads, head_dim)
        y = y.reshape(B, S, -1)  # (B, S, local_heads * head_dim)
        return self.out(copy_to(y, self.tp2))

    def _split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k and v of every head, whole sequences of this rank's cp head group."""
        B, S, _ = qkv.shape
        qkv = qkv.view(B, S, 3, -1, self.head_dim)
        qkv = sequence_to_heads(qkv, self.cp)  # (B, S * cp, 3, local_heads / cp, head_dim)
        return qkv.permute(2, 0, 3, 1, 4).unbind(0)

    def _split_grouped_heads(
        self, kv_heads: int, before: int, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """As :meth:`_split_heads` with fewer KV heads than q heads: k and v of this rank's cp
        group of KV heads, each repeated ``before`` times first (where cp does not divide the
        KV heads, so that each cp rank's q heads get theirs)."""
        B, S, _ = qkv.shape
        q, kv = qkv.split([self.local_heads * self.head_dim, 2 * kv_heads * self.head_dim], -1)
        q = sequence_to_heads(q.view(B, S, self.local_heads, self.head_dim), self.cp)
        kv = kv.view(B, S, 2, kv_heads, self.head_dim).repeat_interleave(before, dim=3)
        kv = sequence_to_heads(kv, self.cp)  # (B, S * cp, 2, kv_heads * before / cp, head_dim)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
        return q.transpose(1, 2), k, v

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seeds: BlockSeeds | None
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v, causal, with dropout on the probabilities: the part
        whose activations grow with the square of the sequence (what selective recompute
        recomputes).

        With dropout, the fused kernel draws one mask for the heads it is given, seeded by the
        layer's attention seed and the global index of this shard's first head: the same draw
        wherever this shard's heads are recomputed, but another layout's shards draw other
        masks. ``dropout_parity`` draws each head's own mask instead (written out, slower), so
        every layout draws the single process's masks. With grouped-query attention k and v
        come with their KV heads and are repeated here, one for each query head.
        """
        k, v = self.repeat_kv(k), self.repeat_kv(v)
        p, seed = (self.dropout_prob, seeds.attention) if seeds is not None else (0.0, None)
        # This tp1 shard's first head, then this cp group's: the global index of head 0.
        first = self.tp1.rank * self.local_heads + self.cp.rank * q.shape[1]
        return self.kernel(q, k, v, p, seed, first)


def _unrepeated(kv: torch.Tensor) -> torch.Tensor:
    return kv


def _unrotated(
    q: torch.Tensor, k: torch.Tensor, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    return q, k


class FeedForward(nn.Module):
    """h -> ffn -> h with tanh-GELU (ffn = 4h for GPT-3); the ffn hidden layer is sharded
    over tp1."""

    # Rows of the first matrix per intermediate feature (a gated MLP has two: gate and up).
    ROWS_PER_FEATURE = 1

    def __init__(self, local_hidden: int, local_ffn: int, tp1: Axis, tp2: Axis, bias: bool = True):
        super().__init__()
        self.fc = ParallelLinear(local_hidden, local_ffn, reduce_axis=tp2, bias=bias)
        self.proj = ParallelLinear(local_ffn, local_hidden, reduce_axis=tp1, bias=bias)
        self.tp1, self.tp2 = tp1, tp2

    @staticmethod
    def inits(hidden: int, ffn: int, std: float, residual_std: float) -> dict[str, ParamInit]:
        """Its unsharded parameters: the projection back to the residual stream (``proj``)
        drawn with ``residual_std``, the other matrix with ``std``, biases zero."""
        return {
            "fc.weight": ParamInit((ffn, hidden), NORMAL, std),
            "fc.bias": ParamInit((ffn,), ZEROS),
            "proj.weight": ParamInit((hidden, ffn), NORMAL, residual_std),
            "proj.bias": ParamInit((hidden,), ZEROS),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc(copy_to(x, self.tp1))  # (B, S, 4h / tp1)
        hidden = F.gelu(copy_to(hidden, self.tp2), approximate="tanh")
        return self.proj(hidden)


class DecoderBlock(nn.Module):
    """Pre-norm decoder block: x + drop(attn(ln_1(x))), then x + drop(mlp(ln_2(x))).

    Its parts are built by whoever builds the model (:class:`modelling.gpt.GPT`): GPT-3's
    layer norms and GELU MLP or the Llama family's (:mod:`modelling.variants`); ``norm``
    makes each of the two norms.
    """

    def __init__(
        self,
        attn: Attention,
        mlp: nn.Module,
        norm: Callable[[], nn.Module],
        dropout_prob: float,
        tp2: Axis,
        cp: Axis = LOCAL,
    ):
        super().__init__()
        self.ln_1 = norm()
        self.attn = attn
        self.ln_2 = norm()
        self.mlp = mlp
        self.dropout_prob = dropout_prob
        self.cp, self.tp2 = cp, tp2

    def forward(self, x: torch.Tensor, seeds: BlockSeeds | None = None) -> torch.Tensor:
        p, axes = self.dropout_prob, (self.cp, self.tp2)
        attn_seed, mlp_seed = (
            (seeds.attention_residual, seeds.mlp_residual) if seeds else (None,) * 2
        )
        x = x + dropout(self.attn(self.ln_1(x), seeds), p, attn_seed, *axes)
        return x + dropout(self.mlp(self.ln_2(x)), p, mlp_seed, *axes)


class WordEmbedding(nn.Module):
    """Word embedding alone (the Llama family's: positions are rotary, in attention); rows
    over tp1, columns over tp2, looked up and summed over tp1 as :class:`Embedding` does."""

    def __init__(
        self,
        local_vocab: int,
        local_hidden: int,
        dropout_prob: float,
        tp1: Axis,
        tp2: Axis = LOCAL,
        cp: Axis = LOCAL,
    ):
        super().__init__()
        self.word = nn.Embedding(local_vocab, local_hidden)
        self.dropout_prob = dropout_prob
        self.tp1, self.tp2, self.cp = tp1, tp2, cp

    @classmethod
    def of(cls, s, tp1: Axis, tp2: Axis, cp: Axis) -> WordEmbedding:
        """This shard's, for the model's shapes ``s`` (:class:`modelling.gpt.GPTShapes`)."""
        return cls(s.vocab_padded // s.tp1, s.hidden // s.tp2, s.dropout_prob, tp1, tp2, cp)

    @staticmethod
    def inits(s, std: float) -> dict[str, ParamInit]:
        """Its unsharded table, unpadded."""
        return {"word.weight": ParamInit((s.vocab, s.hidden), NORMAL, std)}

    def whole(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """The embedding of a whole model's ``ids`` (B, S) at positions from ``start``,
        without dropout (generation's)."""
        return F.embedding(ids, self.word.weight)

    def forward(
        self,
        ids: torch.Tensor,
        seed: int | None = None,
        grad_sinks: Mapping[str, GradSink] = NO_SINKS,
    ) -> torch.Tensor:
        """``grad_sinks``: where the table's gradient is summed, by parameter name
        (:mod:`modelling.grad_sinks`; given by whoever differentiates it)."""
        x = reduce_from(self._rows(ids, grad_sinks), self.tp1)
        return dropout(x, self.dropout_prob, seed, self.cp, self.tp2)

    def _rows(self, ids: torch.Tensor, grad_sinks: Mapping[str, GradSink]) -> torch.Tensor:
        """This tp1 shard's part of the embedding of ``ids`` (its word rows), the table's
        gradient into its sink; summed over tp1 by :meth:`forward`."""
        return lookup_rows(self.word.weight, ids, self.tp1, grad_sinks.get("word.weight"))


class Embedding(WordEmbedding):
    """Word + position embedding; rows (vocab, positions) over tp1, columns over tp2.

    Each rank looks up the ids that fall in its row range (others give zeros) and the partial
    embeddings are summed over tp1. ``ids`` is piece ``cp.rank`` of the sequence, so its
    positions start at ``cp.rank`` times its length.
    """

    def __init__(
        self,
        local_vocab: int,
        local_positions: int,
        local_hidden: int,
        dropout_prob: float,
        tp1: Axis,
        tp2: Axis = LOCAL,
        cp: Axis = LOCAL,
    ):
        super().__init__(local_vocab, local_hidden, dropout_prob, tp1, tp2, cp)
        self.position = nn.Embedding(local_positions, local_hidden)

    @classmethod
    def of(cls, s, tp1: Axis, tp2: Axis, cp: Axis) -> Embedding:
        local_positions = s.positions_padded // s.tp1
        local_hidden = s.hidden // s.tp2
        return cls(
            s.vocab_padded // s.tp1, local_positions, local_hidden, s.dropout_prob, tp1, tp2, cp
        )

    @staticmethod
    def inits(s, std: float) -> dict[str, ParamInit]:
        position = ParamInit((s.positions, s.hidden), NORMAL, std)
        return {**WordEmbedding.inits(s, std), "position.weight": position}

    def whole(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        return super().whole(ids, start) + F.embedding(positions, self.position.weight)

    def _rows(self, ids: torch.Tensor, grad_sinks: Mapping[str, GradSink]) -> torch.Tensor:
        """Its word rows and its position rows (positions from ``cp.rank`` times the piece's
        length)."""
        start = self.cp.rank * ids.shape[-1]
        positions = torch.arange(start, start + ids.shape[-1], device=ids.device).expand_as(ids)
        return super()._rows(ids, grad_sinks) + lookup_rows(
            self.position.weight, positions, self.tp1
        )


def lookup_rows(
    table: torch.Tensor, ids: torch.Tensor, tp1: Axis, grad_sink: GradSink | None = None
) -> torch.Tensor:
    """Embedding lookup of the rows this tp1 shard owns; ids owned elsewhere give zeros.
    ``grad_sink``: where the table's gradient is summed (:mod:`modelling.grad_sinks`)."""
    if tp1.size == 1:
        return embedding(ids, table, grad_sink)
    local = ids - tp1.rank * table.shape[0]
    owned = (local >= 0) & (local < table.shape[0])
    rows = embedding(local.clamp(0, table.shape[0] - 1), table, grad_sink)
    return rows * owned.unsqueeze(-1).to(rows.dtype)
