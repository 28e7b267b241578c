"""A step's records, one per agent, as metrics.jsonl holds them: assembled from the step's parts (pure; the loop
gathers the parts over the ranks)."""
from __future__ import annotations

import time
from typing import Dict, List, Mapping, Sequence

import numpy as np
import torch

from hacpo_megatron.reporting.metrics_file import REQUIRED_KEYS

# Per-update values whose mean over a step says nothing: the step's record shows the last update's, or the largest.
LAST_UPDATE_KEYS = ("cross_clip_lower_bound", "update_index")
LARGEST_OVER_UPDATES_KEYS = ("micro_batch_tokens_max",)


def mean_over_updates(updates: List[Dict[str, float]]) -> Dict[str, float]:
    """An agent's figures for a step from those of its M updates: each one's mean over the updates that have it
    (NaN where none does), the last update's for LAST_UPDATE_KEYS, the largest for LARGEST_OVER_UPDATES_KEYS,
    and M as `num_updates`."""
    keys = dict.fromkeys(key for u in updates for key in u)
    values = {key: [u.get(key, float("nan")) for u in updates] for key in keys}
    out = {key: float(np.nanmean(v)) if any(np.isfinite(v)) else float("nan") for key, v in values.items()}
    out.update({key: float(updates[-1].get(key, float("nan"))) for key in LAST_UPDATE_KEYS if key in keys})
    out.update({key: float(np.nanmax(values[key])) for key in LARGEST_OVER_UPDATES_KEYS
                if key in keys and any(np.isfinite(values[key]))})
    out["num_updates"] = float(len(updates))
    out.update(regime_by_update(updates))
    return out


def regime_by_update(updates: List[Dict[str, float]]) -> Dict[str, float]:
    """Per update m of the step, what says whether a run is in the paper's regime (study/diagnostics.py):
    `regime/own_clipped/u<m>`, the share of own rows outside GSPO's clip (the GSPO paper clips ~15 % of tokens;
    the updates after the first are the ones that can clip), and `regime/right_through/u<m>`, the share of the
    other agents' right answers (positive advantage) inside the cross clip [lo_m, 1]: those that moved it."""
    out = {}
    for m, u in enumerate(updates):
        if u.get("num_own"):
            out[f"regime/own_clipped/u{m}"] = float(u["own_clip_frac_lower"] + u["own_clip_frac_upper"])
        right = u.get("cross_positive_frac", float("nan"))
        if u.get("num_cross") and right > 0:
            out[f"regime/right_through/u{m}"] = float(u["cross_positive_inside_frac"] / right)
    return out


def step_records(step: int, names: Sequence[str], rewards: torch.Tensor, capabilities: torch.Tensor,
                 omega: torch.Tensor, reward_stats: Mapping[str, object], *,
                 before_capability: Sequence[Mapping[str, float]], after_capability: Sequence[Mapping[str, float]],
                 shared: Mapping[str, float], started: float, untrained: bool) -> List[Dict[str, float]]:
    """Agent k's record of completed step `step`: its mean reward, `before_capability[k]` (engine/trainer
    log-prob gaps, rollout pipeline figures), capability P_k, `after_capability[k]` (its update's figures, its
    answers' lengths), omega from each other agent, the reward's figures, `shared` (times, Ray's object store)
    and the step's time since `started`. `untrained` (run.mode rollout_only): the learner's keys are NaN."""
    n = len(names)
    blank = {key: float("nan") for key in REQUIRED_KEYS} if untrained else {}
    records = []
    for k in range(n):
        record = {**blank, "step": step, "agent": names[k], "reward_mean": float(rewards[k].mean()),
                  **before_capability[k], "capability": float(capabilities[k]), **after_capability[k],
                  **{f"omega_from/{names[j]}": float(omega[j, k]) for j in range(n) if j != k},
                  **{f"reward/{key}": float(v) for key, v in reward_stats.items() if isinstance(v, (int, float))},
                  **shared}
        record["time/step"] = time.perf_counter() - started
        records.append(record)
    return records
