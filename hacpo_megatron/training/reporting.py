"""What the user sees of a run: metrics.jsonl, TensorBoard, a progress bar, plots and a summary table.

The training loop (rank 0 only) makes one `RunReporter` and calls

    reporter.log_step(step, records)        # one dict per agent, every step
    reporter.log_eval(step, accuracies)     # {agent: held-out accuracy}, now and then
    reporter.close()                        # curves.png, eval_accuracy.png, summary.md

Files under the run's output folder:

    metrics.jsonl        one JSON object per (step, agent): the source of truth. Each line carries
                         "kind" ("train" or "eval") and "timestamp" (Unix seconds) besides the metrics.
                         NaN and infinities are written as null, so every line is valid JSON.
    tensorboard/         scalars tagged "<agent>/<metric>"
    curves.png           one panel per metric family, one line per agent
    eval_accuracy.png    held-out accuracy per agent
    summary.md           the final table per agent (also printed)

Plots and summary are drawn from metrics.jsonl alone (`render_run_outputs`), so
`tools/plot_metrics.py RUN_DIR` redraws them for any run, finished, crashed or still going.

Resume: a reporter made with `start_step=s` keeps the lines of steps < s and drops the rest (they
belong to the steps about to be redone), then appends. TensorBoard gets the same `purge_step`.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

PathLike = Union[str, os.PathLike]

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
CURVES_FILE = "curves.png"
EVAL_PLOT_FILE = "eval_accuracy.png"
SUMMARY_FILE = "summary.md"
RUN_INFO_FILE = "run_info.json"  # facts about the run as a whole (e.g. prompts used and skipped)

EVAL_ACCURACY = "eval/accuracy"
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


def _flatten(record: Mapping[str, Any], agent: str, prefix: str = "") -> Dict[str, Any]:
    """Nested dicts become "outer/inner" keys (e.g. {"reward": {"timeout": 2}} -> "reward/timeout")."""
    flat: Dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, agent, prefix=f"{name}/"))
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


def _json_line(flat: Mapping[str, Any]) -> str:
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
        f.writelines(_json_line(r) for r in kept)
    os.replace(temporary, path)  # a crash here leaves the old or the new file, never half of one
    return dropped


# ----------------------------------------------------------------------------------------------------------
# The reporter
# ----------------------------------------------------------------------------------------------------------
class RunReporter:
    """Logs a HACPO run for its user. Rank 0 only; every other rank has no reporter.

    Args:
        output_dir: the run's folder (made if missing).
        agent_names: the agents, in the order tables and legends list them.
        total_steps: the run's last step count, for the progress bar.
        tensorboard / plots / progress_bar: switch each output off (metrics.jsonl and summary.md always).
        start_step: the first step this process logs; > 0 when resuming.
    """

    def __init__(self, output_dir: PathLike, agent_names: Sequence[str], *, total_steps: int,
                 tensorboard: bool = True, plots: bool = True, progress_bar: bool = True, start_step: int = 0):
        if not agent_names:
            raise ValueError("RunReporter needs at least one agent name")
        if len(set(agent_names)) != len(agent_names):
            raise ValueError(f"RunReporter: agent names repeat: {list(agent_names)}")
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.agent_names = list(agent_names)
        self.plots = plots
        self.metrics_path = self.output_dir / METRICS_FILE
        # Also on a fresh run (start_step 0): lines from an earlier run in the same folder would mix in.
        truncate_metrics(self.metrics_path, start_step)
        self._metrics_file = open(self.metrics_path, "a", encoding="utf-8")
        self._writer = self._tensorboard_writer(start_step) if tensorboard else None
        self._bar = self._progress_bar(total_steps, start_step) if progress_bar else None
        self._last_rewards: Dict[str, Optional[float]] = {}
        self._last_accuracies: Dict[str, Optional[float]] = {}
        self._closed = False

    # ---- set-up
    def _tensorboard_writer(self, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events of steps >= start_step left by the interrupted run, as truncate_metrics does
        return SummaryWriter(log_dir=str(self.output_dir / TENSORBOARD_DIR),
                             purge_step=start_step if start_step > 0 else None)

    @staticmethod
    def _progress_bar(total_steps: int, start_step: int):
        from tqdm import tqdm

        return tqdm(total=total_steps, initial=start_step, desc="HACPO", unit="step", dynamic_ncols=True)

    # ---- logging
    def log_step(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Log one training step: one record per agent (see REQUIRED_KEYS)."""
        check_step_records(step, records, self.agent_names)
        for record in records:
            agent = record["agent"]
            flat = _flatten(record, agent)
            self._write(dict(flat, kind="train", timestamp=time.time()), step, agent)
            self._last_rewards[agent] = flat["reward_mean"]
            if flat.get(EVAL_ACCURACY) is not None:
                self._last_accuracies[agent] = flat[EVAL_ACCURACY]
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(1)

    def log_eval(self, step: int, accuracies: Mapping[str, float], extra: Optional[Mapping[str, Any]] = None) -> None:
        """Log held-out accuracy per agent at `step`; `extra` (e.g. {"eval/truncated_frac": ...}) goes on
        every agent's line, or per agent when it is {agent: {...}}."""
        unknown = [name for name in accuracies if name not in self.agent_names]
        if unknown:
            raise MetricsError(f"eval at step {step}: unknown agent(s) {unknown}; "
                               f"the run's agents are {self.agent_names}")
        for agent, accuracy in accuracies.items():
            record = {"step": step, "agent": agent, EVAL_ACCURACY: accuracy}
            record.update(_extra_for(agent, extra, self.agent_names))
            flat = _flatten(record, agent)
            self._write(dict(flat, kind="eval", timestamp=time.time()), step, agent)
            self._last_accuracies[agent] = flat[EVAL_ACCURACY]
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix())

    def _write(self, flat: Dict[str, Any], step: int, agent: str) -> None:
        self._metrics_file.write(_json_line(flat))
        self._metrics_file.flush()  # a crashed run keeps every step it finished
        if self._writer is not None:
            for key, value in flat.items():
                if key in ("step", "agent", "kind", "timestamp") or isinstance(value, (str, bool)) or value is None:
                    continue
                self._writer.add_scalar(f"{agent}/{key}", value, global_step=step)

    def _postfix(self) -> str:
        """"qwen3-tiny=0.41 llama-tiny=0.28 | eval qwen3-tiny=0.30 llama-tiny=0.22" (rewards, then held-out)."""
        rewards = " ".join(f"{a}={_short(self._last_rewards[a])}" for a in self.agent_names
                           if a in self._last_rewards)
        if not self._last_accuracies:
            return rewards
        accuracies = " ".join(f"{a}={_short(v)}" for a, v in self._last_accuracies.items())
        return f"{rewards} | eval {accuracies}".strip()

    # ---- the end
    def close(self) -> str:
        """Flush and close everything, draw the plots, print and write summary.md; returns the summary."""
        if self._closed:
            return ""
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
        self._metrics_file.close()
        summary = render_run_outputs(self.output_dir, agent_names=self.agent_names, plots=self.plots)
        print(summary)
        return summary

    def __enter__(self) -> "RunReporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _extra_for(agent: str, extra: Optional[Mapping[str, Any]], agent_names: Sequence[str]) -> Dict[str, Any]:
    if not extra:
        return {}
    if all(key in agent_names and isinstance(value, Mapping) for key, value in extra.items()):
        return dict(extra.get(agent, {}))  # per-agent extras
    return dict(extra)


