"""RunReporter: metrics.jsonl, TensorBoard, plots, summary numbers, resume, validation."""
import glob
import json
import math

import pytest

from hacpo_megatron.reporting import (
    REQUIRED_KEYS, TIME_KEYS, HeldOut, MetricsError, RunReporter, load_run, read_metrics, summarize_agent,
)

AGENTS = ["qwen3-tiny", "llama-tiny"]
STEPS = 6
EVAL_STEPS = {0: {"qwen3-tiny": 0.10, "llama-tiny": 0.05}, 4: {"qwen3-tiny": 0.40, "llama-tiny": 0.15}}


def reward(agent, step):
    return (0.1 if agent == "qwen3-tiny" else 0.05) * (step + 1)


def step_time(agent, phase, step):
    """Distinct, known numbers per phase: the mean over steps 0..5 is base + 0.25."""
    base = {key: 0.5 * (i + 1) for i, key in enumerate(TIME_KEYS)}[phase]
    return base + (0.1 * step if agent == "qwen3-tiny" else 0.0)


def make_record(agent, step, **overrides):
    record = {key: 0.5 for key in REQUIRED_KEYS}
    record.update({key: step_time(agent, key, step) for key in TIME_KEYS})
    record.update(step=step, agent=agent, reward_mean=reward(agent, step), capability=reward(agent, step))
    record.update(overrides)
    return record


def write_run(run_dir, *, steps=range(STEPS), start_step=0, agents=AGENTS, evals=EVAL_STEPS, plots=False,
              trackers=(), nan_at=None, reward_offset=0.0, **reporter_options):
    reporter = RunReporter(run_dir, agents, total_steps=STEPS, trackers=trackers, plots=plots, progress_bar=False,
                           start_step=start_step, **reporter_options)
    for step in steps:
        records = [make_record(a, step, reward_mean=reward(a, step) + reward_offset) for a in agents]
        if step == nan_at:
            records[0]["loss"] = float("nan")
            records[0]["grad_norm"] = float("inf")
        reporter.log_step(step, records)
        if step in evals:
            reporter.log_eval(step, {a: evals[step][a] for a in agents})
    summary = reporter.close()
    return summary


def strict_json(line):
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    return json.loads(line, parse_constant=reject)


def test_metrics_jsonl_is_valid_json_lines_with_null_for_nan(tmp_path):
    write_run(tmp_path, nan_at=2)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [strict_json(line) for line in lines]
    assert len(records) == STEPS * len(AGENTS) + len(EVAL_STEPS) * len(AGENTS)
    bad = next(r for r in records if r["step"] == 2 and r["agent"] == "qwen3-tiny" and r["kind"] == "train")
    assert bad["loss"] is None and bad["grad_norm"] is None
    assert bad["time/rollout"] == pytest.approx(step_time("qwen3-tiny", "time/rollout", 2))
    evals = [r for r in records if r["kind"] == "eval"]
    assert {(r["step"], r["agent"]): r["eval/accuracy"] for r in evals} == {
        (s, a): acc for s, by_agent in EVAL_STEPS.items() for a, acc in by_agent.items()}


def test_tensorboard_scalars_are_tagged_agent_slash_metric(tmp_path):
    write_run(tmp_path, trackers=("tensorboard",))
    events = glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    assert {"qwen3-tiny/reward_mean", "llama-tiny/time/rollout", "qwen3-tiny/eval/accuracy"} <= set(tags)
    rewards = [(e.step, e.value) for e in accumulator.Scalars("llama-tiny/reward_mean")]
    assert rewards == [(s, pytest.approx(reward("llama-tiny", s))) for s in range(STEPS)]


def _png_is_drawn(path):
    from matplotlib import image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 20_000
    pixels = image.imread(str(path))
    assert pixels.shape[0] > 300 and pixels.shape[1] > 400
    assert pixels[..., :3].std() > 0.05  # not a blank canvas


