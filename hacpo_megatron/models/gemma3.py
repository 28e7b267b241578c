"""Gemma 3 in megatron-core: its own layer, layer spec and GPTModel subclass.

A Gemma 3 decoder differs from the Llama-style layer of the other families (models/architectures.py) in ways a
switch cannot express, so it has its own modules here instead of flags threaded through the shared layer:

=========================  ======================================  ==========================================
what                       Gemma 3 (HF modeling_gemma3.py)         here
=========================  ======================================  ==========================================
norms                      RMSNorm computing x * (1 + w) in fp32   `Gemma3RMSNorm` (weights stored as HF's w)
layer                      sandwich: a norm before AND after the    `Gemma3TransformerLayer`: megatron's layer
                           attention and the MLP, then residual     plus `post_self_attn_layernorm` /
                                                                    `post_mlp_layernorm`
QK-norm                    (1 + w) RMSNorm over each head           `Gemma3RMSNorm` as q/k_layernorm
MLP                        GeGLU, gelu with tanh approximation      gated fc1, `gelu_tanh`
attention scale            1 / sqrt(query_pre_attn_scalar)          `TransformerConfig.softmax_scale`
sliding window             `sliding_window` keys on the layers      megatron's `window_size` (W - 1, 0) and
                           `layer_types` calls sliding_attention    `window_attn_skip_freq` (a per-layer list)
RoPE                       base 10k on sliding layers, 1M on full   `LayerTypeRotary`: both tables, each layer
                                                                    takes its own (`RotaryPair`)
embeddings                 scaled by sqrt(hidden), in the           `Gemma3Model._preprocess`
                           embedding's dtype
final norm                 (1 + w)                                  the block spec's `layer_norm`
=========================  ======================================  ==========================================

The local spec (CPU and any machine without Transformer Engine) uses megatron's torch modules and the project's
blocked shared-prompt attention (models/attention.py), which honours the window and the scale too. The
Transformer Engine spec is written as far as it can be without TE (it does not import here): TE's fused
norm+linear modules with `layernorm_zero_centered_gamma` (TE's name for x * (1 + w)); it is untested (no CUDA
machine with TE has run it).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
import torch.nn.functional as F

from hacpo_megatron import megatron_cpu

megatron_cpu.apply()
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules  # noqa: E402
from megatron.core.transformer.utils import is_layer_window_attention  # noqa: E402
from megatron.core.utils import make_viewless_tensor  # noqa: E402

SLIDING = "sliding_attention"
FULL = "full_attention"


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """HF's `gelu_pytorch_tanh` (a named function, not a lambda: the config is deep-copied and compared)."""
    return F.gelu(x, approximate="tanh")


class Gemma3RMSNorm(torch.nn.Module):
    """RMSNorm with zero-centred weights, as HF's Gemma3RMSNorm: (x / rms(x)) * (1 + w), computed in float32 and
    cast back to the input's dtype. The weight holds HF's w as it is (zeros at initialisation), so the mapping to
    HF is the identity. Built like megatron's norms (`config=, hidden_size=, eps=`)."""

    def __init__(self, config: Any = None, hidden_size: int = 0, eps: float = 1e-6, **_unused: Any):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


# ------------------------------------------------------------------------------------------------
# RoPE per layer type
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RotaryPair:
    """The rotary angles of both layer types; each layer takes its own (`Gemma3TransformerLayer`).

    Not a tuple: megatron's attention reads a tuple `rotary_pos_emb` as (query angles, key angles), so a pair that
    reached it unpicked would be applied silently; this class makes that an error.
    """

    full: torch.Tensor
    sliding: torch.Tensor


