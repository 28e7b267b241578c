"""A mixture of experts' weights in the two forms Hugging Face has them (Qwen3-MoE; torch only, no megatron).

A checkpoint (what `save_pretrained` writes, what vLLM and the conversion tools read) holds one tensor per expert and
projection: `model.layers.{i}.mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj.weight` [I, H], `down_proj.weight`
[H, I]. A transformers 5 model holds them fused in memory: `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2I, H] (gate
rows first: `gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)`) and `...experts.down_proj` [E, H, I]. The
trainer's weights always travel under the checkpoint names (checkpoint/hf_mapping.py); these two helpers translate
where a transformers model's own state dict is on the other side: loading the warm-up's weights (`PerExpertView`) and
the embedded engine's weight updates (`per_expert_tensors`).
"""
from __future__ import annotations

import re
from typing import Dict, Iterator, Mapping, Optional, Tuple

import torch

# One expert's projection as a HF checkpoint names it, and the fused tensors transformers 5 keeps in memory
_PER_EXPERT_NAME = re.compile(r"^(?P<experts>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                              r"\.weight$")


class PerExpertView(Mapping):
    """HF tensors by checkpoint name, also where `state` holds a transformers model's fused experts (its
    `state_dict()`: `...mlp.experts.gate_up_proj` [E, 2I, H] with gate rows first, `...mlp.experts.down_proj`
    [E, H, I]): expert e's gate_proj, up_proj and down_proj are then views of those. Names `state` holds itself are
    passed through; iterating lists `state`'s own names."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self.state = state

    def _fused(self, name: str) -> Optional[Tuple[str, int, str]]:
        match = _PER_EXPERT_NAME.match(name)
        if match is None:
            return None
        proj = match["proj"]
        fused = f"{match['experts']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        return (fused, int(match["expert"]), proj) if fused in self.state else None

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.state:
            return self.state[name]
        fused = self._fused(name)
        if fused is None:
            raise KeyError(name)
        fused_name, expert, proj = fused
        tensor = self.state[fused_name][expert]
        if proj == "down_proj":
            return tensor
        gate, up = torch.chunk(tensor, 2, dim=0)  # transformers: gate, up = linear(x, gate_up_proj[e]).chunk(2, -1)
        return gate if proj == "gate_proj" else up

    def __contains__(self, name: object) -> bool:
        return name in self.state or (isinstance(name, str) and self._fused(name) is not None)

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


_FUSED_EXPERTS_NAME = re.compile(r"^(?P<experts>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def per_expert_tensors(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """`state` (a transformers model's state_dict) with every fused expert tensor replaced by per-expert views of it,
    under the checkpoint names `PerExpertView` reads: the names weights are exported and pushed under. Views share
    the model's storage, so copying into one updates the model (the embedded engine's weight updates)."""
    result: Dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _FUSED_EXPERTS_NAME.match(name)
        if match is None:
            result[name] = tensor
            continue
        for expert in range(tensor.shape[0]):
            prefix = f"{match['experts']}.{expert}"
            if match["proj"] == "down_proj":
                result[f"{prefix}.down_proj.weight"] = tensor[expert]
            else:
                gate, up = torch.chunk(tensor[expert], 2, dim=0)
                result[f"{prefix}.gate_proj.weight"], result[f"{prefix}.up_proj.weight"] = gate, up
    return result
