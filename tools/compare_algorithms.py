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
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hacpo_megatron.reporting import EVAL_ACCURACY, METRICS_FILE, read_metrics  # noqa: E402

EXIT_OK, EXIT_INCOMPLETE, EXIT_BAD_INPUT = 0, 1, 2
# What the training entry returns after a preemption (PREEMPTED_EXIT_CODE in orchestrator/preemption.py,
# 128 + SIGTERM; a test keeps the two equal). Read here, not imported: that module imports torch.
PREEMPTED_EXIT_CODE = 143
# Exit codes of a cell that was stopped on request and left a checkpoint to resume from: the entry's own
# code, 75 (EX_TEMPFAIL, what job wrappers use for "try again"), 130 (128 + SIGINT), and a launcher killed
# by the signal itself (subprocess reports -SIGNAL). torchrun itself exits 1 after forwarding a signal, so
# the runner also reports a cell it passed a signal to as preempted (run_launcher).
PREEMPTED_EXIT_CODES = frozenset({PREEMPTED_EXIT_CODE, 75, 130, -signal.SIGTERM, -signal.SIGINT})

CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"
STEP_DIR = re.compile(r"^step_(\d+)$")  # a finished checkpoint step (checkpoint/run_folder.py); .tmp is not
LAUNCHER_LOG = "launcher.log"
RESULTS_FILE = "results.md"
PLOT_FILE = "accuracy.png"
LOCK_FILE = ".study.lock"

LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # a folder name, and no ':' (--only LABEL:SEED)
OVERRIDE_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class StudyInputError(Exception):
    """Input the tool cannot use; main() prints it as one line and exits with code 2."""


# ----------------------------------------------------------------------------------------------------------
# Input: variants, cells, launcher commands
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    label: str
    config: str  # the YAML config this variant starts from
    overrides: Tuple[str, ...] = ()  # KEY=VALUE, applied after the study's common --set lines


@dataclass(frozen=True)
class Cell:
    variant: Variant
    seed: int
    folder: Path

    @property
    def name(self) -> str:
        return f"{self.variant.label}:{self.seed}"


def parse_variant(text: str, base_config: str) -> Variant:
    """`LABEL=SPEC` -> Variant (see the module docstring); StudyInputError on a malformed one."""
    label, equals, spec = text.partition("=")
    label = label.strip()
    if not equals or not LABEL.match(label):
        raise StudyInputError(f"--variant {text!r}: expected LABEL=SPEC with a LABEL of letters, digits, "
                              f"'_', '-', '.', '+' (e.g. gspo_x2=algorithm.name=gspo_x2, or hacpo= for --config as is)")
    config, overrides = None, []
    for item in (part.strip() for part in spec.split(";")):
        if not item:
            continue
        if "=" in item:
            key = item.split("=", 1)[0].strip()
            if not OVERRIDE_KEY.match(key):
                raise StudyInputError(f"--variant {label}: {item!r} is not KEY=VALUE")
            if key == "run.seed":
                raise StudyInputError(f"--variant {label}: run.seed comes from --seeds, not from a variant")
            overrides.append(item)
        elif config is not None:
            raise StudyInputError(f"--variant {label}: two config files ({config}, {item}); a variant has one")
        else:
            config = item
    config = config or base_config
    if not Path(config).is_file():
        raise StudyInputError(f"--variant {label}: config file {config}: no such file")
    return Variant(label, config, tuple(overrides))


def parse_cell_ref(text: str) -> Tuple[str, int]:
    """`LABEL:SEED` -> (label, seed)."""
    label, colon, seed = text.rpartition(":")
    if not colon or not label or not re.fullmatch(r"-?\d+", seed.strip()):
        raise StudyInputError(f"--only {text!r}: expected LABEL:SEED, e.g. hacpo:2")
    return label, int(seed)


def plan_cells(variants: Sequence[Variant], seeds: Sequence[int], out: Path) -> List[Cell]:
    """Every (variant, seed), variant by variant: each variant's seeds finish together."""
    return [Cell(v, seed, out / v.label / f"seed{seed}") for v in variants for seed in seeds]


def launcher_command(cell: Cell, common_overrides: Sequence[str] = (), *, resume: bool = False,
                     python: str = sys.executable) -> List[str]:
    """The launcher's command line for one cell (the same one for a fresh start and, with --resume, a resume)."""
    command = [python, "-m", "hacpo_megatron.launch", "--config", cell.variant.config,
               "--set", f"run.seed={cell.seed}"]
    for override in [*common_overrides, *cell.variant.overrides]:
        command += ["--set", override]
    command += ["--output-dir", str(cell.folder)]
    return command + (["--resume"] if resume else [])


# ----------------------------------------------------------------------------------------------------------
# A cell's run folder: what state it is in, what it measured
# ----------------------------------------------------------------------------------------------------------
FINISHED, RESUMABLE, NOT_STARTED = "finished", "resumable", "not started"


@dataclass
class CellState:
    status: str  # FINISHED | RESUMABLE | NOT_STARTED
    total_steps: Optional[int] = None  # from the folder's config.yaml
    last_step: Optional[int] = None  # the last training step every agent logged
    checkpoint_step: Optional[int] = None  # the newest finished checkpoint


def read_run_config(folder: Path) -> Optional[Dict[str, Any]]:
    """The run's resolved config.yaml (written before the first step), or None."""
    import yaml

    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return None  # torn by a crash while it was written: the cell starts over
    return data if isinstance(data, dict) else None


def agent_names_of(config: Mapping[str, Any]) -> List[str]:
    return [agent["name"] for agent in config.get("agents") or [] if isinstance(agent, dict) and "name" in agent]


