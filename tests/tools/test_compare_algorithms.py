"""tools/compare_algorithms.py and its package hacpo_megatron/study/ with a fake launcher that writes run folders
(no training, no models): the table's statistics against numpy, resume and skip decisions, failures, preemption,
bad input, the plot. The command line is exercised through the tool's file, the rest through the package."""
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from hacpo_megatron.study.cells import (
    FINISHED,
    NOT_STARTED,
    RESUMABLE,
    Cell,
    CellState,
    Variant,
    cell_state,
    launcher_command,
    parse_variant,
    plan_cells,
)
from hacpo_megatron.study.diagnostics import (
    STRATA,
    Answers,
    answers_of,
    clip_diagnostics,
    gate_of,
    regime_of,
    regime_verdict,
    strata_of,
    weaker_agent,
)
from hacpo_megatron.study.report import (
    CellResult,
    accuracy_rows,
    answer_rows,
    clip_table,
    code_version,
    collect_cell,
    gain_rows,
    gate_rows,
    paired_rows,
    results_markdown,
    strata_difference_rows,
    strata_rows,
)
from hacpo_megatron.study.runner import PREEMPTED_EXIT_CODE, resolve_config, run_launcher
from hacpo_megatron.study.stats import Estimate, mean_ci, t_quantile_975

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "compare_algorithms.py"
BASE = str(REPO / "configs" / "default.yaml")
NAIVE = str(REPO / "configs" / "baselines" / "naive.yaml")
AGENTS = ("qwen3-tiny", "llama-tiny")
TOTAL_STEPS = 4

# Final held-out accuracy per (variant, seed, agent) of the fake runs.
FINAL = {
    ("hacpo", 1, "qwen3-tiny"): 0.70, ("hacpo", 2, "qwen3-tiny"): 0.74, ("hacpo", 3, "qwen3-tiny"): 0.66,
    ("hacpo", 1, "llama-tiny"): 0.50, ("hacpo", 2, "llama-tiny"): 0.55, ("hacpo", 3, "llama-tiny"): 0.48,
    ("gspo", 1, "qwen3-tiny"): 0.61, ("gspo", 2, "qwen3-tiny"): 0.69, ("gspo", 3, "qwen3-tiny"): 0.60,
    ("gspo", 1, "llama-tiny"): 0.44, ("gspo", 2, "llama-tiny"): 0.47, ("gspo", 3, "llama-tiny"): 0.44,
}
T_975_2 = 4.303  # Student's t, 0.975 quantile, 2 degrees of freedom (any statistics table)
T_975_1 = 12.706


