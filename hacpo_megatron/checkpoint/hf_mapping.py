"""Megatron <-> Hugging Face weights for Qwen3, Qwen2/2.5, Llama 3.x, Gemma 3 and Qwen3-MoE, in one place.

A weight goes through three forms:

    HF tensors  <-- to_hf / from_hf -->  full megatron tensor  <-- shard / unshard -->  TP shard
    (q, k, v)                            (the TP=1 layout)                             (this rank)

`TensorMap` names one weight in both worlds and its `Kind` says how the two conversions go:

=========== ========================================== =========================================
kind        full megatron tensor from HF               TP shard
=========== ========================================== =========================================
REPLICATED  the same tensor (norm weights)             the whole tensor on every TP rank
COLUMN      the same tensor                            rows split in TP chunks
ROW         the same tensor (o_proj, down_proj)        columns split in TP chunks
QKV         per query group g: [q heads of g; k_g; v_g] rows split in TP chunks (= whole groups)
            i.e. [ng, (q_per_group + 2) * head_dim, h]
GATED       [gate; up] (SwiGLU fc1)                    [gate chunk r; up chunk r]
VOCAB       rows padded with zeros to megatron's        rows split in TP chunks
            padded vocabulary (embedding, lm_head)
=========== ========================================== =========================================

Pipeline parallelism only decides which stage holds a layer: local layer i of a stage is global
layer `layer.layer_number - 1`. The layer norms of the TE spec live inside the fused linear
(`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`); a `TensorMap` lists both names.

Qwen3-MoE replaces the MLP maps with its router (HF `mlp.gate.weight`, megatron `mlp.router.weight`, REPLICATED)
and, per expert e, a GATED fc1 and a ROW fc2 as the dense MLP has them (`mlp.experts.{e}.gate_proj/up_proj/down_proj`
<-> `mlp.experts.local_experts.{e}.linear_fc1/linear_fc2`: megatron's SequentialMLP). These are the names of HF
checkpoints (what `save_pretrained` writes, one tensor per expert); transformers 5 holds the experts fused in memory
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), and loading takes that form too
(checkpoint/hf_experts.py).

Expert parallelism (EP): EP rank r holds each layer's experts [r * E / EP, (r + 1) * E / EP) as its local experts
0 .. E / EP - 1 (megatron's MoE layer keeps their global indices in `local_expert_indices`, which `local_tensors`
reads). Loading maps each local expert to its global HF tensors; exporting takes each expert from its owner (the EP
rank that holds it, expert-data-parallel replica 0) and every other tensor from data-parallel replica 0, so every
tensor is sent once. An expert is split over the experts' own TP (ETP, its group `expt_tp`) where the dense weights
are split over TP.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hacpo_megatron.checkpoint.hf_experts import PerExpertView
from hacpo_megatron.models.architectures import Architecture, HFConfig, read_architecture
from hacpo_megatron.models.build import padded_vocab_size
from hacpo_megatron.parallel.groups import AgentParallel, collective_device


class Kind(enum.Enum):
    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"
    QKV = "qkv"
    GATED = "gated"
    VOCAB = "vocab"


@dataclass(frozen=True)
class TensorMap:
    megatron: Tuple[str, ...]  # alternative names (local spec first, TE spec second); one exists
    hf: Tuple[str, ...]  # the HF tensors that make up the megatron tensor, in order
    kind: Kind
    expert: Optional[int] = None  # an MoE expert's weight: its global index (its TP is the experts', ETP)


# ------------------------------------------------------------------------------------------------
# The name tables
# ------------------------------------------------------------------------------------------------
_QKV = TensorMap(("self_attention.linear_qkv.weight",),
                 ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), Kind.QKV)
_O_PROJ = TensorMap(("self_attention.linear_proj.weight",), ("self_attn.o_proj.weight",), Kind.ROW)
_FC1 = TensorMap(("mlp.linear_fc1.weight",), ("mlp.gate_proj.weight", "mlp.up_proj.weight"), Kind.GATED)
_FC2 = TensorMap(("mlp.linear_fc2.weight",), ("mlp.down_proj.weight",), Kind.ROW)
_QK_NORMS = [  # RMSNorm over each head's head_dim, shared by all heads
    TensorMap(("self_attention.q_layernorm.weight",), ("self_attn.q_norm.weight",), Kind.REPLICATED),
    TensorMap(("self_attention.k_layernorm.weight",), ("self_attn.k_norm.weight",), Kind.REPLICATED),
]


def _pre_norm(megatron: str, fused_te_name: str, hf: str) -> TensorMap:
    """A norm before the attention or the MLP: its own module in the local spec, inside the fused linear in TE's."""
    return TensorMap((f"{megatron}.weight", fused_te_name), (f"{hf}.weight",), Kind.REPLICATED)


