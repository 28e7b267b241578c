"""How an agent is asked, and where its answer ends: the agent's prompt format (`agents[i].prompt_format`).

    chat              the tokenizer's own chat template; an answer ends with one of the tokenizer's end tokens
    plain             "Question: <question>\\nAnswer:"; an answer is one line
    few_shot:<file>   the file's worked examples, a blank line, then "Question: <question>\\nAnswer:"; one line

An instruction-tuned model is asked in its chat template. A base model has none (Gemma 3 270M): it continues
text, so it is shown the layout of a question and its answer, best with a few solved examples before it, and
it answers on the rest of the line. Its answer ends at the first token whose text holds a line break: those
tokens join the tokenizer's end tokens (`eos_token_ids`), so every engine stops there, the bridge cuts other
agents' answers there, and a learner appends its own line break (`answer_end_id`) where it appends an end token
to another agent's finished answer (bridge/retokenize.py), as the warm-up does to its targets.

Only the answer's text crosses the bridge (paper Sec. 3): each agent's prompt is rendered in the agent's own
format, so agents asked in different formats still learn from each other's answers. How likely a learner finds
another agent's answer, and so whether that answer falls inside HACPO's cross clip, depends on the answer's
style, which the prompts set (docs/real_model.md measures it for SmolLM2 and Gemma 3).

A format is installed as the tokenizer's chat template, so everything that renders a prompt (rollouts,
bridged prompts, evaluation, warm-up, a checkpoint's exported tokenizer) renders it the same way. The few-shot
file's text is copied into the template verbatim (a Jinja raw block). A tokenizer that starts every text with
its BOS token on its own (Gemma's) gets it in front of the prompt, as the chat templates write it themselves.

The few-shot file: plain UTF-8 text, worked examples in the same layout, separated by blank lines::

    Question: Ana has 5 pencils and gets 3 more. How many pencils does Ana have now?
    Answer: Ana has 5 + 3 = 8 pencils. The answer is 8.

    Question: ...
"""
from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path
from typing import Optional

from transformers import PreTrainedTokenizerBase

FEW_SHOT_PREFIX = "few_shot:"
LINE_BREAK = "\n"

# The plain question/answer layout (also GPT-2's built-in "chat" template, bridge/tokenizers.py): a system message
# leads, each user turn is a question, each assistant turn an answer.
QUESTION_ANSWER_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- message['content'] + '\n\n' -}}"
    "{%- elif message['role'] == 'user' -%}{{- 'Question: ' + message['content'] + '\n' -}}"
    "{%- else -%}{{- 'Answer: ' + message['content'] + '\n\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Answer:' -}}{%- endif -%}"
)


class PromptFormatError(ValueError):
    """A prompt_format value or few-shot file that cannot be used, phrased for the user."""


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    kind: str  # "chat" | "plain" | "few_shot"
    examples: str = ""  # few_shot: the file's worked examples, without leading or trailing blank lines


def parse_prompt_format(value: str) -> PromptFormat:
    """The format a config value names; a few-shot file is read and checked here (PromptFormatError if unusable)."""
    if value in ("chat", "plain"):
        return PromptFormat(value)
    if not value.startswith(FEW_SHOT_PREFIX) or not value[len(FEW_SHOT_PREFIX):].strip():
        raise PromptFormatError(f"{value!r}: expected chat, plain or few_shot:<file of worked examples>")
    path = Path(value[len(FEW_SHOT_PREFIX):].strip())
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise PromptFormatError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise PromptFormatError(f"{path}: {error.strerror or error}") from None
    examples = text.strip("\n")
    if not examples.strip():
        raise PromptFormatError(f"{path}: no worked examples (the file is empty)")
    if "endraw" in examples:  # the text goes into the template inside a raw block
        raise PromptFormatError(f"{path}: the text 'endraw' cannot appear in a few-shot file")
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip() and not line.startswith(("Question: ", "Answer: ")):
            raise PromptFormatError(f"{path}, line {number}: every example line starts with 'Question: ' or "
                                    f"'Answer: ' (an answer is one line), got {line[:60]!r}")
    return PromptFormat("few_shot", examples=examples)


def prompt_template(fmt: PromptFormat, bos_token: Optional[str]) -> str:
    """The chat template that renders prompts in a plain or few-shot format."""
    lead = "{{- bos_token -}}" if bos_token else ""
    if fmt.kind == "few_shot":
        # verbatim, and no whitespace control next to the raw block (it would strip the examples' own edges)
        lead += "{% raw %}" + fmt.examples + "{% endraw %}{{ '\\n\\n' }}"
    return lead + QUESTION_ANSWER_TEMPLATE


def _starts_texts_with_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    if tokenizer.bos_token_id is None:
        return False
    ids = tokenizer("x", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


# tokenizer -> the ids of every token whose text holds a line break, for tokenizers whose answers are lines
_line_end_ids: "weakref.WeakKeyDictionary[PreTrainedTokenizerBase, frozenset]" = weakref.WeakKeyDictionary()


def check_can_render(tokenizer: PreTrainedTokenizerBase, fmt: PromptFormat, name: str) -> None:
    """PromptFormatError if `tokenizer` cannot render prompts in `fmt`: a chat format needs a chat template."""
    if fmt.kind == "chat" and not tokenizer.chat_template:
        raise PromptFormatError(f"tokenizer {name!r} has no chat template (a base model?): give the agent "
                                "prompt_format: plain or few_shot:<file>")


def install_prompt_format(tokenizer: PreTrainedTokenizerBase, fmt: PromptFormat) -> None:
    """Make `tokenizer` render prompts in `fmt` and, for a line format, end answers at a line break (chat: the
    tokenizer as it is)."""
    if fmt.kind == "chat":
        return
    tokenizer.chat_template = prompt_template(fmt, tokenizer.bos_token if _starts_texts_with_bos(tokenizer) else None)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    _line_end_ids[tokenizer] = frozenset(i for i, text in enumerate(texts) if LINE_BREAK in text)


def line_end_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset:
    """The tokens that end an answer of a line format (none for a chat format)."""
    return _line_end_ids.get(tokenizer, frozenset())


def answer_end_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token a learner is taught to end a finished answer with: its EOS, or a line break in a line format."""
    if tokenizer in _line_end_ids:
        (line_break,) = tokenizer.encode(LINE_BREAK, add_special_tokens=False)
        return line_break
    return tokenizer.eos_token_id
