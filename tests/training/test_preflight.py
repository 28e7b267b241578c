"""Inputs checked before any work: every problem named (file, line, key) in one InputError."""
import pytest

from hacpo_megatron.config import load_config
from hacpo_megatron.training.preflight import InputError, check_inputs

AGENTS = "agents=[{name: a, model: tiny-qwen3, tokenizer: qwen3}, {name: b, model: tiny-llama, tokenizer: llama3.2}]"


def config(*overrides):
    return load_config(None, [AGENTS, "data.train=synthetic:largest", "data.eval=synthetic:largest", *overrides])


def test_good_inputs_pass(tmp_path):
    check_inputs(config(), output_dir=str(tmp_path), resume=False)


def test_every_file_problem_is_named_at_once(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\n[1, 2]\n')
    not_utf8 = tmp_path / "latin1.jsonl"
    not_utf8.write_bytes('{"question": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    cfg = config(f"data.train={bad}", f"data.eval={not_utf8}", "agents.1.init_from=/no/model")
    with pytest.raises(InputError) as error:
        check_inputs(cfg, output_dir=str(tmp_path / "run"), resume=True)
    assert error.value.problems == [
        f"data.train: {bad}:line 2: expected a JSON object, got list",
        f"data.eval: {not_utf8}:line 1: not UTF-8 text (byte 0xe9 at column 18)",
        "agents.1 (b).init_from: /no/model: no such folder",
        f"--resume: {tmp_path / 'run' / 'checkpoints'}: no checkpoint saved yet; start without --resume",
    ]
    assert str(error.value).startswith("4 problems with the run's input:")


def test_an_agents_own_warmup_task_is_checked(tmp_path):
    cfg = config("train.sft_warmup_steps=10", "agents.1.sft_warmup_task=synthetic:largest?min_answer=10")
    with pytest.raises(InputError) as error:
        check_inputs(cfg, output_dir=str(tmp_path), resume=False)
    assert error.value.problems == ["agents.1 (b).sft_warmup_task: 'synthetic:largest?min_answer=10': "
                                    "no train problem is in this part of the task"]


def test_tokenizers_are_checked_once_the_files_are_fine(tmp_path):
    with pytest.raises(InputError) as error:
        check_inputs(config("agents.0.tokenizer=/no/tokenizer"), output_dir=str(tmp_path), resume=False)
    assert len(error.value.problems) == 1 and error.value.problems[0].startswith(
        "agents.0 (a).tokenizer: unknown tokenizer '/no/tokenizer'")


def test_a_tokenizer_with_ids_past_the_models_embedding_is_named(tmp_path):
    # Qwen3's ids (up to 151645 with its chat tokens) in tiny-llama's 128256 rows: the first forward pass would fail
    with pytest.raises(InputError) as error:
        check_inputs(config("agents.1.tokenizer=qwen3"), output_dir=str(tmp_path), resume=False)
    assert error.value.problems == ["agents.1 (b).tokenizer: 'qwen3' writes token ids up to 151645, but the model "
                                    "(tiny-llama) has 128256 embedding rows (vocab_size): give the agent its model's "
                                    "own tokenizer"]
    # the other way round fits (Llama 3.2's 128257th token, never written, is not counted)
    check_inputs(config("agents.0.tokenizer=llama3.2"), output_dir=str(tmp_path), resume=False)


def test_a_reward_function_that_does_not_import_is_named_before_any_work(tmp_path):
    with pytest.raises(InputError) as error:
        check_inputs(config("reward.function=no_such_package.rewards.score"), output_dir=str(tmp_path), resume=False)
    assert error.value.problems == ["reward.function: reward function 'no_such_package.rewards.score': cannot import "
                                    "module 'no_such_package.rewards': No module named 'no_such_package'"]


def test_a_folder_without_weights_is_not_a_model(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(InputError, match=r"agents.0 \(a\).init_from: "):
        check_inputs(config(f"agents.0.init_from={tmp_path / 'm'}"), output_dir=str(tmp_path), resume=False)


def test_an_engine_whose_package_is_missing_is_named_with_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    with pytest.raises(InputError) as error:
        check_inputs(config("agents.1.engine=vllm"), output_dir=str(tmp_path), resume=False)
    assert len(error.value.problems) == 1
    assert (error.value.problems[0].startswith("agents.1 (b).engine: vLLM is not installed")
            and "make setup-vllm" in str(error.value))


def test_a_tracker_whose_package_is_missing_is_named_with_its_install_line(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real_find_spec(name, *a))
    with pytest.raises(InputError) as error:
        check_inputs(config("logging.trackers=[tensorboard, mlflow]"), output_dir=str(tmp_path), resume=False)
    assert error.value.problems == ["logging.trackers: tracker 'mlflow' needs mlflow, not installed here: "
                                    "pip install '.[mlflow]'"]


def test_debug_modes_and_their_rollout_folders_must_fit(tmp_path):
    def problems(overrides="", **folders):
        with pytest.raises(InputError) as error:
            check_inputs(config(overrides) if overrides else config(), output_dir=str(tmp_path), resume=False,
                         **folders)
        return error.value.problems

    with pytest.raises(InputError, match="run.mode rollout_only keeps no checkpoint"):
        check_inputs(config("run.mode=rollout_only"), output_dir=str(tmp_path), resume=True)
    assert problems("run.mode=train_only") == [
        "run.mode train_only trains on saved answers: give --load-rollouts DIR (saved by --save-rollouts)"]
    assert problems(load_rollouts=str(tmp_path)) == [
        "--load-rollouts: only run.mode train_only reads saved answers (run.mode is train)"]
    assert problems("run.mode=train_only", load_rollouts=str(tmp_path), save_rollouts=str(tmp_path / "s")) == [
        "--save-rollouts: run.mode train_only generates no answers to save"]
    (tmp_path / "file").write_text("")
    assert problems(save_rollouts=str(tmp_path / "file")) == [
        f"--save-rollouts {tmp_path / 'file'}: a file is in the way of the folder"]
    (tmp_path / "saved" / "step_00000001").mkdir(parents=True)
    (found,) = problems("run.mode=train_only", load_rollouts=str(tmp_path / "saved"))
    assert found.startswith(f"--load-rollouts: {tmp_path / 'saved' / 'step_00000001' / 'step.json'} is missing (and ")
    assert "run.total_steps=" in found and "one file per agent (a, b)" in found