class LayerTypeRotary(torch.nn.Module):
    """Megatron's RotaryEmbedding twice, with the full-attention and the sliding-window base.

    It stands where GPTModel keeps its one rotary module (`model.rotary_pos_emb`), so GPTModel's own forward
    hands the pair to every layer as `rotary_pos_emb`.
    """

    def __init__(self, full: RotaryEmbedding, sliding: RotaryEmbedding):
        super().__init__()
        self.full, self.sliding = full, sliding

    def forward(self, *args: Any, **kwargs: Any) -> RotaryPair:
        return RotaryPair(self.full(*args, **kwargs), self.sliding(*args, **kwargs))

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return self.full.get_rotary_seq_len(*args, **kwargs)

    def at_positions(self, position_ids: torch.Tensor) -> RotaryPair:
        """Both tables at per-row positions (shared-prompt rows, models/logprobs.py: rotary_at_positions)."""
        from hacpo_megatron.models.attention import rotary_freqs_at_positions

        return RotaryPair(rotary_freqs_at_positions(self.full, position_ids),
                          rotary_freqs_at_positions(self.sliding, position_ids))


# ------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------
@dataclass
class Gemma3LayerSubmodules(TransformerLayerSubmodules):
    """Megatron's layer submodules plus the norms after the attention and after the MLP."""

    post_self_attn_layernorm: Any = None
    post_mlp_layernorm: Any = None


class Gemma3TransformerLayer(TransformerLayer):
    """Gemma 3's decoder layer (HF Gemma3DecoderLayer):

        h = x + post_attn_norm(attention(input_norm(x)))
        y = h + post_mlp_norm(mlp(pre_mlp_norm(h)))

    Megatron's TransformerLayer builds the attention, the MLP and the two pre-norms; this class adds the two
    post-norms and a forward in that order, and gives its attention the RoPE of its layer type.
    """

    def __init__(self, config: Any, submodules: Gemma3LayerSubmodules, layer_number: int = 1, **kwargs: Any):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kwargs)
        if config.add_bias_linear:
            raise ValueError("Gemma 3 has no linear biases (its post-norms would have to see them)")
        norm = dict(config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)
        self.post_self_attn_layernorm = submodules.post_self_attn_layernorm(**norm)
        self.post_mlp_layernorm = submodules.post_mlp_layernorm(**norm)
        # self.layer_number is global (1-based, pipeline offset included): the same list decides the window of
        # the core attention (DotProductAttention reads it the same way)
        self.is_sliding = is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                                    self.layer_number)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Any = None, inference_context: Any = None, packed_seq_params: Any = None,
                **kwargs: Any):
        if isinstance(rotary_pos_emb, RotaryPair):
            rotary_pos_emb = rotary_pos_emb.sliding if self.is_sliding else rotary_pos_emb.full
        attention_kwargs = {k: kwargs.get(k) for k in ("rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin",
                                                       "attention_bias", "sequence_len_offset")}
        residual = hidden_states
        attention_output, _ = self.self_attention(
            self.input_layernorm(hidden_states), attention_mask=attention_mask, inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params, **attention_kwargs,
        )
        hidden_states = self._add_residual(self.self_attn_bda, self.post_self_attn_layernorm(attention_output),
                                           residual)

        residual = hidden_states
        mlp_output, _ = self.mlp(self.pre_mlp_layernorm(hidden_states))
        hidden_states = self._add_residual(self.mlp_bda, self.post_mlp_layernorm(mlp_output), residual)
        # as megatron's layer: the schedule frees outputs in place, which a view would not allow
        output = make_viewless_tensor(inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True)
        return output, None

    def _add_residual(self, bias_dropout_add: Any, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + dropout(x), through megatron's bias-dropout-add (no bias: Gemma has none)."""
        with self.bias_dropout_add_exec_handler():
            return bias_dropout_add(self.training, self.config.bias_dropout_fusion)((x, None), residual,
                                                                                     self.hidden_dropout)


# ------------------------------------------------------------------------------------------------
# Specs
# ------------------------------------------------------------------------------------------------
def gemma3_block_spec(config: Any, *, use_transformer_engine: bool) -> Any:
    """A TransformerBlock spec: this stage's Gemma 3 layers and the (1 + w) final norm.

    A block spec, not a layer spec: given a layer spec, megatron's TransformerBlock would build its final norm
    from its default norm class (x * w).
    """
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    layer, final_norm = (_te_layer_spec() if use_transformer_engine else _local_layer_spec())
    layers_here = config.num_layers // config.pipeline_model_parallel_size
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[layer] * layers_here, layer_norm=final_norm))


