"""GPT-3 building blocks, written once for a single device and for every 2D tensor-parallel shard.

Shapes are per shard (DESIGN.md section 4): the residual stream is ``[B, S, h/tp2]`` (sharded over
tp2, identical over tp1); attention and the FFN hidden layer are sharded over tp1. Local sizes
come from the weights, and every collective is a call into :mod:`modelling.parallel`, so with
size-1 axes this is a plain GPT-2/GPT-3 block.

Dropout draws from explicit seeds rather than the global generator: the phased engine recomputes
each layer in backward and must reproduce the forward's masks exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from modelling.parallel import Axis, all_reduce_sum, copy_to, reduce_from


class BlockSeeds(NamedTuple):
    """Dropout seeds of one decoder layer on one micro-batch.

    ``attention`` masks attention probabilities, which are sharded over tp1 and replicated over
    tp2, so it must be equal across tp2. ``attention_residual`` and ``mlp_residual`` mask the
    residual stream, sharded over tp2 and replicated over tp1, so they must be equal across tp1.
    """

    attention: int
    attention_residual: int
    mlp_residual: int


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Runs the block with the global generator of ``device`` set to ``seed``, then restores it.

    Needed because ``scaled_dot_product_attention`` draws its dropout mask from the global
    generator; forking keeps the caller's random stream untouched.
    """
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        # Only the generator the ops draw from: torch.manual_seed would also queue a lazy seed
        # (with a captured stack) for every uninitialised accelerator type, forever.
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        yield


def dropout(x: torch.Tensor, p: float, seed: int | None) -> torch.Tensor:
    """Inverted dropout whose mask is a pure function of ``seed`` (no-op when seed is None)."""
    if seed is None or p == 0.0:
        return x
    with seeded(seed, x.device):
        return F.dropout(x, p, training=True)


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
    so it is added once, not once per shard.
    """

    def __init__(self, local_in: int, local_out: int, reduce_axis: Axis, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(local_out, local_in))
        self.bias = nn.Parameter(torch.zeros(local_out)) if bias else None
        self.reduce_axis = reduce_axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from(F.linear(x, self.weight), self.reduce_axis)
        return y if self.bias is None else y + self.bias


class Attention(nn.Module):
    """Causal self-attention for the heads of this tp1 shard, replicated over tp2."""

    def __init__(
        self,
        local_hidden: int,
        local_heads: int,
        head_dim: int,
        dropout_prob: float,
        tp1: Axis,
        tp2: Axis,
    ):
        super().__init__()
        width = local_heads * head_dim
        # Columns hold [q | k | v] of the same local heads so a shard never splits a head.
        self.qkv = ParallelLinear(local_hidden, 3 * width, reduce_axis=tp2)
        self.out = ParallelLinear(width, local_hidden, reduce_axis=tp1)
        self.head_dim = head_dim
        self.dropout_prob = dropout_prob
        self.tp1, self.tp2 = tp1, tp2

    def forward(self, x: torch.Tensor, seeds: BlockSeeds | None) -> torch.Tensor:
        B, S, _ = x.shape
        qkv = self.qkv(copy_to(x, self.tp1))  # (B, S, 3 * local_heads * head_dim)
        q, k, v = qkv.view(B, S, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        y = self.core(q, k, v, seeds)  # (B, local_heads, S, head_dim)
        y = y.transpose(1, 2).reshape(B, S, -1)  # (B, S, local_heads * head_dim)
        return self.out(copy_to(y, self.tp2))

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seeds: BlockSeeds | None
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v, causal, with dropout on the probabilities: the part
        whose activations grow with the square of the sequence (what selective recompute
        recomputes)."""
        p = self.dropout_prob if seeds is not None else 0.0
        with seeded(seeds.attention, q.device) if p else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


class FeedForward(nn.Module):
    """h -> 4h -> h with tanh-GELU; the 4h hidden layer is sharded over tp1."""

    def __init__(self, local_hidden: int, local_ffn: int, tp1: Axis, tp2: Axis):
        super().__init__()
        self.fc = ParallelLinear(local_hidden, local_ffn, reduce_axis=tp2)
        self.proj = ParallelLinear(local_ffn, local_hidden, reduce_axis=tp1)
        self.tp1, self.tp2 = tp1, tp2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc(copy_to(x, self.tp1))  # (B, S, 4h / tp1)
        hidden = F.gelu(copy_to(hidden, self.tp2), approximate="tanh")
        return self.proj(hidden)


class DecoderBlock(nn.Module):
    """Pre-layer-norm GPT block: x + drop(attn(ln_1(x))), then x + drop(mlp(ln_2(x)))."""

    def __init__(
        self,
        local_hidden: int,
        local_heads: int,
        head_dim: int,
        local_ffn: int,
        dropout_prob: float,
        eps: float,
        tp1: Axis,
        tp2: Axis,
    ):
        super().__init__()
        self.ln_1 = LayerNorm(local_hidden, tp2, eps)
        self.attn = Attention(local_hidden, local_heads, head_dim, dropout_prob, tp1, tp2)
        self.ln_2 = LayerNorm(local_hidden, tp2, eps)
        self.mlp = FeedForward(local_hidden, local_ffn, tp1, tp2)
        self.dropout_prob = dropout_prob

    def forward(self, x: torch.Tensor, seeds: BlockSeeds | None = None) -> torch.Tensor:
        p = self.dropout_prob
        x = x + dropout(self.attn(self.ln_1(x), seeds), p, seeds and seeds.attention_residual)
        return x + dropout(self.mlp(self.ln_2(x)), p, seeds and seeds.mlp_residual)


