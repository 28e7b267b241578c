"""Hand agent j's response to learner k in k's own tokens (paper Sec. 3: detokenize, then retokenize).

A response crosses the bridge as text:

    source ids --trim--> response as generated (L_j tokens, what j's old log-prob sum covers)
               --decode, special tokens skipped--> text
               --learner encode, no added specials, specials in the text kept as text--> learner ids
               --+ learner EOS iff the source ended with EOS--> response for learner k (L_k tokens)

and the prompt is rendered again with k's own chat template. Decisions, and why:

- Where a response ends: at the first token of `eos_token_ids(source)`; whatever follows is padding.
  A response without one (truncated at the length limit, or stopped by a stop string) is stripped of
  trailing pad tokens only.
- EOS: the learner gets its own EOS exactly when the source's response ended with one of the source's end
  tokens. Correct answers usually end that way, so learners learn from others when to stop; a truncated
  response stays open-ended for the learner too. A learner asked in a line prompt format (a base model,
  bridge/prompt_formats.py) ends its answers with a line break, and gets that instead of its EOS; a source
  in a line format ended its answer at its first token holding a line break.
- Special tokens: decoding skips them, wherever they are, so the source's control tokens never reach another
  tokenizer; encoding treats special-token strings that occur in the text (a model can spell
  "<|eot_id|>" out of ordinary tokens) as plain text, so no text becomes a control token for the learner.
  Added tokens that are not special (Qwen3's `<think>`, `</think>`) are ordinary text on both sides, and a
  learner whose vocabulary has them gets them as the single token it would generate itself.
- Text normalisation: Qwen3's tokenizer normalises its input to Unicode NFC ("e" + U+0301 becomes "é");
  Llama 3.2 and GPT-2 keep text byte for byte. So a response bridged to Qwen3 decodes to the NFC form of
  the source's text, and to exactly the source's text otherwise. No tokenizer here strips or folds
  whitespace. A multi-byte character cut in half by truncation decodes to U+FFFD on both sides.
- Identical vocabularies (e.g. Qwen3-1.7B and Qwen3-4B): the source's ids are the learner's ids, untouched
  (decode/encode may not return the ids the model sampled), so L_k = L_j; when the two are asked in formats
  with different end tokens (chat and few-shot), the source's end token is swapped for the learner's.
- Thinking: Qwen3's template takes `enable_thinking`. True (the template's own default, and what verl
  renders when it passes no flag, as the paper's authors did) ends the prompt at `<|im_start|>assistant\\n`;
  False appends the empty `<think>\\n\\n</think>\\n\\n` block. Templates without the flag ignore it. Whatever
  is chosen, a learner's own rollouts and the responses bridged to it must use the same value, which is why
  both go through `render_prompt`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from transformers import PreTrainedTokenizerBase

from hacpo_megatron.bridge.prompt_formats import answer_end_id
from hacpo_megatron.bridge.tokenizers import eos_token_ids, pad_token_id, same_vocabulary

Messages = Sequence[Mapping[str, str]]  # chat messages: [{"role": "user", "content": "..."}, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class BridgedResponse:
    """One response of source agent j, as learner k sees it."""

    prompt_ids: list[int]  # the prompt in the learner's chat template, generation prompt included
    response_ids: list[int]  # the response in the learner's tokens (learner EOS last iff ended_with_eos)
    source_length: int  # L_j: the response's length in source tokens, EOS included: what the log-prob sum covers
    source_logprob_sum: float  # sum of the source's old log-probs over those L_j tokens
    finish_reason: str  # as the source's engine reported it ("stop", "length", ...)
    ended_with_eos: bool  # the source's response ended with one of the source's end tokens

    @property
    def learner_length(self) -> int:
        """L_k: the response's length in learner tokens.

        0 only for a truncated response made of the source's control tokens alone: it carries no text, and a
        trainer drops it (its token-mean is undefined).
        """
        return len(self.response_ids)

    @property
    def old_seq_logp(self) -> float:
        """The source's mean old log-prob per token, the denominator of the cross-agent ratio."""
        return self.source_logprob_sum / self.source_length


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: Messages, *, enable_thinking: bool = True) -> list[int]:
    """The prompt in the tokenizer's own chat template, ending with the generation prompt."""
    text = tokenizer.apply_chat_template(
        [dict(message) for message in messages],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
    )
    # The template writes its control tokens (and Llama's BOS) itself: encode them as such, add nothing.
    return tokenizer.encode(text, add_special_tokens=False)


def render_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence) -> list[list[int]]:
    """Each prompt record's messages (`.messages`) rendered as `render_prompt` does."""
    return [render_prompt(tokenizer, p.messages) for p in prompts]