def checkpoint_steps(folder: Path) -> List[int]:
    """Finished checkpoint steps under folder/checkpoints (what `--resume` may start from), ascending."""
    root = Path(folder) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


def load_cell_metrics(folder: Path) -> List[Dict[str, Any]]:
    path = Path(folder) / METRICS_FILE
    return read_metrics(path) if path.is_file() else []


def expects_eval(config: Mapping[str, Any]) -> bool:
    """Whether the run evaluates on held-out prompts (loop.run_hacpo: data.eval_every > 0 and a data.eval)."""
    data = config.get("data") or {}
    return bool(data.get("eval_every")) and bool(data.get("eval"))


def cell_state(folder: Path) -> CellState:
    """Finished, resumable or not started: read from the folder alone (see the module docstring)."""
    config = read_run_config(folder)
    checkpoints = checkpoint_steps(folder)
    checkpoint_step = checkpoints[-1] if checkpoints else None
    if config is None:
        return CellState(RESUMABLE if checkpoints else NOT_STARTED, checkpoint_step=checkpoint_step)
    total = (config.get("run") or {}).get("total_steps")
    agents = agent_names_of(config)
    records = load_cell_metrics(folder)
    train_steps: Dict[str, set] = {agent: set() for agent in agents}
    eval_steps: Dict[str, set] = {agent: set() for agent in agents}
    for record in records:
        steps = (eval_steps if record.get("kind") == "eval" else train_steps).get(record.get("agent"))
        if steps is not None and isinstance(record.get("step"), int):
            steps.add(record["step"])
    last_step = min((max(s) if s else 0) for s in train_steps.values()) if agents else None
    finished = (isinstance(total, int) and bool(agents)
                and all(total in train_steps[a] for a in agents)
                and (not expects_eval(config) or all(total in eval_steps[a] for a in agents)))
    status = FINISHED if finished else RESUMABLE if checkpoints else NOT_STARTED
    return CellState(status, total_steps=total, last_step=last_step, checkpoint_step=checkpoint_step)


def eval_curves(records: Sequence[Mapping[str, Any]]) -> Dict[str, Dict[int, float]]:
    """{agent: {step: held-out accuracy}} from metrics.jsonl records (null accuracies left out)."""
    curves: Dict[str, Dict[int, float]] = {}
    for record in records:
        value = record.get(EVAL_ACCURACY)
        if record.get("kind") == "eval" and isinstance(value, (int, float)) and isinstance(record.get("step"), int):
            curves.setdefault(record["agent"], {})[record["step"]] = float(value)
    return curves


def final_accuracies(curves: Mapping[str, Mapping[int, float]]) -> Dict[str, float]:
    """Each agent's held-out accuracy at its last evaluation."""
    return {agent: points[max(points)] for agent, points in curves.items() if points}


CLIP_COLUMNS = ("below", "inside", "above", "mean_s", "right", "right_inside")


# The paper's regime (issue 49): with lr 1e-6 on 128-prompt batches GSPO's own-row clip leaves most rows inside
# (the GSPO paper: ~15 % of tokens clipped), and its cross clip [0.8, 1] was set for ratios near 0.9. A cell whose
# updates after the first clip more than REGIME_OWN_CLIPPED_MAX of own rows throws most of its own answers away;
# one whose weaker learner lets fewer than REGIME_RIGHT_THROUGH_MIN of the other's right answers through its
# cross clip learns almost nothing from them. Either is outside the regime the paper's claim is about.
REGIME_OWN_CLIPPED_MAX = 0.30
REGIME_RIGHT_THROUGH_MIN = 0.30


@dataclass
class Regime:
    own_by_update: Dict[int, float]  # update index m -> share of own rows outside GSPO's clip (mean over steps)
    own_after_first: Optional[float]  # the same over the updates m >= 1
    right_through: Optional[float]  # share of the other agents' right answers inside the cross clip
    from_step_means: bool = False  # a run from before the per-update figures: estimated from each step's mean


def _mean(values: Sequence[float]) -> Optional[float]:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def regime_of(records: Sequence[Mapping[str, Any]]) -> Dict[str, Regime]:
    """{agent: Regime} from a cell's training records. The per-update keys (`regime/own_clipped/u<m>`,
    `regime/right_through/u<m>`, reporting/step_records.py) where the run wrote them; for older runs an
    estimate from the step means, on the assumption that the first update, on-policy, clips nothing: the share
    after it is the mean times M / (M - 1)."""
    by_agent: Dict[str, List[Mapping[str, Any]]] = {}
    for r in records:
        if r.get("kind") == "train" and isinstance(r.get("step"), int):
            by_agent.setdefault(r["agent"], []).append(r)
    out = {}
    for agent, rows in by_agent.items():
        own: Dict[int, List[float]] = {}
        through: List[float] = []
        for r in rows:
            for key, value in r.items():
                if key.startswith("regime/own_clipped/u"):
                    own.setdefault(int(key.rsplit("u", 1)[1]), []).append(value)
                elif key.startswith("regime/right_through/u"):
                    through.append(value)
        if own or through:
            by_update = {m: _mean(v) for m, v in sorted(own.items())}
            after = _mean([v for m, values in own.items() if m >= 1 for v in values])
            out[agent] = Regime(by_update, after, _mean(through))
            continue
        after = _mean([(r.get("own_clip_frac_lower", math.nan) + r.get("own_clip_frac_upper", math.nan))
                       * r["num_updates"] / (r["num_updates"] - 1)
                       for r in rows if r.get("num_updates", 1) > 1 and r.get("num_own")])
        through = [r["cross_positive_inside_frac"] / r["cross_positive_frac"] for r in rows
                   if r.get("num_cross") and r.get("cross_positive_frac", 0) > 0]
        out[agent] = Regime({}, after, _mean(through), from_step_means=True)
    return out


