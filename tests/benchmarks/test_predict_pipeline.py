"""benchmarks/predict_pipeline.py: the pipeline model against timelines worked out by hand."""
import json

import pytest

from tests.benchmarks.scripts import load_benchmark

predict_pipeline = load_benchmark("predict_pipeline")
StepPhases, main, read_phases, simulate = (predict_pipeline.StepPhases, predict_pipeline.main,
                                           predict_pipeline.read_phases, predict_pipeline.simulate)


def test_k0_is_the_phases_one_after_another():
    phases = [StepPhases(3, 5, 1), StepPhases(7, 2, 1), StepPhases(4, 4, 0.5)]
    assert simulate(phases, 0) == pytest.approx(9 + 10 + 8.5)


def test_k1_overlaps_the_next_generation_with_training():
    # by hand: gen0 0-10, gen1 10-20; train0 10-20; push0 20-21; gen2 21-31; train1 21-31; push1 31-32;
    # train2 32-42; push2 42-43
    assert simulate([StepPhases(10, 10, 1)] * 3, 1) == pytest.approx(43)
    assert simulate([StepPhases(10, 10, 1)] * 3, 0) == pytest.approx(63)


def test_pushes_that_wait_behind_later_generations_make_a_deeper_buffer_no_faster():
    # a push queued after the generations of steps t+1 ... t+k waits for all of them, and the learners wait for
    # their push (as the process-group transport's sender does): beyond k = 1 nothing is gained, and the push
    # after step t is delayed by ever more of the future's generations
    phases = [StepPhases(2, 6, 0)] * 3 + [StepPhases(14, 6, 0)] + [StepPhases(2, 6, 0)] * 6
    k0, k1, k2, k4 = (simulate(phases, k) for k in (0, 1, 2, 4))
    assert k0 == pytest.approx(sum(p.rollout + p.learner for p in phases)) == pytest.approx(92)
    assert k1 == pytest.approx(70) and k2 == pytest.approx(70) and k4 == pytest.approx(76)


def test_reads_a_runs_phases_and_prints_the_table(tmp_path, capsys):
    lines = []
    for step in (1, 2, 3):
        for agent, train in (("a", 3.0), ("b", 1.0)):  # the step waits for the slower learner, a
            lines.append({"kind": "train", "step": step, "agent": agent, "time/rollout": 4.0 * step,
                          "time/reward": 1.0, "time/logprob": 1.0, "time/bridge": 0.5, "time/train": train,
                          "time/weight_sync": 0.5})
    lines.append({"kind": "eval", "step": 3, "agent": "a", "eval/accuracy": 0.5})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    assert read_phases(tmp_path, skip_first=1) == [StepPhases(9.0, 4.5, 0.5), StepPhases(13.0, 4.5, 0.5)]
    assert main([str(tmp_path), "--k", "0", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 0 | 16.0 | 1.00 |" in out and "| 1 | 13.8 | 0.86 |" in out  # (14 + 18) / 2; by the model
    assert main([str(tmp_path), "--skip-first", "5"]) == 2
