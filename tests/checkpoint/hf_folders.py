"""Tiny random Hugging Face model folders for the conversion tests (weights, config, real tokenizer)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import torch

from tests.models.workers.reference import TEST_CONFIGS, hf_model

# The layouts tests convert at (TP x PP <= 2 processes).
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}

# qwen3: tied, QK-norm; qwen2: untied, qkv bias; llama: tied, llama3 RoPE scaling (all GQA 4/2 heads,
# vocabulary 1000 -> padded 1024). qwen3_untied: vocabulary 1100, padded 1152 at TP=1 but 1280 at TP=2,
# so a checkpoint saved at TP=2 and loaded at TP=1 crosses paddings.
ARCH_CONFIGS: Dict[str, dict] = dict(
    TEST_CONFIGS,
    qwen3_untied=dict(TEST_CONFIGS["qwen3"], vocab_size=1100, tie_word_embeddings=False),
)
REFERENCE_MODEL = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama", "qwen3_untied": "qwen3"}


def make_hf_folder(folder: Path, arch: str, *, max_shard_size: str = "200KB", seed: int = 0) -> Path:
    """save_pretrained of a random fp32 model (sharded: small shards) plus the real Qwen3 tokenizer."""
    import transformers

    from hacpo_megatron.bridge.tokenizers import load_tokenizer
    from hacpo_megatron.models.architectures import normalized_hf_config

    if arch in TEST_CONFIGS:
        model = hf_model(arch, seed=seed)
    else:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(normalized_hf_config(ARCH_CONFIGS[arch]),
                                                              dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    load_tokenizer("qwen3").save_pretrained(folder)
    return folder