@pytest.fixture(scope="module")
def tool():
    """The command line, loaded from the file users run."""
    spec = importlib.util.spec_from_file_location("compare_algorithms", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------- fake run folders
def _option(command, flag):
    return command[command.index(flag) + 1] if flag in command else None


def _seed_of(command):
    return int(next(v for f, v in zip(command, command[1:]) if f == "--set" and v.startswith("run.seed="))
               .split("=", 1)[1])


def write_run(folder: Path, label: str, seed: int, *, upto: int = TOTAL_STEPS, checkpoint: bool = True,
              summary: bool = True):
    """A run folder as run_hacpo leaves it after `upto` of TOTAL_STEPS steps (eval every 2 steps)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"run": {"name": label, "seed": seed, "total_steps": TOTAL_STEPS},
              "agents": [{"name": a} for a in AGENTS], "data": {"eval": "synthetic:largest", "eval_every": 2}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    lines = []
    for step in range(upto + 1):
        for agent in AGENTS:
            if step > 0:
                lines.append({"step": step, "agent": agent, "reward_mean": 0.5, "kind": "train"})
            if step % 2 == 0:
                final = FINAL.get((label, seed, agent), 0.5)
                accuracy = {0: final - 0.2, 2: final + 0.05}.get(step, final)  # the best is not the last
                lines.append({"step": step, "agent": agent, "eval/accuracy": accuracy, "kind": "eval"})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    if summary:
        (folder / "summary.md").write_text("# Run summary\n", encoding="utf-8")
    if checkpoint and upto >= 2:
        step = upto - upto % 2
        (folder / "checkpoints" / f"step_{step:08d}").mkdir(parents=True, exist_ok=True)
        (folder / "checkpoints" / "latest").write_text(f"step_{step:08d}\n")


class FakeLauncher:
    """Records every command; writes a finished run folder, or fails / is preempted for the cells named."""

    def __init__(self, fail=(), preempt=()):
        self.calls = []
        self.fail, self.preempt = set(fail), set(preempt)

    def __call__(self, command, log_path):
        self.calls.append(list(command))
        folder = Path(_option(command, "--output-dir"))
        label, seed = folder.parent.name, _seed_of(command)
        assert log_path == folder / "launcher.log"
        if (label, seed) in self.fail:
            write_run(folder, label, seed, upto=1, checkpoint=False)
            return 1
        if (label, seed) in self.preempt:
            write_run(folder, label, seed, upto=2)
            return 143
        write_run(folder, label, seed)
        return 0

    def cells(self):
        return [(Path(_option(c, "--output-dir")).parent.name, _seed_of(c), "--resume" in c) for c in self.calls]


def study_args(out, *extra, seeds=("1", "2", "3")):
    return ["--config", BASE, "--variant", "hacpo=", "--variant", "gspo=algorithm.name=gspo",
            "--seeds", *seeds, "--baseline", "gspo", "--out", str(out), *extra]


def run_tool(tool, argv, launcher):
    return tool.main(argv, launch=launcher, resolve=None)


# ---------------------------------------------------------------------------------------- statistics
def _ci(values, t):
    values = np.asarray(values, dtype=float)
    return values.mean(), t * values.std(ddof=1) / math.sqrt(len(values))


def test_table_values_paired_differences_and_plot(tool, tmp_path):
    launcher = FakeLauncher(fail={("gspo", 3)})  # the baseline's seed 3 fails: pairs over seeds 1 and 2 only
    assert run_tool(tool, study_args(tmp_path), launcher) == 1
    assert len(launcher.calls) == 6

    study = tool.study_from_args(tool.build_parser().parse_args(study_args(tmp_path)))
    results = [collect_cell(cell) for cell in study.cells()]
    rows = {(r.label, r.agent): r for r in accuracy_rows(results, study.labels)}
    for agent in AGENTS:
        values = [FINAL[("hacpo", s, agent)] for s in (1, 2, 3)]
        mean, half = _ci(values, T_975_2)
        row = rows[("hacpo", agent)]
        assert row.estimate.n == 3
        assert row.estimate.mean == pytest.approx(mean, abs=1e-9)
        assert row.estimate.half_width == pytest.approx(half, rel=2e-4)
        gspo = rows[("gspo", agent)]  # the failed seed does not count
        mean, half = _ci([FINAL[("gspo", s, agent)] for s in (1, 2)], T_975_1)
        assert (gspo.estimate.n, gspo.estimate.mean) == (2, pytest.approx(mean, abs=1e-9))
        assert gspo.estimate.half_width == pytest.approx(half, rel=2e-4)

    paired = {(r.label, r.agent): r for r in paired_rows(results, study.labels, "gspo")}
    assert set(paired) == {("hacpo", a) for a in AGENTS}  # no row for the baseline against itself
    for agent in AGENTS:
        diffs = [FINAL[("hacpo", s, agent)] - FINAL[("gspo", s, agent)] for s in (1, 2)]
        mean, half = _ci(diffs, T_975_1)
        row = paired[("hacpo", agent)]
        assert [seed for seed, _ in row.per_seed] == [1, 2]
        assert row.estimate.mean == pytest.approx(mean, abs=1e-9)
        assert row.estimate.half_width == pytest.approx(half, rel=2e-4)

    text = (tmp_path / "results.md").read_text()
    mean, half = _ci([FINAL[("hacpo", s, "qwen3-tiny")] for s in (1, 2, 3)], 4.302653)
    assert f"| hacpo | qwen3-tiny | {mean:.3f} ± {half:.3f} | [{mean - half:.3f}, {mean + half:.3f}] | 3 |" in text
    mean, half = _ci([FINAL[("hacpo", s, "llama-tiny")] - FINAL[("gspo", s, "llama-tiny")] for s in (1, 2)], 12.7062)
    assert f"| hacpo - gspo | llama-tiny | {mean:+.3f} ± {half:.3f} |" in text
    assert "| gspo | 3 | not started: no checkpoint (logged up to step 1) | ran fresh, failed (exit 1) |" in text
    # a reader can rerun it: the study folder (outside the checkout here) is OUT, no folder of this machine is named
    assert "--only LABEL:SEED" in text and "--output-dir OUT/hacpo/seed2" in text and "--out OUT" in text
    assert f"Code: {code_version(os.getcwd())}." in text and "| hacpo | 2 | finished" in text
    assert str(tmp_path) not in text and sys.executable not in text
    plot = tmp_path / "accuracy.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_mean_ci_small_cases():
    assert mean_ci([]) == Estimate(None, None, 0)
    assert mean_ci([0.4]) == Estimate(0.4, None, 1)
    estimate = mean_ci([0.2, 0.4, 0.9])
    assert estimate.mean == pytest.approx(0.5, abs=1e-15) and estimate.n == 3  # (0.2 + 0.4 + 0.9) / 3
    assert estimate.half_width == pytest.approx(T_975_2 * np.std([0.2, 0.4, 0.9], ddof=1) / math.sqrt(3), rel=2e-4)
    low, high = estimate.interval
    assert (low, high) == pytest.approx((estimate.mean - estimate.half_width, estimate.mean + estimate.half_width))


def _t_quantile_by_integration(dof):
    """The 0.975 quantile of Student's t from its density (Simpson's rule and bisection): independent of the tool."""
    scale = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(dof * math.pi)

    def cdf(t):
        x = np.linspace(0.0, t, 20001)
        y = scale * (1 + x * x / dof) ** (-(dof + 1) / 2)
        return 0.5 + (x[1] - x[0]) / 3 * (y[0] + y[-1] + 4 * y[1:-1:2].sum() + 2 * y[2:-1:2].sum())

    low, high = 1.0, 20.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < 0.975 else (low, middle)
    return (low + high) / 2


# Every entry of the tool's table (dof 1-30: a mistyped one would misstate every interval of that many seeds),
# the switch to the expansion (31) and a few beyond it.
@pytest.mark.parametrize("dof", [*range(1, 33), 45, 60, 120, 1000])
def test_t_quantile(dof, monkeypatch):
    assert t_quantile_975(dof) == pytest.approx(_t_quantile_by_integration(dof), abs=2e-4)
    # where scipy is installed the line above checked scipy's quantile: the table and the expansion, which serve
    # wherever it is not, are checked with it hidden (an import of None raises ImportError)
    monkeypatch.setitem(sys.modules, "scipy.stats", None)
    assert t_quantile_975(dof) == pytest.approx(_t_quantile_by_integration(dof), abs=2e-4)


def test_t_quantile_known_values():
    assert t_quantile_975(2) == pytest.approx(T_975_2, abs=5e-4)
    assert t_quantile_975(4) == pytest.approx(2.776, abs=5e-4)
    assert t_quantile_975(60) == pytest.approx(2.000, abs=5e-4)


# ---------------------------------------------------------------------------------------- skip, resume, fail
def test_finished_cells_are_skipped(tool, tmp_path):
    first = FakeLauncher()
    assert run_tool(tool, study_args(tmp_path, seeds=("1", "2")), first) == 0
    assert sorted(first.cells()) == [("gspo", 1, False), ("gspo", 2, False), ("hacpo", 1, False), ("hacpo", 2, False)]
    again = FakeLauncher()
    assert run_tool(tool, study_args(tmp_path, seeds=("1", "2")), again) == 0
    assert again.calls == []
    assert "skipped (finished)" in (tmp_path / "results.md").read_text()


def test_finished_needs_the_final_eval_not_summary(tmp_path):
    write_run(tmp_path / "no_summary", "hacpo", 1, summary=False)
    assert cell_state(tmp_path / "no_summary").status == FINISHED  # the last step's records count
    crashed = tmp_path / "crashed"
    write_run(crashed, "hacpo", 1, upto=3)  # crashed after step 3: summary.md is written anyway, checkpoint 2
    state = cell_state(crashed)
    assert (state.status, state.checkpoint_step, state.last_step) == (RESUMABLE, 2, 3)
    assert cell_state(tmp_path / "nothing").status == NOT_STARTED
    records = [json.loads(line) for line in (crashed / "metrics.jsonl").read_text().splitlines()]
    folder = tmp_path / "no_final_eval"
    write_run(folder, "hacpo", 1)  # every training record of step 4, but one agent's final eval missing
    lines = [json.dumps(r) for r in records] + [json.dumps({"step": 4, "agent": a, "reward_mean": 0.5, "kind": "train"})
                                                for a in AGENTS]
    (folder / "metrics.jsonl").write_text("\n".join(lines + [json.dumps(
        {"step": 4, "agent": "qwen3-tiny", "eval/accuracy": 0.7, "kind": "eval"})]) + "\n")
    assert cell_state(folder).status == RESUMABLE


def test_unfinished_cells_resume_or_start_fresh(tool, tmp_path):
    write_run(tmp_path / "hacpo" / "seed1", "hacpo", 1, upto=3)  # checkpoint at step 2: resume
    write_run(tmp_path / "gspo" / "seed1", "gspo", 1, upto=1, checkpoint=False)  # nothing to resume from
    write_run(tmp_path / "gspo" / "seed2", "gspo", 2)  # finished
    launcher = FakeLauncher()
    assert run_tool(tool, study_args(tmp_path, seeds=("1", "2")), launcher) == 0
    assert sorted(launcher.cells()) == [("gspo", 1, False), ("hacpo", 1, True), ("hacpo", 2, False)]
    resumed = next(c for c in launcher.calls if "--resume" in c)
    assert resumed[resumed.index("--output-dir") + 1] == str(tmp_path / "hacpo" / "seed1")


def test_failed_cell_is_reported_and_the_study_goes_on(tool, tmp_path, capsys):
    launcher = FakeLauncher(fail={("hacpo", 1)})
    assert run_tool(tool, study_args(tmp_path, seeds=("1", "2")), launcher) == 1
    assert len(launcher.calls) == 4  # the cells after the failed one ran
    assert "hacpo:1: failed with exit code 1" in capsys.readouterr().out
    text = (tmp_path / "results.md").read_text()
    assert "| hacpo | 1 | not started: no checkpoint (logged up to step 1) | ran fresh, failed (exit 1) |" in text
    assert "| hacpo | qwen3-tiny | " in text and "| 1 | 2: 0.740 |" in text  # the mean of the one finished seed

    again = FakeLauncher()  # the next call tries the failed cell again, and only it
    assert run_tool(tool, study_args(tmp_path, seeds=("1", "2")), again) == 0
    assert again.cells() == [("hacpo", 1, False)]


def test_preempted_cell_stops_the_study(tool, tmp_path):
    launcher = FakeLauncher(preempt={("hacpo", 2)})
    assert run_tool(tool, study_args(tmp_path), launcher) == PREEMPTED_EXIT_CODE
    assert launcher.cells() == [("hacpo", 1, False), ("hacpo", 2, False)]  # nothing started after it
    assert (tmp_path / "results.md").is_file()
    again = FakeLauncher()
    assert run_tool(tool, study_args(tmp_path), again) == 0
    assert again.cells()[0] == ("hacpo", 2, True)  # resumed from its checkpoint
    assert len(again.calls) == 5


def test_preemption_code_is_the_entry_points():
    source = (REPO / "hacpo_megatron" / "orchestrator" / "preemption.py").read_text()
    assert int(re.search(r"^PREEMPTED_EXIT_CODE = (\d+)", source, re.M).group(1)) == PREEMPTED_EXIT_CODE


def test_only_runs_one_cell(tool, tmp_path):
    launcher = FakeLauncher()
    assert run_tool(tool, study_args(tmp_path, "--only", "gspo:2"), launcher) == 0
    assert launcher.cells() == [("gspo", 2, False)]
    assert "| hacpo | 1 | not started | not run |" in (tmp_path / "results.md").read_text()


def test_dry_run_runs_and_writes_nothing(tool, tmp_path, capsys):
    write_run(tmp_path / "hacpo" / "seed1", "hacpo", 1)
    write_run(tmp_path / "hacpo" / "seed2", "hacpo", 2, upto=3)
    launcher = FakeLauncher()
    assert run_tool(tool, study_args(tmp_path, "--dry-run", seeds=("1", "2")), launcher) == 0
    out = capsys.readouterr().out
    assert launcher.calls == [] and not (tmp_path / "results.md").exists()
    assert "hacpo:1 [finished]: skip" in out
    assert re.search(r"hacpo:2 \[resumable\]: .* --output-dir \S+seed2 --resume", out)
    assert re.search(r"gspo:1 \[not started\]: .*--set run\.seed=1 --set algorithm\.name=gspo --output-dir", out)


def test_report_runs_nothing_and_tabulates_the_cells_as_they_are(tool, tmp_path, capsys):
    """--report: the tables of cells that ran elsewhere (copied under OUT), the unfinished ones shown so."""
    for seed in (1, 2):
        write_run(tmp_path / "hacpo" / f"seed{seed}", "hacpo", seed)
        write_run(tmp_path / "gspo" / f"seed{seed}", "gspo", seed)
    launcher = FakeLauncher()
    assert run_tool(tool, study_args(tmp_path, "--report"), launcher) == 1  # seed 3 of each is not there
    assert launcher.calls == []
    text = (tmp_path / "results.md").read_text()
    assert "| hacpo | 3 | not started" in text and "| hacpo - gspo | qwen3-tiny |" in text
    assert "| 2 | 1: " in text  # two pairs per comparison
    assert "Tables written by --report at " in text and " Code: " not in text  # not the cells' code


def test_compare_adds_paired_differences_between_any_two_variants(tool, tmp_path):
    """--compare A:B: A - B seed by seed, like the baseline's pairs, for variants the baseline does not pair."""
    for seed in (1, 2, 3):
        write_run(tmp_path / "hacpo" / f"seed{seed}", "hacpo", seed)
        write_run(tmp_path / "gspo" / f"seed{seed}", "gspo", seed)
    assert run_tool(tool, study_args(tmp_path, "--report", "--compare", "gspo:hacpo"), FakeLauncher()) == 0
    text = (tmp_path / "results.md").read_text()
    for agent in AGENTS:
        mean, half = _ci([FINAL[("gspo", s, agent)] - FINAL[("hacpo", s, agent)] for s in (1, 2, 3)], 4.302653)
        assert f"| gspo - hacpo | {agent} | {mean:+.3f} ± {half:.3f} | [{mean - half:+.3f}, {mean + half:+.3f}] | 3 |" \
            in text
        mean, _ = _ci([FINAL[("hacpo", s, agent)] - FINAL[("gspo", s, agent)] for s in (1, 2, 3)], 4.302653)
        assert f"| hacpo - gspo | {agent} | {mean:+.3f} ±" in text  # the baseline's table as before


