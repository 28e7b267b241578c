"""Two hosts on one machine (tools/local_cluster.py: network and PID namespaces joined by a veth pair,
a Ray cluster across them), and the four-agent example run across them as on a cluster: torchrun
with a static rendezvous on each host, `--ray-address` of the head.

One module fixture makes every run once (2 steps):
  two_hosts    on both hosts, a checkpoint after step 1; every process of host 1 SIGKILLed during step 2 (a host
               that dies), then `--resume` on both hosts, host 1 booted again: one run folder with both steps
  one_host     the same config, uninterrupted, through `python -m hacpo_megatron.launch` on this machine
and the tests read what they left. The resumed two-host run must give the one-host run's metrics: one
comparison that a wrong placement, a wrong cross-host transport and a wrong resume each break (an
uninterrupted two-host run as a third reference cost ~90 s of CI and checked nothing this does not).
Needs root (namespaces); without it every test here skips, saying so (tests/conftest.py: require_root).
"""
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from tests.conftest import require_root
from tests.e2e.test_hacpo_run import ENTRY, REPO, TORCHRUN, comparable, metrics

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CONFIG = REPO / "configs" / "examples" / "four_agents_two_hosts_cpu.yaml"
STEPS = 2
MASTER_PORT = 29500  # inside the hosts' own namespaces: no other job can hold it
NODE_LOSS_DEADLINE_S = 120  # host 0's job must end this soon after host 1 died
# Where each agent's engine rank lives in the config (TP 0, DP 0, last pipeline stage)
ENGINE_HOSTS = {"llama-tiny": 0, "smol-llama": 0, "qwen3-tiny": 1, "qwen3-gpt2": 1}