def layer_tensor_maps(arch: Architecture, experts: Optional[Sequence[int]] = None) -> List[TensorMap]:
    """One decoder layer; names relative to `decoder.layers.{i}.` and `model.layers.{i}.`. `experts`: the global
    indices of the layer's local experts (an EP rank's share); None: all of them, in order (EP 1)."""
    if arch.family == "gemma3":
        return _gemma3_layer_tensor_maps()
    maps = [
        _pre_norm("input_layernorm", "self_attention.linear_qkv.layer_norm_weight", "input_layernorm"),
        _QKV,
        _O_PROJ,
        # HF Llama/Qwen call the pre-MLP norm post_attention_layernorm
        _pre_norm("pre_mlp_layernorm", "mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm"),
        *(_moe_tensor_maps(range(arch.moe.num_experts) if experts is None else experts)
          if arch.moe is not None else [_FC1, _FC2]),
    ]
    if arch.qkv_bias:  # Qwen2
        maps.append(TensorMap(("self_attention.linear_qkv.bias",),
                              ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), Kind.QKV))
    if arch.qk_layernorm:  # Qwen3
        maps += _QK_NORMS
    return maps


def _moe_tensor_maps(experts: Sequence[int]) -> List[TensorMap]:
    """A Qwen3-MoE layer's router and experts: megatron's local expert i is HF's expert `experts[i]` (all of them at
    expert parallelism 1; an EP rank's share otherwise). Each expert's fc1 is [gate; up] and its fc2 the down
    projection, split over the experts' TP as the dense MLP's are over TP."""
    maps = [TensorMap(("mlp.router.weight",), ("mlp.gate.weight",), Kind.REPLICATED)]
    for i, e in enumerate(experts):
        maps += [
            TensorMap((f"mlp.experts.local_experts.{i}.linear_fc1.weight",),
                      (f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight"), Kind.GATED, expert=e),
            TensorMap((f"mlp.experts.local_experts.{i}.linear_fc2.weight",), (f"mlp.experts.{e}.down_proj.weight",),
                      Kind.ROW, expert=e),
        ]
    return maps


def _gemma3_layer_tensor_maps() -> List[TensorMap]:
    """Gemma 3's sandwich layer (models/gemma3.py). Its norms store HF's zero-centred weights as they are (both
    compute x * (1 + w)), so every map is the identity; the names differ: HF's post_attention_layernorm is the
    norm AFTER the attention here (in Llama it is the pre-MLP norm)."""
    return [
        _pre_norm("input_layernorm", "self_attention.linear_qkv.layer_norm_weight", "input_layernorm"),
        _QKV,
        _O_PROJ,
        *_QK_NORMS,
        TensorMap(("post_self_attn_layernorm.weight",), ("post_attention_layernorm.weight",), Kind.REPLICATED),
        _pre_norm("pre_mlp_layernorm", "mlp.linear_fc1.layer_norm_weight", "pre_feedforward_layernorm"),
        _FC1,
        _FC2,
        TensorMap(("post_mlp_layernorm.weight",), ("post_feedforward_layernorm.weight",), Kind.REPLICATED),
    ]


EMBEDDING = TensorMap(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), Kind.VOCAB)
FINAL_NORM = TensorMap(("decoder.final_layernorm.weight",), ("model.norm.weight",), Kind.REPLICATED)


def output_layer_map(arch: Architecture) -> TensorMap:
    # Tied: the last stage's output layer (its own copy when PP > 1) is HF's embedding.
    hf = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    return TensorMap(("output_layer.weight",), (hf,), Kind.VOCAB)


def _hf_layer(i: int, name: str) -> str:
    return f"model.layers.{i}.{name}"


# ------------------------------------------------------------------------------------------------
# The math: HF <-> full megatron tensor <-> TP shard (pure functions on tensors)
# ------------------------------------------------------------------------------------------------
def to_megatron(kind: Kind, hf: Sequence[torch.Tensor], arch: Architecture, padded_vocab: int) -> torch.Tensor:
    """The full (TP=1) megatron tensor from its HF tensors."""
    if kind is Kind.QKV:
        q, k, v = hf
        groups = arch.num_query_groups
        per_group = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
        return torch.cat(per_group, dim=1).reshape(-1, *q.shape[1:])
    if kind is Kind.GATED:
        return torch.cat(list(hf), dim=0)
    (tensor,) = hf
    if kind is Kind.VOCAB:
        padding = tensor.new_zeros(padded_vocab - tensor.shape[0], *tensor.shape[1:])
        return torch.cat([tensor, padding], dim=0)
    return tensor


def to_hf(kind: Kind, full: torch.Tensor, arch: Architecture) -> List[torch.Tensor]:
    """The HF tensors of a full (TP=1) megatron tensor; inverse of `to_megatron`."""
    if kind is Kind.QKV:
        groups, head_dim = arch.num_query_groups, arch.head_dim
        q_rows = arch.num_attention_heads // groups * head_dim
        per_group = full.reshape(groups, q_rows + 2 * head_dim, *full.shape[1:])
        q, k, v = torch.split(per_group, [q_rows, head_dim, head_dim], dim=1)
        return [t.reshape(-1, *full.shape[1:]) for t in (q, k, v)]
    if kind is Kind.GATED:
        return list(torch.chunk(full, 2, dim=0))
    if kind is Kind.VOCAB:
        return [full[: arch.vocab_size]]
    return [full]


def shard(kind: Kind, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank `tp_rank`'s part of a full megatron tensor."""
    if kind is Kind.REPLICATED:
        return full
    if kind is Kind.ROW:
        return torch.chunk(full, tp_size, dim=1)[tp_rank]
    if kind is Kind.GATED:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size, dim=0)[tp_rank], torch.chunk(up, tp_size, dim=0)[tp_rank]])
    return torch.chunk(full, tp_size, dim=0)[tp_rank]  # COLUMN, QKV (whole groups), VOCAB


