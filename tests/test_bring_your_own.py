"""docs/bring_your_own.md's examples (examples/bring_your_own/), as a run reads them: the config loads with its
reward function, data file and Hugging Face model folder; the reward function scores right and wrong answers, also
in the reward's spawned worker processes; the data file gives the prompts and reference answers the guide names;
a tiny model saved with transformers passes as `init_from`, and wrong folders get the project's own errors."""
import json
import shutil
from pathlib import Path

import pytest
import transformers

from examples.bring_your_own import reward
from examples.bring_your_own.make_tiny_model import make_tiny_qwen3
from hacpo_megatron.config import ConfigError, load_config
from hacpo_megatron.data import DataFormatError, load_prompts
from hacpo_megatron.rewards import RewardItem, RewardPool, load_reward_function
from hacpo_megatron.training.preflight import InputError, check_inputs

REPO = Path(__file__).resolve().parents[1]
CONFIG = "examples/bring_your_own/config.yaml"  # its paths are from the repository root, where `make run` starts


@pytest.fixture(autouse=True)
def in_repository_root(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """The guide's model: a tiny random Qwen3 that transformers' save_pretrained wrote, with its tokenizer."""
    return make_tiny_qwen3(str(tmp_path_factory.mktemp("bring_your_own") / "tiny-qwen3"))


def example_config(folder):
    return load_config(CONFIG, [f"agents.0.init_from={folder}"])


def test_the_example_config_loads_with_its_reward_data_and_model(model_folder):
    cfg = example_config(model_folder)
    assert cfg.reward.function == "examples.bring_your_own.reward.last_number_matches"
    assert cfg.data.train == cfg.data.eval == "examples/bring_your_own/prompts.jsonl"
    assert [(a.name, a.model, a.init_from) for a in cfg.agents] == [
        ("my-qwen3", model_folder, model_folder), ("llama-tiny", "tiny-llama", None)]  # model: the folder's own
    assert (cfg.run.name, cfg.data.prompt_batch_size, cfg.train.mini_batch_size) == ("bring_your_own", 4, 4)
    assert cfg.rollout.samples_per_prompt == 8 and cfg.train.sft_warmup_steps == 1500  # from base: default.yaml
    with open(REPO / CONFIG) as f:  # the folder the guide's command makes, when not overridden as here
        assert "init_from: .cache/bring_your_own/tiny-qwen3" in f.read()


def test_the_reward_function_resolves_by_its_dotted_path_and_scores_right_and_wrong_answers(model_folder):
    score = load_reward_function(example_config(model_folder).reward.function)
    assert score is reward.last_number_matches
    assert score("prompts", "She has 5 + 8 = 13 pencils.", "13") == 1.0  # the last number, not the first
    assert score("prompts", "She has 5 + 8 = 12 pencils.", "13") == 0.0
    assert score("my_arithmetic", "17 + 25 = 1,042", "1042") == 1.0  # thousands separators
    assert score("my_arithmetic", "I cannot tell.", "42") == 0.0
    assert score("my_geometry", "About 3.1416.", "3.14", {"tolerance": 0.01}) == 1.0  # the row's tolerance
    assert score("my_geometry", "About 3.1416.", "3.14") == 0.0  # none: exact
    assert score("my_geometry", "About 3.2.", "3.14", {"tolerance": 0.01}) == 0.0


def test_the_reward_function_runs_in_the_reward_worker_processes(model_folder):
    """A run scores in spawned processes, which import the function by its dotted path."""
    function = load_reward_function(example_config(model_folder).reward.function)
    with RewardPool(function, num_workers=1, timeout_s=5.0) as pool:
        scores, stats = pool.score([RewardItem("prompts", "so 13 pencils", "13"),
                                    RewardItem("prompts", "so 12 pencils", "13"),
                                    RewardItem("my_geometry", "3.141", "3.14", {"tolerance": 0.01})])
    assert scores == [1.0, 0.0, 1.0]
    assert stats["ok"] == 3 and stats["error"] == stats["crashed"] == 0


def test_the_data_file_gives_the_prompts_and_answers_of_both_schemas(model_folder):
    records = load_prompts(example_config(model_folder).data.train, "train")
    with open(REPO / "examples" / "bring_your_own" / "prompts.jsonl") as f:
        assert len([json.loads(line) for line in f]) == len(records) == 4  # every row, none dropped
    assert [r.ground_truth for r in records] == ["42", "3.14", "13", "12"]  # '#### 13' and \boxed{12} read
    assert [r.question for r in records] == [
        "What is 17 + 25?", "A circle has radius 1. What is its area, to two decimals?",
        "Ines has 5 pencils and gets 8 more. How many pencils does she have?", "What is $3 \\times 4$?"]
    assert [r.data_source for r in records] == ["my_arithmetic", "my_geometry", "prompts", "prompts"]
    assert [m["role"] for m in records[1].messages] == ["system", "user"]  # verl's chat kept whole
    assert [r.uid for r in records] == ["prompts-0", "prompts-1", "prompts-2", "prompts-3"]
    assert records[1].extra_info == {"tolerance": 0.01} and records[2].extra_info == {}
    for record in records:  # what a run hands the reward function: each row's answer scores 1, another 0
        assert reward.last_number_matches(record.data_source, f"It is {record.ground_truth}.", record.ground_truth,
                                          record.extra_info) == 1.0
        assert reward.last_number_matches(record.data_source, "It is 7.", record.ground_truth,
                                          record.extra_info) == 0.0


def test_a_row_of_neither_schema_is_named_with_its_file_and_line(tmp_path):
    rows = tmp_path / "mine.jsonl"
    rows.write_text('{"question": "What is 2 + 2?", "answer": "4"}\n{"query": "What is 3 + 3?", "answer": "6"}\n')
    with pytest.raises(DataFormatError, match=r"mine\.jsonl:line 2: no question: expected verl's 'prompt' or one of "
                                              r"\['question', 'problem'\]; row has keys \['answer', 'query'\]"):
        load_prompts(str(rows))


def test_a_hugging_face_folder_passes_as_init_from(model_folder, tmp_path):
    assert transformers.AutoConfig.from_pretrained(model_folder).architectures == ["Qwen3ForCausalLM"]
    cfg = example_config(model_folder)
    check_inputs(cfg, output_dir=str(tmp_path / "run"), resume=False)  # data, weights, tokenizers: as a run starts


def test_wrong_folders_get_the_projects_errors(model_folder, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"--set agents\.0\.init_from=.*empty: agents\.0\.init_from: '.*empty' is "
                                          r"neither a built-in preset \(.*tiny-qwen3\) nor a folder with config\.json"):
        example_config(tmp_path / "empty")

    (tmp_path / "no_weights").mkdir()
    shutil.copy(Path(model_folder) / "config.json", tmp_path / "no_weights")
    cfg = example_config(tmp_path / "no_weights")  # config.json is all the config loader reads
    with pytest.raises(InputError, match=r"^agents\.0 \(my-qwen3\)\.init_from: .*no_weights: no model\.safetensors"):
        check_inputs(cfg, output_dir=str(tmp_path / "run"), resume=False)

    # families not supported, named by the config loader with the key the user wrote: Mistral (a config like
    # Llama's) and GPT-2 (whose config has none of the keys a layout check reads: it once failed as a bare KeyError)
    mistral = transformers.MistralConfig(vocab_size=1000, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    transformers.MistralForCausalLM(mistral).save_pretrained(tmp_path / "mistral")
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")
    for folder, architecture in (("mistral", "MistralForCausalLM"), ("gpt2", "GPT2LMHeadModel")):
        with pytest.raises(ConfigError, match=rf"agents\.0\.init_from: unsupported architecture \['{architecture}'\]; "
                                              r"supported architectures: Qwen3ForCausalLM, "):
            example_config(tmp_path / folder)
        with pytest.raises(ConfigError, match=rf"agents\.0\.model: unsupported architecture \['{architecture}'\]"):
            load_config(CONFIG, [f"agents.0.init_from={model_folder}", f"agents.0.model={tmp_path / folder}"])