def test_plots_and_summary_files(tmp_path):
    summary = write_run(tmp_path, plots=True)
    _png_is_drawn(tmp_path / "curves.png")
    _png_is_drawn(tmp_path / "eval_accuracy.png")
    assert (tmp_path / "summary.md").read_text() == summary
    assert "| qwen3-tiny |" in summary and "| llama-tiny |" in summary
    # a folder outside the working folder (a study cell's, later copied into the repository) is not named
    assert summary.startswith("# Run summary\n") and str(tmp_path) not in summary


def test_the_summary_names_a_run_folder_inside_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    summary = write_run(run, plots=False)
    assert summary.startswith("# Run summary: runs/a\n")


def test_summary_numbers(tmp_path):
    summary = write_run(tmp_path)
    metrics = load_run(tmp_path)
    assert metrics.agent_names == AGENTS
    qwen = summarize_agent(metrics, "qwen3-tiny")
    assert qwen.steps == STEPS
    assert qwen.first_reward == pytest.approx(0.1)
    assert qwen.last_reward == pytest.approx(0.6)
    assert qwen.first_eval == (0, pytest.approx(0.10))
    assert qwen.last_eval == (4, pytest.approx(0.40))
    assert qwen.eval_change == pytest.approx(0.30)
    # qwen's times grow by 0.1 per step: the mean over steps 0..5 is base + 0.25
    for i, key in enumerate(TIME_KEYS):
        assert qwen.mean_time[key] == pytest.approx(0.5 * (i + 1) + 0.25)
    step_base = 0.5 * len(TIME_KEYS)
    assert qwen.total_time_s == pytest.approx(sum(step_base + 0.1 * s for s in range(STEPS)))
    llama = summarize_agent(metrics, "llama-tiny")
    assert llama.eval_change == pytest.approx(0.10)
    assert llama.mean_time["time/train"] == pytest.approx(0.5 * (TIME_KEYS.index("time/train") + 1))
    # the table shows those numbers
    assert "| qwen3-tiny | 6 (0-5) | 0.100 | 0.600 | 0.100 (step 0) | 0.400 (step 4) | +0.300 |" in summary
    assert "| llama-tiny | 6 (0-5) | 0.050 | 0.300 | 0.050 (step 0) | 0.150 (step 4) | +0.100 |" in summary


def test_summary_shows_the_updates_model_flops_and_mfu(tmp_path):
    reporter = RunReporter(tmp_path, AGENTS, total_steps=2, trackers=(), plots=False, progress_bar=False)
    for step, (flops, mfu) in enumerate([(2e9, 0.2), (4e9, 0.4)]):
        reporter.log_step(step, [make_record("qwen3-tiny", step, **{"perf/model_flops_per_s": flops, "perf/mfu": mfu}),
                                 make_record("llama-tiny", step)])  # a run without the figures: n/a
    summary = reporter.close()
    qwen = summarize_agent(load_run(tmp_path), "qwen3-tiny")
    assert qwen.mean_train_flops_per_s == pytest.approx(3e9) and qwen.mean_mfu == pytest.approx(0.3)
    assert "train GFLOP/s (MFU)" in summary
    rows = {line.split(" | ")[0]: line for line in summary.splitlines() if "wall time" not in line}
    assert rows["| qwen3-tiny"].endswith("| 3.0 (30%) |") and rows["| llama-tiny"].endswith("| n/a |")