def unshard(kind: Kind, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full megatron tensor from all TP ranks' parts, in TP rank order; inverse of `shard`."""
    if kind is Kind.REPLICATED:
        return shards[0]
    if kind is Kind.ROW:
        return torch.cat(list(shards), dim=1)
    if kind is Kind.GATED:
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=0)


def full_shape(kind: Kind, local: torch.Tensor, tp_size: int) -> Tuple[int, ...]:
    """The full megatron shape of a TP shard."""
    shape = list(local.shape)
    if kind is Kind.ROW:
        shape[1] *= tp_size
    elif kind is not Kind.REPLICATED:
        shape[0] *= tp_size
    return tuple(shape)


# ------------------------------------------------------------------------------------------------
# Which tensors this rank holds
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LocalTensor:
    """A parameter of this rank's model and where it comes from in HF."""

    megatron_name: str
    hf_names: Tuple[str, ...]
    kind: Kind
    parameter: torch.nn.Parameter
    expert: Optional[int] = None  # an MoE expert's weight: its global index


def local_tensors(model: Any, arch: Architecture) -> List[LocalTensor]:
    """Every parameter of this rank's stage with its HF source, in HF order (an EP rank: its own experts)."""
    params = dict(model.named_parameters())
    found: List[LocalTensor] = []

    def add(tensor_map: TensorMap, prefix: str, hf_name: Callable[[str], str]) -> None:
        for name in tensor_map.megatron:
            if prefix + name in params:
                found.append(LocalTensor(prefix + name, tuple(hf_name(n) for n in tensor_map.hf),
                                         tensor_map.kind, params[prefix + name], tensor_map.expert))
                return
        raise KeyError(f"none of {[prefix + n for n in tensor_map.megatron]} in the model")

    if "embedding.word_embeddings.weight" in params:
        add(EMBEDDING, "", lambda n: n)
    for local_index, layer in enumerate(model.decoder.layers):
        global_index = layer.layer_number - 1
        # megatron's MoE layer: the global indices of this EP rank's experts
        experts = getattr(getattr(layer, "mlp", None), "local_expert_indices", None) if arch.moe else None
        for tensor_map in layer_tensor_maps(arch, experts):
            add(tensor_map, f"decoder.layers.{local_index}.", lambda n, i=global_index: _hf_layer(i, n))
    if "decoder.final_layernorm.weight" in params:
        add(FINAL_NORM, "", lambda n: n)
    if "output_layer.weight" in params:  # absent when tied on a single stage (the embedding is used)
        add(output_layer_map(arch), "", lambda n: n)

    mapped = {t.megatron_name for t in found}
    unmapped = [n for n in params if n not in mapped]
    if unmapped:
        raise KeyError(f"parameters without a HF mapping: {unmapped}")
    return found