def trim_response(
    response_ids: Sequence[int], end_ids: frozenset[int], pad_id: int
) -> tuple[list[int], bool]:
    """The response as generated (up to and including its first end token) and whether it ended that way."""
    for position, token_id in enumerate(response_ids):
        if token_id in end_ids:
            return list(response_ids[: position + 1]), True
    length = len(response_ids)
    while length > 0 and response_ids[length - 1] == pad_id:
        length -= 1
    return list(response_ids[:length]), False


def _decode_texts(tokenizer: PreTrainedTokenizerBase, contents: list[list[int]]) -> list[str]:
    # clean_up_tokenization_spaces would delete spaces before punctuation: never wanted for byte-level BPE.
    return tokenizer.batch_decode(contents, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    # split_special_tokens: a special token's string inside the text stays text (never a control token).
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def decode_response(tokenizer: PreTrainedTokenizerBase, response_ids: Sequence[int]) -> tuple[str, bool]:
    """The response's text, without its end token, padding and special tokens; and whether it ended with EOS."""
    generated, ended_with_eos = trim_response(response_ids, eos_token_ids(tokenizer), pad_token_id(tokenizer))
    content = generated[:-1] if ended_with_eos else generated
    return _decode_texts(tokenizer, [content])[0], ended_with_eos


def bridge_responses(
    source_tokenizer: PreTrainedTokenizerBase,
    learner_tokenizer: PreTrainedTokenizerBase,
    responses_ids: Sequence[Sequence[int]],
    *,
    prompts_messages: Sequence[Messages],
    source_logprob_sums: Sequence[float],
    finish_reasons: Sequence[str],
    enable_thinking: bool = True,
) -> list[BridgedResponse]:
    """Bridge many responses of one source agent to one learner at once (batch decode and encode).

    `responses_ids[i]` answers `prompts_messages[i]`; padding after the response is allowed. Each distinct
    prompt is rendered once (an agent answers each prompt G times).
    """
    count = len(responses_ids)
    if not count == len(prompts_messages) == len(source_logprob_sums) == len(finish_reasons):
        raise ValueError(
            f"one prompt, log-prob sum and finish reason per response: got {count} responses, "
            f"{len(prompts_messages)} prompts, {len(source_logprob_sums)} sums, {len(finish_reasons)} reasons"
        )
    end_ids, pad_id = eos_token_ids(source_tokenizer), pad_token_id(source_tokenizer)
    trimmed = [trim_response(ids, end_ids, pad_id) for ids in responses_ids]
    if any(not generated for generated, _ in trimmed):
        raise ValueError("empty response: its old log-prob per token (sum / L_j) is undefined")

    same_ids = same_vocabulary(source_tokenizer, learner_tokenizer)
    if same_ids and end_ids == eos_token_ids(learner_tokenizer):
        learner_responses = [generated for generated, _ in trimmed]
    else:
        contents = [generated[:-1] if ended else generated for generated, ended in trimmed]
        # one vocabulary, asked in other formats: the sampled ids stay, the learner's own end replaces the source's
        encoded = contents if same_ids else _encode_texts(learner_tokenizer, _decode_texts(source_tokenizer, contents))
        learner_eos = answer_end_id(learner_tokenizer)
        learner_responses = [ids + [learner_eos] if ended else ids for ids, (_, ended) in zip(encoded, trimmed)]

    rendered: dict[tuple[tuple[str, str], ...], list[int]] = {}
    bridged = []
    for messages, (generated, ended), learner_ids, logprob_sum, finish_reason in zip(
        prompts_messages, trimmed, learner_responses, source_logprob_sums, finish_reasons
    ):
        key = tuple((message["role"], message["content"]) for message in messages)
        if key not in rendered:
            rendered[key] = render_prompt(learner_tokenizer, messages, enable_thinking=enable_thinking)
        bridged.append(
            BridgedResponse(
                prompt_ids=rendered[key],
                response_ids=learner_ids,
                source_length=len(generated),
                source_logprob_sum=float(logprob_sum),
                finish_reason=finish_reason,
                ended_with_eos=ended,
            )
        )
    return bridged


def bridge_response(
    source_tokenizer: PreTrainedTokenizerBase,
    learner_tokenizer: PreTrainedTokenizerBase,
    response_ids: Sequence[int],
    *,
    prompt_messages: Messages,
    source_logprob_sum: float,
    finish_reason: str,
    enable_thinking: bool = True,
) -> BridgedResponse:
    """Bridge one response of the source agent to the learner (see the module docstring for the rules)."""
    (bridged,) = bridge_responses(
        source_tokenizer,
        learner_tokenizer,
        [response_ids],
        prompts_messages=[prompt_messages],
        source_logprob_sums=[source_logprob_sum],
        finish_reasons=[finish_reason],
        enable_thinking=enable_thinking,
    )
    return bridged
