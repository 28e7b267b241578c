"""The loop driven by vLLM engines (vLLM's CPU build), weights sent over a gloo group of their own.

One agent at TP = 2 (tiny Qwen3, chat template) and one at PP = 2 (tiny Gemma 3 with Gemma's tokenizer, asked
in the plain line format: its answers end at a line break), so the trainer gathers shards and stages before sending;
the check mode compares every engine weight with the trainer's after every sync (the run stops if
one differs), and the engine/trainer log-prob gap of every sampled token is logged each step.
"""
import os
import stat
import tempfile

import pytest
import yaml

from tests.e2e.test_hacpo_run import REPO, metrics, run, small_config

# under xdist, with tests/rollout/test_vllm.py and tests/orchestrator/test_shared_memory.py on one worker, one
# after another: the run must leave nothing new in /dev/shm, and vLLM's engines there (and test_shared_memory.py's
# stand-ins) keep files in /dev/shm while they live
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.vllm, pytest.mark.xdist_group("dev_shm")]


def vllm_config(tmp, cache):
    agents = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())["agents"]
    agents[0].update(engine="vllm", parallel={"tensor": 2, "first_rank": 0})  # qwen3-tiny: TP = 2 on ranks 0-1
    # Gemma 3 (sandwich norms, sliding windows, 262k vocabulary) at PP = 2, time-shared, asked as a base model is
    agents[1].update(name="gemma3-tiny", model="tiny-gemma3", tokenizer="gemma3", prompt_format="plain", engine="vllm",
                     parallel={"pipeline": 2, "first_rank": 0})
    # two steps: the second one starts from weights the first update pushed (and is where the engine is killed);
    # no checkpoint (small_config's default): no test here reads one, and megatron's first save is ~4.5 s
    return small_config(tmp, cache, agents=agents, rollout={"weight_transport": "process_group"},
                        run={"total_steps": 2})


@pytest.fixture(scope="module")
def vllm_run(module_tmp, cache):
    """Two steps, every sync checked, and the TP = 2 agent's engine killed before the second step begins, between
    calls, as Ray's memory monitor ends engines (Ray restarts it unseen; the loop must notice it holds no weights)."""
    out = module_tmp("vllm") / "run"
    shared_before, tmp_before = set(os.listdir("/dev/shm")), _vllm_files_in_tmp()
    output = run(vllm_config(out.parent, cache), out, "--check-weights", faults="kill_engine_before_step=1",
                 timeout=900)
    return (out, output, sorted(set(os.listdir("/dev/shm")) - shared_before),
            sorted(_vllm_files_in_tmp() - tmp_before))


def _vllm_files_in_tmp() -> set:
    """What vLLM makes in the temp dir: its ZMQ sockets (named by a UUID) and its `vllm_dist_*` files. Only this
    test group starts vLLM engines, one test at a time, so another worker's tests add none meanwhile."""
    tmp = tempfile.gettempdir()
    found = set()
    for name in os.listdir(tmp):
        try:
            mode = os.lstat(os.path.join(tmp, name)).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISSOCK(mode) or name.startswith("vllm_dist_"):
            found.add(name)
    return found


def test_vllm_engines_serve_exactly_the_trainers_weights_a_restarted_one_too(vllm_run):
    """The check mode compares every engine weight with the trainer's after every sync, the first push into the
    restarted engine (a new vLLM, new group members) included: a mismatch stops the run. The log-prob gap of every
    sampled token then shows the engines sample with those weights, the restarted one in the redone step too.
    (That the redone step gives the uninterrupted run's metrics, engine-agnostic loop logic, is checked with the
    embedded engine in tests/e2e/test_reliability.py.)"""
    out, output, _, _ = vllm_run
    # the kill really happened, and the restarted engine was found without weights before it generated
    assert "the engines of ['qwen3-tiny'] were restarted since their last weight push" in output
    assert output.count("was replaced by") == 1  # the sender saw the new process (said once: only that engine died)
    train = [r for r in metrics(out) if r["kind"] == "train"]
    assert len(train) == 4 and {r["agent"] for r in train} == {"qwen3-tiny", "gemma3-tiny"}
    assert all(r["weight_sync/check_equal"] == 1.0 for r in train)
    # the sampled tokens' log-probs as vLLM reported them vs the trainer's: fp32 on both sides
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in train)
    assert all(0 <= r["rollout/logprob_diff_mean"] <= r["rollout/logprob_diff_max"] for r in train)
    assert all(r["weight_sync/buckets"] >= 1 and r["weight_sync/bytes"] > 0 for r in train)
    evals = [r for r in metrics(out) if r["kind"] == "eval"]
    assert {r["step"] for r in evals} == {0, 2}


def test_no_engine_leaves_files_in_dev_shm_the_killed_one_neither(vllm_run):
    """vLLM's engine core and workers talk through files in /dev/shm (two ring buffers per engine, and semaphores)
    that only a clean exit unlinks. Three engines lived in this run: two the run's end SIGKILLs (it removes what
    they mapped), and one killed before the second step, whose files the actor Ray started in its place removes
    (orchestrator/shared_memory.py). Without the first, six files stayed; without the second, two to four."""
    _, _, left_in_dev_shm, _ = vllm_run
    assert left_in_dev_shm == []


def test_no_engine_leaves_sockets_or_files_in_tmp(vllm_run):
    """Each engine's ZMQ sockets (two for the engine actor, its engine core and its worker each) and its
    `vllm_dist_*` file are made in the actor's temp dir and stay when its process is SIGKILLed: at the run's end, or
    killed before the second step. The run's actors have their TMPDIR in the run's Ray folder, removed at the end
    (orchestrator/ray_runtime.py): nothing of theirs is left in the machine's temp dir."""
    *_, left_in_tmp = vllm_run
    assert left_in_tmp == []
