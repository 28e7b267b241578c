"""benchmarks/bench_staleness.py's reading of a run: the step's time, the slowest agent's phases, steps after the
first."""
import json

import pytest

from tests.benchmarks.scripts import load_benchmark

bench = load_benchmark("bench_staleness")


def record(step, agent, step_s, rollout, train, staleness=None):
    r = {"kind": "train", "step": step, "agent": agent, "time/step": step_s, "time/rollout": rollout,
         "time/train": train, "time/reward": 0.1, "time/logprob": 0.2, "time/bridge": 0.0, "time/weight_sync": 0.05}
    if staleness is not None:
        r["staleness/versions_behind"] = staleness
    return r


def test_the_summary_skips_the_first_step_and_takes_the_slowest_agent(tmp_path):
    records = [record(1, "a", 9.0, 5.0, 1.0, 0), record(1, "b", 9.0, 5.0, 2.0, 0),
               record(2, "a", 2.0, 0.5, 1.0, 1), record(2, "b", 2.0, 0.5, 1.5, 1),
               record(3, "a", 4.0, 0.7, 1.2, 1), record(3, "b", 4.0, 0.9, 1.1, 1),
               {"kind": "eval", "step": 0, "agent": "a", "eval/accuracy": 0.2},
               {"kind": "eval", "step": 3, "agent": "a", "eval/accuracy": 0.5},
               {"kind": "eval", "step": 3, "agent": "b", "eval/accuracy": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    summary = bench.summarise(tmp_path)
    assert summary["steps"] == 3
    assert summary["step_mean_s"] == pytest.approx(3.0)  # steps 2 and 3 only
    assert summary["phases_mean_s"]["time/rollout"] == pytest.approx((0.5 + 0.9) / 2)
    assert summary["phases_mean_s"]["time/train"] == pytest.approx((1.5 + 1.2) / 2)
    assert summary["staleness_mean"] == pytest.approx(1.0)
    assert summary["held_out"] == {"a": 0.5, "b": 0.4} and summary["held_out_step"] == 3
    assert summary["overlap_mean"] == {}  # records without the pipeline's timing


def test_the_overlap_is_the_mean_over_agents_and_later_steps(tmp_path):
    records = [dict(record(1, "a", 9.0, 5.0, 1.0, 0), **{"pipeline/hidden_frac": 0.0}),
               dict(record(2, "a", 2.0, 0.5, 1.0, 1), **{"pipeline/hidden_frac": 0.8, "pipeline/engine_idle_s": 0.1}),
               dict(record(2, "b", 2.0, 0.5, 1.0, 1), **{"pipeline/hidden_frac": 0.6, "pipeline/engine_idle_s": 0.3})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    overlap = bench.summarise(tmp_path)["overlap_mean"]
    assert overlap == pytest.approx({"pipeline/hidden_frac": 0.7, "pipeline/engine_idle_s": 0.2})
