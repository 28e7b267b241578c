"""`python -m hacpo_megatron.launch` (what `make run` runs): a user's mistake is one line, exit code 2,
before torchrun, process groups, models or Ray exist."""
import faulthandler
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_in_process(monkeypatch, capsys, *argv):
    """`python -m hacpo_megatron.launch ARGV` as this process runs it (`sys.exit(main())`), with no imports to pay
    again (each such process costs seconds of them): (exit code, stdout, stderr). torchrun never starts: the exec
    that would replace this process with it fails the test instead."""
    from hacpo_megatron import launch

    def execv(path, command):
        raise AssertionError(f"the launcher went on to start torchrun: {command}")

    monkeypatch.setattr(launch.os, "execv", execv)
    for variable in ("CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME"):  # what it sets before the exec: restored after
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.chdir(REPO)  # as the command runs: from the repository
    capsys.readouterr()
    code = launch.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# The first three stop at the file checks, before the launcher loads any tokenizer: called in this process. The
# unknown tokenizer is found after the file checks pass and the tokenizers load: a real `python -m` process, which
# also shows that nothing the launcher imports or loads on its way prints more than the one line.
@pytest.mark.parametrize("override,message,process", [
    ("data.train=/no/such.jsonl", "data.train: /no/such.jsonl: no such file", False),
    ("data.train={bad}", "data.train: {bad}:line 2: invalid JSON", False),
    ("agents.0.init_from=/no/model", "agents.0 (qwen3-tiny).init_from: /no/model: no such folder", False),
    ("agents.1.tokenizer=/no/tokenizer", "agents.1 (llama-tiny).tokenizer: unknown tokenizer '/no/tokenizer'", True),
])
def test_a_user_mistake_is_one_line_and_exit_code_2_before_any_work(tmp_path, monkeypatch, capsys, override, message,
                                                                     process):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{oops\n')
    override = override.replace("{bad}", str(bad))
    message = message.replace("{bad}", str(bad))
    args = ["--set", override, "--output-dir", str(tmp_path / "run")]
    if process:
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        result = subprocess.run([sys.executable, "-m", "hacpo_megatron.launch", *args], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=120)
        code, stdout, stderr = result.returncode, result.stdout, result.stderr
    else:
        code, stdout, stderr = launch_in_process(monkeypatch, capsys, *args)
    assert code == 2, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), stderr
    assert "Traceback" not in stdout + stderr
    # before any work: no torchrun (its banner), no Ray, no warm-up, nothing written (not a time bound: a loaded
    # machine makes the imports slow, while what matters is that nothing started)
    assert stdout == "" and not (tmp_path / "run").exists()


def test_resume_without_any_checkpoint_is_a_user_mistake(tmp_path, monkeypatch, capsys):
    code, _, stderr = launch_in_process(monkeypatch, capsys, "--resume", "--output-dir", str(tmp_path / "never-ran"))
    assert code == 2
    assert "no checkpoint saved yet; start without --resume" in stderr and "Traceback" not in stderr


def test_run_device_cpu_hides_the_gpus_from_the_ranks_and_a_rank_that_sees_one_is_told(tmp_path, monkeypatch):
    """run.device: cpu on a GPU machine: the launcher starts torchrun with CUDA_VISIBLE_DEVICES empty (the ranks, Ray's
    actors and the reward's workers inherit it); a rank started another way that still sees a GPU stops with a
    one-line input error."""
    from hacpo_megatron import launch
    from hacpo_megatron.config import load_config
    from hacpo_megatron.training.preflight import InputError, check_device

    started = {}

    def execv(path, command):
        started.update(command=command, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
        raise SystemExit(0)

    monkeypatch.setattr(launch.os, "execv", execv)
    for variable in ("CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME"):  # the launcher sets them: restored at the end
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(SystemExit):
        launch.main(["--set", "run.device=cpu", "--output-dir", str(tmp_path / "run")])
    assert started["visible"] == "" and "torch.distributed.run" in " ".join(started["command"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(SystemExit):
        launch.main(["--output-dir", str(tmp_path / "run")])  # auto: the GPUs stay as they are
    assert started["visible"] is None

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(InputError, match="run.device: cpu, but this rank sees a GPU"):
        check_device(load_config(os.path.join(REPO, "configs", "default.yaml"), ["run.device=cpu"]))
    check_device(load_config(os.path.join(REPO, "configs", "default.yaml"), ["run.device=auto"]))


def test_a_checkpoint_the_disk_refused_ends_the_run_with_one_line_and_exit_code_74(tmp_path, monkeypatch, capfd):
    """Every rank raises the same CheckpointSaveError (tests/checkpoint: a real full disk); rank 0 says it once."""
    from hacpo_megatron import entry
    from hacpo_megatron.checkpoint.save_agreement import CheckpointSaveError

    reason = "saving step 3 failed (rank 1: No space left on device: /out/step_00000003.tmp/a/x.distcp)"

    def run_that_fills_the_disk(cfg, options, provider):
        raise CheckpointSaveError(reason)

    monkeypatch.setattr(entry, "run_hacpo", run_that_fills_the_disk)
    monkeypatch.delenv("RANK", raising=False)
    try:
        assert entry.main(lambda cfg: None, ["--output-dir", str(tmp_path / "run")]) == 74
    finally:
        faulthandler.unregister(signal.SIGUSR1)  # main's `kill -USR1` hook wrote to this test's captured stderr
    assert capfd.readouterr().err == f"error: {reason}\n"


def test_the_launcher_runs_the_packages_own_program_or_the_users_entry(tmp_path, monkeypatch, capsys):
    """By default every rank runs `-m hacpo_megatron.entry` (an installed package launches itself: no repository
    path); `--entry FILE` runs the user's script with their own model provider; a missing one is a user mistake."""
    from hacpo_megatron import launch

    started = []

    def execv(path, command):
        started.append(command)
        raise SystemExit(0)

    monkeypatch.setattr(launch.os, "execv", execv)
    for variable in ("CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        monkeypatch.setenv(variable, "")  # so that what main() sets is undone after the test
        monkeypatch.delenv(variable)
    out = ["--output-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit):
        launch.main([*out, "--set", "run.stop_grace_s=1234"])
    # torchrun lets the ranks finish a step after SIGTERM for run.stop_grace_s, not its own 30 s
    assert os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "1234"
    with pytest.raises(SystemExit):
        launch.main(out)
    command = started[-1]  # python -m torch.distributed.run FLAGS -m hacpo_megatron.entry ARGS
    assert command[1:3] == ["-m", "torch.distributed.run"] and command[-len(out):] == out
    assert command[command.index("-m", 3):][:2] == ["-m", "hacpo_megatron.entry"]
    assert "examples" not in " ".join(command)
    script = os.path.join(REPO, "examples", "hacpo_pretrain_style.py")
    with pytest.raises(SystemExit):
        launch.main(["--entry", script, *out])
    assert script in started[-1] and "hacpo_megatron.entry" not in started[-1]
    assert launch.main(["--entry", str(tmp_path / "missing.py"), *out]) == 2 and len(started) == 3
    assert "--entry" in capsys.readouterr().err
