"""The vLLM engine, for real, on vLLM's CPU build (`make setup-vllm`, which `make test` runs).

The checks run in a child process (vllm_checks.py): vLLM starts worker processes that re-import
the main module, and a crash of vLLM must not take pytest with it."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    assert importlib.util.find_spec("vllm") is not None, "vLLM is not installed: `make setup-vllm` (make test does)"
    work = tmp_path_factory.mktemp("vllm")
    out = work / "facts.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "rollout", "vllm_checks.py"), str(out), str(work)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_vllm_generates_groups_with_sampling_logprobs_at_the_temperature(facts):
    assert facts["group_sizes"] == [3, 3]
    assert facts["lengths_ok"]
    assert facts["logprob_max_abs_diff"] < 1e-4  # vs a transformers forward of the same weights, logits / T
    assert facts["same_seed_same_samples"]
    assert facts["text_is_our_decoding"]  # the agent's tokenizer decodes, as in the other engines
    assert facts["samples_of_a_group_differ"]
    assert facts["truncated_reason"] == "length"


def test_vllm_stops_on_the_agents_end_tokens_and_keeps_the_end_token(facts):
    tokens, num_logprobs, reason, end_token = facts["stop_cut"]
    assert tokens == [end_token] and num_logprobs == 1 and reason == "stop"


def test_vllm_weight_update_changes_generation_and_check_mode_confirms_it(facts):
    assert not facts["check_before_update_equal"] and facts["check_before_update_mismatches"] > 0
    assert facts["check_after_update_equal"], facts["check_after_update_report"]
    assert facts["check_after_update_max_diff"] == 0.0
    assert facts["update_buckets"] > 3  # staged in several buckets, applied once
    assert not facts["partial_check_equal"] and facts["partial_check_unsent"] >= 1
    assert facts["update_without_begin_raises"]
    assert facts["generation_changed"]
    assert facts["logprob_max_abs_diff_after_update"] < 1e-4
