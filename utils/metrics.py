"""Throughput accounting: model FLOPs per token, achieved TFLOPS and MFU."""

from __future__ import annotations

import torch

from modelling.gpt import GPTShapes

# Dense bf16/fp16 tensor-core peaks (TFLOPS, without sparsity) from the vendors' data sheets.
# Matched in order against torch.cuda.get_device_name, so specific names come first.
_GPU_PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10", 125.0),
    ("V100", 125.0),
)


def flops_per_token(shapes: GPTShapes, sequence_length: int) -> int:
    """Model FLOPs of forward + backward per trained token (PaLM's MFU definition).

    ``6 N + 12 L h S``: N is the number of parameters (the tied embedding counted once), the
    second term the attention scores and values (``h`` the heads' width together: the hidden
    size, unless an explicit head width makes it heads x head width). Recomputation is not
    counted, so MFU does not reward doing work twice. Unless the head is tied to it (GPT-3's), the word embedding is
    only looked up and its parameters do no FLOPs: a fine-tuning task's head does not project
    onto the vocabulary, and an untied head (Llama's) projects with its own matrix.
    """
    parameters = shapes.num_parameters
    if not shapes.ties_word_embedding:
        parameters -= shapes.vocab * shapes.hidden
    return 6 * parameters + attention_flops_per_token(shapes, sequence_length)


def attention_flops_per_token(shapes: GPTShapes, sequence_length: int) -> int:
    """The attention scores' and values' share of :func:`flops_per_token`, ``12 L a S`` (``a``
    the width of all heads, heads x head_dim): the whole ``[S, S]`` square, forward and backward
    (a causal kernel executes half of it)."""
    return 12 * shapes.layers * shapes.attention_width * sequence_length


def device_peak_tflops(device: torch.device, configured: float) -> float | None:
    """Peak dense TFLOPS of one device: ``configured`` when > 0, else a known GPU's data sheet.

    Returns None when the peak is unknown (a CPU, or a GPU missing from the table): MFU is then
    reported as null rather than as a made-up number.
    """
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in _GPU_PEAK_TFLOPS:
        if key in name:
            return peak
    return None


def throughput(
    step_seconds: float,
    sequences: int,
    sequence_length: int,
    flops_token: int,
    peak_tflops: float | None,
    devices: int,
) -> dict[str, float | None]:
    """samples/s, tokens/s, achieved TFLOPS (whole job) and MFU of one step."""
    tokens_per_sec = sequences * sequence_length / step_seconds
    tflops = tokens_per_sec * flops_token / 1e12
    return {
        "samples_per_sec": sequences / step_seconds,
        "tokens_per_sec": tokens_per_sec,
        "tflops": tflops,
        "mfu": tflops / (peak_tflops * devices) if peak_tflops else None,
    }
