"""A run survives what clusters do to it, end to end: preemption by SIGTERM, a reward actor that dies,
a damaged checkpoint (user mistakes before the run: tests/test_launch.py)."""
import json
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.test_hacpo_run import comparable, kill_tree, launch, metrics, run, small_config

# under xdist, with test_hacpo_run.py on one worker: both use the session's reference run (tests/e2e/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.xdist_group("reference_run")]
# A resume's last launch with no checkpoint at its end, where no test reads that checkpoint: megatron's first save in a
# process is ~4.5 s (as tests/e2e/test_multi_node.py's resumed run; a checkpoint is saved after the step is logged, so
# the metrics are the same with or without it)
NO_FINAL_CHECKPOINT = ("--set", "checkpoint.save_every=-1")


class Output:
    """A launched run's output, read as it comes: a pipe nobody reads fills at 64 KiB and then holds the run at its
    next write, and a run that ends before the test expects shows why."""

    def __init__(self, proc):
        self.proc, self._lines = proc, []
        self._reader = threading.Thread(target=lambda: self._lines.extend(proc.stdout), daemon=True)
        self._reader.start()

    def text(self) -> str:
        return "".join(self._lines)

    def wait(self, timeout: float) -> str:
        """The whole output, once the run has ended."""
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=30)
        return self.text()


def wait_for(predicate, output: Output, what, timeout=600, poll=0.2):
    deadline = time.time() + timeout
    while not predicate():
        if output.proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {output.proc.returncode}) before {what}:\n"
                                 f"{output.wait(30)[-8000:]}")
        assert time.time() < deadline, f"timed out waiting for {what}:\n{output.text()[-8000:]}"
        time.sleep(poll)


def test_sigterm_then_a_kill_then_resume_give_the_same_metrics(reference_run, tmp_path, cache):
    """One run stopped twice, as a preempted job on a flaky cluster is: SIGTERM during step 2 (the step is
    finished and saved), `--resume`, then every process SIGKILLed after step 3 was logged but before its
    checkpoint (a crash: the log holds a step that no checkpoint has), `--resume` again: the metrics of the
    uninterrupted reference run, every step logged once, and one MLflow run continued by both resumes."""
    out = tmp_path / "run"
    # A checkpoint after every step: the one the signal asks for is not the first, so megatron's checkpoint
    # writer already has its helper process, which the signal reaches too (it used to kill it).
    config = small_config(tmp_path, cache, checkpoint={"save_every": 1}, logging={"trackers": ["mlflow"]})
    latest = out / "checkpoints" / "latest"
    proc = launch(config, out)
    try:
        running = Output(proc)
        wait_for(latest.exists, running, "step 1's checkpoint")
        proc.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to every rank
        output = running.wait(timeout=120)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode != 0, output[-3000:]
    assert "SIGTERM received: finishing the current step" in output
    stopped_after = int(latest.read_text().strip().split("_")[1])
    assert stopped_after == 2 and f"stopped by SIGTERM after step {stopped_after}" in output, output[-3000:]
    assert f"checkpoint {out / 'checkpoints' / 'step_00000002'} is complete" in output

    def step_3_logged():  # read while the run writes: a line may be half-written
        for line in (out / "metrics.jsonl").read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record["kind"] == "train" and record["step"] == 3:
                return True
        return False

    proc = launch(config, out, "--resume")
    try:  # step 3's checkpoint is the resumed process's first save: seconds after its metrics, not 0.05
        wait_for(step_3_logged, Output(proc), "step 3's metrics", poll=0.05)
    finally:
        kill_tree(proc.pid)  # the whole job, Ray included, as a crash would
    assert latest.read_text().strip() == "step_00000002", "killed too late: step 3 was already saved"
    run(config, out, "--resume", *NO_FINAL_CHECKPOINT)
    assert comparable(metrics(out)) == comparable(metrics(reference_run))
    from tests.reporting.test_trackers import expected_metrics, mlflow_client, mlflow_values

    client = mlflow_client(out)
    (tracked,) = client.search_runs([client.get_experiment_by_name("hacpo").experiment_id])
    assert tracked.info.status == "FINISHED"
    expected = expected_metrics(out)  # the redone step 3 was logged twice, with the same numbers
    assert mlflow_values(client, tracked.info.run_id, {key for _, key in expected}) == pytest.approx(expected)