def test_summary_shows_how_far_rollout_ran_ahead_only_for_runs_that_did(tmp_path):
    reporter = RunReporter(tmp_path / "k1", AGENTS, total_steps=2, trackers=(), plots=False, progress_bar=False)
    for step, behind in enumerate([0.0, 1.0]):
        pipeline = {"staleness/versions_behind": behind, "pipeline/generation_s": 2.0 + step,
                    "pipeline/hidden_frac": 0.5 * step, "staleness/behaviour_weight_mean": 1.0}
        if step:
            pipeline["pipeline/engine_idle_s"] = 0.25
        reporter.log_step(step, [make_record(a, step, **pipeline) for a in AGENTS])
    summary = reporter.close()
    assert "Rollout ahead of training" in summary
    # staleness mean 0.5, max 1; waited = mean time/rollout; generation 2.5 s, hidden 0.25, idle from step 1 only
    waited = (step_time("qwen3-tiny", "time/rollout", 0) + step_time("qwen3-tiny", "time/rollout", 1)) / 2
    assert f"| qwen3-tiny | 0.50 | 1.00 | {waited:.2f} | 2.50 | 0.25 | 0.25 | 1.00 |" in summary
    assert "Rollout ahead of training" not in write_run(tmp_path / "k0")  # synchronous: no staleness, no table


def test_resume_truncates_steps_from_start_step(tmp_path):
    write_run(tmp_path)  # steps 0..5, evals at 0 and 4
    write_run(tmp_path, steps=range(4, STEPS), start_step=4, evals={}, reward_offset=1.0)
    records = read_metrics(tmp_path / "metrics.jsonl")
    keys = [(r["kind"], r["step"], r["agent"]) for r in records]
    assert len(keys) == len(set(keys))  # nothing twice
    train = {(r["step"], r["agent"]): r["reward_mean"] for r in records if r["kind"] == "train"}
    assert sorted(train) == sorted((s, a) for s in range(STEPS) for a in AGENTS)
    assert train[(3, "qwen3-tiny")] == pytest.approx(reward("qwen3-tiny", 3))  # kept
    assert train[(5, "qwen3-tiny")] == pytest.approx(reward("qwen3-tiny", 5) + 1.0)  # the redone step
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 0]  # the eval of step 4 was dropped
    assert summarize_agent(load_run(tmp_path), "qwen3-tiny").last_eval == (0, pytest.approx(0.10))


def test_held_out_answers_per_problem_and_their_means_and_a_resume_drops_the_redone_ones(tmp_path):
    def held_out(scores, truncated=None, tokens=None):
        return HeldOut(scores, truncated or [0.0] * len(scores), tokens or [10.0] * len(scores))

    def run(start_step, evals):
        reporter = RunReporter(tmp_path, AGENTS, total_steps=STEPS, trackers=(), plots=False, progress_bar=False,
                               start_step=start_step)
        for step, answers in evals.items():
            reporter.log_held_out(step, answers)
        reporter.close()

    run(0, {0: {"qwen3-tiny": held_out([0.0, 0.25, 1.0, 0.75], [1.0, 0.5, 0.0, 0.0], [96.0, 60.0, 20.0, 24.0]),
                "llama-tiny": held_out([0.5, 0.0, 0.0, 0.0])},
            4: {"qwen3-tiny": held_out([1.0, 1.0, 1.0, 1.0]), "llama-tiny": held_out([0.0, 0.0, 0.0, 0.0])}})
    run(4, {5: {"qwen3-tiny": held_out([0.5] * 4), "llama-tiny": held_out([1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0])}})
    evals = {(r["step"], r["agent"]): r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "eval"}
    assert {key: r["eval/accuracy"] for key, r in evals.items()} == {
        (0, "qwen3-tiny"): 0.5, (0, "llama-tiny"): 0.125, (5, "qwen3-tiny"): 0.5, (5, "llama-tiny"): 0.5}
    assert evals[(0, "qwen3-tiny")]["eval/truncated_frac"] == pytest.approx(0.375)
    assert evals[(0, "qwen3-tiny")]["eval/response_length_mean"] == pytest.approx(50.0)
    assert evals[(5, "llama-tiny")]["eval/truncated_frac"] == pytest.approx(0.25)  # each agent its own
    assert evals[(5, "qwen3-tiny")]["eval/truncated_frac"] == 0.0
    kept = [json.loads(line) for line in (tmp_path / "eval_scores.jsonl").read_text().splitlines()]
    assert [(r["step"], r["agent"], r["scores"]) for r in kept] == [
        (0, "qwen3-tiny", [0.0, 0.25, 1.0, 0.75]), (0, "llama-tiny", [0.5, 0.0, 0.0, 0.0]),
        (5, "qwen3-tiny", [0.5] * 4), (5, "llama-tiny", [1.0, 0.0, 1.0, 0.0])]
    assert (kept[0]["truncated"], kept[0]["tokens"]) == ([1.0, 0.5, 0.0, 0.0], [96.0, 60.0, 20.0, 24.0])
    with pytest.raises(MetricsError, match="unknown agent"):
        RunReporter(tmp_path / "other", AGENTS, total_steps=1, trackers=(), plots=False,
                    progress_bar=False).log_held_out(0, {"gemma": held_out([1.0])})
    assert not (tmp_path / "other" / "eval_scores.jsonl").read_text()  # nothing written for a wrong name


