"""Single-process Hugging Face references for the megatron workers (and their test configs)."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from hacpo_megatron.models.architectures import normalized_hf_config
from hacpo_megatron.models.presets import PRESETS

TEMPERATURE = 0.7
VOCAB = 1000  # not a multiple of 128: megatron pads it (1024 at TP=1 and TP=2)

# Tiny configs with GQA (4 query heads, 2 key/value heads), tied and untied embeddings.
TEST_CONFIGS: Dict[str, dict] = {
    "qwen3": dict(PRESETS["tiny-qwen3"], vocab_size=VOCAB, bos_token_id=0, eos_token_id=1),  # tied, QK-norm
    "qwen2": dict(PRESETS["tiny-qwen2"], vocab_size=VOCAB, bos_token_id=0, eos_token_id=1),  # untied, qkv bias
    # llama3 RoPE scaling with a low_freq_factor other than megatron's built-in 1 and a short
    # original context, so the full HF formula is exercised (tied embeddings, like 3.2-1B/3B).
    "llama": dict(PRESETS["tiny-llama"], vocab_size=VOCAB, bos_token_id=0, eos_token_id=1,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=1024)),
}

# (prompt ids, response ids): different lengths, a one-token prompt, a one-token response.
SEQUENCES: List[Tuple[List[int], List[int]]] = [
    ([11, 12, 13], [14, 15, 16, 17]),
    ([999], [998, 2]),
    ([5, 6, 7, 8, 9, 10], [3]),
    ([100, 200], [300, 400, 500, 600, 700, 800]),
    ([42, 43, 44, 45], [46, 47, 48]),
]

# Several responses to each prompt, as a step's rows are (G samples, other agents' answers): rows with a
# shared prompt hold 4, 3 and 1 of them (one-token responses too); one sequence has a prompt of its own.
SHARED_PROMPT_SEQUENCES: List[Tuple[List[int], List[int]]] = [
    ([21, 22, 23, 24, 25], [30, 31, 32]),
    ([21, 22, 23, 24, 25], [33]),
    ([7, 8], [40, 41, 42, 43, 44, 45]),
    ([21, 22, 23, 24, 25], [30, 34, 35, 36, 37]),
    ([7, 8], [40, 46]),
    ([21, 22, 23, 24, 25], [38, 39]),
    ([7, 8], [2]),
    ([500, 501, 502], [503, 504]),
]


def hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A random fp32 HF model; norms perturbed so a mis-mapped norm weight changes the output."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(normalized_hf_config(TEST_CONFIGS[name]),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(0.1 * torch.randn_like(param))
            if param_name.endswith("bias"):
                param.normal_(0.0, 0.05)
    return model


def hf_token_logprobs(model: torch.nn.Module, sequences: Sequence,
                      temperature: float = TEMPERATURE) -> List[torch.Tensor]:
    """log_softmax(logits / T) at each response token, one sequence at a time (no padding at all)."""
    out = []
    for prompt, response in sequences:
        logits = model(torch.tensor([list(prompt) + list(response)])).logits[0].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
        out.append(logp[positions, torch.tensor(response)])
    return out


def hf_grads_of_logprob_sum(model: torch.nn.Module, sequences: Sequence) -> Dict[str, torch.Tensor]:
    """d(sum of all response log-probs)/d(weights), by HF parameter name (tied: one entry)."""
    model.zero_grad()
    torch.stack([lp.sum() for lp in hf_token_logprobs(model, sequences)]).sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}