# ---------------------------------------------------------------------------------------- commands and input
def test_launcher_command(tmp_path):
    variants = [parse_variant("hacpo=", BASE), parse_variant(f"naive={NAIVE};algorithm.alpha=3", BASE),
                parse_variant("a3 = algorithm.alpha=3 ; algorithm.cross_clip=false", BASE)]
    cells = plan_cells(variants, [7], tmp_path)
    assert launcher_command(cells[0], ["run.total_steps=2"], python="py") == [
        "py", "-m", "hacpo_megatron.launch", "--config", BASE, "--set", "run.seed=7", "--set", "run.total_steps=2",
        "--output-dir", str(tmp_path / "hacpo" / "seed7")]
    naive = launcher_command(cells[1], resume=True, python="py")
    assert naive[3:5] == ["--config", NAIVE] and naive[-3:] == ["--output-dir", str(tmp_path / "naive" / "seed7"),
                                                                "--resume"]
    assert "algorithm.alpha=3" in naive
    assert variants[2] == Variant("a3", BASE, ("algorithm.alpha=3", "algorithm.cross_clip=false"))


@pytest.mark.parametrize("argv_change, message", [
    (lambda a: a[:1] + ["configs/nonexistent.yaml"] + a[2:], "no such file"),
    (lambda a: a + ["--variant", "naive"], "expected LABEL=SPEC"),
    (lambda a: a + ["--variant", "a/b=algorithm.alpha=3"], "expected LABEL=SPEC"),
    (lambda a: a + ["--variant", "x=configs/missing.yaml"], "no such file"),
    (lambda a: a + ["--variant", f"x={NAIVE};{NAIVE}"], "two config files"),
    (lambda a: a + ["--variant", "x=run.seed=5"], "run.seed comes from --seeds"),
    (lambda a: a + ["--variant", "hacpo=algorithm.alpha=3"], "labels repeat"),
    (lambda a: [v if v != "gspo" else "grpo" for v in a], "--baseline grpo: not among the variants"),
    (lambda a: a + ["--only", "hacpo:9"], "no such cell"),
    (lambda a: a + ["--only", "hacpo"], "expected LABEL:SEED"),
    (lambda a: a + ["--compare", "hacpo:grpo"], "--compare hacpo:grpo: grpo not among the variants"),
    (lambda a: a + ["--compare", "hacpo:hacpo"], "a variant against itself"),
    (lambda a: a + ["--compare", "hacpo"], "expected A:B"),
    (lambda a: a + ["--seeds", "1", "1"], "--seeds repeat"),
    (lambda a: a[: a.index("--seeds")] + a[a.index("--seeds") + 4:], "--seeds"),  # required
])
def test_bad_input_is_one_line_and_exit_2(tool, tmp_path, capsys, argv_change, message):
    launcher = FakeLauncher()
    argv = argv_change(study_args(tmp_path / "study"))
    try:
        code = run_tool(tool, argv, launcher)
    except SystemExit as exit_:  # argparse's own checks
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert launcher.calls == [] and not (tmp_path / "study").exists()


