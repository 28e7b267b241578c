"""The records of a run: one JSON object per (step, agent) in metrics.jsonl, checked, flattened, written and read back.

Also the run's other small files by name (run_info.json: facts about the run as a whole).
"""
from __future__ import annotations

import json
import math
import numbers
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence, Union

PathLike = Union[str, os.PathLike]

METRICS_FILE = "metrics.jsonl"
EVAL_SCORES_FILE = "eval_scores.jsonl"  # per evaluation and agent: each held-out problem's score, cut share, tokens
RUN_INFO_FILE = "run_info.json"  # facts about the run as a whole (e.g. prompts used and skipped)

EVAL_ACCURACY = "eval/accuracy"
EVAL_TRUNCATED = "eval/truncated_frac"  # share of the held-out answers cut at the length limit
EVAL_LENGTH = "eval/response_length_mean"  # tokens a held-out answer
TIME_KEYS = ("time/rollout", "time/reward", "time/bridge", "time/logprob", "time/train", "time/weight_sync",
             "time/step")
REQUIRED_KEYS = (
    "step", "agent", "reward_mean", "capability", "own_ratio_mean", "cross_ratio_mean",
    "own_clip_frac_lower", "own_clip_frac_upper", "cross_clip_frac_lower", "cross_clip_frac_upper",
    "loss", "grad_norm", "lr", "response_length_mean",
) + TIME_KEYS
# Keys the reporter writes itself; a record may not set them.
RESERVED_KEYS = ("kind", "timestamp")


class MetricsError(ValueError):
    """A record the reporter cannot log (missing key, wrong agent or step, a value that is not a number)."""


@dataclass(frozen=True)
class HeldOut:
    """One agent's answers to the held-out problems at one evaluation, problem by problem (each the mean over its
    answers to that problem): the score, whose mean is the held-out accuracy; the share of them cut at the length
    limit; the tokens an answer. Kept per problem, two evaluations compare problem by problem: whether a problem
    gained is one whose answers now end within the limit."""
    scores: Sequence[float]
    truncated: Sequence[float]
    tokens: Sequence[float]


# ----------------------------------------------------------------------------------------------------------
# Records -> JSON lines
# ----------------------------------------------------------------------------------------------------------
def _scalar(value: Any, key: str, agent: str) -> Any:
    """A JSON-ready scalar: numbers as float/int (non-finite -> None), text and None as they are.

    numpy and 0-d torch values are accepted through `.item()`, so the loop may pass tensors' values.
    """
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # a tensor of several values
            raise MetricsError(f"agent {agent!r}: metric {key!r} is not a single value: {value!r}") from None
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    raise MetricsError(f"agent {agent!r}: metric {key!r} has a {type(value).__name__}, expected a number: {value!r}")


def flatten_record(record: Mapping[str, Any], agent: str, prefix: str = "") -> Dict[str, Any]:
    """Nested dicts become "outer/inner" keys (e.g. {"reward": {"timeout": 2}} -> "reward/timeout")."""
    flat: Dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_record(value, agent, prefix=f"{name}/"))
        else:
            flat[name] = _scalar(value, name, agent)
    return flat


def check_step_records(step: int, records: Sequence[Mapping[str, Any]], agent_names: Sequence[str]) -> None:
    """MetricsError unless `records` holds exactly one record per agent of this step, each with every required key."""
    seen: List[str] = []
    for record in records:
        agent = record.get("agent", "<no 'agent' key>")
        missing = [key for key in REQUIRED_KEYS if key not in record]
        if missing:
            raise MetricsError(f"step {step}: the record of agent {agent!r} lacks required key(s) "
                               f"{', '.join(repr(k) for k in missing)}")
        if agent not in agent_names:
            raise MetricsError(f"step {step}: record of unknown agent {agent!r}; "
                               f"the run's agents are {list(agent_names)}")
        if agent in seen:
            raise MetricsError(f"step {step}: two records of agent {agent!r}")
        if record["step"] != step:
            raise MetricsError(f"step {step}: the record of agent {agent!r} says step {record['step']!r}")
        reserved = [key for key in RESERVED_KEYS if key in record]
        if reserved:
            raise MetricsError(f"step {step}: agent {agent!r}: key(s) {reserved} are written by the reporter")
        seen.append(agent)
    absent = [name for name in agent_names if name not in seen]
    if absent:
        raise MetricsError(f"step {step}: no record for agent(s) {absent}")


def json_line(flat: Mapping[str, Any]) -> str:
    # allow_nan=False: a NaN that slipped past _scalar would make the line invalid JSON; fail loudly instead
    return json.dumps(flat, allow_nan=False, separators=(",", ":")) + "\n"


# ----------------------------------------------------------------------------------------------------------
# metrics.jsonl on disk
# ----------------------------------------------------------------------------------------------------------
def read_metrics(path: PathLike) -> List[Dict[str, Any]]:
    """Every complete line of a metrics.jsonl; a torn last line (a run killed mid-write) is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"warning: {path}:{line_number}: skipping a line that is not JSON", file=sys.stderr)
    return records


def truncate_metrics(path: Path, start_step: int) -> int:
    """Keep only the lines of steps < start_step (resume redoes the others); returns how many were dropped."""
    if not path.exists():
        return 0
    kept = [r for r in read_metrics(path) if isinstance(r.get("step"), int) and r["step"] < start_step]
    dropped = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip()) - len(kept)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        f.writelines(json_line(r) for r in kept)
    os.replace(temporary, path)  # a crash here leaves the old or the new file, never half of one
    return dropped


def update_run_info(run_dir: PathLike, facts: Mapping[str, Any]) -> None:
    """Merge `facts` into the run's run_info.json (top-level keys replaced; written whole, then renamed)."""
    path = Path(run_dir) / RUN_INFO_FILE
    info = read_run_info(run_dir)
    info.update(facts)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(info, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def read_run_info(run_dir: PathLike) -> Dict[str, Any]:
    path = Path(run_dir) / RUN_INFO_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
