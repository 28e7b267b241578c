"""Hugging Face config -> megatron `TransformerConfig` + layer spec, for the supported decoder families.

The three families differ in only a few switches; everything else (pre-norm RMSNorm, SwiGLU MLP,
grouped-query attention, rotary embeddings, no linear biases) is shared:

=============  ========  ========  ===========================  =========================
family         qkv bias  QK-norm   RoPE                          tied embeddings
=============  ========  ========  ===========================  =========================
Qwen3          no        yes       plain, base `rope_theta`      per config
Qwen2 / 2.5    yes       no        plain, base `rope_theta`      per config
Llama 3.x      no        no        llama3 frequency scaling      per config (3.2-1B/3B: yes)
=============  ========  ========  ===========================  =========================

Gemma 3 is a fourth family with a layer of its own (sandwich norms, x * (1 + w) norms, GeGLU, scaled
embeddings, sliding-window layers with their own RoPE base, attention scale 1/sqrt(query_pre_attn_scalar)):
models/gemma3.py builds it; `Architecture` carries its extra numbers (`activation`, `query_pre_attn_scalar`,
`sliding_window`, `layer_types`, `sliding_rope_theta`), which keep their neutral defaults for the others.

Qwen3-MoE (`Qwen3MoeForCausalLM`) is Qwen3 with every layer's MLP replaced by a mixture of experts: a router
(a linear layer to one logit per expert), top-k routing, and per-expert SwiGLU MLPs of `moe_intermediate_size`.
`Architecture.moe` (a `MoE`) carries those numbers (None for the dense families); megatron builds the layer
with its own MoE modules (router, `allgather` token dispatcher, `SequentialMLP` experts without Transformer
Engine). What is built so far and what is still to come: docs/moe.md.

`read_architecture` reduces a HF config (a dict in either transformers 4.x style, `rope_theta` /
`rope_scaling`, or 5.x style, `rope_parameters`, or a `PretrainedConfig`) to an `Architecture`: the
numbers a megatron model needs, with transformers' own defaults filled in.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from hacpo_megatron import megatron_cpu
from hacpo_megatron.models.presets import SUPPORTED_ARCHITECTURES

# HF `architectures[0]` -> (family, qkv bias, QK-norm)
_FAMILIES = {
    "Qwen3ForCausalLM": ("qwen3", False, True),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "LlamaForCausalLM": ("llama", False, False),
    "Gemma3ForCausalLM": ("gemma3", False, True),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False, True),
}
assert set(_FAMILIES) == set(SUPPORTED_ARCHITECTURES)

_MODEL_TYPE_TO_ARCHITECTURE = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                               "gemma3_text": "Gemma3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
SLIDING_ATTENTION, FULL_ATTENTION = "sliding_attention", "full_attention"  # HF's `layer_types` values


@dataclass(frozen=True)
class Llama3RopeScaling:
    """HF `rope_type: llama3`: long wavelengths divided by `factor`, a smooth ramp in between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class MoE:
    """The mixture of experts of a Qwen3-MoE layer (HF Qwen3MoeSparseMoeBlock), in HF's terms.

    transformers' router: probs = softmax(logits) over all experts, the top `top_k` kept, divided by their sum when
    `norm_topk_prob`. megatron computes the same weights two ways (moe_utils.topk_routing_with_score_function):
    softmax over the top-k logits (`moe_router_pre_softmax=False`: the normalised form, since
    exp(l_i) / sum_topk exp(l_j) = p_i / sum_topk p_j) or softmax over all logits, then top-k
    (`moe_router_pre_softmax=True`: the unnormalised form). See `moe_config_settings`.
    """

    num_experts: int
    top_k: int  # experts per token (HF num_experts_per_tok)
    ffn_hidden_size: int  # of each expert (HF moe_intermediate_size)
    norm_topk_prob: bool  # the kept probabilities divided by their sum
    # HF router_aux_loss_coef: the weight of transformers' load-balancing loss in the checkpoint's own training; read,
    # not applied (an agent's moe.aux_loss_coeff weights the trainer's loss, docs/moe.md)
    aux_loss_coeff: float


