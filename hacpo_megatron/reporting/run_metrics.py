"""Reading a run back: metrics.jsonl grouped into series per agent (for the summary, the plots and the study tools)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from hacpo_megatron.reporting.metrics_file import EVAL_ACCURACY, METRICS_FILE, PathLike, read_metrics

Series = Tuple[List[int], List[float]]  # steps, values (steps where the value was null are left out)


@dataclass
class RunMetrics:
    """metrics.jsonl grouped by agent: training records in step order, and held-out accuracies."""

    agent_names: List[str]
    train: Dict[str, List[Dict[str, Any]]] = field(default_factory=dict)
    eval_accuracy: Dict[str, Series] = field(default_factory=dict)

    def series(self, agent: str, key: str) -> Series:
        steps, values = [], []
        for record in self.train.get(agent, []):
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                steps.append(record["step"])
                values.append(float(value))
        return steps, values

    @property
    def has_eval(self) -> bool:
        return any(steps for steps, _ in self.eval_accuracy.values())


def group_metrics(records: Iterable[Mapping[str, Any]], agent_names: Optional[Sequence[str]] = None) -> RunMetrics:
    """Group raw lines by agent. The last line of a (kind, step, agent) wins, so a line repeated by a
    resume that was not truncated counts once. Held-out accuracy comes from eval lines and from
    training lines that carry "eval/accuracy"."""
    names = list(agent_names or [])
    train: Dict[str, Dict[int, Dict[str, Any]]] = {}
    accuracy: Dict[str, Dict[int, float]] = {}
    for record in records:
        agent, step = record.get("agent"), record.get("step")
        if not isinstance(agent, str) or not isinstance(step, int):
            continue
        if agent not in names:
            names.append(agent)
        if record.get("kind", "train") == "train":
            train.setdefault(agent, {})[step] = dict(record)
        if isinstance(record.get(EVAL_ACCURACY), (int, float)):
            accuracy.setdefault(agent, {})[step] = float(record[EVAL_ACCURACY])
    return RunMetrics(
        agent_names=names,
        train={a: [by_step[s] for s in sorted(by_step)] for a, by_step in train.items()},
        eval_accuracy={a: (sorted(by_step), [by_step[s] for s in sorted(by_step)]) for a, by_step in accuracy.items()},
    )


def load_run(run_dir: PathLike, agent_names: Optional[Sequence[str]] = None) -> RunMetrics:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (is {run_dir} a run folder?)")
    return group_metrics(read_metrics(path), agent_names)
