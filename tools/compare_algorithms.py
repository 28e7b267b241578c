"""Run a study: every variant (algorithm, baseline, ablation) x seed as one training run, one after another,
resumably; then held-out accuracy per agent as mean ± 95% CI over seeds, and paired differences to a baseline.

    python tools/compare_algorithms.py --config configs/default.yaml \\
        --variant hacpo= \\
        --variant gspo_x2="algorithm.name=gspo_x2" \\
        --variant naive=configs/baselines/naive.yaml \\
        --variant "a3_nocc=algorithm.alpha=3;algorithm.cross_clip=false" \\
        --seeds 1 2 3 --baseline gspo_x2 --out studies/default [--set KEY=VALUE ...] [--dry-run | --report]
    python tools/compare_algorithms.py ...the same... --only hacpo:2 [--out OTHER]   # just that cell

--variant LABEL=SPEC (repeat it; at least one): LABEL names the variant (letters, digits, '_', '-', '.', '+';
its runs go to OUT/LABEL/). SPEC is a ';'-separated list of items, each either a `KEY=VALUE` config override
(as `--set` takes it) or one YAML config file (an item without '='), which then replaces --config for this
variant. `LABEL=` alone is --config as it is. --set KEY=VALUE (repeatable) applies to every variant, before the
variant's own overrides (e.g. `--set run.total_steps=10` for a quick study). run.seed comes from --seeds only.
--baseline LABEL: the variant the others are compared with, seed by seed (optional).
--compare A:B (repeatable): one more paired difference A - B, seed by seed (e.g. two variants neither of which is
    the baseline).
--only LABEL:SEED (repeatable): run just these cells; the table still reads every cell under OUT.
--dry-run: check everything, print each cell's state and the command it would run; run and write nothing.
--report: run nothing; write results.md and accuracy.png from the cells as they are (unfinished ones shown so):
the tables of a study whose cells ran elsewhere and were copied under OUT (studies/pair).

Each cell is the run folder OUT/LABEL/seedN/, made by the project's launcher as a subprocess:

    python -m hacpo_megatron.launch --config CFG --set run.seed=N [--set ...] --output-dir OUT/LABEL/seedN [--resume]

its output going to OUT/LABEL/seedN/launcher.log. What a folder holds decides what happens to it:
  finished     metrics.jsonl has, for every agent of the folder's own config.yaml, the training record of
               step run.total_steps and (when data.eval_every > 0 and data.eval is set) the held-out record
               of that step: skipped. (summary.md is no sign of an end: the loop writes it after a crash too.)
  resumable    not finished, but a checkpoint step folder exists: started again with --resume.
  not started  neither: started fresh (an earlier partial metrics.jsonl is dropped by the run itself).
A cell whose folder holds a config.yaml other than the one this call would run (a changed variant) is an
input error: move that folder away or use another --out. A cell that fails is reported and the study goes
on; the next call tries it again. SIGTERM or SIGINT to this tool is passed on to the running cell, which
finishes its step, writes a checkpoint and stops (docs: README "Resume and failures"); the tool then stops
too, and the next call resumes that cell.

Each cell's figure per agent is its held-out accuracy at its final evaluation (step run.total_steps); only
finished cells count. OUT/results.md (also printed) holds per variant and agent the mean over seeds with
its 95% confidence interval (Student's t, n-1 degrees of freedom), each cell's gain from its first evaluation
in standard errors, the paired difference variant - baseline over the seeds where both finished with its 95% CI,
every cell's state, and the command that reruns each cell (on CPU a run on the embedded engine is deterministic
for its seed; with vLLM's log-probs as old log-probs a rerun reproduced rewards and held-out figures with losses
~1e-6 apart: docs/study.md).
OUT/accuracy.png: held-out accuracy over steps, the mean over seeds per variant, one panel per agent.

Exit codes: 0 every cell finished, 1 a cell failed or is not finished, 2 bad input (one line on stderr,
before any run starts), 143 stopped by SIGTERM/SIGINT (run the same command again to resume).

The code is the package hacpo_megatron/study/: cells.py (variants, cells, a cell's folder), diagnostics.py (the
regime, the gate, the cross clip), stats.py (mean ± 95% CI), report.py (the tables, results.md, accuracy.png),
runner.py (checks, running the cells, the lock); this file is its command line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hacpo_megatron.study.cells import StudyInputError, parse_cell_ref, parse_comparison, parse_variant  # noqa: E402
from hacpo_megatron.study.runner import (  # noqa: E402
    EXIT_BAD_INPUT,
    Launch,
    Resolve,
    Study,
    resolve_config,
    run_launcher,
    run_study,
    shown_command,
)


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (and exit code 2), like every other input error."""

    def error(self, message: str):
        print(f"compare_algorithms: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the base YAML config (variants start from it)")
    parser.add_argument("--variant", dest="variants", action="append", default=[], metavar="LABEL=SPEC",
                        help="a variant: SPEC is ';'-separated KEY=VALUE overrides and/or one config file")
    parser.add_argument("--seeds", nargs="+", type=int, required=True, metavar="N", help="run.seed of each cell")
    parser.add_argument("--baseline", default=None, metavar="LABEL", help="the variant others are paired with")
    parser.add_argument("--compare", dest="comparisons", action="append", default=[], metavar="A:B",
                        help="one more paired difference, A - B seed by seed (repeatable)")
    parser.add_argument("--out", required=True, help="the study folder (OUT/LABEL/seedN/, results.md, accuracy.png)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every variant")
    parser.add_argument("--only", action="append", default=[], metavar="LABEL:SEED", help="run just this cell")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print each cell's state and command; run nothing")
    mode.add_argument("--report", action="store_true",
                      help="run nothing; write results.md and accuracy.png from the cells as they are")
    return parser


def study_from_args(args: argparse.Namespace, command: Optional[str] = None) -> Study:
    if not Path(args.config).is_file():
        raise StudyInputError(f"--config {args.config}: no such file")
    return Study(base_config=args.config, variants=[parse_variant(text, args.config) for text in args.variants],
                 seeds=list(args.seeds), out=Path(args.out), baseline=args.baseline,
                 comparisons=[parse_comparison(text) for text in args.comparisons],
                 common_overrides=list(args.overrides), only=[parse_cell_ref(text) for text in args.only],
                 command=command)


def main(argv: Optional[Sequence[str]] = None, *, launch: Launch = run_launcher,
         resolve: Optional[Resolve] = resolve_config) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    command = shown_command(argv, __file__)
    try:
        return run_study(study_from_args(args, command), launch=launch, resolve=resolve, dry_run=args.dry_run,
                         report=args.report)
    except StudyInputError as error:
        print(f"compare_algorithms: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