def _short(value: Optional[float]) -> str:
    return "nan" if value is None else f"{value:.2f}"


# ----------------------------------------------------------------------------------------------------------
# Reading a run back: series per agent
# ----------------------------------------------------------------------------------------------------------
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


def load_run(run_dir: PathLike, agent_names: Optional[Sequence[str]] = None) -> RunMetrics:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (is {run_dir} a run folder?)")
    return group_metrics(read_metrics(path), agent_names)


# ----------------------------------------------------------------------------------------------------------
# Summary table
# ----------------------------------------------------------------------------------------------------------
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


def summary_markdown(metrics: RunMetrics, run_dir: PathLike = "", run_info: Optional[Mapping[str, Any]] = None) -> str:
    """The summary.md text: results per agent, the mean step time by phase, and the prompts used."""
    summaries = [summarize_agent(metrics, agent) for agent in metrics.agent_names]
    lines = [f"# Run summary{f': {run_dir}' if run_dir else ''}", ""]
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
    prompts = (run_info or {}).get("prompts")
    if prompts:
        lines += ["", "Prompts: " + "; ".join(
            f"{split} {p['used']} used, {p['skipped_overlong']} skipped as longer than rollout.max_prompt_length"
            for split, p in prompts.items())]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------
# Plots (matplotlib's Agg canvas through Figure: no pyplot, no global backend switch, no display needed)
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Panel:
    title: str
    lines: Tuple[Tuple[str, str], ...]  # (metric key, label suffix); several keys share a panel by line style
    ylabel: str = ""


CURVE_PANELS = (
    Panel("reward (mean over own responses)", (("reward_mean", ""),), "reward"),
    Panel("capability P_k", (("capability", ""),), "P_k"),
    Panel("loss", (("loss", ""),)),
    Panel("importance ratio mean", (("own_ratio_mean", "own"), ("cross_ratio_mean", "cross")), "ratio"),
    Panel("own-response clip fraction", (("own_clip_frac_lower", "lower"), ("own_clip_frac_upper", "upper")),
          "fraction"),
    Panel("other agents' responses clip fraction",
          (("cross_clip_frac_lower", "below"), ("cross_clip_frac_upper", "above"),
           ("cross_positive_inside_frac", "advantage > 0, inside")), "fraction"),
    Panel("gradient norm", (("grad_norm", ""),)),
    Panel("response length (tokens)", (("response_length_mean", ""),), "tokens"),
)
LINE_STYLES = ("-", "--", ":", "-.")
SMOOTH_FROM_POINTS = 20  # below this, the raw curve is readable as it is


