"""Everything a run reads from the user, checked before any process group, model or actor exists.

A mistake in the user's input (a data file, a tokenizer or model folder, a checkpoint to resume) is
an `InputError`: the entry point prints it once (rank 0), without a traceback, and exits with code 2.
Every rank runs the same checks on the same inputs, so all of them stop, and none waits for another
in a collective. Errors are collected, so one run reports all of them.
"""
from __future__ import annotations

import os
from typing import List, Optional

from hacpo_megatron.config import Config

INPUT_ERROR_EXIT_CODE = 2


class InputError(Exception):
    """A problem with the user's input, already phrased for the user (file, line, key)."""

    def __init__(self, problems: List[str]):
        self.problems = list(problems)
        head = self.problems[0] if len(self.problems) == 1 else f"{len(self.problems)} problems with the run's input:"
        super().__init__("\n  ".join([head] + (self.problems if len(self.problems) > 1 else [])))


def check_inputs(cfg: Config, *, output_dir: str, resume: bool, save_rollouts: Optional[str] = None,
                 load_rollouts: Optional[str] = None) -> None:
    """Raise InputError naming every problem found; return quietly when the inputs are usable.

    Files first (data, model folders, checkpoints: a second or two), tokenizers only when those are
    fine (loading them takes seconds): a wrong path is reported at once.
    """
    problems = (_mode_problems(cfg, resume, save_rollouts, load_rollouts) + _file_problems(cfg, output_dir, resume)
                or _tokenizer_problems(cfg))
    if problems:
        raise InputError(problems)


def check_device(device: str) -> None:
    """InputError when this process sees a GPU that run.device (`device`) says not to use. A process hides its GPUs only
    before it first asks torch about CUDA (CUDA_VISIBLE_DEVICES), so the launcher hides them from the ranks it
    starts; ranks started some other way (torchrun on a cluster) must be started so."""
    import torch

    if device == "cpu" and torch.cuda.is_available():
        raise InputError(["run.device: cpu, but this rank sees a GPU: start the ranks with CUDA_VISIBLE_DEVICES= "
                          "(python -m hacpo_megatron.launch does that itself)"])


def _attempt(problems: List[str], where: str, check) -> None:
    try:
        check()
    except (ValueError, OSError, KeyError) as error:  # the readers' own errors name file and line
        problems.append(f"{where}: {error}")


def _file_problems(cfg: Config, output_dir: str, resume: bool) -> List[str]:
    from hacpo_megatron.data import load_prompts
    from hacpo_megatron.reporting.trackers import tracker_install_problems
    from hacpo_megatron.rewards import load_reward_function

    problems: List[str] = []
    _attempt(problems, "data.train", lambda: load_prompts(cfg.data.train, "train"))
    if cfg.run.mode != "train_only":  # the reward actor imports it in its workers; a module that cannot, stops here
        _attempt(problems, "reward.function", lambda: load_reward_function(cfg.reward.function))
    if cfg.data.eval:
        _attempt(problems, "data.eval", lambda: load_prompts(cfg.data.eval, "eval"))
    if cfg.train.sft_warmup_steps > 0 and cfg.train.sft_warmup_task:
        _attempt(problems, "train.sft_warmup_task", lambda: load_prompts(cfg.train.sft_warmup_task, "train"))
    for k, agent in enumerate(cfg.agents):
        if agent.init_from:
            _attempt(problems, f"agents.{k} ({agent.name}).init_from",
                     lambda folder=agent.init_from: _check_weights(folder))
        if cfg.train.sft_warmup_steps > 0 and agent.sft_warmup_task:
            _attempt(problems, f"agents.{k} ({agent.name}).sft_warmup_task",
                     lambda spec=agent.sft_warmup_task: load_prompts(spec, "train"))
        if agent.engine != "embedded" and cfg.run.mode != "train_only":
            _attempt(problems, f"agents.{k} ({agent.name}).engine",
                     lambda kind=agent.engine: _check_engine_installed(kind))
    problems += [f"logging.trackers: {problem}" for problem in tracker_install_problems(cfg.logging.trackers)]
    if resume:
        from hacpo_megatron.checkpoint.run_folder import resume_candidates

        root = os.path.join(output_dir, "checkpoints")
        if not (os.path.isdir(root) and resume_candidates(root)):
            problems.append(f"--resume: {root}: no checkpoint saved yet; start without --resume")
    return problems


