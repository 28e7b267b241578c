"""How much of the hardware a training update uses: model FLOPs, and a GEMM peak measured in the same run.

    flops = training_flops(arch, [(len(prompt), [len(response)]) for each row])  # one update's model FLOPs
    peak = gemm_peak_flops(torch.float32, torch.device("cpu"))                 # FLOP/s of this rank, measured
    mfu = flops / seconds / (peak * ranks)

Model FLOPs follow megatron's own count (megatron/training/training.py, `num_floating_point_operations`):
every weight GEMM three times (forward, weight gradient, input gradient), two FLOPs per multiply-add, and
core attention (QK^T and softmax·V) over what each token attends to: its own sequence's causal triangle,
and where responses share their prompt in one row (models/packing.py), the prompt counts once. The
output layer counts at the response positions only: an RL update needs the log-probs of response tokens,
and the trainer's output hook computes logits there alone (models/logprobs.py). Model FLOPs are the work
the model needs, not what a kernel happens to do: recomputation, padding and an attention kernel that
computes the whole square make an update slower, and so lower the fraction, rather than raising the count.

The peak is no datasheet figure: it is a square GEMM of the model's parameter dtype, timed on the rank's
own device with its own threads, so "CPU MFU" is relative to what this process can get from a matmul on
this machine (on a shared CPU, at this moment); on GPU it is the same measurement on the device.
"""
from __future__ import annotations

import time
from typing import Iterable, Sequence, Tuple

import torch

from hacpo_megatron.models.architectures import Architecture

# forward, weight-gradient and input-gradient GEMMs; a multiply-add is two FLOPs
_FORWARD_BACKWARD = 3
_FMA = 2


def layer_flops_per_token(arch: Architecture) -> float:
    """Forward FLOPs of one token through the transformer layers' weight GEMMs: Q/K/V and output
    projections and the gated MLP (gate, up, down: every supported family uses SwiGLU); in a mixture of experts
    the router and the top-k experts the token goes through."""
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    if arch.moe is None:
        mlp = 3 * arch.hidden_size * arch.ffn_hidden_size
    else:
        mlp = arch.hidden_size * arch.moe.num_experts + 3 * arch.hidden_size * arch.moe.top_k * arch.moe.ffn_hidden_size
    per_layer = arch.hidden_size * (q + 2 * kv) + q * arch.hidden_size + mlp
    return _FMA * arch.num_layers * per_layer


def output_layer_flops_per_token(arch: Architecture) -> float:
    """Forward FLOPs of the logits of one position."""
    return _FMA * arch.hidden_size * arch.vocab_size


def attention_flops(arch: Architecture, prompt_length: int, response_lengths: Sequence[int]) -> float:
    """Forward FLOPs of core attention (QK^T and softmax·V) in one row: the prompt's causal triangle, then
    each response over the prompt and its own causal triangle."""
    q = arch.num_attention_heads * arch.head_dim
    pairs = prompt_length**2 / 2 + sum(length * prompt_length + length**2 / 2 for length in response_lengths)
    return arch.num_layers * 2 * _FMA * q * pairs


def training_flops(arch: Architecture, rows: Iterable[Tuple[int, Sequence[int]]]) -> float:
    """Model FLOPs of one forward and backward pass over rows (prompt length, response lengths): a row holds
    one prompt and every response computed with it (one response per row without shared prompts)."""
    total = 0.0
    for prompt_length, response_lengths in rows:
        responses = sum(response_lengths)
        total += (layer_flops_per_token(arch) * (prompt_length + responses)
                  + output_layer_flops_per_token(arch) * responses
                  + attention_flops(arch, prompt_length, response_lengths))
    return _FORWARD_BACKWARD * total


def gemm_peak_flops(dtype: torch.dtype, device: torch.device, *, size: int = 0, trials: int = 5) -> float:
    """FLOP/s of the fastest of `trials` square GEMMs of `dtype` on `device` (a warm-up call first).

    size 0 picks 1024 on CPU (~30 ms a GEMM on one core: the measurement costs ~0.2 s) and 8192 on GPU.
    """
    n = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # oneDNN / cuBLAS choose their kernel on the first call
    sync()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best