def weaker_agent(curves: Mapping[str, Mapping[int, float]]) -> Optional[str]:
    """The agent with the lowest held-out accuracy at the first evaluation (the one HACPO should lift)."""
    first = {agent: points[min(points)] for agent, points in curves.items() if points}
    return min(first, key=first.get) if len(first) > 1 else None


def regime_verdict(agent: str, regime: Regime, weaker: Optional[str]) -> str:
    problems = []
    if regime.own_after_first is not None and regime.own_after_first > REGIME_OWN_CLIPPED_MAX:
        # three decimals: a share just past the limit must not read "0.30 > 0.30"
        problems.append(f"own clip {regime.own_after_first:.3f} > {REGIME_OWN_CLIPPED_MAX:.2f}")
    if agent == weaker and regime.right_through is not None and regime.right_through < REGIME_RIGHT_THROUGH_MIN:
        problems.append(f"cross clip lets {regime.right_through:.3f} < {REGIME_RIGHT_THROUGH_MIN:.2f} through")
    return "**outside**: " + "; ".join(problems) if problems else "in"


def regime_rows(results: Sequence[CellResult]) -> List[List[str]]:
    """One row per cell and agent: own rows clipped at each update index, after the first, the other agents'
    right answers let through, and whether the cell is in the paper's regime."""
    def text(value: Optional[float]) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    rows = []
    for r in results:
        weaker = weaker_agent(r.curves)
        for agent, regime in r.regime.items():
            by_update = " / ".join(f"{text(v)}" for v in regime.own_by_update.values()) or "(step means)"
            rows.append([r.cell.variant.label, str(r.cell.seed), agent + (" (weaker)" if agent == weaker else ""),
                         by_update, text(regime.own_after_first) + (" (est.)" if regime.from_step_means else ""),
                         text(regime.right_through), regime_verdict(agent, regime, weaker)])
    return rows


# The gate (issue 49, docs/study.md): where the paper measures its cross ratios (a same-family pair, appendix), the
# other agent's answers sit at a mean ratio s of 0.86-0.94 a step, and its cross clip [0.8, 1] lets most right ones
# through. A pair is in that setting when, at its first step, the weaker learner's s of the stronger's answers lies in
# GATE_MEAN_S and its first update (on-policy) lets at least GATE_RIGHT_THROUGH_MIN of their right answers through.
GATE_MEAN_S = (0.85, 0.95)
GATE_RIGHT_THROUGH_MIN = 0.50


@dataclass
class Gate:
    step: int  # the first step with other agents' answers
    mean_s: float  # their mean ratio s over that step's updates
    through_by_update: List[Optional[float]]  # share of their right answers inside the cross clip, update by update


def gate_of(records: Sequence[Mapping[str, Any]]) -> Dict[str, Gate]:
    """{agent: Gate} from each learner's first training record with other agents' answers in it."""
    first: Dict[str, Mapping[str, Any]] = {}
    for r in records:
        if r.get("kind") == "train" and r.get("num_cross") and isinstance(r.get("step"), int):
            if r["agent"] not in first or r["step"] < first[r["agent"]]["step"]:
                first[r["agent"]] = r
    return {agent: Gate(r["step"], float(r.get("cross_ratio_mean", math.nan)),
                        [r.get(f"regime/right_through/u{m}") for m in range(int(r.get("num_updates", 0)))])
            for agent, r in first.items()}


def gate_rows(results: Sequence[CellResult]) -> List[List[str]]:
    """One row per cell with a cross term: its weaker learner at the first step, and whether it passes the gate."""
    rows = []
    for r in results:
        weaker = weaker_agent(r.curves)
        gate = r.gate.get(weaker)
        if gate is None:
            continue
        first = gate.through_by_update[0] if gate.through_by_update else None
        low, high = GATE_MEAN_S
        misses = ([] if low <= gate.mean_s <= high else [f"mean s {gate.mean_s:.3f} outside {low}-{high}"]) + (
            [] if first is not None and first >= GATE_RIGHT_THROUGH_MIN else
            [f"first update lets {'none' if first is None else f'{first:.2f}'} < {GATE_RIGHT_THROUGH_MIN:.2f} through"])
        rows.append([r.cell.variant.label, str(r.cell.seed), weaker, str(gate.step), f"{gate.mean_s:.3f}",
                     " / ".join("n/a" if v is None else f"{v:.2f}" for v in gate.through_by_update),
                     "**misses**: " + "; ".join(misses) if misses else "passes"])
    return rows


def clip_diagnostics(records: Sequence[Mapping[str, Any]]) -> Dict[str, Dict[int, Dict[str, float]]]:
    """{agent: {step: ...}}: where the other agents' answers fell against the learner's cross clip [lo_m, 1],
    from its training records (each a mean over the step's updates, losses.py). below / inside / above: shares
    of those answers; mean_s: their mean ratio s; right: share with a positive advantage (the right answers of a
    group not all right); right_inside: share that is right and inside the clip, i.e. moved the learner. Steps
    without any other agent's answer (single-agent baselines) are left out."""
    out: Dict[str, Dict[int, Dict[str, float]]] = {}
    for r in records:
        if r.get("kind") != "train" or not r.get("num_cross") or not isinstance(r.get("step"), int):
            continue
        below, above = float(r.get("cross_clip_frac_lower", math.nan)), float(r.get("cross_clip_frac_upper", math.nan))
        out.setdefault(r["agent"], {})[r["step"]] = {
            "below": below, "inside": 1.0 - below - above, "above": above,
            "mean_s": float(r.get("cross_ratio_mean", math.nan)),
            "right": float(r.get("cross_positive_frac", math.nan)),
            "right_inside": float(r.get("cross_positive_inside_frac", math.nan))}
    return out