@dataclass(frozen=True)
class Architecture:
    """What a megatron GPT model needs to know about a HF decoder."""

    hf_architecture: str  # e.g. "Qwen3ForCausalLM"
    family: str  # qwen3 | qwen2 | llama
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # key/value heads
    head_dim: int
    vocab_size: int  # the tokenizer's / HF embedding's rows, before megatron's padding
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Llama3RopeScaling]
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    max_position_embeddings: int
    # Gemma 3 (the defaults are the other families')
    activation: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    query_pre_attn_scalar: Optional[float] = None  # attention scale 1/sqrt(this); None: 1/sqrt(head_dim)
    sliding_window: Optional[int] = None  # keys a sliding layer sees, its own included (HF's `sliding_window`)
    layer_types: Tuple[str, ...] = ()  # per layer: sliding_attention | full_attention; (): all full
    sliding_rope_theta: Optional[float] = None  # RoPE base of the sliding layers (`rope_theta` is the full ones')
    # Qwen3-MoE: every layer's MLP is a mixture of experts (None: a dense MLP of ffn_hidden_size)
    moe: Optional[MoE] = None

    @property
    def layout_shape(self) -> Dict[str, int]:
        """What a TP x PP layout must divide (presets.layout_problems)."""
        return {"num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_query_groups,
                "num_hidden_layers": self.num_layers, "num_experts": self.moe.num_experts if self.moe else 0}

    @property
    def softmax_scale(self) -> Optional[float]:
        """The attention scale megatron must use; None: its default 1/sqrt(head_dim)."""
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5

    @property
    def sliding_layers(self) -> List[int]:
        """1 for each layer with a sliding window, 0 for a full-attention one (megatron's window_attn_skip_freq)."""
        return [int(layer_type == SLIDING_ATTENTION) for layer_type in self.layer_types]


HFConfig = Union[Mapping[str, Any], "transformers.PretrainedConfig"]  # noqa: F821


def supported_architectures_message() -> str:
    return "supported architectures: " + ", ".join(SUPPORTED_ARCHITECTURES)


def normalized_hf_config(hf_config: HFConfig) -> "transformers.PretrainedConfig":  # noqa: F821
    """The transformers config object for a dict, with transformers' defaults and 5.x rope fields."""
    import transformers

    if isinstance(hf_config, transformers.PretrainedConfig):
        return hf_config
    values: Dict[str, Any] = dict(hf_config)
    architecture = _hf_architecture_name(values)
    model_type = values.pop("model_type", None) or {v: k for k, v in _MODEL_TYPE_TO_ARCHITECTURE.items()}[architecture]
    return transformers.AutoConfig.for_model(model_type, **values)


def _hf_architecture_name(values: Mapping[str, Any]) -> str:
    names = list(values.get("architectures") or [])
    if not names and values.get("model_type") in _MODEL_TYPE_TO_ARCHITECTURE:
        names = [_MODEL_TYPE_TO_ARCHITECTURE[values["model_type"]]]
    for name in names:
        if name in _FAMILIES:
            return name
    raise ValueError(f"unsupported architecture {names or values.get('model_type')!r}; "
                     + supported_architectures_message())


