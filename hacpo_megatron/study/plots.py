"""accuracy.png: a study's held-out accuracy over steps, one panel per agent, one line per variant."""
from __future__ import annotations

from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple

from hacpo_megatron.study.report import CellResult, variant_agents
from hacpo_megatron.study.stats import mean_ci


def mean_curve(curves: Sequence[Mapping[int, float]]) -> Tuple[List[int], List[float], List[Optional[float]]]:
    """Steps, the mean over runs at each step, and the 95% CI half-width there (None below two runs)."""
    steps = sorted({step for curve in curves for step in curve})
    estimates = [mean_ci([curve[step] for curve in curves if step in curve]) for step in steps]
    return steps, [e.mean for e in estimates], [e.half_width for e in estimates]


def plot_accuracy(results: Sequence[CellResult], labels: Sequence[str], baseline: Optional[str], path: Path) -> None:
    """accuracy.png: one panel per agent, one line per variant (the mean over its finished seeds, with its 95%
    CI shaded); the baseline dashed. Matplotlib's Agg canvas: no display needed."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    agents: List[str] = []
    for label in labels:
        agents += [a for a in variant_agents(results, label) if a not in agents]
    panels = max(1, len(agents))
    figure = Figure(figsize=(5.5 * panels, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.subplots(1, panels, squeeze=False)[0]
    palette = colormaps["tab10"]
    for axes, agent in zip(grid, agents or ["(no runs yet)"]):
        axes.set_title(f"held-out accuracy: {agent}")
        axes.set_xlabel("step")
        axes.set_ylabel("accuracy")
        axes.grid(alpha=0.3)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        for i, label in enumerate(labels):
            curves = [r.curves[agent] for r in results
                      if r.cell.variant.label == label and r.finished and agent in r.curves]
            if not curves:
                continue
            steps, means, halves = mean_curve(curves)
            color = palette(i % 10)
            axes.plot(steps, means, color=color, marker="o", linewidth=1.6,
                      linestyle="--" if label == baseline else "-", label=f"{label} (n={len(curves)})")
            if any(h is not None for h in halves):
                low = [m - (h or 0.0) for m, h in zip(means, halves)]
                high = [m + (h or 0.0) for m, h in zip(means, halves)]
                axes.fill_between(steps, low, high, color=color, alpha=0.15, linewidth=0)
        if axes.lines:
            axes.legend(fontsize="small")
        else:
            axes.text(0.5, 0.5, "no finished run", ha="center", va="center", transform=axes.transAxes, color="gray")
    figure.suptitle("Held-out accuracy, mean over seeds (shaded: 95% CI)")
    figure.savefig(path, dpi=110)