def clip_table(results: Sequence[CellResult], label: str) -> List[List[str]]:
    """Rows (step, agent, then CLIP_COLUMNS as means over the variant's cells that logged that step, n cells)."""
    rows = []
    for agent in variant_agents(results, label):
        per_step: Dict[int, List[Dict[str, float]]] = {}
        for r in results:
            if r.cell.variant.label == label:
                for step, values in r.clip.get(agent, {}).items():
                    per_step.setdefault(step, []).append(values)
        for step in sorted(per_step):
            cells = per_step[step]
            means = [mean_ci([c[k] for c in cells if math.isfinite(c[k])]).mean for k in CLIP_COLUMNS]
            rows.append([str(step), agent] + ["n/a" if m is None else f"{m:.2f}" for m in means] + [str(len(cells))])
    return rows


def config_differences(expected: Mapping[str, Any], found: Mapping[str, Any], limit: int = 3) -> List[str]:
    """'key: X here, Y in the folder' for keys both configs hold with different values (keys only one of them
    holds are not compared: a key added to the schema since the folder was written is no change of the run)."""
    ours, theirs = _flatten(expected), _flatten(found)
    return [f"{key}: {ours[key]!r} here, {theirs[key]!r} in the folder"
            for key in sorted(ours.keys() & theirs.keys()) if ours[key] != theirs[key]][:limit]


def _flatten(value: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return {prefix: value}
    flat: Dict[str, Any] = {}
    for key, item in items:
        flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


# ----------------------------------------------------------------------------------------------------------
# Statistics: mean with a Student-t 95% confidence interval
# ----------------------------------------------------------------------------------------------------------
# t_{0.975, dof} for dof 1..30 (to 4 decimals; a few seeds is the usual case). Beyond, the Cornish-Fisher
# expansion around the normal quantile is good to 1e-4.
T_975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
         2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
         2.0518, 2.0484, 2.0452, 2.0423)
Z_975 = 1.959963985


def t_quantile_975(dof: int) -> float:
    """The 0.975 quantile of Student's t with `dof` degrees of freedom (scipy's when it is installed)."""
    if dof < 1:
        raise ValueError(f"t quantile needs dof >= 1, got {dof}")
    try:
        from scipy.stats import t as student_t
    except ImportError:  # not a dependency of the project: the table and the expansion
        if dof <= len(T_975):
            return T_975[dof - 1]
        z, v = Z_975, float(dof)
        return (z + (z ** 3 + z) / (4 * v) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * v ** 2)
                + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * v ** 3))
    return float(student_t.ppf(0.975, dof))


@dataclass(frozen=True)
class Estimate:
    mean: Optional[float]
    half_width: Optional[float]  # of the 95% CI; None below two values
    n: int

    @property
    def interval(self) -> Optional[Tuple[float, float]]:
        if self.mean is None or self.half_width is None:
            return None
        return self.mean - self.half_width, self.mean + self.half_width


def mean_ci(values: Sequence[float]) -> Estimate:
    """Mean and 95% CI half-width t_{0.975,n-1} * s / sqrt(n), s the sample standard deviation."""
    n = len(values)
    if n == 0:
        return Estimate(None, None, 0)
    mean = sum(values) / n
    if n == 1:
        return Estimate(mean, None, 1)
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return Estimate(mean, t_quantile_975(n - 1) * math.sqrt(variance / n), n)


# ----------------------------------------------------------------------------------------------------------
# Results: per cell, per variant and agent, paired against the baseline
# ----------------------------------------------------------------------------------------------------------
@dataclass
class CellResult:
    cell: Cell
    state: CellState
    agents: List[str]  # from the folder's config.yaml
    final: Dict[str, float]  # agent -> held-out accuracy at the final evaluation (finished cells only)
    curves: Dict[str, Dict[int, float]]
    outcome: str = "not run"  # what this call did: skipped / ran fresh / resumed / failed (exit N) / ...
    clip: Dict[str, Dict[int, Dict[str, float]]] = field(default_factory=dict)  # clip_diagnostics of its records
    regime: Dict[str, Regime] = field(default_factory=dict)  # regime_of its records
    gate: Dict[str, Gate] = field(default_factory=dict)  # gate_of its records
    eval_problems: Optional[int] = None  # held-out problems per evaluation (run_info.json)
    # eval_scores.jsonl: agent -> step -> each held-out problem's score
    problem_scores: Dict[str, Dict[int, List[float]]] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.state.status == FINISHED


def collect_cell(cell: Cell, outcome: str = "not run") -> CellResult:
    state = cell_state(cell.folder)
    config = read_run_config(cell.folder) or {}
    records = load_cell_metrics(cell.folder) if config else []
    curves = eval_curves(records)
    final = final_accuracies(curves) if state.status == FINISHED else {}
    return CellResult(cell, state, agent_names_of(config), final, curves, outcome, clip_diagnostics(records),
                      regime_of(records), gate_of(records), eval_problems_of(cell.folder),
                      problem_scores_of(cell.folder))


