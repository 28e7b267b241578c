"""A study's results: each cell's CellResult (read from its folder) and the tables made of them: held-out
accuracy per variant and agent (mean ± 95% CI over seeds), paired differences to the baseline and the --compare
pairs, each cell's gain over its run, the regime, the gate, the cross clip and what the answers became; results.md
(accuracy.png: plots.py)."""
from __future__ import annotations

import datetime
import math
import statistics
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hacpo_megatron.study.cells import (
    FINISHED,
    RESUMABLE,
    Cell,
    CellState,
    agent_names_of,
    cell_state,
    eval_curves,
    eval_problems_of,
    final_accuracies,
    load_cell_metrics,
    problem_scores_of,
    read_run_config,
)
from hacpo_megatron.study.diagnostics import (
    CLIP_COLUMNS,
    GATE_MEAN_S,
    GATE_RIGHT_THROUGH_MIN,
    REGIME_OWN_CLIPPED_MAX,
    REGIME_RIGHT_THROUGH_MIN,
    RIGHT_SCORE,
    STRATA,
    Answers,
    Gate,
    Regime,
    Stratum,
    answers_of,
    clip_diagnostics,
    gate_of,
    regime_of,
    regime_verdict,
    strata_of,
    weaker_agent,
)
from hacpo_megatron.study.stats import Estimate, mean_ci

PLOT_FILE = "accuracy.png"


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
    answers: Dict[str, Answers] = field(default_factory=dict)  # answers_of its records

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
                      problem_scores_of(cell.folder), answers_of(records))


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


def gate_rows(results: Sequence[CellResult]) -> List[List[str]]:
    """One row per cell with a cross term: its weaker learner at the first step, and whether it passes the gate."""
    rows = []
    for r in results:
        weaker = weaker_agent(r.curves)
        gate = r.gate.get(weaker)
        if gate is None:
            continue
        low, high = GATE_MEAN_S
        misses = [] if low <= gate.mean_s <= high else [f"mean s {gate.mean_s:.3f} outside {low}-{high}"]
        if not gate.through_by_update:  # a cell from before the per-update figures: the gate cannot be read
            misses.append("first update not logged")
        elif gate.through_by_update[0] is None or gate.through_by_update[0] < GATE_RIGHT_THROUGH_MIN:
            first = gate.through_by_update[0]
            misses.append(f"first update lets {'none' if first is None else f'{first:.2f}'} < "
                          f"{GATE_RIGHT_THROUGH_MIN:.2f} through")
        through = " / ".join("n/a" if v is None else f"{v:.2f}" for v in gate.through_by_update) or "not logged"
        rows.append([r.cell.variant.label, str(r.cell.seed), weaker, str(gate.step), f"{gate.mean_s:.3f}", through,
                     "**misses**: " + "; ".join(misses) if misses else "passes"])
    return rows


def answer_rows(results: Sequence[CellResult]) -> List[List[str]]:
    """One row per cell and agent: its own answers' length, share cut at the token limit and reward, opening
    quarter of the run -> closing quarter; its held-out answers cut at the limit, first -> last evaluation."""
    def change(pair: Tuple[Optional[float], Optional[float]], form: str) -> str:
        return " → ".join("n/a" if v is None else form.format(v) for v in pair)

    rows = []
    for r in results:
        weaker = weaker_agent(r.curves)
        for agent, answers in r.answers.items():
            (a, b), (c, d) = answers.first_steps, answers.last_steps
            rows.append([r.cell.variant.label, str(r.cell.seed), agent + (" (weaker)" if agent == weaker else ""),
                         f"{a}-{b} → {c}-{d}", change(answers.length, "{:.0f}"),
                         change(answers.truncated, "{:.2f}"), change(answers.reward, "{:.2f}"),
                         change(answers.finished_reward, "{:.2f}"), change(answers.held_out_truncated, "{:.2f}")])
    return rows


def strata_rows(results: Sequence[CellResult]) -> List[List[str]]:
    """One row per cell with per-problem scores at two evaluations or more: its weaker agent's held-out score on each
    of STRATA, first evaluation -> last, with the stratum's number of problems."""
    rows = []
    for r in results:
        weaker = weaker_agent(r.curves)
        found = strata_of(r.problem_scores, weaker)
        if found is None or found[0][0] == found[0][1]:
            continue
        (first, last), strata = found
        rows.append([r.cell.variant.label, str(r.cell.seed), str(weaker), f"{first} → {last}"]
                    + [f"{s.first:.2f} → {s.last:.2f} ({s.problems})" if s.problems else "none"
                       for s in (strata[name] for name in STRATA)])
    return rows


