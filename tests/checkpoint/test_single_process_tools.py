"""The conversion tools as a user runs them: one plain `python` command at any --tp/--pp, no torchrun.

The tools start their TP x PP worker processes themselves (hacpo_megatron/checkpoint/local_world.py). Every
command here runs through `run_tool`, which watches the command's whole process tree while it runs and
fails the test if any process of it outlives the command.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from hacpo_megatron.checkpoint.hf_io import HFWeights
from hacpo_megatron.checkpoint.format import read_checkpoint_metadata
from tests.checkpoint.hf_folders import make_hf_folder
from tests.models.torchrun import REPO

pytestmark = pytest.mark.distributed
ARCH = "qwen3_untied"  # untied output layer; vocabulary 1100 is padded differently at TP=1 and TP=2
LAUNCH_WORKER = Path(__file__).parent / "workers" / "launch_worker.py"


def run_tool(script, *args, timeout: float = 180):
    """`python script args` (no torchrun); (exit code, stdout, stderr, pids of every process it started)."""
    # NO_VCS_VERSION: importing megatron-core otherwise runs `git rev-parse` (package_info.py), a process of
    # the tree that a slow machine catches and that is not one of the workers the tests count.
    env = dict(os.environ, PYTHONWARNINGS="ignore", NO_VCS_VERSION="1")
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, str(script), *map(str, args)]
    descendants, deadline = {}, time.monotonic() + timeout
    # Output into files, not pipes: a process left behind holding a pipe would block the reading here.
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=stdout, stderr=stderr, text=True)
        try:
            while process.poll() is None:  # watch the tree while it runs
                try:
                    descendants.update((p.pid, p) for p in psutil.Process(process.pid).children(recursive=True))
                except psutil.Error:
                    pass
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        stdout.seek(0), stderr.seek(0)
        out, err = stdout.read(), stderr.read()
    # multiprocessing's resource tracker notices the end of its parent a moment after it: a grace period
    psutil.wait_procs(list(descendants.values()), timeout=10)
    leftover = {p.pid: _command_of(p) for p in descendants.values() if _alive(p)}
    for p in descendants.values():  # a failing test must not leave them behind either
        if p.pid in leftover:
            p.kill()
    assert process.returncode != -9, f"{' '.join(command)} still running after {timeout} s:\n{err[-3000:]}"
    assert not leftover, f"{' '.join(command)} left processes behind: {leftover}\n{err[-3000:]}"
    return process.returncode, out, err, sorted(descendants)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _command_of(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())[:200]
    except psutil.Error:
        return "?"


def tool(name: str) -> Path:
    return REPO / "tools" / f"{name}.py"


def single_error_line(stderr: str, tool_name: str) -> str:
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and len(lines) == 1 and lines[0].startswith(f"{tool_name}: error: "), stderr
    return lines[0]


@pytest.fixture(scope="module")
def converted(module_tmp):
    """HF -> Megatron at TP=2 and at PP=2, each from one plain `python` command."""
    root = module_tmp("single_process")
    hf = make_hf_folder(root / "hf", ARCH)
    runs = {}
    for layout, flags in {"tp2": ("--tp", 2), "pp2": ("--pp", 2)}.items():
        start = time.time()
        runs[layout] = run_tool(tool("convert_hf_to_megatron"), "--hf-path", hf, "--save", root / layout, *flags)
        runs[layout] += (time.time() - start,)
    return {"root": root, "hf": hf, "runs": runs}


@pytest.mark.parametrize("layout, tp, pp", [("tp2", 2, 1), ("pp2", 1, 2)])
def test_hf_to_megatron_at_tp_or_pp_2_from_plain_python(converted, layout, tp, pp):
    code, stdout, stderr, pids = converted["runs"][layout][:4]
    assert code == 0, stderr[-5000:]
    folder = converted["root"] / layout
    assert stdout.strip() == f"saved Megatron checkpoint (TP={tp}, PP={pp}) to {folder}"
    metadata = read_checkpoint_metadata(folder)
    assert (metadata.tensor_parallel, metadata.pipeline_parallel) == (tp, pp)
    assert metadata.padded_vocab_size == 128 * tp * -(-1100 // (128 * tp))  # padded for the TP it was written at
    assert len(pids) >= 2  # the workers it started (all gone again: run_tool checks)


def test_compare_from_plain_python_at_pp2(converted):
    code, stdout, stderr, _ = run_tool(tool("compare_hf_megatron"), "--hf-path", converted["hf"],
                                       "--megatron-path", converted["root"] / "tp2", "--pp", "2")
    assert code == 0, stderr[-5000:]
    assert logit_difference(stdout) <= 1e-4 and stdout.strip().endswith("(TP=1, PP=2, float32); tolerance 1.0e-04: OK")


def test_compare_from_plain_python_at_tp2_exits_1_above_the_tolerance(converted):
    code, stdout, stderr, _ = run_tool(tool("compare_hf_megatron"), "--hf-path", converted["hf"], "--megatron-path",
                                       converted["root"] / "pp2", "--tp", "2", "--tolerance", "1e-12")
    assert code == 1, stderr[-5000:]
    assert 0 < logit_difference(stdout) <= 1e-4  # fp32 sums in another order: small, but above 1e-12
    assert stdout.strip().endswith("(TP=2, PP=1, float32); tolerance 1.0e-12: EXCEEDED")


def logit_difference(stdout: str) -> float:
    return float(re.search(r"max \|logit difference\| = (\S+) ", stdout).group(1))


def test_megatron_to_hf_at_tp2_from_plain_python_round_trips_exactly(converted, tmp_path):
    code, stdout, stderr, _ = run_tool(tool("convert_megatron_to_hf"), "--load", converted["root"] / "pp2",
                                       "--save", tmp_path / "hf", "--tp", "2", "--max-shard-size", "300KB")
    assert code == 0, stderr[-5000:]
    assert stdout.strip() == f"exported pp2 to {tmp_path / 'hf'}"
    original, exported = HFWeights(converted["hf"]), HFWeights(tmp_path / "hf")
    assert set(exported) == set(original) and "lm_head.weight" in exported
    for name in original:
        assert exported[name].dtype == original[name].dtype and torch.equal(exported[name], original[name]), name


# ------------------------------------------------------------------------------------------------
# Bad input: one line, before any process starts
# ------------------------------------------------------------------------------------------------
def test_non_empty_target_fails_before_any_process_starts(converted, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    code, stdout, stderr, pids = run_tool(tool("convert_hf_to_megatron"), "--hf-path", converted["hf"],
                                          "--save", tmp_path / "out", "--tp", "2")
    line = single_error_line(stderr, "convert_hf_to_megatron")
    assert code != 0 and f"{tmp_path / 'out'}: target exists and is not an empty folder" in line
    assert pids == [] and os.listdir(tmp_path / "out") == ["keep.txt"]


def test_tp_not_dividing_the_heads_fails_before_any_process_starts(converted):
    code, stdout, stderr, pids = run_tool(tool("compare_hf_megatron"), "--hf-path", converted["hf"],
                                          "--megatron-path", converted["root"] / "tp2", "--tp", "3")
    line = single_error_line(stderr, "compare_hf_megatron")
    assert code != 0 and "TP=3 must divide the attention heads" in line and pids == []


# ------------------------------------------------------------------------------------------------
# The launcher: a rank that fails while the other waits in a collective
# ------------------------------------------------------------------------------------------------
def test_launcher_returns_rank_0_result_with_one_thread_per_worker(tmp_path):
    code, stdout, stderr, pids = run_tool(LAUNCH_WORKER, "ok", tmp_path)
    assert code == 0, stderr[-5000:]
    result = json.loads(stdout)
    assert result["sum"] == 3.0 and result["world_size"] == 2
    assert result["threads"] == 1 and result["omp_num_threads"] == "1"  # as torchrun gives each rank
    assert result["pid"] == int((tmp_path / "rank0.pid").read_text()) != result["parent_pid"]


@pytest.mark.parametrize("mode, message", [
    ("raise", "launch_worker: error: rank 1 found bad input in data.jsonl"),
    ("die", "launch_worker: error: worker rank 1 of 2 was killed by SIGKILL before it finished; "
            "the other workers were stopped"),
    # the peer's connection error reaches the parent first: the death that caused it is still the one named
    ("die_late", "launch_worker: error: worker rank 1 of 2 was killed by SIGKILL before it finished; "
                 "the other workers were stopped"),
])
def test_a_failing_rank_stops_the_others_instead_of_hanging(tmp_path, mode, message):
    start = time.time()
    code, stdout, stderr, pids = run_tool(LAUNCH_WORKER, mode, tmp_path, timeout=60)
    assert code == 2 and stderr.strip().splitlines() == [message], stderr
    assert time.time() - start < 30  # rank 0 waited in a barrier rank 1 never reached: stopped, not timed out
    ranks = {int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)}
    assert ranks <= set(pids)  # ... and, like every process it started, gone (run_tool checks)
    if mode == "raise":  # rank 0's own child process (too short-lived in the tree for run_tool to see it)
        grandchild = int((tmp_path / "grandchild.pid").read_text())
        try:
            assert psutil.Process(grandchild).cmdline() != ["sleep", "600"], "rank 0's child is still running"
        except psutil.NoSuchProcess:  # gone (a pid reused since then belongs to another command)
            pass