def _mode_problems(cfg: Config, resume: bool, save_rollouts: Optional[str], load_rollouts: Optional[str]) -> List[str]:
    """run.mode and the rollout folders fit together; train_only finds every step it will train on."""
    from hacpo_megatron.rollout.replay import missing_steps

    mode = cfg.run.mode
    if mode == "rollout_only" and resume:
        return ["--resume: run.mode rollout_only keeps no checkpoint (it learns nothing); start it again"]
    if mode == "train_only" and not load_rollouts:
        return ["run.mode train_only trains on saved answers: give --load-rollouts DIR (saved by --save-rollouts)"]
    if load_rollouts and mode != "train_only":
        return [f"--load-rollouts: only run.mode train_only reads saved answers (run.mode is {mode})"]
    if save_rollouts and mode == "train_only":
        return ["--save-rollouts: run.mode train_only generates no answers to save"]
    if save_rollouts and os.path.exists(save_rollouts) and not os.path.isdir(save_rollouts):
        return [f"--save-rollouts {save_rollouts}: a file is in the way of the folder"]
    if mode == "train_only":
        missing = missing_steps(load_rollouts, [a.name for a in cfg.agents], range(1, cfg.run.total_steps + 1))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            return [f"--load-rollouts: {missing[0]} is missing{more}; run.total_steps={cfg.run.total_steps} needs "
                    f"every step's step.json and one file per agent ({', '.join(a.name for a in cfg.agents)})"]
    return []


def _check_engine_installed(kind: str) -> None:
    from hacpo_megatron.rollout import install_hint

    hint = install_hint(kind)
    if hint:
        raise ValueError(hint)


def _check_weights(folder: str) -> None:
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: no such folder")
    from hacpo_megatron.checkpoint.hf_io import check_hf_weights_complete, read_hf_config
    from hacpo_megatron.checkpoint.format import is_agent_checkpoint
    from hacpo_megatron.models.architectures import read_architecture

    if is_agent_checkpoint(folder):
        raise ValueError(f"{folder} is a Megatron agent checkpoint; convert it with tools/convert_megatron_to_hf.py, "
                         "or resume its run with --resume")
    check_hf_weights_complete(folder, read_architecture(read_hf_config(folder)))


def _tokenizer_problems(cfg: Config) -> List[str]:
    from hacpo_megatron.bridge import load_tokenizer
    from hacpo_megatron.bridge.prompt_formats import check_can_render, parse_prompt_format

    problems: List[str] = []
    for k, agent in enumerate(cfg.agents):
        name = agent.tokenizer_source
        found = len(problems)
        _attempt(problems, f"agents.{k} ({agent.name}).tokenizer",
                 lambda name=name, agent=agent: load_tokenizer(name, agent.prompt_format))
        if len(problems) == found:  # it loads: can it ask in the agent's format?
            _attempt(problems, f"agents.{k} ({agent.name}).prompt_format",
                     lambda name=name, agent=agent: check_can_render(load_tokenizer(name, agent.prompt_format),
                                                                     parse_prompt_format(agent.prompt_format), name))
        if len(problems) == found:  # and are its ids rows of the model's embedding?
            _attempt(problems, f"agents.{k} ({agent.name}).tokenizer",
                     lambda name=name, agent=agent: _check_fits_model(load_tokenizer(name, agent.prompt_format), name,
                                                                      agent.model))
    return problems


def _check_fits_model(tokenizer, name: str, model: str) -> None:
    """ValueError when the tokenizer can give an id the model has no embedding row for: a tokenizer of another
    family (the run would stop in the first forward pass, or on a GPU in a device-side assert). Counted: its
    vocabulary, its end and pad tokens, and the tokens its prompt format writes. Not `len(tokenizer)`: Llama 3.2's
    has an added token past the model's 128256 rows that a run never writes."""
    from hacpo_megatron.bridge.retokenize import render_prompt
    from hacpo_megatron.bridge.tokenizers import eos_token_ids
    from hacpo_megatron.models.presets import load_hf_config_dict

    rows = load_hf_config_dict(model).get("vocab_size")
    if rows is None:  # a config without it: the model builder names the problem
        return
    used = {tokenizer.vocab_size - 1, tokenizer.pad_token_id, *eos_token_ids(tokenizer),
            *render_prompt(tokenizer, [{"role": "user", "content": "What is 1 + 1?"}])}
    if tokenizer.bos_token_id is not None:
        used.add(tokenizer.bos_token_id)
    if max(used) >= rows:
        raise ValueError(f"{name!r} writes token ids up to {max(used)}, but the model ({model}) has {rows} embedding "
                         "rows (vocab_size): give the agent its model's own tokenizer")
