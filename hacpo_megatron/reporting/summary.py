"""summary.md: the final table per agent (first and last reward, held-out accuracy, time by phase)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from hacpo_megatron.reporting.metrics_file import TIME_KEYS, PathLike
from hacpo_megatron.reporting.run_metrics import RunMetrics

SUMMARY_FILE = "summary.md"

@dataclass
class AgentSummary:
    agent: str
    steps: int
    first_step: Optional[int]
    last_step: Optional[int]
    first_reward: Optional[float]
    last_reward: Optional[float]
    first_eval: Optional[Tuple[int, float]]  # (step, accuracy)
    last_eval: Optional[Tuple[int, float]]
    mean_time: Dict[str, Optional[float]]  # TIME_KEYS -> mean seconds over the agent's steps
    total_time_s: float  # sum of time/step: the time spent in steps (resumes' downtime excluded)
    mean_train_flops_per_s: Optional[float] = None  # perf/model_flops_per_s: model FLOP/s of the updates
    mean_mfu: Optional[float] = None  # perf/mfu: that as a fraction of the GEMM peak measured in the run

    @property
    def eval_change(self) -> Optional[float]:
        if self.first_eval is None or self.last_eval is None:
            return None
        return self.last_eval[1] - self.first_eval[1]


def summarize_agent(metrics: RunMetrics, agent: str) -> AgentSummary:
    records = metrics.train.get(agent, [])
    reward_steps, rewards = metrics.series(agent, "reward_mean")
    eval_steps, accuracies = metrics.eval_accuracy.get(agent, ([], []))
    def mean(key: str) -> Optional[float]:
        values = metrics.series(agent, key)[1]
        return sum(values) / len(values) if values else None

    return AgentSummary(
        agent=agent,
        steps=len(records),
        first_step=records[0]["step"] if records else None,
        last_step=records[-1]["step"] if records else None,
        first_reward=rewards[0] if rewards else None,
        last_reward=rewards[-1] if rewards else None,
        first_eval=(eval_steps[0], accuracies[0]) if eval_steps else None,
        last_eval=(eval_steps[-1], accuracies[-1]) if eval_steps else None,
        mean_time={key: mean(key) for key in TIME_KEYS},
        total_time_s=sum(metrics.series(agent, "time/step")[1]),
        mean_train_flops_per_s=mean("perf/model_flops_per_s"),
        mean_mfu=mean("perf/mfu"),
    )


def _number(value: Optional[float], digits: int = 3, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _at_step(value: Optional[Tuple[int, float]]) -> str:
    return "n/a" if value is None else f"{value[1]:.3f} (step {value[0]})"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _utilisation(summary: AgentSummary) -> str:
    if summary.mean_train_flops_per_s is None or summary.mean_mfu is None:
        return "n/a"
    return f"{summary.mean_train_flops_per_s / 1e9:.1f} ({100 * summary.mean_mfu:.0f}%)"


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


OVERLAP_COLUMNS = (  # (heading, metric, how the steps are summed up)
    ("staleness mean", "staleness/versions_behind", "mean"), ("staleness max", "staleness/versions_behind", "max"),
    ("learners waited for answers s", "time/rollout", "mean"), ("generation s", "pipeline/generation_s", "mean"),
    ("generation hidden by training", "pipeline/hidden_frac", "mean"),
    ("engine waited for weights s", "pipeline/engine_idle_s", "mean"),
    ("behaviour weight mean", "staleness/behaviour_weight_mean", "mean"),
)


def _overlap_table(metrics: RunMetrics) -> List[str]:
    """Rollout ahead of training (rollout.max_staleness >= 1, the runs whose records carry a staleness): how old
    the trained answers were and how far generation and training overlapped, per agent."""
    if not any(metrics.series(agent, "staleness/versions_behind")[1] for agent in metrics.agent_names):
        return []

    def summed(agent: str, key: str, how: str) -> str:
        values = metrics.series(agent, key)[1]
        if not values:
            return "n/a"
        return _number(max(values) if how == "max" else sum(values) / len(values), digits=2)

    return ["", "Rollout ahead of training (per step):", ""] + _markdown_table(
        ["agent"] + [heading for heading, _, _ in OVERLAP_COLUMNS],
        [[agent] + [summed(agent, key, how) for _, key, how in OVERLAP_COLUMNS] for agent in metrics.agent_names])


def _shown_run_dir(run_dir: PathLike) -> str:
    """The run folder as summary.md names it: relative to the working folder when inside it (runs/x), else not at
    all (a study's cell folders are copied into the repository: a folder of the machine they ran on would mislead)."""
    if not run_dir:
        return ""
    relative = os.path.relpath(run_dir)
    return "" if relative.startswith("..") else relative


def summary_markdown(metrics: RunMetrics, run_dir: PathLike = "", run_info: Optional[Mapping[str, Any]] = None) -> str:
    """The summary.md text: results per agent, the mean step time by phase, and the prompts used."""
    summaries = [summarize_agent(metrics, agent) for agent in metrics.agent_names]
    shown = _shown_run_dir(run_dir)
    lines = [f"# Run summary{f': {shown}' if shown else ''}", ""]
    lines += _markdown_table(
        ["agent", "steps", "first reward", "last reward", "held-out acc. first", "held-out acc. last",
         "held-out change"],
        [[s.agent, f"{s.steps}" + (f" ({s.first_step}-{s.last_step})" if s.steps else ""),
          _number(s.first_reward), _number(s.last_reward), _at_step(s.first_eval), _at_step(s.last_eval),
          _number(s.eval_change, signed=True)] for s in summaries])
    if not metrics.has_eval:
        lines += ["", "No held-out evaluation was logged."]
    lines += ["", "Mean seconds per step, by phase:", ""]
    phases = [key.split("/", 1)[1] for key in TIME_KEYS]
    lines += _markdown_table(
        ["agent"] + phases + ["total wall time", "train GFLOP/s (MFU)"],
        [[s.agent] + [_number(s.mean_time[key], digits=2) for key in TIME_KEYS] + [_duration(s.total_time_s),
                                                                                   _utilisation(s)]
         for s in summaries])
    lines += _overlap_table(metrics)
    prompts = (run_info or {}).get("prompts")
    if prompts:
        lines += ["", "Prompts: " + "; ".join(
            f"{split} {p['used']} used, {p['skipped_overlong']} skipped as longer than rollout.max_prompt_length"
            for split, p in prompts.items())]
    return "\n".join(lines) + "\n"