def load_harness():
    spec = importlib.util.spec_from_file_location("local_cluster", REPO / "tools" / "local_cluster.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def job_args(out: Path, cache: Path, *extra: str) -> list:
    return [*ENTRY, "--config", str(CONFIG), "--output-dir", str(out), "--set", f"run.total_steps={STEPS}",
            "--set", f"train.sft_warmup_cache={cache}", "--set", "logging.plots=false", *extra]


def start_on_hosts(cluster, out: Path, cache: Path, *extra: str, label: str = "") -> list:
    """torchrun on each host (2 ranks each), as a user on a two-node cluster would start it; the output
    of host I goes to OUT<label>.hostI.log."""
    procs = []
    for host in cluster.hosts:
        command = [str(TORCHRUN), "--nnodes=2", f"--node_rank={host.index}", "--nproc_per_node=2",
                   f"--master_addr={cluster.hosts[0].address}", f"--master_port={MASTER_PORT}",
                   *job_args(out, cache, "--ray-address", cluster.head_address, *extra)]
        log = open(f"{out}{label}.host{host.index}.log", "w")
        env = dict(cluster.env(host.index), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        procs.append(subprocess.Popen(cluster.command(host.index, command), env=env, cwd=REPO, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
    return procs


def log_of(out: Path, host: int, label: str = "") -> str:
    return Path(f"{out}{label}.host{host}.log").read_text(errors="replace")


def finish(procs: list, out: Path, label: str = "", timeout: float = 900) -> None:
    for host, proc in enumerate(procs):
        proc.wait(timeout=timeout)
        assert proc.returncode == 0, f"host {host}:\n{log_of(out, host, label)[-6000:]}"


def latest_checkpoint(out: Path) -> str:
    latest = out / "checkpoints" / "latest"
    return latest.read_text().strip() if latest.exists() else ""


def run_interrupted(cluster, out: Path, cache: Path) -> SimpleNamespace:
    """Start on both hosts; once step 1's checkpoint is complete, kill every process of host 1."""
    procs = start_on_hosts(cluster, out, cache)
    deadline = time.monotonic() + 900
    while latest_checkpoint(out) != "step_00000001":
        assert all(p.poll() is None for p in procs), "the run ended before host 1 could be killed"
        assert time.monotonic() < deadline, "no checkpoint of step 1 in time"
        time.sleep(0.2)
    killed_at = time.monotonic()
    cluster.kill(1)
    procs[1].wait(timeout=30)  # nsenter, killed with the host
    try:
        procs[0].wait(timeout=NODE_LOSS_DEADLINE_S)
    except subprocess.TimeoutExpired:
        pass  # reported by the test; `down` stops it
    return SimpleNamespace(returncode=procs[0].poll(), seconds=time.monotonic() - killed_at, log=log_of(out, 0),
                           checkpoint=latest_checkpoint(out))


@pytest.fixture(scope="module")
def runs(module_tmp, cache):
    require_root("makes two hosts of this machine with network and PID namespaces: tools/local_cluster.py")
    harness = load_harness()
    harness.clean_stale()  # clusters of test processes that died before their teardown
    tmp = module_tmp("multi_node")
    r = SimpleNamespace(two_hosts=tmp / "two_hosts", one_host=tmp / "one_host")
    cluster = harness.LocalCluster.up(f"t{os.getpid()}")
    seen_pids = set()
    t0 = time.monotonic()
    try:
        crossed = cluster.link_bytes(0)
        r.node_loss = run_interrupted(cluster, r.two_hosts, cache)
        r.info_before_loss = json.loads((r.two_hosts / "run_info.json").read_text())
        cluster.boot(1)  # the host is back (new processes, a new Ray node)
        # the same command with --resume, less the checkpoint after step 2 (no test reads it; the first save of
        # every rank's 4 agents takes seconds on 2 cores)
        procs = start_on_hosts(cluster, r.two_hosts, cache, "--resume", "--set", "checkpoint.save_every=-1",
                               label=".resumed")
        finish(procs, r.two_hosts, label=".resumed")
        r.two_hosts_bytes = cluster.link_bytes(0) - crossed
        seen_pids = {pid for host in cluster.hosts for pid in cluster.pids(host.index)}
    finally:
        cluster.down()
    r.leftovers = cluster.leftovers() + [f"process {pid}" for pid in seen_pids if psutil.pid_exists(pid)]
    r.seen_pids = seen_pids
    r.cluster_seconds = time.monotonic() - t0
    one_host = [sys.executable, "-m", "hacpo_megatron.launch",  # the reference: no checkpoint needed
                *job_args(r.one_host, cache, "--set", "checkpoint.save_every=-1")[len(ENTRY):]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run(one_host, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    print(f"\ntwo hosts, killed and resumed: {r.cluster_seconds:.0f} s, {r.two_hosts_bytes / 1e6:.1f} MB between "
          f"the hosts; node loss noticed in {r.node_loss.seconds:.1f} s")
    return r


def test_both_hosts_train_every_agent_and_engines_run_on_their_engine_ranks_nodes(runs):
    train = [r for r in metrics(runs.two_hosts) if r["kind"] == "train"]
    assert sorted((r["step"], r["agent"]) for r in train) == sorted(
        (step, agent) for step in range(1, STEPS + 1) for agent in ENGINE_HOSTS)
    # qwen3-gpt2 lives on host 1 only, llama-tiny on host 0 only, qwen3-tiny on both: all trained. At step 1
    # every answer earned 0 (no advantage, no gradient); at step 2 some earned 1, and every learner trains on them.
    assert all(r["num_updates"] == 4 and r["loss"] == r["loss"] for r in train)
    assert all(r["grad_norm"] > 0 for r in train if r["step"] == 2)
    # qwen3-tiny's stage 0 sends its weights (~39 MB with the embedding) to the engine rank on host 1 at each
    # sync: at least once per step over the two attempts
    assert runs.two_hosts_bytes > STEPS * 30e6
    for info in (runs.info_before_loss, json.loads((runs.two_hosts / "run_info.json").read_text())):
        ranks = info["ranks"]
        assert [node["node_ip"] for node in ranks] == ["10.77.0.1", "10.77.0.1", "10.77.0.2", "10.77.0.2"]
        assert ranks[0]["node_id"] != ranks[2]["node_id"]
        for agent, host in ENGINE_HOSTS.items():  # asked inside each engine actor: where it really runs
            assert info["engines"][agent] == ranks[2 * host], agent


def test_losing_the_second_host_ends_the_job_on_the_first_naming_the_node_and_its_ranks(runs):
    loss = runs.node_loss
    assert loss.returncode is not None, f"host 0 still ran {NODE_LOSS_DEADLINE_S} s after host 1 died"
    assert loss.returncode != 0
    assert "node 10.77.0.2" in loss.log and "ranks 2, 3" in loss.log, loss.log[-4000:]
    assert "rollout engines of qwen3-tiny, qwen3-gpt2" in loss.log and "--resume" in loss.log
    assert loss.checkpoint == "step_00000001"  # nothing half-written became `latest`


def test_resumed_on_the_restored_hosts_the_run_gives_the_metrics_of_the_same_config_on_one_host(runs):
    assert comparable(metrics(runs.two_hosts)) == comparable(metrics(runs.one_host))
    info = json.loads((runs.two_hosts / "run_info.json").read_text())
    # the restored host: a new Ray node
    assert info["ranks"][2]["node_id"] != runs.info_before_loss["ranks"][2]["node_id"]
    one_host = json.loads((runs.one_host / "run_info.json").read_text())
    assert len({node["node_id"] for node in one_host["ranks"]}) == 1


def test_nothing_is_left_behind(runs):
    assert runs.seen_pids  # the hosts did run processes (Ray, torchrun, ranks)
    assert runs.leftovers == []
