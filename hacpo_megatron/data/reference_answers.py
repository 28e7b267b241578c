"""Getting a reference final answer out of the fields datasets store it in."""

from __future__ import annotations

from typing import Any

from hacpo_megatron.rewards.answers import last_boxed_content

# A solution field with neither a box nor '####' is taken as the answer itself only when it is this short
# and on one line (Minerva-style files store the bare answer under "solution"); longer text is an error.
MAX_BARE_SOLUTION_CHARS = 200


class AnswerFormatError(ValueError):
    """A field holds no recognisable final answer."""


def answer_from_field(value: Any, field_name: str) -> str:
    """The final answer held by ``value``, read according to its usual formats.

    - a list (OlympiadBench ``final_answer``): its items, each read alone, joined by ", ";
    - text with ``####`` (GSM8K): the text after the last ``####``, without thousands separators;
    - text with ``\\boxed{}`` (MATH solutions): the last box's content;
    - inline math ``$...$``: its content;
    - a number: its decimal text;
    - otherwise: the text itself, except that a field named like a solution must be short and on one line.
    """
    if isinstance(value, (list, tuple)):
        if not value:
            raise AnswerFormatError(f"field {field_name!r} is an empty list")
        return ", ".join(answer_from_field(item, field_name) for item in value)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise AnswerFormatError(f"field {field_name!r} is a {type(value).__name__}, expected text or a number")
    text = str(value).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    elif "\\boxed" in text or "\\fbox" in text:
        boxed = last_boxed_content(text)
        if boxed is None:
            raise AnswerFormatError(f"field {field_name!r} has an unclosed \\boxed{{")
        text = boxed
    elif "solution" in field_name and (len(text) > MAX_BARE_SOLUTION_CHARS or "\n" in text):
        raise AnswerFormatError(f"field {field_name!r} holds a worked solution with no \\boxed{{}} or '####' answer")
    if len(text) > 1 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    if not text:
        raise AnswerFormatError(f"field {field_name!r} holds an empty answer")
    return text
