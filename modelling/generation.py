"""Text generation with a key/value cache, on the weights of a single-device :class:`GPT`.

The training path computes a loss and never logits over a whole sequence; generation needs the
logits of the last position, one new token at a time. This module runs the same blocks (their
layer norms, projections and MLP) with attention over cached keys and values, so each new token
costs one position's work instead of the whole prefix's. The Llama variants run here too: the
cache holds the KV heads only (grouped-query attention), rotated at their own positions.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from modelling.gpt import GPT, GPTShapes
from modelling.layers import DecoderBlock


def build_model(
    shapes: GPTShapes,
    weights: dict[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> GPT:
    """A single-device GPT in eval mode holding logical (unpadded) ``weights``.

    Args:
        shapes: The model's sizes (one device: tp1 = tp2 = 1).
        weights: Every parameter, named as in :class:`GPT`, unpadded.
    """
    with torch.device("meta"):
        gpt = GPT(shapes)
    gpt = gpt.to_empty(device=device)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            t = weights[name]
            p.zero_()[: t.shape[0]].copy_(t)  # rows past vocab / positions are padding
    return gpt.to(dtype).eval()


class KVCache:
    """Keys and values of every layer for positions ``[0, length)``, preallocated.

    Args:
        model: The model whose layers fill the cache.
        batch: Sequences generated together.
        max_length: Positions the cache holds (prompt plus new tokens).
    """

    def __init__(self, model: GPT, batch: int, max_length: int):
        attn = model.layers[0].attn
        p = attn.qkv.weight
        heads = (p.shape[0] // attn.head_dim - attn.local_heads) // 2  # the KV heads
        shape = (len(model.layers), batch, heads, max_length, attn.head_dim)
        self.keys = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.values = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.length = 0


def _attention(block: DecoderBlock, x: torch.Tensor, cache: KVCache | None, n: int):
    """The block's attention on ``x`` (B, S, h) at positions ``[start, start + S)``."""
    attn = block.attn
    B, S, _ = x.shape
    d = attn.head_dim
    qkv = attn.qkv(x)  # (B, S, (heads + 2 kv_heads) * d): q, k and v of every head
    kv_width = (qkv.shape[-1] - attn.local_heads * d) // 2
    q, k, v = (
        t.view(B, S, -1, d).transpose(1, 2)
        for t in qkv.split([attn.local_heads * d, kv_width, kv_width], -1)
    )
    start = 0 if cache is None else cache.length
    q, k = attn.position(q, k, start)
    if cache is None:
        mask = None
    else:
        cache.keys[n, :, :, start : start + S] = k
        cache.values[n, :, :, start : start + S] = v
        k, v = cache.keys[n, :, :, : start + S], cache.values[n, :, :, : start + S]
        # Query i (at position start + i) sees keys 0 .. start + i.
        mask = torch.ones(S, start + S, dtype=torch.bool, device=x.device).tril(start)
    group = attn.local_heads // k.shape[1]  # query heads per KV head
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    return attn.out(y.transpose(1, 2).reshape(B, S, -1))


def forward_logits(model: GPT, ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
    """Next-token logits ``(B, S, vocab)`` of ``ids`` (B, S), without dropout.

    Without a cache, ``ids`` is the whole sequence from position 0. With one, ``ids`` continues
    the ``cache.length`` positions already cached, and the cache grows by S.
    """
    start = 0 if cache is None else cache.length
    emb = model.embedding
    x = emb.whole(ids, start)  # with learned positions; rotary ones are attention's
    for n, block in enumerate(model.layers):
        x = x + _attention(block, block.ln_1(x), cache, n)
        x = x + block.mlp(block.ln_2(x))
    if cache is not None:
        cache.length += ids.shape[1]
    head = model.head
    projection = emb.word.weight if model.shapes.tied_head else head.output.weight
    logits = F.linear(head.ln_f(x), projection)
    return logits[..., : model.shapes.vocab]  # padded rows are not tokens


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row of ``logits`` (B, vocab); temperature 0 is greedy (argmax)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the ones before it already reach top_p (the first always stays).
        drop = cumulative - sorted_logits.softmax(-1) >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    stop_token: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yields ``(B,)`` new token ids one at a time after ``prompt`` (B, S).

    Stops after ``max_new_tokens``, at the end of the position table, or when every row has
    produced ``stop_token``.
    """
    limit = model.shapes.positions
    max_new_tokens = min(max_new_tokens, limit - prompt.shape[1])
    if max_new_tokens <= 0:
        return
    cache = KVCache(model, prompt.shape[0], prompt.shape[1] + max_new_tokens) if use_cache else None
    ids, step_input = prompt, prompt
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        logits = forward_logits(model, step_input if use_cache else ids, cache)[:, -1]
        token = sample_next(logits, temperature, top_k, top_p, generator)
        yield token
        if stop_token is not None:
            done |= token == stop_token
            if done.all():
                return
        ids = torch.cat([ids, token[:, None]], dim=1)
        step_input = token[:, None]