# ------------------------------------------------------------------------------------------------
# Load: full HF tensors -> this rank's shards
# ------------------------------------------------------------------------------------------------
@torch.no_grad()
def load_hf_state_dict_into_model(
    model: Any, hf_state_dict: Mapping[str, torch.Tensor], hf_config: HFConfig, agent_parallel: AgentParallel
) -> None:
    """Copy this rank's TP shard of this stage's layers from FULL HF tensors into `model`.

    Not collective: every member rank reads what it needs from `hf_state_dict` (e.g. a lazily
    loaded safetensors mapping). Padded vocabulary rows become zeros. Experts may come one tensor each (a
    checkpoint) or fused (a transformers model's state_dict, e.g. the supervised warm-up's): `PerExpertView`; an
    EP rank takes its own experts (global expert r * E / EP + i into its local expert i), each its ETP shard.
    """
    arch = read_architecture(hf_config)
    padded = padded_vocab_size(arch.vocab_size, agent_parallel.tp_size)
    if arch.moe is not None:  # a checkpoint's per-expert tensors, or a transformers model's fused ones
        hf_state_dict = PerExpertView(hf_state_dict)
    for tensor in local_tensors(model, arch):
        missing = [n for n in tensor.hf_names if n not in hf_state_dict]
        if missing:
            raise KeyError(f"{tensor.megatron_name} needs {missing}, not in the HF state dict")
        full = to_megatron(tensor.kind, [hf_state_dict[n] for n in tensor.hf_names], arch, padded)
        if tensor.expert is not None:
            local = shard(tensor.kind, full, agent_parallel.etp_rank, agent_parallel.etp_size)
        else:
            local = shard(tensor.kind, full, agent_parallel.tp_rank, agent_parallel.tp_size)
        if local.shape != tensor.parameter.shape:
            raise ValueError(f"{tensor.megatron_name}: HF gives {tuple(local.shape)} for this rank, "
                             f"the model has {tuple(tensor.parameter.shape)}")
        tensor.parameter.copy_(local.to(tensor.parameter.dtype))