def strata_difference_rows(results: Sequence[CellResult], label: str, other: str) -> List[Row]:
    """Per stratum (Row.agent holds its name): the weaker agent's last score on it under `label` - under `other`,
    seed by seed, over the seeds where both cells finished with the same strata (the same first evaluation and
    stratum sizes: the same problems), with the 95% CI of the mean difference (paired t)."""
    def strata_by_seed(of: str) -> Dict[int, Tuple[int, Dict[str, Stratum]]]:
        found = {}
        for r in results:
            strata = strata_of(r.problem_scores, weaker_agent(r.curves)) if r.finished else None
            if r.cell.variant.label == of and strata is not None:
                found[r.cell.seed] = (strata[0][0], strata[1])
        return found

    mine, theirs = strata_by_seed(label), strata_by_seed(other)
    same = [seed for seed in mine if seed in theirs and mine[seed][0] == theirs[seed][0]
            and all(mine[seed][1][n].problems == theirs[seed][1][n].problems for n in STRATA)]
    rows = []
    for name in STRATA:
        per_seed = tuple((seed, mine[seed][1][name].last - theirs[seed][1][name].last) for seed in sorted(same)
                         if mine[seed][1][name].problems)
        rows.append(Row(label, name, mean_ci([d for _, d in per_seed]), per_seed))
    return rows


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


def _section(title: str, rows: Sequence[Sequence[str]], header: Sequence[str], intro: str) -> List[str]:
    """A results.md section: its title, what its table says, the table; nothing where there are no rows."""
    return ["", f"## {title}", "", intro, ""] + _markdown_table(header, rows) if rows else []


def _difference_table(rows: Sequence[Tuple[str, Row]], of: str = "agent") -> List[str]:
    """A table of paired differences, each row (what it was paired against, its Row); `of`: what Row.agent holds."""
    table = []
    for other, row in rows:
        mean, interval = _estimate_text(row.estimate, signed=True)
        table.append([f"{row.label} - {other}", row.agent, mean, interval, str(row.estimate.n),
                      _per_seed_text(row.per_seed, signed=True)])
    return _markdown_table(["comparison", of, "difference (mean ± 95% CI)", "95% CI", "pairs", "per seed"], table)


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
    intro = ("Per cell and agent, its own training answers over the opening quarter of its steps and over the "
             "closing quarter (means of the steps' figures): tokens an answer, the share that reached the token "
             "limit without ending, their mean reward, and the reward of those that ended (reward / (1 − cut), "
             "taking a cut answer to score 0); and the share of its held-out answers cut at the limit at the "
             "first and the last evaluation (n/a: a run from before `eval/truncated_frac`). A held-out gain "
             "that comes with much shorter or fewer cut-off answers is partly a change of form; the reward of "
             "the finished answers tells how much of a reward gain is not.")
    lines += _section("What the answers became", answer_rows(results),
                      ["variant", "seed", "agent", "steps", "tokens", "cut at the limit", "reward",
                       "reward of the finished", "held-out cut at the limit"], intro)
    strata = strata_rows(results)
    intro = ("Per cell, its weaker agent's held-out problems split by what the agents answered at the first "
             f"evaluation (right: a score of at least {RIGHT_SCORE}): those another agent got right and it did "
             "not, those every agent got wrong, those it got right; its mean score on each, first evaluation → "
             "last (problems in brackets). The first is where the other agents' answers can teach it what its "
             "own cannot; a gain there beyond a baseline's is their knowledge crossing, one in the second is "
             "not.")
    lines += _section("Where the weaker agent's held-out gain lies", strata,
                      ["variant", "seed", "weaker agent", "evaluations"] + list(STRATA), intro)
    if strata:
        pairs = ([(label, baseline) for label in labels if baseline and label != baseline] + list(comparisons))
        differences = [(other, row) for label, other in pairs for row in strata_difference_rows(results, label, other)
                       if row.per_seed]
        if differences:
            lines += ["", "The weaker agent's last score on each group, A - B on the same seed (the baseline and "
                      "--compare pairs), over the seeds where both finished; 95% CI of the mean difference "
                      "(paired t).", ""]
            lines += _difference_table(differences, of="problems")
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