def test_dead_engines_and_a_dead_reward_actor_are_restarted_and_their_work_redone(reference_run, tmp_path, cache):
    """Four faults in one run (tools/faults.py; steps count from 0): agent 0's engine process ends in the middle of
    the first step's weight push (restarted, the weights pushed again), it is killed again before the second
    step's rollout (restarted, given the weights, the rollout redone with the same seed), the reward actor
    dies inside its scoring call in the third (restarted, the same answers scored again), and the engine dies
    while answering the held-out problems after the third (its weights pushed again, the same answers again)."""
    out = tmp_path / "run"
    # no checkpoint (small_config's default): none is read here, and checkpoints are saved after a step is logged
    output = run(small_config(tmp_path, cache), out,
                 faults="kill_engine_in_sync_at_step=0,kill_engine_at_step=1,kill_reward_at_step=2,"
                        "kill_engine_in_eval_at_step=3")
    assert "died during their weight push" in output and "finishing the weight stream without it" in output
    assert "evaluation after step 3: the engines of ['qwen3-tiny'] died while answering" in output
    assert "score on" in output and "waiting for its restart" in output  # the reward actor's failure really happened
    records = metrics(out)
    losses = {(r["step"], r["agent"]): r["weight_sync/engine_losses"] for r in records if r["kind"] == "train"}
    assert losses == {(s, a): float(s == 1 and a == "qwen3-tiny")
                      for s in (1, 2, 3) for a in ("qwen3-tiny", "llama-tiny")}
    # nothing lost, nothing counted twice
    assert without_losses(comparable(records)) == without_losses(comparable(metrics(reference_run)))


def test_rollout_one_step_ahead_through_faults_and_a_sigterm_then_resumed(reference_run, tmp_path, cache):
    """rollout.max_staleness = 1: step t+1's answers are generated while step t trains, from the weights before
    step t's update. Agent 0's engine is killed as step 2 is launched (during step 1): its restarted actor
    answers nothing without weights, so step 2 gives it the current weights and answers again, on-policy; the
    reward actor dies scoring step 2; SIGTERM during step 2 ends the run after it, dropping step 3's answers in
    flight; the resumed run draws their prompts again and answers them from the checkpoint's weights. Every
    step's prompts are the synchronous run's: none trained twice, none skipped."""
    out, saved = tmp_path / "run", tmp_path / "rollouts"
    config = small_config(tmp_path, cache, rollout={"max_staleness": 1}, run={"total_steps": 3},
                          checkpoint={"save_every": 1}, data={"eval_every": 0})  # held-out: not the point here
    latest = out / "checkpoints" / "latest"
    proc = launch(config, out, "--save-rollouts", str(saved), faults="kill_engine_at_step=1,kill_reward_at_step=1")
    try:
        running = Output(proc)
        wait_for(latest.exists, running, "step 1's checkpoint")
        proc.send_signal(signal.SIGTERM)
        output = running.wait(timeout=300)
    finally:
        kill_tree(proc.pid)
    assert "stopped by SIGTERM after step 2" in output, output[-3000:]
    assert "step 2: the engines of ['qwen3-tiny'] died while generating" in output, output[-3000:]
    assert "waiting for its restart" in output  # the reward actor's death really happened
    run(config, out, "--resume", "--save-rollouts", str(saved), *NO_FINAL_CHECKPOINT)

    train = sorted((r for r in metrics(out) if r["kind"] == "train"), key=lambda r: (r["step"], r["agent"]))
    assert [(r["step"], r["agent"]) for r in train] == [(s, a) for s in (1, 2, 3) for a in ("llama-tiny", "qwen3-tiny")]
    # step 1 from the initial weights (launched with them); step 2 launched before step 1's update: one version
    # behind, but for qwen3-tiny's answers, redone after its engine's death from the current weights; step 3
    # launched at the resume, after the checkpoint of step 2: on-policy again
    assert [r["staleness/versions_behind"] for r in train] == [0, 0, 1, 0, 0, 0]
    for step in (1, 2, 3):
        for agent in ("qwen3-tiny", "llama-tiny"):
            ours = json.loads((saved / f"step_{step:08d}" / f"{agent}.json").read_text())["prompt_uids"]
            reference = json.loads((reference_run.parent / "rollouts" / f"step_{step:08d}" / f"{agent}.json")
                                   .read_text())["prompt_uids"]
            assert ours == reference, (step, agent)
    for r in train:  # own rows carry pi_prox / pi_behaviour: ~1 when on-policy, finite and capped when not
        assert 0 < r["staleness/behaviour_weight_mean"] <= 2.0 and r["loss"] == r["loss"]
        if r["staleness/versions_behind"] == 0:
            assert r["staleness/behaviour_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    # the overlap: only llama-tiny's step 2 can have been generated while the learners worked (it follows its
    # step 1 on its engine, possibly while the loop still waits for qwen3-tiny's step 1: then 0); the others
    # while they waited. In the synchronous run never
    for r in train:
        assert r["pipeline/generation_s"] > 0 and 0.0 <= r["pipeline/hidden_frac"] <= 1.0
        assert (r["step"] == 2) == ("pipeline/engine_idle_s" in r)  # an engine's first generation has no wait before it
    assert [r["pipeline/hidden_frac"] for r in train if (r["step"], r["agent"]) != (2, "llama-tiny")] == [0.0] * 5
    synchronous = [r for r in metrics(reference_run) if r["kind"] == "train"]
    assert all(r["pipeline/hidden_frac"] == 0.0 and "staleness/versions_behind" not in r for r in synchronous)
    assert all(r["pipeline/engine_idle_s"] >= r["time/train"] for r in synchronous if r["step"] > 1)
    # step 1 is the synchronous step (its answers redone after the kill, with the same seed), but for the engine's
    # log-probs in place of the trainer's (a ~1e-7 gap)
    first_reference = [r for r in synchronous if r["step"] == 1]
    for ours, ref in zip(train[:2], sorted(first_reference, key=lambda r: r["agent"])):
        assert ours["reward_mean"] == ref["reward_mean"]
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-3, abs=1e-6)


