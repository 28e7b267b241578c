"""HACPO training entry, in the style of Megatron's pretrain_gpt.py.

    torchrun --nproc_per_node=N examples/hacpo_pretrain_style.py [--config FILE] [--set KEY=VALUE ...]

N is the number of ranks the config's agents need (`python -m hacpo_megatron.config --config FILE
--print-world-size`). This is the command that stays; until the Ray-orchestrated loop lands (issue 6),
it validates the config, forms the torchrun world, reports where every agent lives, and runs one
HACPO advantage computation on synthetic rewards so the algorithm core is exercised end to end.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

from hacpo_megatron.algorithms import CapabilityTracker, resolve_algorithm, step_advantages
from hacpo_megatron.config import ConfigError, load_config
from hacpo_megatron.parallel.layout import agent_rank_ranges, required_world_size

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "default.yaml")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="HACPO training (Megatron-core agents)")
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    needed = required_world_size(cfg.agents)
    if world != needed:
        print(f"error: {args.config} needs {needed} processes (torchrun --nproc_per_node={needed}), got {world}",
              file=sys.stderr)
        return 2
    if world > 1 or "RANK" in os.environ:
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank = dist.get_rank() if dist.is_initialized() else 0
    hosted = [a.name for a, ranks in zip(cfg.agents, agent_rank_ranges(cfg.agents)) if rank in ranks]
    print(f"[rank {rank}] hosts agents {hosted}", flush=True)

    if rank == 0:
        spec = resolve_algorithm(cfg.algorithm.name)
        n, B, G = len(cfg.agents), cfg.data.prompt_batch_size, cfg.rollout.samples_per_prompt
        generator = torch.Generator().manual_seed(cfg.run.seed)
        strength = torch.linspace(0.2, 0.8, n)[:, None, None]
        rewards = (torch.rand(n, B, G, generator=generator) < strength).double()
        tracker = CapabilityTracker(n, cfg.algorithm.capability_window)
        P = tracker.update(rewards)
        out = step_advantages(rewards, P, spec)
        print(f"[rank 0] {spec.name}: capabilities {[round(p, 3) for p in P.tolist()]}, "
              f"omega {[[round(w, 3) for w in row] for row in out.omega.tolist()]}")
        print("[rank 0] the Ray-orchestrated training loop is not built yet (issue 6); config and layout are valid.")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
