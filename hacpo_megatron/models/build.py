"""Build one agent's megatron GPT model (this rank's pipeline stage, this rank's TP shard).

    groups = create_agent_groups(cfg.agents)                  # collective, every rank
    for agent_cfg, parallel in zip(cfg.agents, groups):
        if parallel.is_member:
            agent = build_agent_model(load_hf_config_dict(agent_cfg.model), parallel, seed=cfg.run.seed)

The model is a plain `GPTModel` (no DDP wrapper): training wraps it, inference uses it as is.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from hacpo_megatron import megatron_cpu
from hacpo_megatron.models.architectures import (
    Architecture,
    HFConfig,
    layer_spec,
    read_architecture,
    transformer_config,
    transformer_engine_available,
)
from hacpo_megatron.models.attention import resolve_attention
from hacpo_megatron.models.presets import layout_problems
from hacpo_megatron.parallel.groups import AgentParallel

# Megatron pads the vocabulary so each TP shard of the embedding/output has a multiple of 128 rows
# (`--make-vocab-size-divisible-by 128`): aligned GEMMs, and every TP shard the same size.
VOCAB_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tensor_parallel: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """The smallest multiple of `multiple * tensor_parallel` that holds `vocab_size` rows."""
    step = multiple * tensor_parallel
    return -(-vocab_size // step) * step


@dataclass
class AgentModel:
    """One agent's model on this rank and what the rest of the code needs to know about it."""

    model: Any  # megatron GPTModel: this rank's pipeline stage and TP shard
    arch: Architecture
    parallel: AgentParallel
    padded_vocab_size: int  # rows of the embedding/output layer across all TP shards
    # megatron's local attention with its unfused softmax applies a given mask (the fused causal kernel
    # ignores it) and the unfused RoPE takes per-row positions, so responses can share their prompt's row
    # (models/packing.py); Transformer Engine's layers are not set up for that here
    takes_attention_mask: bool = False
    # the core attention's kernel (models/attention.py: local, sdpa, flex, or auto-gpu), `train.attention` resolved
    # for this device; Transformer Engine's layers have their own
    attention: str = "local"

    @property
    def config(self) -> Any:
        """The model's megatron TransformerConfig."""
        return self.model.config

    @property
    def vocab_size(self) -> int:
        """The true vocabulary; rows beyond it are padding and never receive probability."""
        return self.arch.vocab_size


def seed_model_parallel_rng(seed: int, parallel: AgentParallel) -> None:
    """Seed the CPU generator and megatron's tensor-parallel RNG tracker for one agent.

    Like megatron's `pretrain`: each pipeline stage gets `seed + 100 * pp_rank` (stages draw
    different layers); all TP ranks of a stage share it, because with CPU initialisation every TP
    rank draws the full weight and keeps its slice. The tracker gives TP ranks distinct streams for
    tensor-parallel dropout/initialisation (`model_parallel_cuda_manual_seed`), and EP x ETP ranks distinct
    streams for their experts ("expert-parallel-rng": the same on the replicas of an expert, expert-DP): an
    MoE layer's experts are drawn from it (on a GPU by megatron itself; on a CPU `_experts_from_expert_rng`).
    """
    megatron_cpu.apply()
    from megatron.core import tensor_parallel

    stage_seed = seed + 100 * parallel.pp_rank
    torch.manual_seed(stage_seed)  # also seeds CUDA where present
    tensor_parallel.model_parallel_cuda_manual_seed(
        stage_seed, tp_rank=parallel.tp_rank, ep_rank=parallel.ep_rank, etp_rank=parallel.etp_rank,
        force_reset_rng=True,
    )


@contextlib.contextmanager
def _experts_from_expert_rng(active: bool) -> Iterator[None]:
    """With CPU initialisation (`use_cpu_initialization`) megatron draws every weight, the experts' too, from the
    default generator, which every rank of a stage seeds alike: at EP > 1 the experts of EP rank 1 would equal
    those of EP rank 0. Inside this block an MoE layer's experts are drawn from the "expert-parallel-rng" tracker
    state instead (distinct per EP x ETP rank), as megatron's GPU initialisation draws them; the default generator
    is left where it was, so the replicated weights stay equal on every rank. Not active: nothing changes."""
    if not active:
        yield
        return
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
    from megatron.core.transformer.moe.experts import SequentialMLP

    original = SequentialMLP.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            original(self, *args, **kwargs)

    SequentialMLP.__init__ = init
    try:
        yield
    finally:
        SequentialMLP.__init__ = original


