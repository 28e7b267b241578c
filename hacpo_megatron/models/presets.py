"""Built-in architectures by name: Hugging Face `config.json` contents, without weights.

The paper's models are here so that their configs validate (heads vs. TP, layers vs. PP) on any
machine; their weights come from `init_from` (a Hugging Face folder) on the machine that trains them.
The tiny ones are random-initialised models for CPU runs and tests.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "Gemma3ForCausalLM",
                           "Qwen3MoeForCausalLM")

_QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", attention_bias=False,
    rms_norm_eps=1e-6, vocab_size=151936, head_dim=128, rope_theta=1000000.0, max_position_embeddings=32768,
    bos_token_id=151643, eos_token_id=151643,
)
_LLAMA32 = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", attention_bias=False, mlp_bias=False,
    rms_norm_eps=1e-5, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
)
# Gemma 3 (the real 270M comes as the GGUF model `gemma3-270m`, checkpoint/gguf_sources.py: its config.json names it)
_GEMMA3 = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
    attention_bias=False, rms_norm_eps=1e-6, vocab_size=262144, head_dim=256, query_pre_attn_scalar=256,
    rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                         full_attention=dict(rope_type="default", rope_theta=1000000.0)),
    tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
)

# Qwen3-MoE (Qwen3-30B-A3B's settings): Qwen3's attention, every layer's MLP a mixture of experts whose top-k
# probabilities are renormalised (norm_topk_prob)
_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu", attention_bias=False,
    rms_norm_eps=1e-6, vocab_size=151936, head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960,
    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, router_aux_loss_coef=0.001,
    bos_token_id=151643, eos_token_id=151645,
)


PRESETS: Dict[str, Dict[str, Any]] = {
    # ---- the paper's models (weights from `init_from`) ----
    "qwen3-1.7b-base": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b-base": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                     eos_token_id=151645, max_position_embeddings=40960),
    "qwen3-4b-instruct-2507": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                   num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                                   eos_token_id=151645, rope_theta=5000000.0, max_position_embeddings=262144),
    "qwen3-8b-base": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "llama3.2-1b-instruct": dict(_LLAMA32, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                 num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "llama3.2-3b-instruct": dict(_LLAMA32, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                 num_attention_heads=24, num_key_value_heads=8, head_dim=128),
    # ---- tiny random models for CPU runs and tests (vocabularies of the real tokenizers) ----
    # Sizes tuned with the supervised warm-up (benchmarks/bench_warmup.py): hidden 64 keeps the vocabulary-
    # sized work of a CPU step small; 4 heads / 2 KV heads (TP=2), an even layer count (PP=2), head_dim 32
    # (vLLM's CPU attention). Qwen3 is the deeper one; Llama's 131072 positions are its real ones (RoPE scaling).
    "tiny-qwen3": dict(_QWEN3, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=2048),
    "tiny-llama": dict(_LLAMA32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=128256,
                       max_position_embeddings=131072, tie_word_embeddings=True),
    # the study's "size" setting (configs/study/size.yaml): tiny-qwen3's family and tokenizer, twice as wide,
    # 1.5x as deep
    "small-qwen3": dict(_QWEN3, hidden_size=128, intermediate_size=384, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=151936,
                        tie_word_embeddings=True, max_position_embeddings=2048),
    # Gemma 3's structure in small: 2 KV heads (TP=2), 4 layers (PP=2) whose two stages differ in layer types (a
    # pipeline-offset mistake shows), a window of 8, a query_pre_attn_scalar other than head_dim (a wrong
    # attention scale shows), the real 262,144-word vocabulary
    "tiny-gemma3": dict(_GEMMA3, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                        max_position_embeddings=2048),
    # a mixture of experts in small, with tiny-qwen3's width, heads and tokenizer: 8 experts (EP=2 and 4 divide them),
    # 2 per token, each expert half as wide as tiny-qwen3's MLP (a token goes through as many expert weights as a
    # tiny-qwen3 token through its MLP); 2 layers; random init (docs/moe.md)
    "qwen3-moe-tiny": dict(_QWEN3_MOE, hidden_size=64, intermediate_size=192, moe_intermediate_size=96,
                           num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, max_position_embeddings=2048,
                           eos_token_id=151643),
    "tiny-qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                       rms_norm_eps=1e-6, vocab_size=151936, hidden_size=128, intermediate_size=384,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0,
                       max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=151643,
                       eos_token_id=151643),
}


def load_hf_config_dict(model: str) -> Dict[str, Any]:
    """The Hugging Face config of a preset name or of a model folder holding config.json."""
    if model in PRESETS:
        return copy.deepcopy(PRESETS[model])  # callers may write into nested dicts (rope_scaling)
    path = os.path.join(model, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            try:
                return json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg})") from None
    raise ValueError(
        f"{model!r} is neither a built-in preset ({', '.join(sorted(PRESETS))}) nor a folder with config.json"
    )


def attention_shape(hf_config: Dict[str, Any]) -> Dict[str, int]:
    """The numbers parallel layouts must divide: attention heads, key/value heads, layers. A family this project
    does not build is named first (GPT-2's config has none of these keys: a bare KeyError would say nothing)."""
    named = list(hf_config.get("architectures") or [])
    if named and not any(name in SUPPORTED_ARCHITECTURES for name in named):
        raise ValueError(f"unsupported architecture {named}; supported architectures: "
                         + ", ".join(SUPPORTED_ARCHITECTURES))
    heads = int(hf_config["num_attention_heads"])
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": int(hf_config.get("num_key_value_heads") or heads),
        "num_hidden_layers": int(hf_config["num_hidden_layers"]),
        # experts of a mixture-of-experts model (Qwen3-MoE: `num_experts`, saved by transformers 5 as
        # `num_local_experts`); 0 for a dense one
        "num_experts": int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0),
    }