def test_a_folder_of_another_config_is_bad_input(tool, tmp_path, capsys):
    write_run(tmp_path / "hacpo" / "seed1", "hacpo", 1, upto=3)

    def resolve(config, overrides):  # what load_config would give: total_steps now 8, not the folder's 4
        seed = int(overrides[0].split("=")[1])
        return {"run": {"name": "hacpo", "seed": seed, "total_steps": 8}, "agents": [{"name": a} for a in AGENTS]}

    launcher = FakeLauncher()
    assert tool.main(study_args(tmp_path, seeds=("1",)), launch=launcher, resolve=resolve) == 2
    err = capsys.readouterr().err
    assert "run.total_steps: 8 here, 4 in the folder" in err and len(err.strip().splitlines()) == 1
    assert launcher.calls == []


def test_invalid_override_is_found_before_any_run(tool, tmp_path, capsys):
    launcher = FakeLauncher()
    argv = study_args(tmp_path, "--variant", "typo=algorithm.alhpa=3", seeds=("1",))
    assert tool.main(argv, launch=launcher, resolve=resolve_config) == 2  # the project's config loader
    err = capsys.readouterr().err
    assert "--variant typo" in err and "algorithm.alhpa: unknown key" in err and len(err.strip().splitlines()) == 1
    assert launcher.calls == []