def check_layout(arch: Architecture, parallel: AgentParallel, *, training: bool = True) -> None:
    """ValueError if the model cannot be split this way (heads over TP, layers over PP, experts over EP); `training`:
    also where training does not take the layout yet (presets.layout_problems)."""
    # the experts' TP as configured (AgentParallel keeps megatron's default, TP, where EP and ETP are 1)
    expert_tensor = parallel.etp_size if parallel.ep_size > 1 or parallel.etp_size != parallel.tp_size else 1
    problems = layout_problems(arch.layout_shape, parallel.tp_size, parallel.pp_size, arch.hf_architecture,
                               dp=parallel.dp_size, ep=parallel.ep_size, etp=expert_tensor, training=training)
    if problems:
        raise ValueError(f"{parallel.name}: " + "; ".join(problems.values()))


def build_agent_model(
    hf_config: HFConfig,
    parallel: AgentParallel,
    *,
    seed: int = 1234,
    params_dtype: Optional[torch.dtype] = None,
    use_transformer_engine: Optional[bool] = None,
    attention: str = "auto",
    training: bool = True,
    **config_overrides: Any,
) -> AgentModel:
    """This rank's part of the agent's GPTModel, randomly initialised (load weights afterwards).

    Call only on the agent's members; not collective beyond the agent (tied embeddings with PP > 1
    all-reduce the output-layer copy over the agent's embedding group). `attention`: `train.attention`.
    `training` False: a model for its weights and its passes in eval mode only (the conversion tools), which takes
    the layouts training does not take yet (a mixture of experts at TP > 1: presets.layout_problems).
    """
    megatron_cpu.apply()
    from megatron.core.models.gpt import GPTModel

    if not parallel.is_member:
        raise RuntimeError(f"rank {parallel.rank} builds no part of agent {parallel.name!r}")
    arch = read_architecture(hf_config)
    check_layout(arch, parallel, training=training)
    seed_model_parallel_rng(seed, parallel)
    config = transformer_config(
        arch, tensor_parallel=parallel.tp_size, pipeline_parallel=parallel.pp_size,
        expert_parallel=parallel.ep_size, expert_tensor_parallel=parallel.etp_size,
        params_dtype=params_dtype, **config_overrides,
    )
    vocab = padded_vocab_size(arch.vocab_size, parallel.tp_size)
    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_available()
    model_class, family_kwargs = GPTModel, {}
    if arch.family == "gemma3":  # its own layer, two RoPE bases, scaled embeddings (models/gemma3.py)
        from hacpo_megatron.models.gemma3 import Gemma3Model

        model_class, family_kwargs = Gemma3Model, dict(sliding_rotary_base=arch.sliding_rope_theta)
    experts_split = arch.moe is not None and parallel.ep_size * parallel.etp_size > 1
    with _experts_from_expert_rng(experts_split and config.use_cpu_initialization):
        model = model_class(
            config=config,
            transformer_layer_spec=layer_spec(arch, use_transformer_engine=use_transformer_engine, config=config),
            vocab_size=vocab,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=parallel.is_first_stage,
            post_process=parallel.is_last_stage,
            parallel_output=True,  # logits stay split over TP: log-probs are computed vocab-parallel
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=arch.rope_theta,
            rope_scaling=False,  # llama3 scaling is applied below with all four HF parameters
            pg_collection=parallel.pg_collection,
            **family_kwargs,
        )
    _apply_llama3_rope_scaling(model, arch)
    if config.params_dtype != torch.float32:
        # What megatron's Float16Module does to a bf16/fp16 model: every parameter in that dtype, the norm
        # weights too (torch's RMSNorm is created in the default fp32).
        model.to(config.params_dtype)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        model.cuda(device)
    if use_transformer_engine and attention != "auto":
        raise ValueError(f"train.attention: {attention} applies to megatron's local layers; with Transformer Engine "
                         "its own fused attention runs (leave it auto)")
    return AgentModel(model=model, arch=arch, parallel=parallel, padded_vocab_size=vocab,
                      takes_attention_mask=not (use_transformer_engine or config.apply_rope_fusion
                                                 or config.masked_softmax_fusion),
                      attention=resolve_attention(attention, device))


def _apply_llama3_rope_scaling(model: Any, arch: Architecture) -> None:
    """Rescale RoPE frequencies as HF's `rope_type: llama3` does.

    GPTModel(rope_scaling=True) passes only `factor` and fixes low/high_freq_factor (1, 4) and
    original_max_position_embeddings (8192) to Llama 3.1's values; calling its `_apply_scaling` (the
    HF formula) with the config's own values covers every llama3-scaled checkpoint.
    """
    scaling = arch.rope_scaling
    if scaling is None:
        return
    rotary = model.rotary_pos_emb
    rotary.inv_freq = rotary._apply_scaling(
        rotary.inv_freq,
        factor=scaling.factor,
        low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position_embeddings,
    )