def _rope(config: Any) -> tuple[float, Optional[Llama3RopeScaling]]:
    """RoPE base and scaling from 5.x `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy_scaling = getattr(config, "rope_scaling", None)
    if legacy_scaling:
        params = {**dict(legacy_scaling), **params}
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        return theta, Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")


def _gemma3_settings(config: Any) -> Dict[str, Any]:
    """Gemma 3's own numbers (HF Gemma3TextConfig), after refusing what models/gemma3.py does not build."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2's; None in every Gemma 3
        if getattr(config, name, None) is not None:
            raise ValueError(f"Gemma 3 with {name}={getattr(config, name)} is not supported")
    if getattr(config, "use_bidirectional_attention", False) or getattr(config, "attention_bias", False):
        raise ValueError("Gemma 3 with use_bidirectional_attention or attention_bias is not supported")
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 with hidden_activation {activation!r} is not supported (gelu_pytorch_tanh only)")
    layer_types = tuple(config.layer_types)
    unknown = set(layer_types) - {SLIDING_ATTENTION, FULL_ATTENTION}
    if unknown or len(layer_types) != int(config.num_hidden_layers):
        raise ValueError(f"Gemma 3 layer_types must name one of {SLIDING_ATTENTION}, {FULL_ATTENTION} per layer, "
                         f"got {list(layer_types)}")
    thetas = {}
    for layer_type in (FULL_ATTENTION, SLIDING_ATTENTION):  # transformers 5.x: one rope_parameters per layer type
        params = dict(config.rope_parameters[layer_type])
        if params.get("rope_type", "default") != "default":  # the larger Gemma 3 scale their full layers' RoPE
            raise ValueError(f"Gemma 3 with rope_type {params['rope_type']!r} on {layer_type} layers is not supported "
                             "(default only)")
        thetas[layer_type] = float(params["rope_theta"])
    return dict(activation=activation, query_pre_attn_scalar=float(config.query_pre_attn_scalar),
                sliding_window=int(config.sliding_window), layer_types=layer_types,
                rope_theta=thetas[FULL_ATTENTION], sliding_rope_theta=thetas[SLIDING_ATTENTION])


# Keys of other MoE families' configs (Qwen2-MoE, DeepSeek) for shared experts, which Qwen3-MoE does not have
_SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")


def _qwen3_moe_settings(config: Any) -> Dict[str, Any]:
    """Qwen3-MoE's experts (HF Qwen3MoeConfig), after refusing, by key, what this family does not build here."""
    def unsupported(key: str, why: str) -> ValueError:
        return ValueError(f"Qwen3-MoE with {key}={getattr(config, key)!r} is not supported: {why}")

    for key in _SHARED_EXPERT_KEYS:
        if getattr(config, key, None):
            raise unsupported(key, "shared experts are not built for this family")
    # HF: layer i is MoE unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0; those are dense
    if int(getattr(config, "decoder_sparse_step", 1)) != 1:
        raise unsupported("decoder_sparse_step", "every layer must be a mixture of experts (1), as in the released "
                          "Qwen3-MoE models; dense layers between them are not built")
    if list(getattr(config, "mlp_only_layers", None) or []):
        raise unsupported("mlp_only_layers", "every layer must be a mixture of experts ([]), as in the released "
                          "Qwen3-MoE models; dense layers between them are not built")
    if getattr(config, "attention_bias", False):
        raise unsupported("attention_bias", "Qwen3's attention has no biases")
    experts, top_k = int(config.num_experts), int(config.num_experts_per_tok)
    if experts < 1:
        raise unsupported("num_experts", "a mixture of experts needs at least one expert")
    if not 1 <= top_k <= experts:
        raise unsupported("num_experts_per_tok", f"must be between 1 and num_experts ({experts})")
    norm_topk_prob = bool(config.norm_topk_prob)
    if top_k == 1 and norm_topk_prob:
        # transformers then weights each token's one expert by exactly 1; megatron refuses a softmax over a single
        # top-k logit (TransformerConfig: "Please use --moe-router-pre-softmax when topk is 1"), and its other form
        # weights the expert by its unnormalised probability: the two models would differ
        raise unsupported("norm_topk_prob", "with num_experts_per_tok=1 transformers weights the chosen expert by 1, "
                          "which megatron's router does not compute")
    return dict(moe=MoE(num_experts=experts, top_k=top_k, ffn_hidden_size=int(config.moe_intermediate_size),
                        norm_topk_prob=norm_topk_prob, aux_loss_coeff=float(config.router_aux_loss_coef)))