def test_default_runner_logs_and_returns_the_exit_code(tmp_path):
    log = tmp_path / "cell" / "launcher.log"
    command = [sys.executable, "-c", "import sys; print('hello from the cell'); sys.exit(3)"]
    assert run_launcher(command, log) == 3
    text = log.read_text()
    assert "hello from the cell" in text and text.lstrip().startswith("===")


def test_code_version_names_the_commit_and_uncommitted_changes(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    assert code_version(str(tmp_path)) == "not a git checkout"
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert code_version(str(tmp_path)) == f"commit {head.strip()[:12]}"
    (tmp_path / "notes.txt").write_text("untracked files are no code change\n")
    assert code_version(str(tmp_path)) == f"commit {head.strip()[:12]}"
    (tmp_path / "a.py").write_text("x = 2\n")
    assert code_version(str(tmp_path)) == f"commit {head.strip()[:12]} with uncommitted changes"


def test_clip_diagnostics_per_step_and_their_table_over_seeds(tmp_path):
    def train(step, agent, num_cross, lower, upper, s, right, right_inside):
        return {"kind": "train", "step": step, "agent": agent, "num_cross": num_cross, "cross_clip_frac_lower": lower,
                "cross_clip_frac_upper": upper, "cross_ratio_mean": s, "cross_positive_frac": right,
                "cross_positive_inside_frac": right_inside}

    records = [train(1, "a", 32.0, 0.75, 0.05, 0.6, 0.25, 0.0625), train(1, "b", 0.0, 0, 0, 0, 0, 0),
               {"kind": "eval", "step": 1, "agent": "a", "eval/accuracy": 0.5}]
    clip = clip_diagnostics(records)
    assert set(clip) == {"a"}  # b saw no other agent's answer (a single-agent baseline): left out
    assert clip["a"][1] == pytest.approx({"below": 0.75, "inside": 0.2, "above": 0.05, "mean_s": 0.6,
                                          "right": 0.25, "right_inside": 0.0625})

    for seed, below in ((1, 0.75), (2, 0.25)):  # two seeds of one variant: the table holds their means
        folder = tmp_path / "hacpo" / f"seed{seed}"
        write_run(folder, "hacpo", seed)
        with (folder / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(train(1, AGENTS[0], 32.0, below, 0.0, 0.5, 0.5, 0.25)) + "\n")
    variant = Variant("hacpo", "cfg.yaml")
    results = [collect_cell(cell) for cell in plan_cells([variant], [1, 2], tmp_path)]
    rows = clip_table(results, "hacpo")
    assert rows == [["1", AGENTS[0], "0.50", "0.50", "0.00", "0.50", "0.50", "0.25", "2"]]
    text = results_markdown(results, ["hacpo"], None, {}, base_config="cfg.yaml", seeds=[1, 2],
                                 workdir=str(tmp_path))
    assert "| 1 | " + AGENTS[0] + " | 0.50 | 0.50 | 0.00 | 0.50 | 0.50 | 0.25 | 2 |" in text


def test_the_gain_over_the_run_in_standard_errors(tmp_path):
    """hacpo seed 1, qwen3-tiny: 0.50 at step 0, 0.70 at the last step (write_run), on 100 held-out problems and
    no per-problem scores: binomial SE = sqrt((0.5 * 0.5 + 0.7 * 0.3) / 100) = 0.0678, the gain 0.20 is 2.9 of
    them. Seed 2 kept each problem's score (eval_scores.jsonl): the paired SE, sd of the per-problem gains / sqrt(n)."""
    folder = tmp_path / "hacpo" / "seed1"
    write_run(folder, "hacpo", 1)
    (folder / "run_info.json").write_text(json.dumps({"prompts": {"eval": {"used": 100, "skipped_overlong": 0}}}))
    paired = tmp_path / "hacpo" / "seed2"
    write_run(paired, "hacpo", 2)  # no run_info.json: llama-tiny, without scores either, gets no row (n unknown)
    before, after = [0.0, 1.0, 0.5, 0.5], [0.5, 1.0, 0.75, 0.55]
    (paired / "eval_scores.jsonl").write_text("".join(
        json.dumps({"step": step, "agent": "qwen3-tiny", "scores": scores}) + "\n"
        for step, scores in ((0, before), (4, after))))
    results = [collect_cell(cell) for cell in plan_cells([Variant("hacpo", "cfg.yaml")], [1, 2],
                                                                    tmp_path)]
    rows = gain_rows(results, ["hacpo"])
    se = math.sqrt((0.5 * 0.5 + 0.7 * 0.3) / 100)
    assert rows[0] == ["hacpo", "qwen3-tiny", "1", "0.500 (step 0)", "0.700 (step 4)", "+0.200", f"{se:.3f} (binomial)",
                       f"{0.2 / se:+.1f}"]
    gains = [b - a for a, b in zip(before, after)]  # 0.5, 0, 0.25, 0.05: mean 0.2, sd 0.2254
    paired_se = math.sqrt(sum((g - 0.2) ** 2 for g in gains) / 3) / 2  # / sqrt(4 problems)
    # the gain is the accuracies' (write_run's: final - (final - 0.2) on every seed), the SE the scores'
    assert rows[2][5:] == ["+0.200", f"{paired_se:.3f} (paired)", f"{0.2 / paired_se:+.1f}"]
    assert [row[:3] for row in rows] == [["hacpo", agent, "1"] for agent in AGENTS] + [["hacpo", "qwen3-tiny", "2"]]
    text = results_markdown(results, ["hacpo"], None, {}, base_config="cfg.yaml", seeds=[1, 2],
                                 workdir=str(tmp_path))
    assert "## Held-out gain over the run" in text and f"| +0.200 | {se:.3f} (binomial) | +2.9 |" in text


def test_the_regime_of_a_cell_from_per_update_figures_and_its_flags():
    """Own rows clipped per update index (means over steps), after the first, and the others' right answers let
    through; flagged outside when updates after the first clip more than 30 %, or when the weaker agent (lower
    first held-out accuracy) lets fewer than 30 % through. The stronger agent's cross figure is no flag."""
    def train(step, agent, own, through):
        return {"kind": "train", "step": step, "agent": agent,
                **{f"regime/own_clipped/u{m}": v for m, v in enumerate(own)},
                **{f"regime/right_through/u{m}": v for m, v in enumerate(through)}}

    records = [train(1, "a", [0.0, 0.2, 0.4], [0.5, 0.1]), train(2, "a", [0.0, 0.4, 0.6], [0.3]),
               train(1, "b", [0.0, 0.1, 0.1], [0.1]), train(2, "b", [0.0, 0.1, 0.3], [0.0])]
    regime = regime_of(records)
    assert regime["a"].own_by_update == pytest.approx({0: 0.0, 1: 0.3, 2: 0.5})
    assert regime["a"].own_after_first == pytest.approx(0.4) and regime["a"].right_through == pytest.approx(0.3)
    assert regime["b"].own_after_first == pytest.approx(0.15) and not regime["b"].from_step_means
    curves = {"a": {0: 0.6, 4: 0.7}, "b": {0: 0.3, 4: 0.5}}
    assert weaker_agent(curves) == "b"
    assert regime_verdict("a", regime["a"], "b").startswith("**outside**: own clip 0.400 > 0.30")
    just_past = type(regime["a"])({}, 0.3014, None)  # past the limit by less than the second decimal
    assert regime_verdict("a", just_past, "b") == "**outside**: own clip 0.301 > 0.30"
    assert "cross clip" not in regime_verdict("a", regime["a"], "b")  # a is the stronger: no cross flag
    assert regime_verdict("b", regime["b"], "b") == "**outside**: cross clip lets 0.050 < 0.30 through"
    assert regime_verdict("b", regime["b"], "a") == "in"


def test_the_gate_reads_the_weaker_learners_first_step_and_names_what_it_misses(tmp_path):
    """At the first step with the other's answers: the weaker agent's mean s in 0.85-0.95 and >= 50 % of the
    other's right answers through at the first update; later steps, and the stronger agent, do not count."""
    def train(step, agent, mean_s, through):
        return {"kind": "train", "step": step, "agent": agent, "num_cross": 16.0, "num_updates": float(len(through)),
                "cross_ratio_mean": mean_s, **{f"regime/right_through/u{m}": v for m, v in enumerate(through)
                                               if v is not None}}

    def result(seed, records):
        cell = Cell(Variant("hacpo", "cfg.yaml"), seed, tmp_path / f"seed{seed}")
        return CellResult(cell, CellState(FINISHED), ["a", "b"], {}, curves,
                               gate=gate_of(records))

    curves = {"a": {0: 0.3, 4: 0.5}, "b": {0: 0.6, 4: 0.7}}  # a is the weaker
    later = [train(2, "a", 0.5, [0.0]), train(1, "b", 0.5, [0.0])]
    results = [result(1, [train(1, "a", 0.90, [0.6, 0.2])] + later),
               result(2, [train(1, "a", 0.998, [0.14, 0.20, 0.95, 0.91])] + later),
               result(3, [train(1, "a", 0.80, [None, 0.7])] + later),
               result(4, [{"kind": "train", "step": 1, "agent": "a", "num_cross": 0.0}]),  # no cross term: no row
               result(5, [{"kind": "train", "step": 1, "agent": "a", "num_cross": 16.0, "num_updates": 2.0,
                           "cross_ratio_mean": 0.9}])]  # records from before the per-update figures
    assert gate_rows(results) == [
        ["hacpo", "1", "a", "1", "0.900", "0.60 / 0.20", "passes"],
        ["hacpo", "2", "a", "1", "0.998", "0.14 / 0.20 / 0.95 / 0.91",
         "**misses**: mean s 0.998 outside 0.85-0.95; first update lets 0.14 < 0.50 through"],
        ["hacpo", "3", "a", "1", "0.800", "n/a / 0.70",
         "**misses**: mean s 0.800 outside 0.85-0.95; first update lets none < 0.50 through"],
        ["hacpo", "5", "a", "1", "0.900", "not logged", "**misses**: first update not logged"]]
    text = results_markdown(results, ["hacpo"], None, {}, base_config="cfg.yaml", seeds=[1, 2, 3, 4],
                                 workdir=str(tmp_path))
    assert "## The gate at the first step" in text and "| hacpo | 1 | a | 1 | 0.900 | 0.60 / 0.20 | passes |" in text


def test_what_the_answers_became_is_the_mean_of_the_opening_and_the_closing_quarter_of_the_steps(tmp_path):
    """Length, share cut at the limit and reward of an agent's own answers: the mean over the first quarter of its
    training steps and over the last (at least one step each); eval records and figures a run did not log are left
    out, not counted as zero. The held-out answers cut at the limit: the first evaluation's and the last's."""
    def train(step, agent, **figures):
        return {"kind": "train", "step": step, "agent": agent, **figures}

    records = [train(s, "a", response_length_mean=10.0 * s, truncated_frac=s / 10, reward_mean=s / 16)
               for s in range(8, 0, -1)]  # written in any order
    records += [train(1, "b", response_length_mean=30.0), train(2, "b", response_length_mean=31.0),
                train(3, "b", response_length_mean=20.0, truncated_frac=0.5),
                {"kind": "eval", "step": 8, "agent": "a", "eval/accuracy": 0.9, "response_length_mean": 999.0,
                 "eval/truncated_frac": 0.1},
                {"kind": "eval", "step": 0, "agent": "a", "eval/accuracy": 0.2, "eval/truncated_frac": 0.3},
                {"kind": "eval", "step": 4, "agent": "a", "eval/accuracy": 0.5, "eval/truncated_frac": 0.2},
                train(4, "c")]  # no rollout figures: no row
    answers = answers_of(records)
    assert set(answers) == {"a", "b"}
    a = answers["a"]
    assert (a.first_steps, a.last_steps) == ((1, 2), (7, 8))
    assert a.length == pytest.approx((15.0, 75.0)) and a.truncated == pytest.approx((0.15, 0.75))
    assert a.reward == pytest.approx((0.09375, 0.46875))
    assert a.held_out_truncated == (0.3, 0.1)  # the first and the last evaluation, not the order of the lines
    assert a.finished_reward == pytest.approx((0.09375 / 0.85, 0.46875 / 0.25))  # reward / (1 - cut)
    b = answers["b"]  # 3 steps: a quarter is less than one, so one step each
    assert (b.first_steps, b.last_steps, b.length) == ((1, 1), (3, 3), (30.0, 20.0))
    assert b.truncated == (None, 0.5) and b.reward == (None, None) and b.held_out_truncated == (None, None)
    assert b.finished_reward == (None, None)  # no reward logged: not a reward of 0
    assert Answers((1, 1), (2, 2), (9.0, 9.0), (1.0, 0.5), (0.0, 0.25)).finished_reward == (None, 0.5)  # all cut
    cell = Cell(Variant("hacpo", "cfg.yaml"), 1, tmp_path / "seed1")
    result = CellResult(cell, CellState(FINISHED), ["a", "b"], {}, {"a": {0: 0.6}, "b": {0: 0.3}}, answers=answers)
    assert answer_rows([result]) == [
        ["hacpo", "1", "a", "1-2 → 7-8", "15 → 75", "0.15 → 0.75", "0.09 → 0.47", "0.11 → 1.88", "0.30 → 0.10"],
        ["hacpo", "1", "b (weaker)", "1-1 → 3-3", "30 → 20", "n/a → 0.50", "n/a → n/a", "n/a → n/a", "n/a → n/a"]]
    text = results_markdown([result], ["hacpo"], None, {}, base_config="cfg.yaml", seeds=[1], workdir=str(tmp_path))
    assert "## What the answers became" in text and "| hacpo | 1 | b (weaker) | 1-1 → 3-3 | 30 → 20 |" in text


def test_the_weaker_agents_held_out_problems_are_split_by_what_the_agents_answered_first(tmp_path):
    """Strata at the weaker agent's first evaluation: another agent right and it wrong, all wrong, it right (a score
    of at least 0.5 is right: avg@k scores are fractions); its mean score on each at the first and the last
    evaluation, whatever order the evaluations were written in."""
    scores = {"w": {16: [1.0, 1.0, 0.0, 0.0, 0.5, 0.0], 0: [0.0, 0.25, 0.0, 1.0, 0.5, 0.0], 8: [0.0] * 6},
              "s": {0: [1.0, 0.5, 0.0, 0.0, 0.0, 0.25], 16: [0.0] * 6}}
    (steps, strata) = strata_of(scores, "w")
    assert steps == (0, 16) and list(strata) == list(STRATA)
    mixed, wrong, right = (strata[name] for name in STRATA)
    assert (mixed.problems, mixed.first, mixed.last) == (2, pytest.approx(0.125), 1.0)  # problems 0 and 1
    assert (wrong.problems, wrong.first, wrong.last) == (2, 0.0, 0.0)  # 2 and 5 (0.25 < 0.5 for the other)
    assert (right.problems, right.first, right.last) == (2, 0.75, 0.25)  # 3 and 4
    assert strata_of(scores, None) is None  # no weaker agent
    assert strata_of({"w": scores["w"], "s": {16: [0.0] * 6}}, "w") is None  # the other not scored at step 0
    assert strata_of({"w": scores["w"], "s": {0: [0.0] * 5}}, "w") is None  # another set of problems
    cell = Cell(Variant("hacpo", "cfg.yaml"), 2, tmp_path / "seed2")
    result = CellResult(cell, CellState(FINISHED), ["w", "s"], {}, {"w": {0: 0.3, 16: 0.4}, "s": {0: 0.5, 16: 0.6}},
                        problem_scores=scores)
    assert strata_rows([result]) == [["hacpo", "2", "w", "0 → 16", "0.12 → 1.00 (2)", "0.00 → 0.00 (2)",
                                      "0.75 → 0.25 (2)"]]
    one_evaluation = CellResult(cell, CellState(FINISHED), ["w", "s"], {}, {"w": {0: 0.3}, "s": {0: 0.5}},
                                problem_scores={"w": {0: [0.0]}, "s": {0: [1.0]}})
    assert strata_rows([one_evaluation]) == []  # nothing to compare yet
    text = results_markdown([result], ["hacpo"], None, {}, base_config="cfg.yaml", seeds=[2], workdir=str(tmp_path))
    assert "## Where the weaker agent's held-out gain lies" in text and "| hacpo | 2 | w | 0 → 16 |" in text


def test_variants_are_paired_by_seed_on_each_group_of_problems(tmp_path):
    """A - B in the weaker agent's last score on each group, seed by seed, only where both cells finished on the
    same groups of problems (a seed whose groups differ, or a cell not finished, is left out)."""
    def result(label, seed, last, first_other=(1.0, 0.0, 0.0), state=FINISHED):
        scores = {"w": {0: [0.0, 0.0, 1.0], 8: list(last)}, "s": {0: list(first_other)}}
        return CellResult(Cell(Variant(label, "cfg.yaml"), seed, tmp_path / f"{label}{seed}"), CellState(state),
                          ["w", "s"], {}, {"w": {0: 0.3, 8: 0.5}, "s": {0: 0.6}}, problem_scores=scores)

    results = [result("a", 1, (1.0, 0.0, 1.0)), result("b", 1, (0.0, 0.0, 1.0)),
               result("a", 2, (1.0, 1.0, 0.0)), result("b", 2, (0.0, 0.0, 1.0)),
               result("a", 3, (1.0, 1.0, 1.0)), result("b", 3, (0.0, 0.0, 0.0), first_other=(1.0, 1.0, 0.0)),
               result("a", 4, (1.0, 1.0, 1.0)), result("b", 4, (0.0, 0.0, 0.0), state="running")]
    rows = {row.agent: row for row in strata_difference_rows(results, "a", "b")}
    assert list(rows) == list(STRATA)
    assert rows["another right, it wrong"].per_seed == ((1, 1.0), (2, 1.0))  # seed 3: other groups; 4 unfinished
    assert rows["all wrong"].per_seed == ((1, 0.0), (2, 1.0))
    assert rows["it right"].per_seed == ((1, 0.0), (2, -1.0))
    assert rows["all wrong"].estimate.mean == pytest.approx(0.5) and rows["all wrong"].estimate.n == 2
    text = results_markdown(results, ["a", "b"], "b", {}, base_config="cfg.yaml", seeds=[1, 2, 3, 4],
                            workdir=str(tmp_path))
    assert "| a - b | another right, it wrong | +1.000 " in text


def test_the_regime_of_a_run_from_before_the_per_update_figures_is_estimated_from_step_means():
    """M updates whose first is on-policy: the step mean of the clipped share times M / (M - 1)."""
    records = [{"kind": "train", "step": 1, "agent": "a", "num_updates": 4.0, "num_own": 32.0,
                "own_clip_frac_lower": 0.3, "own_clip_frac_upper": 0.15, "num_cross": 32.0,
                "cross_positive_frac": 0.5, "cross_positive_inside_frac": 0.1},
               {"kind": "train", "step": 1, "agent": "g", "num_updates": 1.0, "num_own": 8.0,
                "own_clip_frac_lower": 0.0, "own_clip_frac_upper": 0.0}]
    regime = regime_of(records)
    assert regime["a"].from_step_means and regime["a"].own_after_first == pytest.approx(0.45 * 4 / 3)
    assert regime["a"].right_through == pytest.approx(0.2)
    assert regime["g"].own_after_first is None  # one update a step: nothing after the first to clip
