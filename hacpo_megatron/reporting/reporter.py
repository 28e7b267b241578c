"""RunReporter: what the training loop (rank 0) tells its user, step by step, and what it leaves at the end."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

from hacpo_megatron.reporting.plots import CURVES_FILE, EVAL_PLOT_FILE, plot_curves, plot_eval_accuracy
from hacpo_megatron.reporting.metrics_file import (
    EVAL_ACCURACY, EVAL_LENGTH, EVAL_SCORES_FILE, EVAL_TRUNCATED, METRICS_FILE, HeldOut, MetricsError, PathLike,
    check_step_records, flatten_record, json_line, read_run_info, truncate_metrics, update_run_info,
)
from hacpo_megatron.reporting.run_metrics import load_run
from hacpo_megatron.reporting.summary import SUMMARY_FILE, summary_markdown
from hacpo_megatron.reporting.trackers import TrackerSettings, open_tracker

TRACKER_IDS_KEY = "trackers"  # run_info.json: {tracker name: its run id}, what --resume continues


class RunReporter:
    """Logs a HACPO run for its user. Rank 0 only; every other rank has no reporter.

    Args:
        output_dir: the run's folder (made if missing).
        agent_names: the agents, in the order tables and legends list them.
        total_steps: the run's last step count, for the progress bar.
        trackers: where the metrics go besides metrics.jsonl (reporting/trackers.py: tensorboard, wandb, mlflow).
        plots / progress_bar: switch each output off (metrics.jsonl and summary.md always).
        start_step: the first step this process logs; > 0 when resuming (the tracked runs continue).
        project, run_name, params, mlflow_tracking_uri: what the trackers name and record (the resolved config).
    """

    def __init__(self, output_dir: PathLike, agent_names: Sequence[str], *, total_steps: int,
                 trackers: Sequence[str] = ("tensorboard",), plots: bool = True, progress_bar: bool = True,
                 start_step: int = 0, project: str = "hacpo", run_name: str = "", params: Mapping[str, Any] = None,
                 mlflow_tracking_uri: Optional[str] = None):
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
        truncate_metrics(self.output_dir / EVAL_SCORES_FILE, start_step)
        self._eval_scores_file = open(self.output_dir / EVAL_SCORES_FILE, "a", encoding="utf-8")
        self._trackers = self._open_trackers(trackers, TrackerSettings(
            output_dir=self.output_dir, run_name=run_name or self.output_dir.name, project=project,
            params=dict(params or {}), start_step=start_step, mlflow_tracking_uri=mlflow_tracking_uri))
        self._bar = self._progress_bar(total_steps, start_step) if progress_bar else None
        self._last_rewards: Dict[str, Optional[float]] = {}
        self._last_accuracies: Dict[str, Optional[float]] = {}
        self._closed = False

    # ---- set-up
    def _open_trackers(self, names: Sequence[str], settings: TrackerSettings) -> list:
        """Open each tracker; a resumed run (start_step > 0) continues the tracked runs its run_info.json names."""
        known_ids = read_run_info(self.output_dir).get(TRACKER_IDS_KEY, {}) if settings.start_step > 0 else {}
        trackers = [open_tracker(name, replace(settings, run_id=known_ids.get(name))) for name in names]
        ids = {tracker.name: tracker.run_id for tracker in trackers if tracker.run_id}
        if ids:
            update_run_info(self.output_dir, {TRACKER_IDS_KEY: ids})
        return trackers

    @staticmethod
    def _progress_bar(total_steps: int, start_step: int):
        from tqdm import tqdm

        # start_step is the first step this process logs, so the steps already done are one fewer.
        done = max(start_step - 1, 0)
        return tqdm(total=total_steps, initial=done, desc="train", unit="step", dynamic_ncols=True)

    # ---- logging
    def log_step(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Log one training step: one record per agent (see REQUIRED_KEYS)."""
        check_step_records(step, records, self.agent_names)
        for_trackers: Dict[str, float] = {}
        for record in records:
            agent = record["agent"]
            flat = flatten_record(record, agent)
            self._write(dict(flat, kind="train", timestamp=time.time()), agent, for_trackers)
            self._last_rewards[agent] = flat["reward_mean"]
            if flat.get(EVAL_ACCURACY) is not None:
                self._last_accuracies[agent] = flat[EVAL_ACCURACY]
        self._log_to_trackers(step, for_trackers)
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
        for_trackers: Dict[str, float] = {}
        for agent, accuracy in accuracies.items():
            record = {"step": step, "agent": agent, EVAL_ACCURACY: accuracy}
            record.update(_extra_for(agent, extra, self.agent_names))
            flat = flatten_record(record, agent)
            self._write(dict(flat, kind="eval", timestamp=time.time()), agent, for_trackers)
            self._last_accuracies[agent] = flat[EVAL_ACCURACY]
        self._log_to_trackers(step, for_trackers)
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix())

    def log_held_out(self, step: int, held_out: Mapping[str, HeldOut]) -> None:
        """Log each agent's held-out answers at `step`, problem by problem (eval_scores.jsonl: score, share cut at
        the length limit, tokens; for paired comparisons of two evaluations), and their means (metrics.jsonl and
        the trackers: the held-out accuracy, `eval/truncated_frac`, `eval/response_length_mean`)."""
        self.log_eval(step, {agent: _mean(h.scores) for agent, h in held_out.items()},  # checks the agents' names
                      {agent: {EVAL_TRUNCATED: _mean(h.truncated), EVAL_LENGTH: _mean(h.tokens)}
                       for agent, h in held_out.items()})
        for agent, h in held_out.items():
            self._eval_scores_file.write(json_line({"step": step, "agent": agent, "scores": list(h.scores),
                                                    "truncated": list(h.truncated), "tokens": list(h.tokens)}))
        self._eval_scores_file.flush()

    def _write(self, flat: Dict[str, Any], agent: str, for_trackers: Dict[str, float]) -> None:
        """One line of metrics.jsonl; its numbers also go to `for_trackers` as "<agent>/<metric>"."""
        self._metrics_file.write(json_line(flat))
        self._metrics_file.flush()  # a crashed run keeps every step it finished
        for key, value in flat.items():
            if key not in ("step", "agent", "kind", "timestamp") and isinstance(value, (int, float)) \
                    and not isinstance(value, bool):
                for_trackers[f"{agent}/{key}"] = value

    def _log_to_trackers(self, step: int, metrics: Mapping[str, float]) -> None:
        for tracker in self._trackers:
            tracker.log(step, metrics)

    def _postfix(self) -> str:
        """"qwen3-tiny=0.41 llama-tiny=0.28 | eval qwen3-tiny=0.30 llama-tiny=0.22" (rewards, then held-out)."""
        rewards = " ".join(f"{a}={_short(self._last_rewards[a])}" for a in self.agent_names
                           if a in self._last_rewards)
        if not self._last_accuracies:
            return rewards
        accuracies = " ".join(f"{a}={_short(v)}" for a, v in self._last_accuracies.items())
        return f"{rewards} | eval {accuracies}".strip()

    # ---- the end
    def close(self, failed: bool = False) -> str:
        """Flush and close everything, draw the plots, print and write summary.md, hand summary and plots to the
        trackers (which mark their runs failed if `failed`: the run ended in an error); returns the summary."""
        if self._closed:
            return ""
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        self._metrics_file.close()
        self._eval_scores_file.close()
        summary = render_run_outputs(self.output_dir, agent_names=self.agent_names, plots=self.plots)
        print(summary)
        artifacts = [self.output_dir / name for name in (SUMMARY_FILE, CURVES_FILE, EVAL_PLOT_FILE)]
        for tracker in self._trackers:
            tracker.finish(artifacts, failed)
        return summary

    def __enter__(self) -> "RunReporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close(failed=exc[0] is not None)


def _extra_for(agent: str, extra: Optional[Mapping[str, Any]], agent_names: Sequence[str]) -> Dict[str, Any]:
    if not extra:
        return {}
    if all(key in agent_names and isinstance(value, Mapping) for key, value in extra.items()):
        return dict(extra.get(agent, {}))  # per-agent extras
    return dict(extra)


def _mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if len(values) else None


def _short(value: Optional[float]) -> str:
    return "nan" if value is None else f"{value:.2f}"


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