def read_architecture(hf_config: HFConfig) -> Architecture:
    """Reduce a HF config to the numbers a megatron model needs. ValueError if unsupported."""
    import transformers

    values = hf_config.to_dict() if isinstance(hf_config, transformers.PretrainedConfig) else dict(hf_config)
    hf_architecture = _hf_architecture_name(values)
    family, qkv_bias, qk_layernorm = _FAMILIES[hf_architecture]
    config = normalized_hf_config(hf_config)
    heads = int(config.num_attention_heads)
    if family == "gemma3":
        extra = _gemma3_settings(config)
        rope_theta, rope_scaling = extra.pop("rope_theta"), None
    else:
        if getattr(config, "use_sliding_window", False):
            raise ValueError(f"{hf_architecture} with use_sliding_window=True is not supported")
        if family == "llama" and (getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)):
            raise ValueError("Llama with attention_bias/mlp_bias is not supported")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (SwiGLU with silu only)")
        extra = _qwen3_moe_settings(config) if family == "qwen3_moe" else {}
        rope_theta, rope_scaling = _rope(config)
    return Architecture(
        hf_architecture=hf_architecture,
        family=family,
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        ffn_hidden_size=int(config.intermediate_size),
        num_attention_heads=heads,
        num_query_groups=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        vocab_size=int(config.vocab_size),
        rms_norm_eps=float(config.rms_norm_eps),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(config.tie_word_embeddings),
        qkv_bias=qkv_bias,
        qk_layernorm=qk_layernorm,
        max_position_embeddings=int(config.max_position_embeddings),
        **extra,
    )


def transformer_engine_available() -> bool:
    """TE layers need both the package and a GPU (TE does not import without CUDA/cuDNN)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def default_params_dtype() -> torch.dtype:
    """bf16 on GPU (what the rollout engines and RL frameworks use), fp32 on CPU (no fast bf16 matmul)."""
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def transformer_config(
    arch: Architecture,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    expert_parallel: int = 1,
    expert_tensor_parallel: Optional[int] = None,
    params_dtype: Optional[torch.dtype] = None,
    **overrides: Any,
) -> "megatron.core.transformer.TransformerConfig":  # noqa: F821
    """The megatron `TransformerConfig` of `arch` for one TP x PP layout (a mixture of experts: and its EP x ETP;
    ETP None: megatron's default, TP).

    `pipeline_model_parallel_size` must be set here: with the default (1) every stage builds all the
    layers. Dropout is off (RL log-prob ratios must be deterministic). On CPU: fp32 and CPU
    initialisation. Fusions: on a GPU megatron's compiled SwiGLU and bias-dropout-add; the others (CUDA kernels
    shipped with TE/apex) only where TE is.
    """
    megatron_cpu.apply()
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    on_gpu = torch.cuda.is_available()
    fused = transformer_engine_available()  # megatron's fused kernels come with TE/apex builds
    dtype = params_dtype or default_params_dtype()
    settings: Dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,  # SwiGLU: fc1 = [gate; up], silu(gate) * up
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        # the experts' layout (parallel/groups.py: the expert grid); EP > 1 marks the experts' weights as reduced over
        # the expert-data-parallel group (megatron's `allreduce = False`), so DDP and the optimizer treat them apart
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
        sequence_parallel=False,
        # Micro-batches of different [seq, batch] shapes: pipeline stages exchange shapes first.
        variable_seq_lengths=pipeline_parallel > 1,
        # No experts here, but TransformerConfig refuses variable_seq_lengths with the default
        # "allgather" MoE dispatcher even for dense models.
        moe_token_dispatcher_type="alltoall",
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=not on_gpu,
        # megatron's SwiGLU and bias-dropout-add fusions are torch code it compiles (megatron.core.jit: torch.compile):
        # on a GPU one Triton kernel each instead of 3-4 elementwise passes, with or without TE; on a CPU the eager ops
        bias_activation_fusion=fused or on_gpu,
        bias_dropout_fusion=fused or on_gpu,
        masked_softmax_fusion=fused,  # a CUDA kernel of TE/apex builds
        persist_layer_norm=fused,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,  # needs apex/TE fused wgrad kernels
    )
    if arch.family == "gemma3":
        settings.update(_gemma3_config_settings(arch))
    if arch.moe is not None:
        settings.update(moe_config_settings(arch.moe, expert_parallel=expert_parallel,
                                            pipeline_parallel=pipeline_parallel))
    settings.update(overrides)
    return TransformerConfig(**settings)


def _gemma3_config_settings(arch: Architecture) -> Dict[str, Any]:
    """What a Gemma 3 model changes in megatron's config (models/gemma3.py builds the modules that read it)."""
    from hacpo_megatron.models.gemma3 import gelu_tanh

    return dict(
        activation_func=gelu_tanh,  # GeGLU: fc1 = [gate; up], gelu_tanh(gate) * up
        # megatron's fused bias-activation kernels know silu and erf-gelu only
        bias_activation_fusion=False,
        softmax_scale=arch.softmax_scale,
        # megatron's sliding window: keys from query - left to query + right; HF's window counts the query
        window_size=(arch.sliding_window - 1, 0),
        window_attn_skip_freq=arch.sliding_layers,  # a list: 1 where the layer slides
        # TE's name for x * (1 + w); the local spec's Gemma3RMSNorm computes that whatever this says
        layernorm_zero_centered_gamma=True,
    )