def layout_problems(shape: Dict[str, int], tp: int, pp: int, model: str, *, dp: int = 1, ep: int = 1,
                    etp: int = 1, training: bool = True) -> Dict[str, str]:
    """Why a TP x PP x DP layout with EP x ETP (expert parallelism, expert tensor parallelism) cannot split a model of
    this shape (`shape_of`), by the layout key it breaks ("tensor", "pipeline", "expert", "expert_tensor"); empty
    where it fits. The one layout check, for the config loader (which names the file, line and key), the model builder
    and the conversion tools. A size below 1 is the callers' range check, not this.

    Experts (docs/moe.md): megatron lays each stage's TP x DP ranks out a second time, for the experts, as
    ETP x EP x expert-DP (EP takes no ranks of its own), so EP x ETP must divide TP x DP, and EP the experts.
    `training` False: a model built for its weights and passes in eval mode only (the conversion tools), which a
    mixture of experts also has at TP > 1."""
    heads, kv, layers = shape["num_attention_heads"], shape["num_key_value_heads"], shape["num_hidden_layers"]
    experts = shape.get("num_experts") or 0
    problems = {}
    if tp >= 1 and (heads % tp or kv % tp):
        problems["tensor"] = (f"TP={tp} must divide the attention heads ({heads}) and key/value heads ({kv}) "
                              f"of {model}" + fewer_kv_heads_than_tp(kv, tp))
    if pp >= 1 and layers % pp:
        problems["pipeline"] = f"PP={pp} must divide the {layers} layers of {model}"
    if not experts:  # a dense model: nothing to split over expert ranks
        if ep > 1:
            problems["expert"] = (f"EP={ep} splits the experts of a mixture-of-experts model; {model} has none: "
                                  "leave parallel.expert at 1")
        if etp > 1:
            problems["expert_tensor"] = (f"ETP={etp} splits the experts of a mixture-of-experts model; {model} has "
                                         "none: leave parallel.expert_tensor at 1")
        return problems
    # a mixture of experts trains at TP 1 so far (docs/moe.md)
    if training and tp > 1 and "tensor" not in problems:
        problems["tensor"] = (f"TP={tp} with the mixture of experts of {model} is not supported yet in training: "
                              "megatron's MoE layer trains at TP > 1 only with sequence parallelism, which is not set "
                              "up here; use TP=1")
    if etp > 1:
        problems["expert_tensor"] = (f"ETP={etp} (tensor parallelism inside each expert) is not supported yet: only "
                                     "ETP=1 has been built and run here; spread the experts with parallel.expert")
    if ep >= 1 and experts % ep:
        problems["expert"] = f"EP={ep} must divide the {experts} experts of {model}"
    elif ep >= 1 and etp >= 1 and tp >= 1 and dp >= 1 and (tp * dp) % (ep * etp):
        problems["expert"] = (f"EP={ep} x ETP={etp} must divide the {tp * dp} ranks of each pipeline stage "
                              f"(TP={tp} x DP={dp}): megatron lays the experts' ETP x EP x expert-DP grid over those "
                              "ranks, EP takes none of its own; use a parallel.data that EP x ETP divides")
    return problems


def fewer_kv_heads_than_tp(kv_heads: int, tp: int) -> str:
    """The end of a layout error when TP exceeds the key/value heads (Gemma 3 270M has one): why, and what works."""
    if kv_heads >= tp:
        return ""
    allowed = "TP=1" if kv_heads == 1 else f"a TP that divides {kv_heads}"
    return (f"; a key/value head cannot be split over TP ranks: use {allowed} "
            "(pipeline or data parallelism spread the model further)")