class Embedding(nn.Module):
    """Word + position embedding; rows (vocab, positions) over tp1, columns over tp2.

    Each rank looks up the ids that fall in its row range (others give zeros) and the partial
    embeddings are summed over tp1.
    """

    def __init__(
        self,
        local_vocab: int,
        local_positions: int,
        local_hidden: int,
        dropout_prob: float,
        tp1: Axis,
    ):
        super().__init__()
        self.word = nn.Embedding(local_vocab, local_hidden)
        self.position = nn.Embedding(local_positions, local_hidden)
        self.dropout_prob = dropout_prob
        self.tp1 = tp1

    def forward(self, ids: torch.Tensor, seed: int | None = None) -> torch.Tensor:
        positions = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
        x = _lookup_rows(self.word.weight, ids, self.tp1) + _lookup_rows(
            self.position.weight, positions, self.tp1
        )
        return dropout(reduce_from(x, self.tp1), self.dropout_prob, seed)


def _lookup_rows(table: torch.Tensor, ids: torch.Tensor, tp1: Axis) -> torch.Tensor:
    """Embedding lookup of the rows this tp1 shard owns; ids owned elsewhere give zeros."""
    if tp1.size == 1:
        return F.embedding(ids, table)
    local = ids - tp1.rank * table.shape[0]
    owned = (local >= 0) & (local < table.shape[0])
    rows = F.embedding(local.clamp(0, table.shape[0] - 1), table)
    return rows * owned.unsqueeze(-1).to(rows.dtype)


class LMHead(nn.Module):
    """Final layer norm and the tied projection onto this tp1 shard of the (padded) vocabulary."""

    def __init__(self, local_hidden: int, eps: float, tp1: Axis, tp2: Axis):
        super().__init__()
        self.ln_f = LayerNorm(local_hidden, tp2, eps)
        self.tp1, self.tp2 = tp1, tp2

    def forward(
        self, x: torch.Tensor, word_embedding: torch.Tensor, labels: torch.Tensor, vocab_size: int
    ) -> torch.Tensor:
        """Mean next-token cross-entropy over every token of the micro-batch.

        Args:
            x: Final residual stream (B, S, h/tp2).
            word_embedding: This rank's shard of the tied word embedding (V_pad/tp1, h/tp2).
            labels: Next-token ids (B, S).
            vocab_size: Real vocabulary size; padded columns never receive probability.
        """
        z = copy_to(self.ln_f(x), self.tp1)
        logits = reduce_from(F.linear(z, word_embedding), self.tp2)  # (B, S, V_pad / tp1)
        return vocab_parallel_cross_entropy(logits, labels, self.tp1, vocab_size)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits sharded over tp1 along the vocabulary, never gathering them.

    Three all-reduces over tp1: the max (for stability), the sum of exponentials and the logit of
    the target. The backward needs no communication: softmax minus one-hot on the local shard.
    """

    @staticmethod
    def forward(ctx, logits, labels, tp1: Axis, vocab_size: int):
        ctx.input_dtype = logits.dtype
        local_vocab = logits.shape[-1]
        start = tp1.rank * local_vocab
        # Columns past the real vocabulary are padding: excluded from the max, zero probability.
        real = min(max(vocab_size - start, 0), local_vocab)
        if real:
            local_max = logits[..., :real].amax(-1).float()
        else:
            local_max = logits.new_full(logits.shape[:-1], float("-inf"), dtype=torch.float32)
        max_logit = tp1.all_reduce_(local_max, op="max")

        # One fp32 buffer of the logits' size, reused in place: shifted logits -> exp -> softmax.
        shifted = logits.float() - max_logit.unsqueeze(-1)
        shifted[..., real:] = float("-inf")
        local_label = labels - start
        owned = (local_label >= 0) & (local_label < local_vocab)
        local_label = local_label.clamp(0, local_vocab - 1)
        target = shifted.gather(-1, local_label.unsqueeze(-1)).squeeze(-1)
        target = tp1.all_reduce_(torch.where(owned, target, 0.0))

        exp = shifted.exp_()
        sum_exp = tp1.all_reduce_(exp.sum(-1))
        loss = sum_exp.log() - target
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_label, owned)
        return loss.mean()

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_label, owned = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_label.unsqueeze(-1), -owned.unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss / local_label.numel())
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, tp1: Axis, vocab_size: int
) -> torch.Tensor:
    """Mean cross-entropy over all tokens; see :class:`_VocabParallelCrossEntropy`."""
    return _VocabParallelCrossEntropy.apply(logits, labels, tp1, vocab_size)
