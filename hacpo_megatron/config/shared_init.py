"""Validation of agents that share an initialisation: agents[].same_init_as and agents[].sft_warmup_gain_beyond.

Called by config/checks.py with the loader's `where` (a key path -> "file:line: key" for the message); returns the
problems found.
"""
from __future__ import annotations

from typing import Any, Callable, List, Tuple

from hacpo_megatron.config.schema import Config


def shared_init_problems(cfg: Config, where: Callable[[Tuple[Any, ...]], str]) -> List[str]:
    """agents[].same_init_as names another agent of the same model, both starting from a random initialisation;
    sft_warmup_gain_beyond continues that agent's warm-up, so it needs its warm-up task, prompts and tokenizer."""
    errors: List[str] = []
    by_name = {agent.name: agent for agent in cfg.agents}
    for i, agent in enumerate(cfg.agents):
        name, gain = agent.same_init_as, agent.sft_warmup_gain_beyond
        if gain is not None:
            path = ("agents", i, "sft_warmup_gain_beyond")
            first = by_name.get(name)
            if first is None or first is agent:
                errors.append(f"{where(path)}: continues the warm-up of the agent same_init_as names; set that")
            elif not 0 < gain < 1 or cfg.train.sft_warmup_steps <= 0 or agent.sft_warmup_stop_accuracy is not None:
                errors.append(f"{where(path)}: must be in (0, 1), with train.sft_warmup_steps > 0 and no "
                              f"sft_warmup_stop_accuracy of this agent's own (it stops {gain} more accurate than "
                              f"{name})")
            else:
                for key, what in (("sft_warmup_task", "sft_warmup_task"), ("tokenizer_source", "tokenizer"),
                                  ("prompt_format", "prompt_format")):
                    mine, theirs = getattr(agent, key), getattr(first, key)
                    if mine != theirs:
                        errors.append(f"{where(path)}: continues {name}'s warm-up, so needs its {what} "
                                      f"({theirs!r}, not {mine!r})")
        if name is None:
            continue
        path = ("agents", i, "same_init_as")
        other = by_name.get(name)
        if other is None or other is agent:
            errors.append(f"{where(path)}: names {'this agent' if other is agent else 'no agent'} ({name!r}); "
                          f"name another of {sorted(set(by_name) - {agent.name})}")
        elif other.same_init_as is not None:
            errors.append(f"{where(path)}: {name!r} itself starts as {other.same_init_as!r}: name "
                          f"{other.same_init_as!r} directly")
        elif other.model != agent.model:
            errors.append(f"{where(path)}: {name!r} is a {other.model or 'model-less'} agent and this one a "
                          f"{agent.model or 'model-less'} one; one initialisation needs one model")
        elif agent.init_from or other.init_from:
            errors.append(f"{where(path)}: init_from's pretrained weights replace the random initialisation this "
                          f"key chooses ({agent.name if agent.init_from else name} has one): leave one out")
    return errors
