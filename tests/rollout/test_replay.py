"""Saved rollouts (rollout/replay.py): what train_only reads is exactly what was saved, per step and agent."""
import json

import pytest

from hacpo_megatron.data.records import PromptRecord, user_prompt
from hacpo_megatron.rollout.base import Completion
from hacpo_megatron.checkpoint.run_folder import step_folder
from hacpo_megatron.rollout.replay import ReplayError, load_step, missing_steps, save_step

AGENTS = ["qwen3-tiny", "llama-tiny"]
B, G = 2, 3


def prompts(offset=0):
    return [PromptRecord(uid=f"p{offset + b}", messages=user_prompt(f"{b} + 1 = ?"), ground_truth=str(b + 1),
                         data_source="synthetic:arithmetic") for b in range(B)]


def rollouts():
    """Distinct answers per agent, prompt and sample; log-probs that only an exact float round trip keeps."""
    return [[[Completion(token_ids=[k, b, i, 2], text=f"{k}{b}{i}",
                         logprobs=[-0.1 * (i + 1) / 3, -1e-300, -7.0, 0.1 + 0.2],
                         finish_reason="stop" if i else "length")
              for i in range(G)] for b in range(B)] for k in range(len(AGENTS))]


def scores():
    return [float((k + b + i) % 2) for k in range(len(AGENTS)) for b in range(B) for i in range(G)]


STATS = {"timeout": 1, "nonzero": 6, "seconds": 0.25, "answers_per_s": float("inf")}


def test_a_saved_step_loads_back_exactly_per_agent(tmp_path):
    save_step(tmp_path, 3, AGENTS, prompts(), rollouts(), scores(), STATS)
    folder = step_folder(tmp_path, 3)
    assert sorted(p.name for p in folder.iterdir()) == ["llama-tiny.json", "qwen3-tiny.json", "step.json"]
    assert json.loads((folder / "llama-tiny.json").read_text())["scores"] == scores()[B * G:]
    loaded, loaded_scores, stats = load_step(tmp_path, 3, AGENTS, prompts(), G)
    assert loaded == rollouts() and loaded_scores == scores() and stats == STATS
    # agents may be asked for in another order than saved: each file is its agent's
    back, back_scores, _ = load_step(tmp_path, 3, AGENTS[::-1], prompts(), G)
    assert back == rollouts()[::-1] and back_scores == scores()[B * G:] + scores()[:B * G]


def test_a_step_without_step_json_is_incomplete_and_never_read(tmp_path):
    save_step(tmp_path, 1, AGENTS, prompts(), rollouts(), scores(), STATS)
    (step_folder(tmp_path, 1) / "step.json").unlink()  # a run killed between the agents' files and step.json
    with pytest.raises(ReplayError, match="step_00000001/step.json: no complete saved step 1"):
        load_step(tmp_path, 1, AGENTS, prompts(), G)


def test_replaying_on_other_prompts_agents_or_group_size_is_refused(tmp_path):
    save_step(tmp_path, 1, AGENTS, prompts(), rollouts(), scores(), STATS)
    with pytest.raises(ReplayError, match="saved for other prompts than this run's step 1"):
        load_step(tmp_path, 1, AGENTS, prompts(offset=5), G)
    with pytest.raises(ReplayError,
                       match=r"no answers of agent 'gemma3' \(the saved run's agents: qwen3-tiny, llama-tiny\)"):
        load_step(tmp_path, 1, ["gemma3"], prompts(), G)
    with pytest.raises(ReplayError, match=r"\[3\] answers per prompt, this run needs 6"):
        load_step(tmp_path, 1, AGENTS, prompts(), 2 * G)


def test_missing_steps_names_every_file_a_train_only_run_would_lack(tmp_path):
    assert missing_steps(tmp_path / "none", AGENTS, [1]) == [f"{tmp_path / 'none'}: no such folder"]
    save_step(tmp_path, 1, AGENTS, prompts(), rollouts(), scores(), STATS)
    save_step(tmp_path, 2, AGENTS[:1], prompts(), rollouts()[:1], scores()[:B * G], STATS)
    assert missing_steps(tmp_path, AGENTS, [1, 2, 3]) == [
        str(step_folder(tmp_path, 2) / "llama-tiny.json"), str(step_folder(tmp_path, 3) / "step.json"),
        str(step_folder(tmp_path, 3) / "qwen3-tiny.json"), str(step_folder(tmp_path, 3) / "llama-tiny.json")]


def test_rollouts_saved_under_the_older_six_digit_name_are_still_read(tmp_path):
    """Until 9492f63 a saved step's folder was step_000001; checkpoints' were (and are) step_00000001."""
    save_step(tmp_path, 1, AGENTS, prompts(), rollouts(), scores(), STATS)
    step_folder(tmp_path, 1).rename(tmp_path / "step_000001")
    assert missing_steps(tmp_path, AGENTS, [1]) == []
    loaded, loaded_scores, stats = load_step(tmp_path, 1, AGENTS, prompts(), G)
    assert loaded == rollouts() and loaded_scores == scores() and stats == STATS
