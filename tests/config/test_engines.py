"""`python -m hacpo_megatron.config --engines`: the engines the resolved config starts (its base: files and --set
overrides included), which `make run` reads to decide whether vLLM's build is needed (Makefile)."""
import os
import shutil
import subprocess

import pytest

from hacpo_megatron.config.__main__ import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT = os.path.join(REPO, "configs", "default.yaml")


def engines(capsys, *argv):
    assert main(["--engines", *argv]) == 0
    return capsys.readouterr().out.split()


def test_the_default_config_starts_only_embedded_engines(capsys):
    assert engines(capsys, "--config", DEFAULT) == ["embedded"]


def test_an_engine_set_in_a_base_file_counts_though_the_config_never_names_it(tmp_path, capsys):
    with open(DEFAULT) as f:
        text = f.read()
    assert text.count("    tokenizer: llama3.2\n") == 1
    (tmp_path / "base.yaml").write_text(text.replace("    tokenizer: llama3.2\n",
                                                     "    tokenizer: llama3.2\n    engine: vllm\n"))
    (tmp_path / "run.yaml").write_text("base: base.yaml\nrun:\n  total_steps: 3\n")
    assert engines(capsys, "--config", str(tmp_path / "run.yaml")) == ["embedded", "vllm"]
    # the same file with its agents replaced (lists are replaced whole): the base's vllm agent is gone
    (tmp_path / "own_agents.yaml").write_text("base: base.yaml\nagents:\n  - {name: a, model: tiny-qwen3}\n"
                                              "  - {name: b, model: tiny-llama}\n")
    assert engines(capsys, "--config", str(tmp_path / "own_agents.yaml")) == ["embedded"]


def test_set_overrides_count(capsys):
    assert engines(capsys, "--config", DEFAULT, "--set", "agents.0.engine=vllm") == ["embedded", "vllm"]
    assert engines(capsys, "--config", DEFAULT, "--set", "agents.0.engine=vllm",
                   "--set", "agents.llama-tiny.engine=vllm") == ["vllm"]


def test_train_only_starts_no_engine(capsys):
    assert engines(capsys, "--config", DEFAULT, "--set", "agents.0.engine=vllm", "--set", "run.mode=train_only") == []


def test_the_launchers_own_arguments_pass_with_engines_and_fail_without(capsys):
    launch_args = ["--output-dir", "runs/x", "--resume", "--load-rollouts", "dir", "--check-weights"]
    assert engines(capsys, "--config", DEFAULT, *launch_args, "--set", "agents.1.engine=vllm") == ["embedded", "vllm"]
    with pytest.raises(SystemExit) as exc:
        main(["--config", DEFAULT, "--resume"])
    assert exc.value.code == 2 and "unrecognized arguments: --resume" in capsys.readouterr().err


def test_an_invalid_config_is_reported_with_exit_code_2(capsys):
    assert main(["--engines", "--config", DEFAULT, "--set", "algorithm.alhpa=1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "algorithm.alhpa: unknown key" in captured.err


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_run_asks_the_resolved_config_with_its_args_before_launching():
    args = "--set agents.0.engine=vllm --output-dir /tmp/x"
    plan = subprocess.run(["make", "-n", "run", f"ARGS={args}"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=True).stdout
    check = plan.index(f"-m hacpo_megatron.config --config configs/default.yaml {args} --engines")
    assert "setup-vllm" in plan[check:] and "grep -qE" not in plan
    assert plan.index(f"-m hacpo_megatron.launch --config configs/default.yaml {args}") > check
