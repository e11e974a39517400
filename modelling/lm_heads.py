"""The language model's heads: the final norm and a projection onto this tp1 shard of the
(padded) vocabulary, and the cross-entropy of vocabulary-sharded logits that never gathers them.

:class:`LMHead` projects with the word embedding (tied, GPT-3); :class:`UntiedLMHead` with a
projection of its own, split as the word embedding is (rows over tp1, columns over tp2: Llama).

A micro-batch's logits can be the largest tensors of a step (Llama 3's 128,256-word vocabulary
at 8,192 tokens: 4.2 GB in float32, which the cross-entropy holds twice), so where the
vocabulary is large the engine calls a head on chunks of the tokens (:func:`logits_chunks`),
each chunk's forward and backward before the next's, and never holds all the logits.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from modelling.grad_sinks import NO_SINKS, GradSink, linear
from modelling.layers import ParallelLinear
from modelling.parallel import Axis, copy_to, reduce_from

# Vocabularies larger than this many words run a micro-batch's head on chunks of its tokens
# (Llama 3's 128,256); smaller ones whole (GPT-2's 50,257). See logits_chunks.
CHUNKED_VOCABULARY = 1 << 16
# A chunk's logits may always hold this many elements (32 MiB in float32): a micro-batch whose
# logits are no more runs whole, and a small head is cut no finer.
LOGITS_CHUNK_FLOOR = 1 << 23


def logits_chunks(tokens: int, vocab: int, local_vocab: int, local_hidden: int) -> list[slice]:
    """The chunks of a micro-batch's ``tokens`` (flattened) whose logits a language model's
    head computes at once, a chunk's forward and backward before the next's.

    A vocabulary of more than :data:`CHUNKED_VOCABULARY` words (``vocab``, the model's) is cut
    into chunks as equal as can be (where their number divides the tokens, one compiled graph
    serves them all), each one's logits at most half as many elements as the head's weight
    shard (``local_vocab`` x ``local_hidden``), or :data:`LOGITS_CHUNK_FLOOR` where that is
    more; a smaller vocabulary runs whole.

    Why half the weight: a chunk's backward makes a gradient of the whole weight shard beside
    the gradient of the chunk's logits where the head is compiled in 16 bits (elsewhere it is
    summed in place: :mod:`modelling.grad_sinks`), and the cross-entropy holds two float32
    tensors of the logits' size at once (the logits and their shifted copy). At half the
    weight's elements those take what the weight's own float32 gradient does: the head's
    working set is a few of the weight's size, however long the micro-batch. Smaller chunks
    would hold little less.

    Why by the vocabulary: each chunk passes over the whole weight three or four times (its
    matmuls read it; its gradient is written and accumulated), which costs the same share of
    the head's time whatever the vocabulary, while the memory it gives back grows with the
    vocabulary. Llama 3's 128,256 words at 8,192 tokens hold 8.1 GiB in a bfloat16 head run
    whole, 3.6 GiB on 4 chunks, and the dry run prices llama3_8B's step 0.7% slower for it;
    GPT-2's, cut the same way, would cost gpt3_125M 13% of its step on an H100 for memory its
    plan does not need.
    """
    if vocab <= CHUNKED_VOCABULARY:
        return [slice(0, tokens)]
    limit = max(local_vocab * local_hidden // 2, LOGITS_CHUNK_FLOOR) // local_vocab
    count = -(-tokens // max(limit, 1))
    size = -(-tokens // count)
    return [slice(start, min(start + size, tokens)) for start in range(0, tokens, size)]


class LMHead(nn.Module):
    """Final norm (``norm``: a layer norm for GPT-3) and the tied projection onto this tp1
    shard of the (padded) vocabulary."""

    def __init__(self, norm: nn.Module, tp1: Axis, tp2: Axis):
        super().__init__()
        self.ln_f = norm
        self.tp1, self.tp2 = tp1, tp2

    def forward(
        self,
        x: torch.Tensor,
        word_embedding: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        grad_sinks: Mapping[str, GradSink] = NO_SINKS,
    ) -> torch.Tensor:
        """Mean next-token cross-entropy over every token of the micro-batch.

        Args:
            x: Final residual stream (B, S, h/tp2).
            word_embedding: This rank's shard of the tied word embedding (V_pad/tp1, h/tp2).
            labels: Next-token ids (B, S).
            vocab_size: Real vocabulary size; padded columns never receive probability.
            grad_sinks: Where the word embedding's gradient is summed (``word.weight``:
                :mod:`modelling.grad_sinks`; given by whoever differentiates it).
        """
        z = copy_to(self.ln_f(x), self.tp1)
        projected = linear(z, word_embedding, grad_sinks.get("word.weight"))
        logits = reduce_from(projected, self.tp2)  # (B, S, V_pad / tp1)
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

        # One fp32 buffer of the logits' size, reused in place: shifted logits -> exp -> softmax
        # (from 16-bit logits, their float32 copy itself; float32 logits are the caller's).
        if logits.dtype == torch.float32:
            shifted = logits - max_logit.unsqueeze(-1)
        else:
            shifted = logits.float().sub_(max_logit.unsqueeze(-1))
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


class UntiedLMHead(nn.Module):
    """Final norm and a projection of its own onto this tp1 shard of the (padded) vocabulary.

    ``output`` is split as the word embedding is (rows over tp1, columns over tp2), so the
    logits are vocabulary-sharded as the tied head's are.
    """

    def __init__(self, norm: nn.Module, local_vocab: int, local_hidden: int, tp1: Axis, tp2: Axis):
        super().__init__()
        self.ln_f = norm
        self.output = ParallelLinear(local_hidden, local_vocab, reduce_axis=tp2, bias=False)
        self.tp1 = tp1

    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        grad_sinks: Mapping[str, GradSink] = NO_SINKS,
    ) -> torch.Tensor:
        """Mean next-token cross-entropy of the final residual stream ``x`` (B, S, h/tp2);
        ``grad_sinks``: where the projection's gradient is summed (``output.weight``)."""
        sink = grad_sinks.get("output.weight")
        logits = self.output(copy_to(self.ln_f(x), self.tp1), sink)  # (B, S, V_pad / tp1)
        return vocab_parallel_cross_entropy(logits, labels, self.tp1, vocab_size)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, tp1: Axis, vocab_size: int
) -> torch.Tensor:
    """Mean cross-entropy over all tokens; see :class:`_VocabParallelCrossEntropy`. Split over
    tp1 it runs outside a compiled graph, as every collective does (:mod:`modelling.parallel`)."""
    if tp1.size == 1:
        return _VocabParallelCrossEntropy.apply(logits, labels, tp1, vocab_size)
    return _sharded_cross_entropy(logits, labels, tp1, vocab_size)


_sharded_cross_entropy = torch.compiler.disable(
    _VocabParallelCrossEntropy.apply, reason="a collective on the axis's process group"
)
