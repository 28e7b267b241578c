"""The SGLang engine's requests and response parsing, without SGLang (it cannot run on these machines).

The response dicts below follow SGLang's documented output of `Engine.generate(..., return_logprob=True)`:
{"text", "output_ids", "meta_info": {"finish_reason": {"type", "matched"/"length"}, "output_token_logprobs":
[(logprob, token_id, None), ...], ...}}.
"""
import importlib.util

import pytest
import torch

from hacpo_megatron.rollout.base import SamplingParams
from hacpo_megatron.rollout.sglang_engine import (
    INSTALL_HINT, SGLangEngine, compare_read_back, generate_request, parse_completion, parse_generate_output,
    raise_unless_success, sampling_params_dict, tensor_update_kwargs,
)

EOS = [151645, 151643]


def sglang_output(tokens, logprobs, finish, text="..."):
    """A response dict as SGLang's Engine.generate returns it."""
    return {
        "text": text,
        "output_ids": list(tokens),
        "meta_info": {
            "id": "4f1c",
            "finish_reason": finish,
            "prompt_tokens": 3,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "output_token_logprobs": [(lp, tok, None) for lp, tok in zip(logprobs, tokens)],
            "e2e_latency": 0.01,
        },
    }


def test_sampling_params_sample_the_whole_vocabulary_and_stop_on_the_agents_end_tokens():
    params = SamplingParams(n=8, temperature=0.7, top_p=0.95, max_new_tokens=64)
    assert sampling_params_dict(params, EOS) == dict(
        n=8, temperature=0.7, top_p=0.95, top_k=-1, min_p=0.0, max_new_tokens=64,
        stop_token_ids=[151643, 151645], skip_special_tokens=True)


def test_unseeded_request_asks_for_n_samples_per_prompt():
    request = generate_request([[1, 2], [3]], SamplingParams(n=4, max_new_tokens=5), EOS)
    assert request["input_ids"] == [[1, 2], [3]] and request["return_logprob"] is True
    assert [p["n"] for p in request["sampling_params"]] == [4, 4]
    assert all("sampling_seed" not in p for p in request["sampling_params"])


def test_seeded_request_gives_every_sample_its_own_reproducible_seed():
    params = SamplingParams(n=3, max_new_tokens=5, seed=7)
    request = generate_request([[1, 2], [3]], params, EOS)
    assert request["input_ids"] == [[1, 2]] * 3 + [[3]] * 3  # prompt-major, like SGLang's own n expansion
    seeds = [p["sampling_seed"] for p in request["sampling_params"]]
    assert all(p["n"] == 1 for p in request["sampling_params"])
    assert len(set(seeds)) == 6 and seeds == [p["sampling_seed"] for p in generate_request(
        [[1, 2], [3]], params, EOS)["sampling_params"]]
    assert seeds != [p["sampling_seed"] for p in generate_request(
        [[1, 2], [3]], SamplingParams(n=3, max_new_tokens=5, seed=8), EOS)["sampling_params"]]
    with pytest.raises(ValueError, match="empty"):
        generate_request([[]], params, EOS)


def test_a_stopped_response_keeps_its_end_token_and_its_logprob():
    c = parse_completion(sglang_output([11, 12, 151645], [-0.5, -1.25, -0.125],
                                       {"type": "stop", "matched": 151645}, text="Hi there"))
    assert (c.token_ids, c.logprobs, c.finish_reason, c.text) == ([11, 12, 151645], [-0.5, -1.25, -0.125],
                                                                  "stop", "Hi there")
    assert c.logprob_sum == -1.875 and not c.truncated


def test_a_length_cut_response_is_truncated():
    c = parse_completion(sglang_output([5, 6], [-1.0, -2.0], {"type": "length", "length": 2}))
    assert c.truncated and c.token_ids == [5, 6]


def test_a_stop_string_match_is_a_stop_without_an_end_token():
    c = parse_completion(sglang_output([5, 6], [-1.0, -2.0], {"type": "stop", "matched": "\n\n"}))
    assert c.finish_reason == "stop"


def test_malformed_or_aborted_outputs_fail_loudly():
    with pytest.raises(RuntimeError, match="aborted"):
        parse_completion(sglang_output([], [], {"type": "abort", "message": "out of memory"}))
    no_logprobs = sglang_output([5], [-1.0], {"type": "length", "length": 1})
    del no_logprobs["meta_info"]["output_token_logprobs"]
    with pytest.raises(ValueError, match="return_logprob"):
        parse_completion(no_logprobs)
    disagreeing = sglang_output([5, 6], [-1.0, -2.0], {"type": "length", "length": 2})
    disagreeing["output_ids"] = [5, 7]
    with pytest.raises(ValueError, match="disagree"):
        parse_completion(disagreeing)
    with pytest.raises(ValueError, match="does not end"):
        parse_completion(sglang_output([5, 6], [-1.0, -2.0], {"type": "stop", "matched": 151645}))
    with pytest.raises(ValueError, match="finish reason"):
        parse_completion(sglang_output([5], [-1.0], None))


def test_outputs_are_grouped_prompt_major():
    outputs = [sglang_output([100 + i], [-float(i)], {"type": "length", "length": 1}) for i in range(6)]
    groups = parse_generate_output(outputs, num_prompts=2, n=3)
    assert [[c.token_ids[0] for c in g] for g in groups] == [[100, 101, 102], [103, 104, 105]]
    assert parse_generate_output(outputs[0], 1, 1)[0][0].token_ids == [100]  # a batch of one: a bare dict
    with pytest.raises(ValueError, match="6 outputs for 2 prompts x 2"):
        parse_generate_output(outputs, num_prompts=2, n=2)


def test_weight_update_payload_defers_the_cache_flush_to_the_end():
    bucket = [("model.norm.weight", torch.ones(4)), ("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 2).t())]
    kwargs = tensor_update_kwargs(bucket)
    assert kwargs["flush_cache"] is False and kwargs["load_format"] is None
    assert [n for n, _ in kwargs["named_tensors"]] == [n for n, _ in bucket]
    assert all(t.is_contiguous() for _, t in kwargs["named_tensors"])


def test_control_call_answers_are_checked():
    raise_unless_success((True, "ok"), "update")
    raise_unless_success({"success": True}, "update")
    with pytest.raises(RuntimeError, match="update failed: shape mismatch"):
        raise_unless_success((False, "shape mismatch"), "update")


def test_read_back_comparison_uses_the_rows_sglang_returns():
    weight = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    assert compare_read_back("w", weight.tolist(), weight, 0.0) == (0.0, "")
    assert compare_read_back("w", weight[:2].tolist(), weight, 0.0) == (0.0, "")  # truncated read-back
    diff, problem = compare_read_back("w", (weight + 0.5).tolist(), weight, 0.0)
    assert diff == 0.5 and "max |diff|" in problem
    assert compare_read_back("w", None, weight, 0.0)[0] is None
    assert "shape" in compare_read_back("w", [[1.0, 2.0]], weight, 0.0)[1]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed")
def test_without_sglang_the_engine_says_what_to_install():
    with pytest.raises(ImportError, match=r"pip install \.\[sglang\]") as error:
        SGLangEngine("/nonexistent", eos_token_ids=EOS)
    assert str(error.value) == INSTALL_HINT
