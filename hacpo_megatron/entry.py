"""The program every torchrun rank runs: the main job's command line, the config, then Algorithm 1.

    torchrun --nproc_per_node=N -m hacpo_megatron.entry [--config FILE] [--set KEY=VALUE ...] [...]

`python -m hacpo_megatron.launch` (what `make run` calls) checks every input, works N out and starts torchrun on
this module, with the package's model provider (training/provider.py). A script of your own that calls `main`
with another provider runs in its place (`launch --entry FILE`; examples/hacpo_pretrain_style.py). A mistake in
the user's input ends every rank with code 2 and one message from rank 0, without a traceback; a preemption
(SIGTERM) with its own code once the run's state is saved; a checkpoint that the disk could not take, with one
message and its own code (`latest` unchanged).
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
from typing import Callable, List, Optional

import torch.distributed as dist

from hacpo_megatron.checkpoint.save_agreement import CheckpointSaveError
from hacpo_megatron.config import Config, ConfigError, load_config
from hacpo_megatron.launch import output_dir_of, parse_args
from hacpo_megatron.orchestrator.preemption import PREEMPTED_EXIT_CODE, Preempted
from hacpo_megatron.training.loop import RunOptions, run_hacpo
from hacpo_megatron.training.preflight import INPUT_ERROR_EXIT_CODE, InputError
from hacpo_megatron.training.provider import ModelProvider, model_provider

SAVE_FAILED_EXIT_CODE = 74  # EX_IOERR: a checkpoint could not be written; `latest` is the previous step


def main(provider: Callable[[Config], ModelProvider] = model_provider, argv: Optional[List[str]] = None) -> int:
    """Run this rank's part of the main job with the agents' models from `provider(cfg)`; its exit code."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints where a rank is
    args = parse_args(argv)
    says = int(os.environ.get("RANK", "0")) == 0  # rank 0 speaks for all: every rank reaches the same end
    try:
        cfg = load_config(args.config, args.overrides)
        options = RunOptions(output_dir=output_dir_of(args, cfg), resume=args.resume, ray_address=args.ray_address,
                             weight_check=args.check_weights, save_rollouts=args.save_rollouts,
                             load_rollouts=args.load_rollouts)
        run_hacpo(cfg, options, provider(cfg))
    except (ConfigError, InputError) as exc:  # the user's input: said once, without a traceback
        if says:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return INPUT_ERROR_EXIT_CODE
    except Preempted as exc:
        if says:
            print(str(exc), file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except CheckpointSaveError as exc:  # a full or failing disk: every rank raised it at the same save
        if says:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        # rank 0 reached here after tearing Ray down; a rank that exited before it would have torchrun stop
        # rank 0 before it printed the reason
        if dist.is_initialized():
            dist.barrier()
        return SAVE_FAILED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