def problem_scores_of(folder: Path) -> Dict[str, Dict[int, List[float]]]:
    """Each evaluation's score per held-out problem (eval_scores.jsonl; runs before it existed have none)."""
    scores: Dict[str, Dict[int, List[float]]] = {}
    try:
        lines = (Path(folder) / "eval_scores.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return scores
    for line in lines:
        if line.strip():
            record = json.loads(line)
            scores.setdefault(record["agent"], {})[record["step"]] = record["scores"]
    return scores


def eval_problems_of(folder: Path) -> Optional[int]:
    """How many held-out problems each evaluation scored (run_info.json's prompts.eval.used), or None."""
    try:
        used = json.loads((Path(folder) / "run_info.json").read_text(encoding="utf-8"))["prompts"]["eval"]["used"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return used if isinstance(used, int) and used > 0 else None


def gain_rows(results: Sequence[CellResult], labels: Sequence[str]) -> List[List[str]]:
    """Per finished cell and agent: held-out accuracy at the first and the last evaluation, the gain, and the gain
    in standard errors. Problems are the unit (the k samples of one problem are not independent). With each
    problem's score at both evaluations (eval_scores.jsonl) the standard error is the paired one: the spread of
    the per-problem gains d_i over sqrt(n), sd(d) / sqrt(n), which counts both the sampling of problems and that
    of the answers, and that both evaluations score the same problems. Without them (older runs) it is binomial
    per evaluation, sqrt(p (1 - p) / n), combined as if the two were independent: on the large side twice over
    (an average of k samples varies less than one answer, and the two evaluations correlate)."""
    rows = []
    for label in labels:
        for r in results:
            if r.cell.variant.label != label or not r.finished:
                continue
            for agent, last in r.final.items():
                first_step, last_step = min(r.curves[agent]), max(r.curves[agent])
                first = r.curves[agent][first_step]
                per_problem = r.problem_scores.get(agent, {})
                before, after = per_problem.get(first_step), per_problem.get(last_step)
                if before and after and len(before) == len(after) > 1:
                    se, kind = statistics.stdev(b - a for a, b in zip(before, after)) / math.sqrt(len(before)), "paired"
                elif r.eval_problems:
                    se, kind = math.sqrt(sum(p * (1 - p) for p in (first, last)) / r.eval_problems), "binomial"
                else:
                    continue
                ratio = f"{(last - first) / se:+.1f}" if se > 0 else "n/a"
                rows.append([label, agent, str(r.cell.seed), f"{first:.3f} (step {first_step})",
                             f"{last:.3f} (step {last_step})", f"{last - first:+.3f}", f"{se:.3f} ({kind})", ratio])
    return rows


@dataclass(frozen=True)
class Row:
    label: str
    agent: str
    estimate: Estimate
    per_seed: Tuple[Tuple[int, float], ...]


def variant_agents(results: Sequence[CellResult], label: str) -> List[str]:
    agents: List[str] = []
    for result in results:
        if result.cell.variant.label == label:
            agents += [a for a in result.agents if a not in agents]
    return agents


def accuracy_rows(results: Sequence[CellResult], labels: Sequence[str]) -> List[Row]:
    """Per variant and agent: the final accuracy's mean and 95% CI over the finished seeds."""
    rows = []
    for label in labels:
        for agent in variant_agents(results, label):
            per_seed = tuple((r.cell.seed, r.final[agent]) for r in results
                             if r.cell.variant.label == label and agent in r.final)
            rows.append(Row(label, agent, mean_ci([v for _, v in per_seed]), per_seed))
    return rows


def paired_rows(results: Sequence[CellResult], labels: Sequence[str], baseline: str) -> List[Row]:
    """Per variant (not the baseline) and agent: variant - baseline seed by seed, over the seeds where both
    cells finished, with the 95% CI of the mean difference (a paired t interval)."""
    return [row for label in labels if label != baseline for row in difference_rows(results, label, baseline)]


def difference_rows(results: Sequence[CellResult], label: str, other: str) -> List[Row]:
    """Per agent of `label`: label - other seed by seed, over the seeds where both cells finished, with the 95% CI
    of the mean difference (paired t). Row.label is `label`."""
    base = {(r.cell.seed, agent): value for r in results if r.cell.variant.label == other
            for agent, value in r.final.items()}
    rows = []
    for agent in variant_agents(results, label):
        per_seed = tuple((r.cell.seed, r.final[agent] - base[(r.cell.seed, agent)]) for r in results
                         if r.cell.variant.label == label and agent in r.final and (r.cell.seed, agent) in base)
        rows.append(Row(label, agent, mean_ci([d for _, d in per_seed]), per_seed))
    return rows


def _estimate_text(estimate: Estimate, signed: bool = False) -> Tuple[str, str]:
    """('0.712 ± 0.034', '[0.678, 0.746]') for a table; n/a where there is nothing to show."""
    if estimate.mean is None:
        return "n/a", "n/a"
    mean = f"{estimate.mean:+.3f}" if signed else f"{estimate.mean:.3f}"
    if estimate.half_width is None:
        return mean, "n/a (one seed)"
    low, high = estimate.interval
    form = "{:+.3f}" if signed else "{:.3f}"
    return f"{mean} ± {estimate.half_width:.3f}", f"[{form.format(low)}, {form.format(high)}]"


def _per_seed_text(per_seed: Sequence[Tuple[int, float]], signed: bool = False) -> str:
    return ", ".join(f"{seed}: {value:+.3f}" if signed else f"{seed}: {value:.3f}" for seed, value in per_seed) or "-"


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def cell_status_text(result: CellResult) -> str:
    state = result.state
    if state.status == FINISHED:
        return f"finished ({state.total_steps} steps)"
    if state.status == RESUMABLE:
        return f"not finished: checkpoint at step {state.checkpoint_step} of {state.total_steps or '?'}"
    if state.last_step:
        return f"not started: no checkpoint (logged up to step {state.last_step})"
    return "not started"


def code_version(folder: str) -> str:
    """The git commit of the code in `folder`, and whether tracked files differ from it: a cell reproduces
    its numbers with the same code (a change as small as the order of a sum can make a run drift)."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", folder, *args], capture_output=True, text=True)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return "not a git checkout"
    changed = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return f"commit {head.stdout.strip()[:12]}" + (" with uncommitted changes" if changed else "")


def _difference_table(rows: Sequence[Tuple[str, Row]]) -> List[str]:
    """A table of paired differences, each row (what it was paired against, its Row)."""
    table = []
    for other, row in rows:
        mean, interval = _estimate_text(row.estimate, signed=True)
        table.append([f"{row.label} - {other}", row.agent, mean, interval, str(row.estimate.n),
                      _per_seed_text(row.per_seed, signed=True)])
    return _markdown_table(["comparison", "agent", "difference (mean ± 95% CI)", "95% CI", "pairs", "per seed"],
                           table)


def results_markdown(results: Sequence[CellResult], labels: Sequence[str], baseline: Optional[str],
                     rerun: Mapping[str, str], *, base_config: str, seeds: Sequence[int], workdir: str,
                     study_command: Optional[str] = None, comparisons: Sequence[Tuple[str, str]] = (),
                     report: bool = False) -> str:
    """results.md: accuracy table, paired differences, cell states, and how to rerun each cell. `report`: written
    by --report, whose checkout need not be the one the cells ran in."""
    code = (f" Tables written by --report at {code_version(workdir)}; each cell's code is the checkout it ran in."
            if report else f" Code: {code_version(workdir)}.")
    lines = ["# Study results", "",
             f"Written {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Base config "
             f"`{base_config}`, seeds {', '.join(map(str, seeds))}"
             + (f", baseline `{baseline}`." if baseline else ".")
             + code, ""]
    if study_command:
        lines += [f"The study: `{study_command}`", ""]
    lines += [
             "## Held-out accuracy at the final step", "",
             "Mean over the finished seeds, 95% confidence interval from Student's t with n-1 degrees of freedom.", ""]
    table = []
    for row in accuracy_rows(results, labels):
        mean, interval = _estimate_text(row.estimate)
        table.append([row.label, row.agent, mean, interval, str(row.estimate.n), _per_seed_text(row.per_seed)])
    lines += _markdown_table(["variant", "agent", "accuracy (mean ± 95% CI)", "95% CI", "n", "per seed"], table)
    if not table:
        lines += ["", "No cell has written a config yet."]
    gains = gain_rows(results, labels)
    if gains:
        lines += ["", "## Held-out gain over the run", "",
                  "Per finished cell: the first and the last evaluation, their difference, its standard error over "
                  "the held-out problems (paired: the spread of the per-problem gains; binomial, for runs without "
                  "eval_scores.jsonl: each evaluation's, taken as independent, on the large side) and the gain in "
                  "standard errors.", ""]
        lines += _markdown_table(["variant", "agent", "seed", "first", "last", "gain", "SE", "gain / SE"], gains)
    if baseline:
        lines += ["", f"## Paired difference to {baseline}", "",
                  f"variant - {baseline} on the same seed, over the seeds where both finished; 95% CI of the "
                  "mean difference (paired t). An interval that excludes 0 is a difference at the 5% level.", ""]
        lines += _difference_table([(baseline, row) for row in paired_rows(results, labels, baseline)])
    if comparisons:
        lines += ["", "## Other paired differences (--compare)", "",
                  "A - B on the same seed, over the seeds where both finished; 95% CI of the mean difference "
                  "(paired t).", ""]
        lines += _difference_table([(other, row) for label, other in comparisons
                                    for row in difference_rows(results, label, other)])
    regime = regime_rows(results)
    if regime:
        lines += ["", "## The regime: the paper's or not", "",
                  "Per cell and agent, means over its steps: the share of own rows outside GSPO's clip at each "
                  "update index of a step (u0 / u1 / ...: the first is on-policy), the same over the updates after "
                  f"the first (more than {REGIME_OWN_CLIPPED_MAX:.0%}: most own answers thrown away, where the "
                  "GSPO paper clips ~15 %), and the share of the other agents' right answers inside the learner's "
                  f"cross clip (under {REGIME_RIGHT_THROUGH_MIN:.0%} for the weaker agent, the one with the lower "
                  "first held-out accuracy: it learns almost nothing from them). (est.): a run from before the "
                  "per-update figures, estimated from step means as if the first update clipped nothing.", ""]
        lines += _markdown_table(["variant", "seed", "agent", "own clipped by update", "after the first",
                                  "others' right answers through", "regime"], regime)
    gates = gate_rows(results)
    if gates:
        lines += ["", "## The gate at the first step", "",
                  "Per cell with a cross term, its weaker agent at the first step: the mean ratio s of the other "
                  "agents' answers, and the share of their right answers inside its cross clip at each of the "
                  f"step's updates. The gate: s in {GATE_MEAN_S[0]}-{GATE_MEAN_S[1]} (where the paper measured its "
                  f"ratios) and at least {GATE_RIGHT_THROUGH_MIN:.0%} through at the first, on-policy, update.", ""]
        lines += _markdown_table(["variant", "seed", "weaker agent", "step", "mean s", "right answers through, "
                                  "by update", "gate"], gates)
    clip_sections = [(label, clip_table(results, label)) for label in labels]
    if any(rows for _, rows in clip_sections):
        lines += ["", "## The other agents' answers against each learner's cross clip", "",
                  "Per step and learner, means over the variant's seeds (each step's record is a mean over its "
                  "updates): "
                  "the shares of the other agents' answers whose ratio s falls below, inside or above [lo_m, 1], "
                  "their mean s, the share with a positive advantage (right answers), and the share right *and* "
                  "inside: the other agents' answers that moved the learner."]
        for label, rows in clip_sections:
            if rows:
                lines += ["", f"### {label}", ""]
                lines += _markdown_table(["step", "learner", "below", "inside", "above", "mean s", "right",
                                          "right and inside", "seeds"], rows)
    lines += ["", f"![held-out accuracy over steps, mean over seeds]({PLOT_FILE})", "", "## Cells", ""]
    lines += _markdown_table(["variant", "seed", "state", "this call", "folder"],
                             [[r.cell.variant.label, str(r.cell.seed), cell_status_text(r), r.outcome,
                               f"`{r.cell.variant.label}/seed{r.cell.seed}`"] for r in results])
    lines += ["", "## Rerun a cell", "",
              "Folders are the study folder's (this file's; `OUT` in commands where it was outside the checkout). "
              "To redo one cell in a fresh folder: the study's command plus `--only LABEL:SEED --out OTHER`, or "
              "the cell's launcher command below (run from the checkout's root) with another `--output-dir`. "
              "On CPU a run "
              "on the embedded engine is deterministic for its seed and code: either reproduces the cell's "
              "metrics.jsonl (all but timings) with the code named above; with vLLM's log-probs as old log-probs "
              "(rollout.old_logprobs: engine) losses and ratios differ by ~1e-6 (vLLM's CPU log-probs vary "
              "between runs), in the one rerun measured, rewards and held-out figures were the same (docs/study.md).",
              "", "```"]
    lines += [f"# {name}\n{command}" for name, command in rerun.items()]
    lines += ["```"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------
# Running cells
# ----------------------------------------------------------------------------------------------------------
Launch = Callable[[List[str], Path], int]  # (command, log file) -> exit code
Resolve = Callable[[str, Sequence[str]], Dict[str, Any]]  # (config, overrides) -> resolved config as plain data


def run_launcher(command: List[str], log_path: Path) -> int:
    """Run one cell's launcher, its output appended to `log_path`; returns its exit code.

    The launcher runs in its own session, so a Ctrl-C in the terminal reaches it once, through this tool:
    SIGTERM/SIGINT here are passed on (the run finishes its step, writes a checkpoint and stops; a second
    signal stops it at once). A run that ends non-zero after such a signal is reported as preempted:
    torchrun itself exits 1 after forwarding a signal, whatever the ranks returned.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n=== {datetime.datetime.now():%Y-%m-%d %H:%M:%S} {shlex.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        received: List[int] = []

        def forward(signum, _frame):
            received.append(signum)
            process.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            returncode = process.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if received and returncode != 0:
        return PREEMPTED_EXIT_CODE
    return returncode


def resolve_config(config: str, overrides: Sequence[str]) -> Dict[str, Any]:
    """The config a run of (config, overrides) writes as config.yaml, as plain data; StudyInputError if invalid."""
    from hacpo_megatron.config import ConfigError, config_to_dict, load_config

    try:
        return json.loads(json.dumps(config_to_dict(load_config(config, list(overrides)))))
    except ConfigError as error:
        head, *problems = [line.strip() for line in str(error).splitlines()]
        raise StudyInputError(" ".join([head, "; ".join(problems)]).strip()) from None  # one line


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class Study:
    base_config: str
    variants: List[Variant]
    seeds: List[int]
    out: Path
    baseline: Optional[str] = None
    comparisons: List[Tuple[str, str]] = field(default_factory=list)  # --compare A:B, paired like the baseline
    common_overrides: List[str] = field(default_factory=list)
    only: List[Tuple[str, int]] = field(default_factory=list)
    command: Optional[str] = None  # how this study was started, for results.md

    @property
    def labels(self) -> List[str]:
        return [v.label for v in self.variants]

    def cells(self) -> List[Cell]:
        return plan_cells(self.variants, self.seeds, self.out)

    def cell_overrides(self, cell: Cell) -> List[str]:
        return [f"run.seed={cell.seed}", *self.common_overrides, *cell.variant.overrides]


def check_study(study: Study, resolve: Optional[Resolve]) -> None:
    """Every input problem that can be found before a run starts, as StudyInputError."""
    labels = study.labels
    if not study.variants:
        raise StudyInputError("no --variant given (e.g. --variant hacpo=)")
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise StudyInputError(f"--variant labels repeat: {', '.join(repeated)}")
    if len(set(study.seeds)) != len(study.seeds):
        raise StudyInputError(f"--seeds repeat: {' '.join(map(str, study.seeds))}")
    if study.baseline is not None and study.baseline not in labels:
        raise StudyInputError(f"--baseline {study.baseline}: not among the variants ({', '.join(labels)})")
    for label, other in study.comparisons:
        unknown = [x for x in (label, other) if x not in labels]
        if unknown or label == other:
            raise StudyInputError(f"--compare {label}:{other}: " + (f"{', '.join(unknown)} not among the variants "
                                  f"({', '.join(labels)})" if unknown else "a variant against itself"))
    for override in study.common_overrides:
        if "=" not in override or not OVERRIDE_KEY.match(override.split("=", 1)[0].strip()):
            raise StudyInputError(f"--set {override!r}: expected KEY=VALUE")
        if override.split("=", 1)[0].strip() == "run.seed":
            raise StudyInputError("--set run.seed: seeds come from --seeds")
    cells = {(c.variant.label, c.seed) for c in study.cells()}
    for label, seed in study.only:
        if (label, seed) not in cells:
            raise StudyInputError(f"--only {label}:{seed}: no such cell (variants {', '.join(labels)}; "
                                  f"seeds {' '.join(map(str, study.seeds))})")
    if resolve is None:
        return
    for cell in study.cells():
        try:
            expected = resolve(cell.variant.config, study.cell_overrides(cell))
        except StudyInputError as error:
            raise StudyInputError(f"--variant {cell.variant.label}: {error}") from None
        found = read_run_config(cell.folder)
        differences = config_differences(expected, found) if found else []
        if differences:
            raise StudyInputError(f"{cell.folder} was run with another config ({'; '.join(differences)}): "
                                  "move it away or use another --out")


def run_study(study: Study, *, launch: Launch = run_launcher, resolve: Optional[Resolve] = resolve_config,
              dry_run: bool = False, report: bool = False, python: str = sys.executable,
              echo: Callable[[str], None] = print) -> int:
    """Check the study, run the cells that need it, write results.md and accuracy.png; returns the exit code.

    StudyInputError before any run starts if the input is unusable (main() makes it exit code 2).
    """
    check_study(study, resolve)
    cells = study.cells()
    chosen = [c for c in cells if not study.only or (c.variant.label, c.seed) in study.only]
    if dry_run:
        for cell in chosen:
            state = cell_state(cell.folder)
            action = ("skip" if state.status == FINISHED else
                      shlex.join(launcher_command(cell, study.common_overrides, resume=state.status == RESUMABLE,
                                                  python=python)))
            echo(f"{cell.name} [{state.status}]: {action}")
        return EXIT_OK

    study.out.mkdir(parents=True, exist_ok=True)
    with _StudyLock(study.out / LOCK_FILE):
        outcomes, preempted = ({}, None) if report else _run_cells(study, chosen, launch, python, echo)
    results = [collect_cell(c, outcomes.get(c.name, "not run")) for c in cells]
    shown = _shown_out(study.out)
    rerun = {c.name: shlex.join(launcher_command(c, study.common_overrides, python=_shown_python(python)))
             .replace(str(study.out), shown) for c in cells}
    text = results_markdown(results, study.labels, study.baseline, rerun, base_config=study.base_config,
                            seeds=study.seeds, workdir=os.getcwd(), study_command=study.command,
                            comparisons=study.comparisons, report=report)
    (study.out / RESULTS_FILE).write_text(text, encoding="utf-8")
    plot_accuracy(results, study.labels, study.baseline, study.out / PLOT_FILE)
    echo(text)
    echo(f"wrote {study.out / RESULTS_FILE} and {study.out / PLOT_FILE}")
    if preempted:
        echo(f"stopped on request at {preempted}: run the same command again to resume")
        return PREEMPTED_EXIT_CODE
    unfinished = [r.cell.name for r in results if (not study.only or r.outcome != "not run") and not r.finished]
    if unfinished:
        echo(f"not finished: {', '.join(unfinished)}")
        return EXIT_INCOMPLETE
    return EXIT_OK


def _run_cells(study: Study, cells: Sequence[Cell], launch: Launch, python: str,
               echo: Callable[[str], None]) -> Tuple[Dict[str, str], Optional[str]]:
    """Run each cell that needs it; {cell name: what happened}, and the cell a preemption stopped (or None)."""
    outcomes: Dict[str, str] = {}
    for index, cell in enumerate(cells, 1):
        state = cell_state(cell.folder)
        prefix = f"[{index}/{len(cells)}] {cell.name}"
        if state.status == FINISHED:
            outcomes[cell.name] = "skipped (finished)"
            echo(f"{prefix}: finished, skipped")
            continue
        resume = state.status == RESUMABLE
        command = launcher_command(cell, study.common_overrides, resume=resume, python=python)
        log_path = cell.folder / LAUNCHER_LOG
        echo(f"{prefix}: {'resuming from step ' + str(state.checkpoint_step) if resume else 'starting'} "
             f"(log: {log_path})")
        returncode = launch(command, log_path)
        done = "resumed" if resume else "ran fresh"
        if returncode in PREEMPTED_EXIT_CODES:
            outcomes[cell.name] = f"{done}, preempted"
            return outcomes, cell.name
        if returncode != 0:
            outcomes[cell.name] = f"{done}, failed (exit {returncode})"
            echo(f"{prefix}: failed with exit code {returncode}; the end of {log_path}:\n{_tail(log_path)}")
            continue
        if cell_state(cell.folder).status != FINISHED:  # exit 0, yet the folder does not show the end
            outcomes[cell.name] = f"{done}, exit 0 but not finished"
            echo(f"{prefix}: exit 0, but {cell.folder} does not hold the final step's records")
            continue
        outcomes[cell.name] = done
        echo(f"{prefix}: finished")
    return outcomes, None


def _shown_python(path: str) -> str:
    """The interpreter as results.md shows it: relative to the working folder when inside it (.venv/bin/python),
    else plain `python` (a folder of the machine the study ran on means nothing to a reader)."""
    relative = os.path.relpath(path)
    return "python" if relative.startswith("..") else relative


def _shown_out(out: Path) -> str:
    """The study folder as results.md shows it: relative to the working folder when inside it, else `OUT`."""
    relative = os.path.relpath(out)
    return "OUT" if relative.startswith("..") else relative


def shown_command(argv: Sequence[str], script: str, python: str = sys.executable) -> str:
    """The study's command line as results.md shows it: no folder of the machine it ran on."""
    args = list(argv)
    for i, arg in enumerate(args[:-1]):
        if arg == "--out":
            args[i + 1] = _shown_out(Path(args[i + 1]))
    script = os.path.relpath(script)
    return shlex.join([_shown_python(python), script if not script.startswith("..") else "tools/compare_algorithms.py",
                       *args])


class _StudyLock:
    """One study process per --out folder: two would run the same cell into the same folder at once."""

    def __init__(self, path: Path):
        self.path = path
        self._file = None

    def __enter__(self) -> "_StudyLock":
        import fcntl

        self._file = open(self.path, "w")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.close()
            raise StudyInputError(f"{self.path.parent}: another compare_algorithms is running on this folder") from None
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()  # releases the lock


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------
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


def parse_comparison(text: str) -> Tuple[str, str]:
    """--compare A:B -> (A, B)."""
    label, sep, other = text.partition(":")
    if not sep or not label.strip() or not other.strip():
        raise StudyInputError(f"--compare {text!r}: expected A:B, two variant labels")
    return label.strip(), other.strip()


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
