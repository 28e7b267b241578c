"""A study: every variant (algorithm, baseline, ablation) x seed as one training run, compared over seeds;
tools/compare_algorithms.py is its command line (docs/study.md).

One module per concern: cells.py (variants, cells, their launcher commands, what a cell's folder holds),
diagnostics.py (what a cell's training records say about its clips: the regime, the gate, the cross clip),
stats.py (mean and Student-t 95% CI), report.py (a cell's results, the tables, results.md, accuracy.png),
runner.py (the Study, its checks, running its cells one after another, one study process per folder).
"""