def moe_config_settings(moe: MoE, *, expert_parallel: int = 1, pipeline_parallel: int = 1) -> Dict[str, Any]:
    """megatron's MoE settings that compute what transformers' Qwen3-MoE block computes (the class `MoE` says how
    the two routers' weights correspond). Dropless: no capacity factor, so no token is dropped and a token's output
    does not depend on the other tokens of its micro-batch (how rows are packed).

    The token dispatcher: at expert parallelism 1 and PP 1 `allgather`, which only permutes tokens locally (megatron
    refuses it with `variable_seq_lengths`, i.e. PP > 1: there, as at EP > 1, `alltoall`, which at EP 1 exchanges
    nothing). At EP > 1 `alltoall`: each EP rank sends every token to the ranks of its experts and gets the outputs
    back, in any numbers (megatron's all-to-all with split sizes). The allgather one would gather every EP rank's
    hidden states into one tensor, which needs the same token count on every EP rank, and EP ranks are data-parallel
    replicas whose micro-batches differ. Either way the EP ranks run their forward and backward passes in step
    (models/logprobs.py: `in_step_with_expert_peers`). On a CPU the alltoall dispatcher runs with megatron_cpu's
    shim; each token's experts compute the same numbers either way."""
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.norm_topk_prob,  # softmax over all, then top-k: no renormalisation
        moe_router_topk_scaling_factor=None,
        moe_token_dispatcher_type="allgather" if expert_parallel == 1 and pipeline_parallel == 1 else "alltoall",
        moe_expert_capacity_factor=None,  # dropless
        moe_pad_expert_input_to_capacity=False,
        # megatron's own load-balancing loss is off: the trainer adds it per model (models/moe_router.py), weighted by
        # the agent's moe.aux_loss_coeff; the checkpoint's router_aux_loss_coef (MoE.aux_loss_coeff) is not applied
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        moe_input_jitter_eps=None,
        moe_shared_expert_intermediate_size=None,
        moe_grouped_gemm=False,  # SequentialMLP: one MLP per expert (grouped GEMM needs TE)
        moe_permute_fusion=False,  # TE kernels
        moe_router_fusion=False,
    )


def layer_spec(arch: Architecture, *, use_transformer_engine: Optional[bool] = None,
               config: Any = None) -> "ModuleSpec":  # noqa: F821
    """Transformer Engine layers where TE works, megatron's local (torch) layers otherwise, with a core
    attention that computes shared-prompt rows in dense blocks (models/attention.py).

    Gemma 3 gets its own block spec (models/gemma3.py), which needs the model's TransformerConfig (`config`).
    """
    megatron_cpu.apply()
    if arch.family == "gemma3":
        from hacpo_megatron.models.gemma3 import gemma3_block_spec

        if config is None:
            raise ValueError("layer_spec of Gemma 3 needs the model's TransformerConfig")
        if use_transformer_engine is None:
            use_transformer_engine = transformer_engine_available()
        return gemma3_block_spec(config, use_transformer_engine=use_transformer_engine)
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_available()
    # a mixture of experts: megatron's MoE layer, one MLP per expert (SequentialMLP; no grouped GEMM)
    experts = dict(num_experts=arch.moe.num_experts, moe_grouped_gemm=False) if arch.moe is not None else {}
    if use_transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_layernorm, **experts)
    from hacpo_megatron.models.attention import CoreAttention

    spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_layernorm, normalization="RMSNorm", **experts)
    spec.submodules.self_attention.submodules.core_attention = CoreAttention
    return spec