def _local_layer_spec():
    """megatron's torch modules, Gemma3RMSNorm everywhere, the project's blocked shared-prompt core attention."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from hacpo_megatron.models.attention import CoreAttention

    layer = ModuleSpec(module=Gemma3TransformerLayer, submodules=Gemma3LayerSubmodules(
        input_layernorm=Gemma3RMSNorm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(
                                      linear_qkv=ColumnParallelLinear, core_attention=CoreAttention,
                                      linear_proj=RowParallelLinear, q_layernorm=Gemma3RMSNorm,
                                      k_layernorm=Gemma3RMSNorm)),
        self_attn_bda=get_bias_dropout_add,
        post_self_attn_layernorm=Gemma3RMSNorm,
        pre_mlp_layernorm=Gemma3RMSNorm,
        mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                   linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add,
        post_mlp_layernorm=Gemma3RMSNorm,
        # checkpoint keys as the TE spec names them (its pre-norms live inside the fused linears), like
        # megatron's local spec does: a checkpoint loads into either
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                                     "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
    ))
    return layer, Gemma3RMSNorm


def _te_layer_spec():  # pragma: no cover - needs CUDA and Transformer Engine (untested)
    """Transformer Engine: pre-norms fused into the QKV and fc1 linears; x * (1 + w) through the config's
    `layernorm_zero_centered_gamma`, which TE's norms honour."""
    from megatron.core.extensions.transformer_engine import (
        TEDotProductAttention, TELayerNormColumnParallelLinear, TENorm, TERowParallelLinear,
    )
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    layer = ModuleSpec(module=Gemma3TransformerLayer, submodules=Gemma3LayerSubmodules(
        input_layernorm=IdentityOp,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(
                                      linear_qkv=TELayerNormColumnParallelLinear, core_attention=TEDotProductAttention,
                                      linear_proj=TERowParallelLinear, q_layernorm=TENorm, k_layernorm=TENorm)),
        self_attn_bda=get_bias_dropout_add,
        post_self_attn_layernorm=TENorm,
        pre_mlp_layernorm=IdentityOp,
        mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=TELayerNormColumnParallelLinear,
                                                                   linear_fc2=TERowParallelLinear)),
        mlp_bda=get_bias_dropout_add,
        post_mlp_layernorm=TENorm,
    ))
    return layer, TENorm


# ------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------
class Gemma3Model(GPTModel):
    """GPTModel with Gemma 3's two RoPE tables and scaled embeddings (see the module docstring)."""

    def __init__(self, *args: Any, sliding_rotary_base: float, **kwargs: Any):
        super().__init__(*args, **kwargs)  # rotary_base: the full-attention layers' base
        config = self.config
        sliding = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                                  rotary_interleaved=config.rotary_interleaved, rotary_base=sliding_rotary_base,
                                  use_cpu_initialization=config.use_cpu_initialization, cp_group=self.pg_collection.cp)
        self.rotary_pos_emb = LayerTypeRotary(full=self.rotary_pos_emb, sliding=sliding)

    def _preprocess(self, input_ids: torch.Tensor, position_ids: torch.Tensor, decoder_input: Any = None,
                    **kwargs: Any):
        """Embeddings times sqrt(hidden) (HF Gemma3TextScaledWordEmbedding: the factor as a float32 scalar, cast
        to the embedding's dtype, so a bf16 model multiplies by bf16(sqrt(h)) as HF does), then GPTModel's own
        preprocessing (which leaves given decoder inputs as they are)."""
        if decoder_input is None and self.pre_process:
            if self.config.sequence_parallel:
                raise NotImplementedError("Gemma 3 with sequence parallelism")  # megatron would scatter here
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
            scale = torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.float32)
            decoder_input = decoder_input * scale.to(device=decoder_input.device, dtype=decoder_input.dtype)
        return super()._preprocess(input_ids, position_ids, decoder_input=decoder_input, **kwargs)
