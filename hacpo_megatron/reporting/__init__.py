"""What the user sees of a run: metrics.jsonl, trackers (TensorBoard, W&B, MLflow), a progress bar, plots, a summary.

The training loop (rank 0 only) makes one `RunReporter` and calls

    reporter.log_step(step, records)        # one dict per agent, every step
    reporter.log_held_out(step, held_out)   # {agent: HeldOut}, each held-out problem's answers, now and then
    reporter.close()                        # curves.png, eval_accuracy.png, summary.md

Files under the run's output folder:

    metrics.jsonl        one JSON object per (step, agent): the source of truth. Each line carries
                         "kind" ("train" or "eval") and "timestamp" (Unix seconds) besides the metrics.
                         NaN and infinities are written as null, so every line is valid JSON.
    tensorboard/         scalars tagged "<agent>/<metric>" (logging.trackers: tensorboard, the default)
    wandb/, mlflow.db    the same under the same names, when logging.trackers lists wandb / mlflow (trackers.py)
    curves.png           one panel per metric family, one line per agent
    eval_accuracy.png    held-out accuracy per agent
    summary.md           the final table per agent (also printed)

Plots and summary are drawn from metrics.jsonl alone (`render_run_outputs`), so
`tools/plot_metrics.py RUN_DIR` redraws them for any run, finished, crashed or still going.

Resume: a reporter made with `start_step=s` keeps the lines of steps < s and drops the rest (they
belong to the steps about to be redone), then appends; the trackers continue the tracked runs of run_info.json.

One module per concern: metrics_file.py (the lines and files), step_records.py (a step's records), run_metrics.py
(reading a run back), summary.py, plots.py, trackers.py, reporter.py (RunReporter, render_run_outputs).
"""
from hacpo_megatron.reporting.plots import CURVES_FILE, EVAL_PLOT_FILE, plot_curves, plot_eval_accuracy
from hacpo_megatron.reporting.metrics_file import (
    EVAL_ACCURACY, METRICS_FILE, REQUIRED_KEYS, RUN_INFO_FILE, TIME_KEYS, HeldOut, MetricsError, check_step_records,
    read_metrics, read_run_info, truncate_metrics, update_run_info,
)
from hacpo_megatron.reporting.reporter import RunReporter, render_run_outputs
from hacpo_megatron.reporting.run_metrics import RunMetrics, group_metrics, load_run
from hacpo_megatron.reporting.summary import SUMMARY_FILE, summarize_agent, summary_markdown
from hacpo_megatron.reporting.trackers import TENSORBOARD_DIR, TRACKERS, tracker_install_problems

__all__ = [
    "CURVES_FILE", "EVAL_ACCURACY", "EVAL_PLOT_FILE", "HeldOut", "METRICS_FILE", "MetricsError", "REQUIRED_KEYS",
    "RUN_INFO_FILE", "RunMetrics", "RunReporter", "SUMMARY_FILE", "TENSORBOARD_DIR", "TIME_KEYS", "TRACKERS",
    "check_step_records", "group_metrics", "load_run", "plot_curves", "plot_eval_accuracy", "read_metrics",
    "read_run_info", "render_run_outputs", "summarize_agent", "summary_markdown", "tracker_install_problems",
    "truncate_metrics", "update_run_info",
]
