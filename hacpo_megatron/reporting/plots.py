"""curves.png and eval_accuracy.png, drawn from metrics.jsonl alone.

matplotlib's Agg canvas through Figure: no pyplot, no global backend switch, no display needed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from hacpo_megatron.reporting.metrics_file import PathLike
from hacpo_megatron.reporting.run_metrics import RunMetrics

CURVES_FILE = "curves.png"
EVAL_PLOT_FILE = "eval_accuracy.png"

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
