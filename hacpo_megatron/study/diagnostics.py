"""What a cell's training records say about its clips (issue 49, docs/study.md): whether it is in the paper's
regime (own rows clipped after the first update, the other agents' right answers let through the cross clip), the
gate at the first step (the weaker learner's mean ratio s and its first update), and where the other agents'
answers fell against each learner's cross clip, step by step; what each agent's own answers became over the
run (length, the share cut at the token limit, reward); and where the weaker agent's held-out gain lies. Pure
functions of metrics.jsonl records and eval_scores.jsonl scores."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

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
    # (None: no right answers of theirs in that update; [] when the records predate the per-update figures)


def gate_of(records: Sequence[Mapping[str, Any]]) -> Dict[str, Gate]:
    """{agent: Gate} from each learner's first training record with other agents' answers in it."""
    first: Dict[str, Mapping[str, Any]] = {}
    for r in records:
        if r.get("kind") == "train" and r.get("num_cross") and isinstance(r.get("step"), int):
            if r["agent"] not in first or r["step"] < first[r["agent"]]["step"]:
                first[r["agent"]] = r
    return {agent: Gate(r["step"], float(r.get("cross_ratio_mean", math.nan)),
                        [r.get(f"regime/right_through/u{m}") for m in range(int(r.get("num_updates", 0)))]
                        if any(key.startswith("regime/") for key in r) else [])
            for agent, r in first.items()}


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


@dataclass
class Answers:
    """An agent's own answers at the start and at the end of a run: means over its first and its last quarter of
    training steps (at least one step each). A gain in held-out accuracy that comes with much shorter answers, or
    far fewer cut at the token limit, is partly a change of form, and a reader comparing variants should see it."""
    first_steps: Tuple[int, int]  # (first, last) step of the opening quarter
    last_steps: Tuple[int, int]  # the same of the closing quarter
    length: Tuple[Optional[float], Optional[float]]  # tokens an answer, opening and closing quarter
    truncated: Tuple[Optional[float], Optional[float]]  # share that reached the token limit without ending
    reward: Tuple[Optional[float], Optional[float]]  # mean reward of the agent's own answers
    # the held-out answers cut at the limit, first and last evaluation (None: a run from before eval/truncated_frac)
    held_out_truncated: Tuple[Optional[float], Optional[float]] = (None, None)

    @property
    def finished_reward(self) -> Tuple[Optional[float], Optional[float]]:
        """The mean reward of the answers that ended, r / (1 - cut), opening and closing quarter, taking a cut answer
        to score 0 (it can score: rewards/answers.py reads its last closed box or last line; where cut answers do, the
        true figure starts lower and, as the cut share falls, rises more). It splits a reward gain into fewer cut
        answers and right-er finished ones."""
        return tuple(None if r is None or c is None or c >= 1 else r / (1 - c)  # type: ignore[return-value]
                     for r, c in zip(self.reward, self.truncated))


def answers_of(records: Sequence[Mapping[str, Any]]) -> Dict[str, Answers]:
    """{agent: Answers} from a cell's training records (`response_length_mean`, `truncated_frac`, `reward_mean`
    of its own rollouts, training/step_data.py) and its evaluations (`eval/truncated_frac`); agents without
    rollout figures are left out."""
    by_agent: Dict[str, Dict[int, Mapping[str, Any]]] = {}
    held_out: Dict[str, Dict[int, float]] = {}
    for r in records:
        if not isinstance(r.get("step"), int):
            continue
        if r.get("kind") == "train" and "response_length_mean" in r:
            by_agent.setdefault(r["agent"], {})[r["step"]] = r
        elif r.get("kind") == "eval" and isinstance(r.get("eval/truncated_frac"), (int, float)):
            held_out.setdefault(r["agent"], {})[r["step"]] = r["eval/truncated_frac"]
    out = {}
    for agent, rows in by_agent.items():
        steps = sorted(rows)
        quarter = max(1, len(steps) // 4)
        opening, closing = [rows[s] for s in steps[:quarter]], [rows[s] for s in steps[-quarter:]]
        evaluations = held_out.get(agent, {})
        out[agent] = Answers((steps[0], steps[quarter - 1]), (steps[-quarter], steps[-1]),
                             *(_opening_and_closing(opening, closing, key)
                               for key in ("response_length_mean", "truncated_frac", "reward_mean")),
                             (evaluations[min(evaluations)], evaluations[max(evaluations)]) if evaluations
                             else (None, None))
    return out


def _opening_and_closing(opening: Sequence[Mapping[str, Any]], closing: Sequence[Mapping[str, Any]],
                         key: str) -> Tuple[Optional[float], Optional[float]]:
    return _mean([r.get(key, math.nan) for r in opening]), _mean([r.get(key, math.nan) for r in closing])


# The weaker agent's held-out problems, split by what the agents answered at the first evaluation: those another
# agent got right and it did not are where answers crossing from that agent can teach it something its own cannot.
STRATA = ("another right, it wrong", "all wrong", "it right")
RIGHT_SCORE = 0.5  # a problem's score (mean over its sampled answers) from which it counts as answered right


@dataclass
class Stratum:
    problems: int
    first: Optional[float]  # the weaker agent's mean score on them at the first evaluation
    last: Optional[float]  # and at the last


def strata_of(problem_scores: Mapping[str, Mapping[int, Sequence[float]]],
              weaker: Optional[str]) -> Optional[Tuple[Tuple[int, int], Dict[str, Stratum]]]:
    """((first, last) evaluation step, {stratum: Stratum}) of `weaker`'s held-out problems (STRATA), from a cell's
    eval_scores.jsonl (agent -> step -> each problem's score); None without a weaker agent, or without every agent's
    scores at the weaker's first evaluation. Every variant starts from the same models, so the strata are the same
    problems in every cell: a lead over a baseline in the first is the other agents' knowledge reaching the weaker,
    one in the second is not (no agent's answers held it)."""
    own = problem_scores.get(weaker or "", {})
    if len(own) < 1 or len(problem_scores) < 2:
        return None
    first, last = min(own), max(own)
    others = [scores.get(first) for agent, scores in problem_scores.items() if agent != weaker]
    if any(s is None or len(s) != len(own[first]) for s in others):
        return None
    groups: Dict[str, List[int]] = {name: [] for name in STRATA}
    for i, score in enumerate(own[first]):
        if score >= RIGHT_SCORE:
            groups["it right"].append(i)
        elif any(other[i] >= RIGHT_SCORE for other in others):
            groups["another right, it wrong"].append(i)
        else:
            groups["all wrong"].append(i)
    return (first, last), {name: Stratum(len(idx), _mean([own[first][i] for i in idx]),
                                         _mean([own[last][i] for i in idx])) for name, idx in groups.items()}
