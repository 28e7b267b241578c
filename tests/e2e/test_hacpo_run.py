"""The whole program, end to end on CPU: `torchrun -m hacpo_megatron.entry` with Ray actors.

Small versions of the default run (few steps, small batches) so the suite stays in minutes; the
full default run is `make run` (figures in docs/). Every run here is a real run: torchrun world,
Megatron agents, Ray engine and reward actors, bridge, checkpoints.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
ENTRY = ["-m", "hacpo_megatron.entry"]  # the package's own program, as `python -m hacpo_megatron.launch` runs it
FAULTS_ENTRY = REPO / "tools" / "faults.py"  # the same with faults planted (HACPO_FAULTS)
IGNORED = ("time/", "perf/", "pipeline/", "timestamp", "weight_sync/seconds", "weight_sync/engine_seconds",
           "weight_sync/check_seconds", "weight_sync/bytes_per_second", "reward/seconds", "reward/answers_per_s",
           "ray/")

# under xdist, with test_reliability.py on one worker: both use the session's reference run (tests/e2e/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.xdist_group("reference_run")]


def small_config(tmp: Path, cache: Path, **changes) -> dict:
    config = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    config["run"].update(total_steps=3, name="e2e")
    config["rollout"].update(samples_per_prompt=2)
    config["data"].update(prompt_batch_size=4, eval_every=3, eval_max_prompts=8)
    config["train"].update(mini_batch_size=2, micro_batch_size=8, sft_warmup_steps=20,
                           sft_warmup_cache=str(cache))
    # no plots and no checkpoint unless a test reads them: 1.4 s and ~4.5 s (megatron's first save) a run
    config["logging"] = {"progress_bar": False, "trackers": ["tensorboard"], "plots": False}
    config["checkpoint"] = {"save_every": -1, "keep_last": 2}
    for section, values in changes.items():
        if section == "agents":
            config["agents"] = values
        else:
            config.setdefault(section, {}).update(values)
    return config


def launch(config: dict, out: Path, *extra: str, nproc: int = 2, faults: str = "") -> subprocess.Popen:
    """torchrun on the main job; `faults` (tools/faults.py's names, e.g. "kill_engine_at_step=1") runs it with
    those faults planted."""
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HACPO_FAULTS=faults)
    program = [str(FAULTS_ENTRY)] if faults else ENTRY
    command = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc), *program, "--config", str(path),
               "--output-dir", str(out), *extra]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant, by id: torchrun's workers (own process groups) and
    the local Ray its rank 0 started, as a crash of the whole job would."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    family = [root] + root.children(recursive=True)
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=30)


def run(config: dict, out: Path, *extra: str, nproc: int = 2, timeout: float = 600, faults: str = "") -> str:
    proc = launch(config, out, *extra, nproc=nproc, faults=faults)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        raise
    assert proc.returncode == 0, output[-8000:]
    return output


def metrics(out: Path) -> list:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def comparable(records: list) -> list:
    return [{k: v for k, v in r.items() if not k.startswith(IGNORED)} for r in records]


def test_a_run_writes_everything_a_user_reads(reference_run):
    out = reference_run
    records = metrics(out)
    train = [r for r in records if r["kind"] == "train"]
    assert sorted({(r["step"], r["agent"]) for r in train}) == [
        (s, a) for s in (1, 2, 3) for a in sorted(["llama-tiny", "qwen3-tiny"])]
    for r in train:
        for key in ("reward_mean", "capability", "own_ratio_mean", "cross_ratio_mean", "loss", "grad_norm",
                    "time/rollout", "time/reward", "time/bridge", "time/logprob", "time/train", "time/weight_sync"):
            assert key in r, key
        # mini-batch 2 prompts x G = 2 = 4 responses per update: one prompt's own and other answers, M = 4
        assert r["num_updates"] == 4 and r["num_own"] == 2 and r["num_cross"] == 2
        assert r["cross_clip_lower_bound"] == pytest.approx(1 - 0.2 + 3 * 0.025)  # m = 3 in the last update
    evals = [r for r in records if r["kind"] == "eval"]
    assert {r["step"] for r in evals} == {0, 3}
    info = json.loads((out / "run_info.json").read_text())
    assert info["prompts"]["train"] == {"used": 784, "skipped_overlong": 0}
    assert "train 784 used, 0 skipped" in (out / "summary.md").read_text()
    for name in ("config.yaml", "curves.png", "eval_accuracy.png", "summary.md"):
        assert (out / name).stat().st_size > 0, name
    assert any((out / "tensorboard").rglob("events.out.tfevents*"))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    # the trackers the reference run lists (conftest.py) hold every number of metrics.jsonl, read back by their readers
    from tests.reporting.test_trackers import (
        expected_metrics, mlflow_client, mlflow_values, wandb_history, wandb_records,
    )
    expected = expected_metrics(out)
    client = mlflow_client(out)
    (tracked,) = client.search_runs([client.get_experiment_by_name("hacpo").experiment_id])
    assert tracked.info.status == "FINISHED" and tracked.data.params["algorithm.name"] == "hacpo"
    assert mlflow_values(client, tracked.info.run_id, {key for _, key in expected}) == pytest.approx(expected)
    (wandb_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    assert wandb_history(wandb_records(wandb_file)) == pytest.approx(expected)


def test_train_only_replays_the_saved_steps_to_the_same_training_metrics(reference_run, tmp_path, cache):
    """run.mode train_only on the answers and rewards the reference run saved: no engine, no Ray, no held-out
    evaluation, and every training figure of the uninterrupted run."""
    out = tmp_path / "run"
    output = run(small_config(tmp_path, cache, run={"mode": "train_only"}), out,
                 "--load-rollouts", str(reference_run.parent / "rollouts"))
    assert "Started a local Ray instance" not in output and "no held-out evaluation" in output

    def trained(records):
        return [{k: v for k, v in r.items() if not k.startswith("weight_sync/")}
                for r in comparable(records) if r["kind"] == "train"]

    ours = metrics(out)
    assert not [r for r in ours if r["kind"] == "eval"]
    assert trained(ours) == trained(metrics(reference_run)) and len(trained(ours)) == 6


def test_rollout_only_generates_and_scores_with_no_update(reference_run, tmp_path, cache):
    """run.mode rollout_only: engines and rewards, no learner and no checkpoint. Its first step's saved answers are the
    reference run's (the same weights and sampling seed); the weights never change, so held-out accuracy at the end
    (sampled with the same seed at every evaluation) equals that at step 0."""
    out, saved = tmp_path / "run", tmp_path / "rollouts"
    output = run(small_config(tmp_path, cache, run={"mode": "rollout_only", "total_steps": 2}, data={"eval_every": 2}),
                 out, "--save-rollouts", str(saved))
    assert "run.mode rollout_only: no learner" in output and not (out / "checkpoints").exists()
    records = metrics(out)
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 4 and all(r["loss"] is None and r["grad_norm"] is None for r in train)
    assert all(0 <= r["reward_mean"] <= 1 and r["response_length_mean"] > 0 for r in train)
    evals = {(r["step"], r["agent"]): r["eval/accuracy"] for r in records if r["kind"] == "eval"}
    assert {step for step, _ in evals} == {0, 2}
    assert all(evals[(2, agent)] == evals[(0, agent)] for _, agent in evals)
    problems = json.loads((out / "run_info.json").read_text())["prompts"]["eval"]["used"]
    lines = {(r["step"], r["agent"]): r for r in map(json.loads, (out / "eval_scores.jsonl").read_text().splitlines())}
    scores = {key: line["scores"] for key, line in lines.items()}
    # each problem's score, whose mean is the accuracy, the same problem by problem
    assert scores.keys() == evals.keys()
    assert all(len(s) == problems and sum(s) / problems == pytest.approx(evals[key]) for key, s in scores.items())
    assert all(scores[(2, agent)] == scores[(0, agent)] for _, agent in scores)
    # and each problem's answers cut at the length limit and their tokens, whose means the eval records carry
    eval_records = {(r["step"], r["agent"]): r for r in records if r["kind"] == "eval"}
    for key, line in lines.items():
        assert len(line["truncated"]) == len(line["tokens"]) == problems
        assert all(0 <= t <= 1 for t in line["truncated"]) and all(n > 0 for n in line["tokens"])
        assert eval_records[key]["eval/truncated_frac"] == pytest.approx(sum(line["truncated"]) / problems)
        assert eval_records[key]["eval/response_length_mean"] == pytest.approx(sum(line["tokens"]) / problems)
    for name in ("qwen3-tiny.json", "llama-tiny.json", "step.json"):
        ours = json.loads((saved / "step_00000001" / name).read_text())
        reference = json.loads((reference_run.parent / "rollouts" / "step_00000001" / name).read_text())
        if name == "step.json":
            ours, reference = ours["agents"], reference["agents"]  # reward_stats hold the scoring's timings
        assert ours == reference, name
    assert sorted(p.name for p in saved.iterdir()) == ["step_00000001", "step_00000002"]


def test_engine_log_probs_replace_the_old_log_prob_pass_after_the_first_step(reference_run, tmp_path, cache):
    out = tmp_path / "run"
    # two steps, no held-out evaluation: step 2 is the first without the trainer's pass; the evaluation draws no
    # training sample (the k = 1 run in test_reliability.py, with none, gets the reference's step 1 rewards and prompts)
    run(small_config(tmp_path, cache, rollout={"old_logprobs": "engine"}, run={"total_steps": 2},
                     data={"eval_every": 0}), out)

    def train(records):
        return sorted((r for r in records if r["kind"] == "train"), key=lambda r: (r["step"], r["agent"]))

    ours, reference = train(metrics(out)), train(metrics(reference_run))
    first = [r for r in ours if r["step"] == 1]
    # step 1: the trainer's pass ran and vouched for the engine's log-probs: the same step as the reference
    assert comparable(first) == comparable([r for r in reference if r["step"] == 1])
    assert all(r["rollout/logprob_diff_mean"] < 3e-5 for r in first)
    later = [(r, ref) for r, ref in zip(ours, reference) if r["step"] > 1]
    assert [r["step"] for r, _ in later] == [2, 2] and all(ref["step"] == 2 for _, ref in later)
    assert all("rollout/logprob_diff_max" not in r for r, _ in later)  # no trainer pass, no gap
    for r, ref in later:  # the engine's log-probs differ from the trainer's by ~1e-7: the same learning
        assert r["reward_mean"] == ref["reward_mean"]  # sampled from the same weights (step 1's update: the same)
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-3, abs=1e-6)


# GSPO alone is not run: gspo_x2 is GSPO's single-agent path with 2G answers, grpo the same path with 2 updates
@pytest.mark.parametrize("algorithm,updates", [("gspo_x2", 4), ("naive", 4), ("grpo", 2)])
def test_baselines_run_to_completion(reference_run, tmp_path, cache, algorithm, updates):
    out = tmp_path / "run"
    # one step, no evaluation: what differs between the algorithms is all in a step
    config = small_config(tmp_path, cache, algorithm={"name": algorithm}, run={"total_steps": 1},
                          data={"eval_every": 0})
    if algorithm == "gspo_x2":  # 2G answers a prompt: its own engines generate them
        run(config, out)
    else:
        # G answers a prompt, from the initial weights: the answers and rewards of the reference run's first step are
        # what this algorithm's own first step would generate (the same weights, prompts and sampling seed), so it
        # trains on those (run.mode train_only): its whole step, with no Ray or engine to start (~10 s a run). The
        # engine side does not depend on the algorithm but for G' (gspo_x2 above, the reference run)
        config["run"]["mode"] = "train_only"
        run(config, out, "--load-rollouts", str(reference_run.parent / "rollouts"))
    train = [r for r in metrics(out) if r["kind"] == "train"]
    assert len(train) == 2
    # B = 4, mini-batch 2 prompts x G = 2: M = n*B/2 = 4 with shared rollouts, B/2 = 2 alone, 2B/2 with 2G
    assert all(r["num_updates"] == updates for r in train)
    if algorithm in ("gspo", "gspo_x2", "grpo"):
        assert all(r["num_cross"] == 0 for r in train)  # single-agent baselines train on their own answers
    if algorithm == "naive":  # shares rollouts, and treats the other agent's like its own (one GSPO loss)
        assert all(r["num_own"] == 4 and r["num_cross"] == 0 for r in train)


def test_a_third_agent_is_a_config_change_with_kl_data_parallel_and_mixed_micro_batches(tmp_path, cache):
    """Two checks in one run (each run costs ~30 s of start-up): a third agent needs nothing but its lines in the
    config; and the KL term under data parallelism, in micro-batches that mix own and other agents' rows."""
    agents = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())["agents"]
    agents[0]["parallel"] = {"data": 2, "first_rank": 0}  # qwen3-tiny on ranks 0-1, llama-tiny time-shares rank 1
    agents[1]["parallel"] = {"first_rank": 1}
    third = {"name": "qwen2-tiny", "model": "tiny-qwen2", "tokenizer": "qwen3",
             "parallel": {"tensor": 1, "pipeline": 1, "data": 1, "first_rank": 0}}
    out = tmp_path / "run"
    # 4 rows per update in grid order (own, other, other, own, ...): each of qwen3-tiny's replicas takes 2 rows,
    # one micro-batch that mixes its own answers and another agent's
    config = small_config(tmp_path, cache, agents=agents + [third], algorithm={"kl_coef": 0.001},
                          run={"total_steps": 2}, data={"eval_every": 0})
    run(config, out)
    train = [r for r in metrics(out) if r["kind"] == "train"]
    assert len(train) == 6 and {r["agent"] for r in train} == {"qwen3-tiny", "llama-tiny", "qwen2-tiny"}
    assert all(r["num_cross"] == pytest.approx(2 * r["num_own"]) for r in train)  # two other agents
    assert all(r["num_updates"] == 6 for r in train)  # 3 agents x B = 4 / mini-batch 2
    assert all(r["kl"] >= 0 and r["kl"] == r["kl"] for r in train)  # a number (not NaN) on every step
    assert any(r["kl"] > 0 for r in train if r["step"] == 2)  # the policies left their references after step 1
