"""Redraw a run's curves.png, eval_accuracy.png and summary.md from its metrics.jsonl.

    python tools/plot_metrics.py RUN_DIR [--no-plots]

Works on any run folder with a metrics.jsonl: finished, crashed, or still training (it reads what is
there). The same code draws them at the end of training (`RunReporter.close`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hacpo_megatron.reporting import METRICS_FILE, render_run_outputs  # noqa: E402


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help=f"a run's output folder (holds {METRICS_FILE})")
    parser.add_argument("--no-plots", action="store_true", help="write summary.md only")
    args = parser.parse_args(argv)
    if not (Path(args.run_dir) / METRICS_FILE).is_file():
        print(f"plot_metrics: error: {Path(args.run_dir) / METRICS_FILE}: no such file", file=sys.stderr)
        return 2
    print(render_run_outputs(args.run_dir, plots=not args.no_plots))
    if not args.no_plots:
        print(f"wrote {Path(args.run_dir) / 'curves.png'} and {Path(args.run_dir) / 'eval_accuracy.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
