"""The layout a conversion tool runs at (tools/convert_hf_to_megatron.py, convert_megatron_to_hf.py,
compare_hf_megatron.py): its --tp, --pp and --ep, the processes they take, and their check against a model before any
process starts.

A checkpoint does not depend on the layout that wrote it (megatron reshards on load): the layout only splits the
tool's work, i.e. sets the memory per process. Expert parallelism (EP: each layer's experts split over EP ranks, a
mixture-of-experts model's) takes no ranks of its own (hacpo_megatron/parallel/groups.py): megatron lays each pipeline
stage's TP x DP ranks out a second time for the experts, so at EP > 1 a tool runs the fewest data-parallel replicas
that make TP x DP a multiple of EP (EP 2: two replicas at TP 1, one at TP 2). Every replica holds the dense weights,
each EP rank its share of the experts. At EP > 1 an expert is not split over TP (expert tensor parallelism 1); at EP 1
it is split over TP as the dense MLP is (megatron's default).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hacpo_megatron.config.schema import ParallelConfig
from hacpo_megatron.models.architectures import Architecture
from hacpo_megatron.models.presets import layout_problems


@dataclass(frozen=True)
class ToolLayout:
    """--tp, --pp and --ep of a tool's run."""

    tensor: int = 1
    pipeline: int = 1
    expert: int = 1

    @property
    def data(self) -> int:
        """Data-parallel replicas: the fewest for which EP divides each pipeline stage's TP x DP ranks."""
        return self.expert // math.gcd(self.tensor, self.expert)

    @property
    def world_size(self) -> int:
        """Processes the tool runs in: TP x PP x DP."""
        return self.tensor * self.pipeline * self.data

    def parallel_config(self) -> ParallelConfig:
        """The layout of the tool's one agent, on ranks 0 .. world_size - 1."""
        return ParallelConfig(tensor=self.tensor, pipeline=self.pipeline, data=self.data, expert=self.expert,
                              first_rank=0)

    def __str__(self) -> str:
        """As the tools print it: "TP=2, PP=1", with ", EP=2" at EP > 1."""
        return f"TP={self.tensor}, PP={self.pipeline}" + (f", EP={self.expert}" if self.expert > 1 else "")


def check_tool_layout(arch: Architecture, layout: ToolLayout) -> None:
    """ValueError saying what does not fit: a size below 1, --ep > 1 on a dense model, TP not dividing the heads, PP
    the layers, EP the experts (presets.layout_problems, less what only training refuses)."""
    if min(layout.tensor, layout.pipeline, layout.expert) < 1:
        raise ValueError(f"TP, PP and EP must be >= 1, got TP={layout.tensor}, PP={layout.pipeline}, "
                         f"EP={layout.expert}")
    if layout.expert > 1 and arch.moe is None:
        raise ValueError(f"--ep {layout.expert}: {arch.hf_architecture} is a dense model, it has no experts to split "
                         "over expert-parallel ranks (--ep is for mixture-of-experts models such as Qwen3-MoE); "
                         "leave --ep at 1")
    problems = layout_problems(arch.layout_shape, layout.tensor, layout.pipeline, arch.hf_architecture,
                               dp=layout.data, ep=layout.expert, training=False)
    if problems:
        raise ValueError("; ".join(problems.values()))
