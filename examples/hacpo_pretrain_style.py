"""HACPO training entry, in the style of Megatron's pretrain_gpt.py.

    torchrun --nproc_per_node=N examples/hacpo_pretrain_style.py [--config FILE] [--set KEY=VALUE ...]
             [--output-dir DIR] [--resume] [--ray-address ADDR]

N is the number of ranks the config's agents need (`python -m hacpo_megatron.config --config FILE
--print-world-size`); `python -m hacpo_megatron.launch` (what `make run` calls) checks every input,
works N out and starts torchrun. Without --config it runs configs/default.yaml: two
tiny heterogeneous agents on synthetic math, on a laptop-sized CPU machine.

Like pretrain_gpt.py, this file holds the parts a user swaps — how an agent's model is provided
(built, then its initial weights) — and hands them to the library's loop (Algorithm 1 of the paper,
hacpo_megatron/training/loop.py). The forward step and the loss are the library's
(models/logprobs.py: vocab-parallel log-probs; algorithms/losses.py: the HACPO objective).
"""
import faulthandler
import os
import signal
import sys
from typing import Any, Dict

import torch
import torch.distributed as dist

from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
from hacpo_megatron.config import AgentConfig, Config, ConfigError, load_config
from hacpo_megatron.launch import output_dir_of, parse_args
from hacpo_megatron.models.build import AgentModel, build_agent_model
from hacpo_megatron.orchestrator.preemption import PREEMPTED_EXIT_CODE, Preempted
from hacpo_megatron.parallel.groups import AgentParallel
from hacpo_megatron.training.loop import RunOptions, run_hacpo
from hacpo_megatron.training.preflight import INPUT_ERROR_EXIT_CODE, InputError



# train.params_dtype -> the model's parameter dtype (None: bf16 on GPU, fp32 on CPU). With bf16 the optimizer
# keeps fp32 main weights (megatron's mixed precision), on CPU as on GPU.
PARAMS_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}


def model_provider(cfg: Config):
    """Returns the function that builds an agent's model on this rank and gives it initial weights."""

    def provide(agent_cfg: AgentConfig, parallel: AgentParallel, hf_config: Dict[str, Any], seed: int) -> AgentModel:
        agent = build_agent_model(hf_config, parallel, seed=seed, params_dtype=PARAMS_DTYPES[cfg.train.params_dtype],
                                  attention=cfg.train.attention)
        state = initial_weights(cfg, agent_cfg, parallel, hf_config, seed)
        if state is not None:
            load_hf_state_dict_into_model(agent.model, state, hf_config, parallel)
        return agent

    return provide


def initial_weights(cfg: Config, agent_cfg: AgentConfig, parallel: AgentParallel, hf_config, seed):
    """Pretrained weights (`init_from`: a Hugging Face folder or an agent checkpoint), else the
    supervised warm-up of a random model (cached on disk), else None (random weights)."""
    if agent_cfg.init_from:  # checked before any work (training/preflight.py): a complete HF folder
        from hacpo_megatron.checkpoint.hf_io import HFWeights

        return HFWeights(agent_cfg.init_from)
    if cfg.train.sft_warmup_steps <= 0:
        return None
    from hacpo_megatron.training.warmup import agent_warmup_plan, supervised_warmup

    task, stop_accuracy = agent_warmup_plan(cfg, agent_cfg)

    def warm_up():
        return supervised_warmup(
            hf_config, agent_cfg.tokenizer or agent_cfg.model, task,
            steps=cfg.train.sft_warmup_steps, batch_size=cfg.train.sft_warmup_batch_size,
            lr=cfg.train.sft_warmup_lr, seed=seed, cache_dir=cfg.train.sft_warmup_cache,
            stop_accuracy=stop_accuracy, prompt_format=agent_cfg.prompt_format)

    # The agent's first rank trains (or finds the cache); the others then read the cache.
    state = warm_up() if parallel.agent_rank == 0 else None
    dist.barrier(group=parallel.group)
    return state if state is not None else warm_up()


def main(argv=None) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints where a rank is
    args = parse_args(argv)
    says = int(os.environ.get("RANK", "0")) == 0  # rank 0 speaks for all: every rank reaches the same end
    try:
        cfg = load_config(args.config, args.overrides)
        options = RunOptions(output_dir=output_dir_of(args, cfg), resume=args.resume, ray_address=args.ray_address,
                             kill_engine_at_step=args.kill_engine_at_step,
                             kill_reward_at_step=args.kill_reward_at_step,
                             kill_engine_in_sync_at_step=args.kill_engine_in_sync_at_step,
                             kill_engine_before_step=args.kill_engine_before_step,
                             kill_engine_in_eval_at_step=args.kill_engine_in_eval_at_step, weight_check=args.check_weights,
                             save_rollouts=args.save_rollouts, load_rollouts=args.load_rollouts,
                             leak_mib_per_step=args.leak_mib_per_step)
        run_hacpo(cfg, options, model_provider(cfg))
    except (ConfigError, InputError) as exc:  # the user's input: said once, without a traceback
        if says:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return INPUT_ERROR_EXIT_CODE
    except Preempted as exc:
        if says:
            print(str(exc), file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