# ------------------------------------------------------------------------------------------------
# Export: this agent's shards -> full HF tensors on one rank, one tensor at a time
# ------------------------------------------------------------------------------------------------
def _hf_tensor_owners(arch: Architecture, agent_parallel: AgentParallel) -> List[Tuple[str, int, Optional[int]]]:
    """Every megatron tensor as (HF key of its first tensor, owning pipeline stage, owning EP rank: None for a tensor
    every EP rank holds), in HF order.

    Known on every rank without communication: layers are split evenly over stages, each layer's experts evenly over
    EP ranks (EP rank r holds experts [r * E / EP, (r + 1) * E / EP), as megatron's MoE layer lays them out).
    """
    layers_per_stage = arch.num_layers // agent_parallel.pp_size
    per_rank = arch.moe.num_experts // agent_parallel.ep_size if arch.moe is not None else 0
    owners: List[Tuple[str, int, Optional[int]]] = [(EMBEDDING.hf[0], 0, None)]
    for i in range(arch.num_layers):
        for tensor_map in layer_tensor_maps(arch):
            ep_rank = None if tensor_map.expert is None else tensor_map.expert // per_rank
            owners.append((_hf_layer(i, tensor_map.hf[0]), i // layers_per_stage, ep_rank))
    owners.append((FINAL_NORM.hf[0], agent_parallel.pp_size - 1, None))
    if not arch.tie_word_embeddings:
        owners.append(("lm_head.weight", agent_parallel.pp_size - 1, None))
    return owners


@torch.no_grad()
def iter_hf_tensors(
    model: Any,
    hf_config: HFConfig,
    agent_parallel: AgentParallel,
    *,
    tensor_of: Callable[[torch.nn.Parameter], Optional[torch.Tensor]] = lambda p: p.detach(),
    dst_rank: Optional[int] = None,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) on `dst_rank` (default: the agent's first rank), in HF order.

    Collective over the agent's data-parallel replica 0 and, at expert parallelism > 1, over the EP ranks of
    expert-data-parallel replica 0 (the owners of the experts, other data-parallel replicas): call on every member
    rank and exhaust the iterator (other ranks yield nothing). Per tensor: the owning stage all-gathers its TP
    shards (an expert: its owner's ETP shards), its (E)TP rank 0 sends the full tensor to `dst_rank`; at most one
    full tensor is in flight, so this also streams weights to a rollout engine. `tensor_of` picks what to export
    (`p.grad` exports gradients).
    """
    arch = read_architecture(hf_config)
    if dst_rank is None:
        dst_rank = agent_parallel.ranks[0]
    holds_dense, holds_experts = agent_parallel.dp_rank == 0, agent_parallel.expert_dp_rank == 0
    if not holds_dense and not holds_experts and agent_parallel.rank != dst_rank:
        return
    # Keyed by HF name. A tied last stage (PP > 1) keys its output-layer copy under the embedding's
    # name too; the owner table sends that name to stage 0, so the copy is never exported.
    mine = {t.hf_names[0]: t for t in local_tensors(model, arch)}
    for first_hf_name, stage, ep_rank in _hf_tensor_owners(arch, agent_parallel):
        if ep_rank is None:  # every EP rank holds it: data-parallel replica 0's TP ranks of the stage
            owner = agent_parallel.global_rank_of(tp_rank=0, dp_rank=0, pp_rank=stage)
            takes_part = holds_dense and agent_parallel.pp_rank == stage
            group, size = agent_parallel.tp_group if takes_part else None, agent_parallel.tp_size
        else:  # an expert: its EP rank's ETP ranks of expert-data-parallel replica 0
            owner = agent_parallel.expert_global_rank_of(etp_rank=0, ep_rank=ep_rank, expert_dp_rank=0,
                                                         pp_rank=stage)
            takes_part = holds_experts and agent_parallel.pp_rank == stage and agent_parallel.ep_rank == ep_rank
            group, size = agent_parallel.expert_tp_group if takes_part else None, agent_parallel.etp_size
        full: Optional[torch.Tensor] = None
        kind: Optional[Kind] = None
        hf_names: Tuple[str, ...] = ()
        if takes_part:
            local = mine[first_hf_name]
            kind, hf_names = local.kind, local.hf_names
            full = _gather_tp(local.kind, tensor_of(local.parameter), group, size)
        if dst_rank != owner:
            full, kind, hf_names = _send_to(dst_rank, owner, full, kind, hf_names, agent_parallel)
        if agent_parallel.rank == dst_rank:
            for name, tensor in zip(hf_names, to_hf(kind, full, arch)):
                yield name, tensor.clone()


def export_hf_state_dict(model: Any, hf_config: HFConfig, agent_parallel: AgentParallel,
                         **kwargs: Any) -> Dict[str, torch.Tensor]:
    """All HF tensors on `dst_rank` (default: the agent's first rank); {} elsewhere. See `iter_hf_tensors`."""
    return dict(iter_hf_tensors(model, hf_config, agent_parallel, **kwargs))


def _gather_tp(kind: Kind, local: torch.Tensor, group: Optional[dist.ProcessGroup], size: int) -> torch.Tensor:
    """The full tensor from its shards over `group` (TP, or an expert's ETP) of `size` ranks."""
    if kind is Kind.REPLICATED or size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return unshard(kind, parts)


def _send_to(dst_rank: int, owner: int, full: Optional[torch.Tensor], kind: Optional[Kind],
             hf_names: Tuple[str, ...], agent_parallel: AgentParallel):
    """Point-to-point from the owning stage's TP rank 0 to `dst_rank`, with a small header first."""
    rank = agent_parallel.rank
    if rank == owner:
        header = [list(full.shape), str(full.dtype), kind.value, list(hf_names)]
        dist.send_object_list([header], dst=dst_rank)
        dist.send(full.contiguous(), dst=dst_rank)
    elif rank == dst_rank:
        received: List[Any] = [None]
        dist.recv_object_list(received, src=owner)
        shape, dtype, kind_value, names = received[0]
        full = torch.empty(shape, dtype=getattr(torch, dtype.replace("torch.", "")), device=collective_device())
        dist.recv(full, src=owner)
        return full, Kind(kind_value), tuple(names)
    return full, kind, hf_names
