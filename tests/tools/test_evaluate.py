"""tools/evaluate.py on real (tiny) Hugging Face model folders: generation, scoring, counts, bad input."""
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hacpo_megatron.bridge.tokenizers import load_tokenizer
from hacpo_megatron.rollout.embedded import hf_model_from_config

TOOL = Path(__file__).resolve().parents[2] / "tools" / "evaluate.py"

# A Qwen3 layout small enough to save and load in a second (the vocabulary is the real tokenizer's).
TINY_QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", attention_bias=False,
    rms_norm_eps=1e-6, vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=1000000.0, max_position_embeddings=512,
    tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
)


@pytest.fixture(scope="module")
def evaluate_tool():
    spec = importlib.util.spec_from_file_location("evaluate_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _save_folder(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    load_tokenizer("qwen3").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def random_model_dir(module_tmp):
    return _save_folder(hf_model_from_config(TINY_QWEN3, seed=0), module_tmp("random_model"))


@torch.no_grad()
def always_answers_seven(tokenizer):
    """A model whose every answer is "7", then <|im_end|>, made by setting its weights by hand.

    Attention and MLP outputs are zeroed, so the last hidden state is the (normalised) embedding of the
    current token. Every token embeds to e0 except "7", which embeds to e1; the output layer maps e0 to
    "7" and e1 to <|im_end|>. So after any prompt the model says "7" and stops, with a margin of ~56 nats.
    """
    model = hf_model_from_config(TINY_QWEN3, seed=0)
    seven = tokenizer.convert_tokens_to_ids("7")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    embed = model.model.embed_tokens.weight
    embed.zero_()
    embed[:, 0] = 1.0
    embed[seven] = 0.0
    embed[seven, 1] = 1.0
    head = model.lm_head.weight
    head.zero_()
    head[seven, 0] = 10.0
    head[end, 1] = 10.0
    return model


@pytest.fixture(scope="module")
def seven_model_dir(module_tmp):
    return _save_folder(always_answers_seven(load_tokenizer("qwen3")), module_tmp("seven_model"))


def _run(tool, args, output):
    code = tool.main([*map(str, args), "--output", str(output), "--reward-workers", "1"])
    report = json.loads(output.read_text()) if code == 0 else None
    return code, report


def test_random_model_on_synthetic_arithmetic_counts(evaluate_tool, random_model_dir, tmp_path):
    code, report = _run(evaluate_tool, ["--checkpoint", random_model_dir, "--benchmark", "synthetic:arithmetic",
                                        "--limit", 8, "--samples", 2, "--max-new-tokens", 4], tmp_path / "r.json")
    assert code == 0
    totals = report["totals"]
    assert 0.0 <= totals["accuracy"] <= 1.0
    assert (totals["num_prompts"], totals["num_responses"]) == (8, 16)
    responses = [r for prompt in report["prompts"] for r in prompt["responses"]]
    assert len(responses) == 16 and all(1 <= r["tokens"] <= 4 for r in responses)
    assert totals["truncated"] == sum(r["truncated"] for r in responses)
    assert totals["truncated"] == sum(r["tokens"] == 4 and r["truncated"] for r in responses)
    assert totals["accuracy"] == pytest.approx(sum(r["score"] for r in responses) / 16)
    stats = report["reward_stats"]
    assert stats["total"] == 16
    assert totals["reward_timeouts"] == stats["timeout"] + stats["killed"]
    assert totals["reward_errors"] == stats["error"] + stats["crashed"]
    assert report["checkpoint_kind"] == "hf" and report["sampling"]["samples"] == 2


def _gsm8k_file(path: Path, answers):
    rows = [{"question": f"What is {i} + 7 - {i}?", "answer": f"Add, then subtract.\n#### {answer}"}
            for i, answer in enumerate(answers)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_accuracy_counts_exactly_the_correct_answers(evaluate_tool, seven_model_dir, tmp_path):
    # The model answers "7" to everything: 4 of these 6 ground truths are 7, so accuracy is exactly 4/6.
    data = _gsm8k_file(tmp_path / "gsm8k.jsonl", [7, 8, 7, 7, 12, 7])
    code, report = _run(evaluate_tool, ["--checkpoint", seven_model_dir, "--benchmark", "GSM8K", "--data", data,
                                        "--greedy", "--max-new-tokens", 8], tmp_path / "greedy.json")
    assert code == 0
    assert [r["text"] for p in report["prompts"] for r in p["responses"]] == ["7"] * 6
    assert [p["mean_score"] for p in report["prompts"]] == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert report["totals"]["accuracy"] == pytest.approx(4 / 6)
    assert report["totals"]["truncated"] == 0
    assert report["totals"]["reward_timeouts"] == 0 and report["totals"]["reward_errors"] == 0


def test_sampled_accuracy_and_limit(evaluate_tool, seven_model_dir, tmp_path):
    data = _gsm8k_file(tmp_path / "gsm8k.jsonl", [7, 8, 9, 7, 7])
    code, report = _run(evaluate_tool, ["--checkpoint", seven_model_dir, "--benchmark", "gsm8k", "--data", data,
                                        "--samples", 3, "--temperature", 1.0, "--limit", 4, "--max-new-tokens", 1],
                        tmp_path / "sampled.json")
    assert code == 0
    totals = report["totals"]
    assert (totals["num_prompts"], totals["num_responses"]) == (4, 12)
    assert totals["accuracy"] == pytest.approx(2 / 4)
    assert totals["pass_at_k"] == pytest.approx(2 / 4)
    # one new token: "7" is generated, the end token never is, so every answer is truncated (and still right)
    assert totals["truncated"] == 12


def test_a_reasoning_gym_generator_is_evaluated_on_its_held_out_split(evaluate_tool, seven_model_dir, tmp_path):
    """`--benchmark reasoning_gym:<generator>`: no --data; the held-out split the training run evaluates on. The
    model answers "7" to everything, so it scores exactly the sums of three digits whose answer is 7."""
    from hacpo_megatron.data import load_prompts

    spec = "reasoning_gym:chain_sum?size=60&min_terms=3&max_terms=3&min_digits=1&max_digits=1"
    held_out = load_prompts(spec, split="eval")[:24]
    code, report = _run(evaluate_tool, ["--checkpoint", seven_model_dir, "--benchmark", spec, "--limit", 24,
                                        "--greedy", "--max-new-tokens", 8], tmp_path / "rg.json")
    assert code == 0 and report["totals"]["num_prompts"] == len(held_out) == 24
    assert [p["mean_score"] for p in report["prompts"]] == [float(r.ground_truth == "7") for r in held_out]
    assert 0 < report["totals"]["accuracy"] < 1  # some answers are 7, some are not: the check means something


def test_eval_totals_pass_at_1_is_the_mean_over_samples(evaluate_tool):
    completion = SimpleNamespace(truncated=False, token_ids=[1, 2])
    scores = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    completions = [[completion] * 4 for _ in scores]
    totals = evaluate_tool.eval_totals(completions, scores, {"timeout": 1, "killed": 2, "error": 3, "crashed": 0})
    assert totals.accuracy == pytest.approx((0.25 + 1.0 + 0.0) / 3)
    assert totals.pass_at_k == pytest.approx(2 / 3)
    assert (totals.reward_timeouts, totals.reward_errors) == (3, 3)


@pytest.mark.parametrize("case", ["missing_data", "unknown_benchmark", "no_checkpoint", "not_a_model",
                                  "no_weights", "no_data_for_file_benchmark"])
def test_bad_input_exits_2_naming_it(evaluate_tool, random_model_dir, tmp_path, capsys, case):
    empty = tmp_path / "empty"
    empty.mkdir()
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text(json.dumps(TINY_QWEN3))
    data = _gsm8k_file(tmp_path / "ok.jsonl", [7])
    args, named = {
        "missing_data": (["--checkpoint", random_model_dir, "--benchmark", "gsm8k", "--data", tmp_path / "nope.jsonl"],
                         "nope.jsonl"),
        "unknown_benchmark": (["--checkpoint", random_model_dir, "--benchmark", "mmlu", "--data", data], "mmlu"),
        "no_checkpoint": (["--checkpoint", tmp_path / "ghost", "--benchmark", "gsm8k", "--data", data], "ghost"),
        "not_a_model": (["--checkpoint", empty, "--benchmark", "gsm8k", "--data", data], "empty"),
        "no_weights": (["--checkpoint", config_only, "--benchmark", "gsm8k", "--data", data], "no weights"),
        "no_data_for_file_benchmark": (["--checkpoint", random_model_dir, "--benchmark", "math500"], "--data"),
    }[case]
    assert evaluate_tool.main([*map(str, args), "--output", str(tmp_path / "x.json")]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_reward_function_that_does_not_import_stops_before_the_model_loads(evaluate_tool, tmp_path, capsys):
    # --checkpoint names nothing: were the reward function loaded after generating (as it was), that error would come
    # first; it must be the reward function's, before any model or answer
    with pytest.raises(SystemExit) as stop:
        evaluate_tool.main(["--checkpoint", str(tmp_path / "ghost"), "--benchmark", "synthetic:largest",
                            "--reward-function", "no_such_package.rewards.score"])
    assert stop.value.code == 2
    assert "--reward-function: reward function 'no_such_package.rewards.score': cannot import module" in (
        capsys.readouterr().err)


@pytest.mark.slow
@pytest.mark.distributed
def test_megatron_checkpoint_is_converted_and_scored(seven_model_dir, tmp_path):
    """HF -> Megatron agent checkpoint -> evaluate: the same model, the same exact accuracy (~45 s on CPU)."""
    import subprocess

    root = TOOL.parents[1]
    megatron_dir = tmp_path / "seven_megatron"
    subprocess.run([sys.executable, str(root / "tools" / "convert_hf_to_megatron.py"), "--hf-path",
                    str(seven_model_dir), "--save", str(megatron_dir), "--name", "seven"], check=True,
                   capture_output=True)
    data = _gsm8k_file(tmp_path / "gsm8k.jsonl", [7, 8, 7])
    output = tmp_path / "report.json"
    subprocess.run([sys.executable, str(TOOL), "--checkpoint", str(megatron_dir), "--benchmark", "gsm8k", "--data",
                    str(data), "--greedy", "--max-new-tokens", "4", "--reward-workers", "1", "--output", str(output)],
                   check=True, capture_output=True)
    report = json.loads(output.read_text())
    assert report["checkpoint_kind"] == "megatron"
    assert report["totals"]["accuracy"] == pytest.approx(2 / 3)