def _moving_average(values: List[float], window: int) -> List[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _plot_series(axes, steps: List[int], values: List[float], color, style: str, label: str) -> None:
    """Raw values faint and a moving average bold once there are many points (RL curves are noisy)."""
    if len(values) >= SMOOTH_FROM_POINTS:
        axes.plot(steps, values, color=color, linestyle=style, alpha=0.25, linewidth=0.8)
        axes.plot(steps, _moving_average(values, max(2, len(values) // 20)), color=color, linestyle=style,
                  linewidth=1.6, label=label)
    else:
        axes.plot(steps, values, color=color, linestyle=style, linewidth=1.4, marker="." if len(values) < 50 else None,
                  label=label)


def _agent_colors(agent_names: Sequence[str]) -> Dict[str, Any]:
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    return {agent: palette(i % 10) for i, agent in enumerate(agent_names)}


def _new_figure(rows: int, columns: int, width: float, height: float):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    return figure, axes


def _draw_eval_panel(axes, metrics: RunMetrics, colors: Dict[str, Any]) -> None:
    axes.set_title("held-out accuracy")
    axes.set_xlabel("step")
    axes.set_ylabel("accuracy")
    if not metrics.has_eval:
        axes.text(0.5, 0.5, "no evaluation in this run", ha="center", va="center", transform=axes.transAxes,
                  color="gray")
        return
    for agent in metrics.agent_names:
        steps, values = metrics.eval_accuracy.get(agent, ([], []))
        if steps:
            axes.plot(steps, values, color=colors[agent], marker="o", linewidth=1.6, label=agent)
    axes.legend(fontsize="small")


def plot_curves(metrics: RunMetrics, path: PathLike) -> None:
    """curves.png: one panel per metric family plus held-out accuracy; colour = agent, line style = variant."""
    colors = _agent_colors(metrics.agent_names)
    panels = len(CURVE_PANELS) + 1
    columns = 3
    rows = -(-panels // columns)
    figure, grid = _new_figure(rows, columns, 5.0 * columns, 3.4 * rows)
    cells = [grid[i // columns][i % columns] for i in range(rows * columns)]
    for axes, panel in zip(cells, CURVE_PANELS):
        axes.set_title(panel.title)
        axes.set_xlabel("step")
        axes.set_ylabel(panel.ylabel)
        axes.grid(alpha=0.3)
        for agent in metrics.agent_names:
            for (key, variant), style in zip(panel.lines, LINE_STYLES):
                steps, values = metrics.series(agent, key)
                if steps:
                    label = f"{agent} {variant}".strip()
                    _plot_series(axes, steps, values, colors[agent], style, label)
        if axes.lines:
            axes.legend(fontsize="small")
        else:
            axes.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axes.transAxes, color="gray")
    _draw_eval_panel(cells[len(CURVE_PANELS)], metrics, colors)
    cells[len(CURVE_PANELS)].grid(alpha=0.3)
    for axes in cells[panels:]:
        axes.set_visible(False)
    figure.suptitle(f"HACPO training curves ({', '.join(metrics.agent_names)})")
    figure.savefig(path, dpi=110)


def plot_eval_accuracy(metrics: RunMetrics, path: PathLike) -> None:
    figure, grid = _new_figure(1, 1, 7.0, 4.5)
    axes = grid[0][0]
    _draw_eval_panel(axes, metrics, _agent_colors(metrics.agent_names))
    axes.grid(alpha=0.3)
    axes.set_ylim(-0.02, 1.02)
    figure.savefig(path, dpi=110)


def render_run_outputs(run_dir: PathLike, *, agent_names: Optional[Sequence[str]] = None, plots: bool = True) -> str:
    """Draw curves.png and eval_accuracy.png (if `plots`) and write summary.md from the run's metrics.jsonl.

    Returns the summary text.
    """
    run_dir = Path(run_dir)
    metrics = load_run(run_dir, agent_names)
    if plots:
        plot_curves(metrics, run_dir / CURVES_FILE)
        plot_eval_accuracy(metrics, run_dir / EVAL_PLOT_FILE)
    summary = summary_markdown(metrics, run_dir, read_run_info(run_dir))
    (run_dir / SUMMARY_FILE).write_text(summary, encoding="utf-8")
    return summary


__all__ = [
    "EVAL_ACCURACY", "MetricsError", "REQUIRED_KEYS", "RunMetrics", "RunReporter", "TIME_KEYS", "check_step_records",
    "group_metrics", "load_run", "read_metrics", "read_run_info", "render_run_outputs", "summarize_agent",
    "summary_markdown", "update_run_info",
]
