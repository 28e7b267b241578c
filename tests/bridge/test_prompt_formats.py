"""Prompt formats (bridge/prompt_formats.py): how each agent is asked, where its answers end, and what crosses
the bridge between a chat-asked SmolLM2 and a few-shot-asked Gemma 3 (the real pair's tokenizers)."""
import pytest

from hacpo_megatron.bridge import bridge_responses, eos_token_ids, load_tokenizer, render_prompt
from hacpo_megatron.bridge.prompt_formats import (
    PromptFormatError, answer_end_id, check_can_render, line_end_ids, parse_prompt_format,
)
from hacpo_megatron.data.records import PromptRecord, user_prompt
from hacpo_megatron.training.warmup import build_examples

FEW_SHOT = "configs/real/prompts/word_problems_3shot.txt"
QUESTION = "Ines has 5 pencils and gets 8 more. How many pencils does Ines have now?"
SMOL_CHAT = load_tokenizer("smollm2")
SMOL_FEW = load_tokenizer("smollm2", f"few_shot:{FEW_SHOT}")
GEMMA_FEW = load_tokenizer("gemma3", f"few_shot:{FEW_SHOT}")
GEMMA_PLAIN = load_tokenizer("gemma3", "plain")


def text_of(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_a_few_shot_prompt_is_bos_then_the_files_examples_a_blank_line_and_the_question():
    examples = open(FEW_SHOT, encoding="utf-8").read().strip("\n")
    ids = render_prompt(GEMMA_FEW, user_prompt(QUESTION))
    assert ids[0] == GEMMA_FEW.bos_token_id and ids.count(GEMMA_FEW.bos_token_id) == 1  # Gemma's texts start with it
    assert text_of(GEMMA_FEW, ids[1:]) == f"{examples}\n\nQuestion: {QUESTION}\nAnswer:"
    # SmolLM2's tokenizer adds no BOS of its own, so its prompt in the same format has none
    assert (text_of(SMOL_FEW, render_prompt(SMOL_FEW, user_prompt(QUESTION)))
            == f"{examples}\n\nQuestion: {QUESTION}\nAnswer:")
    assert (text_of(GEMMA_PLAIN, render_prompt(GEMMA_PLAIN, user_prompt(QUESTION))[1:])
            == f"Question: {QUESTION}\nAnswer:")
    # the prompt tokenizes as the same text would on its own (the template adds no odd token boundary)
    assert (render_prompt(GEMMA_PLAIN, user_prompt(QUESTION))
            == GEMMA_PLAIN(f"Question: {QUESTION}\nAnswer:")["input_ids"])


def test_a_system_message_leads_and_chat_stays_the_tokenizers_own_template():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    assert (text_of(GEMMA_PLAIN, render_prompt(GEMMA_PLAIN, messages)[1:])
            == f"Be brief.\n\nQuestion: {QUESTION}\nAnswer:")
    assert text_of(SMOL_CHAT, render_prompt(SMOL_CHAT, user_prompt(QUESTION))).startswith("<|im_start|>system")
    assert line_end_ids(SMOL_CHAT) == frozenset() and answer_end_id(SMOL_CHAT) == SMOL_CHAT.eos_token_id


@pytest.mark.parametrize("tokenizer", [GEMMA_FEW, SMOL_FEW], ids=["gemma3", "smollm2"])
def test_in_a_line_format_every_token_holding_a_line_break_ends_an_answer_and_no_other(tokenizer):
    ends = eos_token_ids(tokenizer)
    lines = line_end_ids(tokenizer)
    assert lines <= ends and tokenizer.eos_token_id in ends
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    assert lines == {i for i, text in enumerate(texts) if "\n" in text}
    assert len(lines) > 1 and answer_end_id(tokenizer) in lines
    assert tokenizer.decode([answer_end_id(tokenizer)]) == "\n"
    assert tokenizer.encode(" The answer is 8.", add_special_tokens=False)[-1] not in ends


def test_a_chat_answer_bridged_to_a_few_shot_learner_ends_with_the_learners_line_break():
    answer = "Ines has 5 + 8 = 13 pencils."
    smol_ids = SMOL_CHAT.encode(answer, add_special_tokens=False) + [SMOL_CHAT.eos_token_id]
    (row,) = bridge_responses(SMOL_CHAT, GEMMA_FEW, [smol_ids], prompts_messages=[user_prompt(QUESTION)],
                              source_logprob_sums=[-3.0], finish_reasons=["stop"])
    assert row.prompt_ids == render_prompt(GEMMA_FEW, user_prompt(QUESTION))
    assert row.response_ids[-1] == answer_end_id(GEMMA_FEW) and row.ended_with_eos
    assert GEMMA_FEW.decode(row.response_ids[:-1]) == answer
    assert row.source_length == len(smol_ids)


def test_a_few_shot_answer_ends_at_its_line_break_for_a_chat_learner_and_what_follows_is_dropped():
    answer = " Ines has 5 + 8 = 13 pencils. The answer is 13."
    gemma_ids = GEMMA_FEW.encode(answer + "\n\nQuestion: Tom", add_special_tokens=False)
    end = next(i for i, t in enumerate(gemma_ids) if t in eos_token_ids(GEMMA_FEW))
    (row,) = bridge_responses(GEMMA_FEW, SMOL_CHAT, [gemma_ids], prompts_messages=[user_prompt(QUESTION)],
                              source_logprob_sums=[-5.0], finish_reasons=["stop"])
    assert row.source_length == end + 1  # L_j covers the answer and the token that ended it, nothing after
    assert row.response_ids[-1] == SMOL_CHAT.eos_token_id and row.ended_with_eos
    assert SMOL_CHAT.decode(row.response_ids[:-1]) == answer
    # a truncated line (no line break) stays open-ended for the learner
    (open_row,) = bridge_responses(GEMMA_FEW, SMOL_CHAT, [gemma_ids[:end]], prompts_messages=[user_prompt(QUESTION)],
                                   source_logprob_sums=[-5.0], finish_reasons=["length"])
    assert not open_row.ended_with_eos and SMOL_CHAT.decode(open_row.response_ids) == answer


def test_one_vocabulary_in_two_formats_keeps_the_sampled_ids_and_swaps_the_end_token():
    """SmolLM2 asked in its chat template, a second SmolLM2 in few-shot lines: the ids need no retokenising,
    but the learner must be taught its own end (a line break), never the source's <|im_end|>."""
    answer_ids = SMOL_CHAT.encode("Ines has 5 + 8 = 13 pencils.", add_special_tokens=False)
    rows = bridge_responses(SMOL_CHAT, SMOL_FEW, [answer_ids + [SMOL_CHAT.eos_token_id], answer_ids],
                            prompts_messages=[user_prompt(QUESTION)] * 2, source_logprob_sums=[-3.0, -2.0],
                            finish_reasons=["stop", "length"])
    assert rows[0].response_ids == answer_ids + [answer_end_id(SMOL_FEW)] and rows[0].ended_with_eos
    assert rows[1].response_ids == answer_ids and not rows[1].ended_with_eos  # cut short: stays open
    assert rows[0].prompt_ids == render_prompt(SMOL_FEW, user_prompt(QUESTION))
    # and back: a few-shot line's break becomes the chat learner's end token
    (back,) = bridge_responses(SMOL_FEW, SMOL_CHAT, [rows[0].response_ids], prompts_messages=[user_prompt(QUESTION)],
                               source_logprob_sums=[-3.0], finish_reasons=["stop"])
    assert back.response_ids == answer_ids + [SMOL_CHAT.eos_token_id]
    # one vocabulary and one format: untouched, whatever the ids
    (same,) = bridge_responses(SMOL_CHAT, SMOL_CHAT, [answer_ids + [SMOL_CHAT.eos_token_id]],
                               prompts_messages=[user_prompt(QUESTION)], source_logprob_sums=[-3.0],
                               finish_reasons=["stop"])
    assert same.response_ids == answer_ids + [SMOL_CHAT.eos_token_id]


def test_the_warm_up_teaches_a_line_format_agent_to_end_with_a_line_break():
    record = PromptRecord("a", user_prompt(QUESTION), "13", "test")
    ((prompt, answer),) = build_examples(GEMMA_FEW, [record])
    assert prompt == render_prompt(GEMMA_FEW, user_prompt(QUESTION))
    assert answer[-1] == answer_end_id(GEMMA_FEW)
    ((_, chat_answer),) = build_examples(SMOL_CHAT, [record])
    assert chat_answer[-1] == SMOL_CHAT.eos_token_id


def test_loading_one_tokenizer_in_two_formats_gives_two_objects_and_leaves_the_chat_one_alone():
    assert load_tokenizer("smollm2") is SMOL_CHAT and SMOL_FEW is not SMOL_CHAT
    assert SMOL_CHAT.chat_template != SMOL_FEW.chat_template
    assert eos_token_ids(SMOL_CHAT) < eos_token_ids(SMOL_FEW)


@pytest.mark.parametrize("value, message", [
    ("chatml", "expected chat, plain or few_shot:<file"),
    ("few_shot:", "expected chat, plain or few_shot:<file"),
    ("few_shot:/nonexistent/shots.txt", "/nonexistent/shots.txt: No such file or directory"),
])
def test_a_bad_prompt_format_is_named(value, message):
    with pytest.raises(PromptFormatError, match=message.replace("(", r"\(")):
        parse_prompt_format(value)


def test_a_bad_few_shot_file_is_named_with_its_line(tmp_path):
    path = tmp_path / "shots.txt"
    path.write_text("Question: What is 2 + 2?\nAnswer: 4\n\nQ: What is 3 + 3?\n", encoding="utf-8")
    with pytest.raises(PromptFormatError, match=rf"{path}, line 4: every example line starts with 'Question: '"):
        parse_prompt_format(f"few_shot:{path}")
    path.write_bytes(b"Question: caf\xe9\n")
    with pytest.raises(PromptFormatError, match="not UTF-8"):
        parse_prompt_format(f"few_shot:{path}")
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(PromptFormatError, match="no worked examples"):
        parse_prompt_format(f"few_shot:{path}")


def test_chat_on_a_tokenizer_without_a_chat_template_is_named(tmp_path):
    SMOL_CHAT.save_pretrained(tmp_path)
    for name in ("chat_template.jinja", "chat_template.json"):
        (tmp_path / name).unlink(missing_ok=True)
    import json
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    bare = load_tokenizer(str(tmp_path))  # loads (a bridge or a converter needs no template)...
    with pytest.raises(PromptFormatError, match="has no chat template .* prompt_format: plain or few_shot"):
        check_can_render(bare, parse_prompt_format("chat"), str(tmp_path))  # ...but cannot be asked in chat
    check_can_render(load_tokenizer(str(tmp_path), "plain"), parse_prompt_format("plain"), str(tmp_path))
    assert load_tokenizer(str(tmp_path), "plain").chat_template  # the line formats bring their own