def without_losses(records: list) -> list:
    return [{k: v for k, v in r.items() if k != "weight_sync/engine_losses"} for r in records]


def flip_bytes(path: Path, offset: int, count: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    offset = min(offset, max(len(data) - count, 0))
    for i in range(offset, min(offset + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))

def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    """A finished run's folder to resume in: the reference run's checkpoints (steps 2 and 3, keep_last 2), its
    metrics and run info, as a run that stopped there would leave them."""
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    return out


def test_a_damaged_latest_checkpoint_is_refused_and_the_previous_one_used(reference_run, tmp_path, cache):
    out = copy_of(reference_run, tmp_path)
    config = small_config(tmp_path, cache, checkpoint={"save_every": 1})  # the reference run's config
    shard = sorted((out / "checkpoints" / "step_00000003" / "qwen3-tiny" / "dist_checkpoint").glob("*.distcp"))[0]
    flip_bytes(shard, shard.stat().st_size // 2)  # 4 KiB in the middle, as a failing disk would
    output = run(config, out, "--resume", *NO_FINAL_CHECKPOINT)
    assert f"step_00000003/qwen3-tiny/dist_checkpoint/{shard.name} is damaged" in output
    assert "resuming from step_00000002" in output
    assert comparable(metrics(out)) == comparable(metrics(reference_run))  # step 3 redone from step 2


def test_with_no_intact_checkpoint_resume_stops_with_exit_code_2(reference_run, tmp_path, cache):
    out = copy_of(reference_run, tmp_path)
    config = small_config(tmp_path, cache, checkpoint={"save_every": 1})
    steps = sorted((out / "checkpoints").glob("step_*"))
    assert len(steps) == 2
    for step in steps:
        flip_bytes(step / "trainer_state.pt", 0, 16)
    proc = launch(config, out, "--resume")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "trainer_state.pt is damaged" in output and "no intact checkpoint to resume from" in output
    # said before any work: a rank stopped behind Ray's teardown could be killed by torchrun before saying it
    assert "Started a local Ray instance" not in output