def test_missing_key_names_the_key_and_agent(tmp_path):
    reporter = RunReporter(tmp_path, AGENTS, total_steps=1, trackers=(), plots=False, progress_bar=False)
    broken = make_record("llama-tiny", 0)
    del broken["time/bridge"]
    with pytest.raises(MetricsError, match=r"'llama-tiny'.*'time/bridge'"):
        reporter.log_step(0, [make_record("qwen3-tiny", 0), broken])
    with pytest.raises(MetricsError, match="no record for agent"):
        reporter.log_step(0, [make_record("qwen3-tiny", 0)])
    with pytest.raises(MetricsError, match="unknown agent"):
        reporter.log_step(0, [make_record("qwen3-tiny", 0), make_record("gpt-tiny", 0)])
    reporter.close()


def test_single_agent_without_evaluation(tmp_path):
    summary = write_run(tmp_path, agents=["solo"], evals={}, plots=True)
    assert "No held-out evaluation" in summary
    assert "| solo | 6 (0-5) |" in summary
    _png_is_drawn(tmp_path / "curves.png")
    assert (tmp_path / "eval_accuracy.png").stat().st_size > 5_000


def test_plot_metrics_tool_redraws_from_jsonl(tmp_path):
    import importlib.util
    from pathlib import Path

    write_run(tmp_path, nan_at=1)
    spec = importlib.util.spec_from_file_location(
        "plot_metrics", Path(__file__).resolve().parents[2] / "tools" / "plot_metrics.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([str(tmp_path)]) == 0
    _png_is_drawn(tmp_path / "curves.png")
    assert "+0.300" in (tmp_path / "summary.md").read_text()
    assert tool.main([str(tmp_path / "missing")]) == 2


def test_eval_accuracy_in_step_records_and_numpy_values(tmp_path):
    import numpy as np

    reporter = RunReporter(tmp_path, ["a"], total_steps=2, trackers=(), plots=False, progress_bar=False)
    reporter.log_step(0, [make_record("a", 0, **{"eval/accuracy": np.float32(0.25), "weight_sync/bytes": np.int64(7)})])
    reporter.log_step(1, [make_record("a", 1, **{"reward": {"timeout": 2}})])
    reporter.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[0]["weight_sync/bytes"] == 7 and records[1]["reward/timeout"] == 2
    assert summarize_agent(load_run(tmp_path), "a").first_eval == (0, pytest.approx(0.25))
    assert not math.isnan(records[0]["eval/accuracy"])


def test_a_resumed_runs_progress_bar_counts_the_steps_done_and_ends_at_the_total(tmp_path):
    # A run resumed from step 3's checkpoint logs steps 4-5 of 5: its bar starts at 3 and ends at 5, not one past.
    reporter = RunReporter(tmp_path, AGENTS, total_steps=5, trackers=(), plots=False, progress_bar=True, start_step=4)
    assert reporter._bar.n == 3
    for step in (4, 5):
        reporter.log_step(step, [make_record(agent, step) for agent in AGENTS])
    assert reporter._bar.n == reporter._bar.total == 5
    reporter.close()
