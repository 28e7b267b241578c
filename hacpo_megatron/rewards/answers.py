"""Finding a response's final answer, and cheap checks that reject a response before any parsing.

The final answer is what the model wrote last:
  1. the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), if the response has one;
     a last box that is never closed (a truncated response) means *no* answer, not an earlier box;
  2. otherwise the rest of the line after the last "answer is" / "answer:" (e.g. "... the answer is 42.");
  3. otherwise the last non-empty line (e.g. a bare "12").

Everything here is plain string scanning, linear in the length of the text, so the reward pool can run it
in the training process for every response before sending anything to a worker.
"""

from __future__ import annotations

import re
from typing import Any, Optional

# A response longer than this scores 0 unparsed: math answers are short, and parsing cost grows fast.
MAX_RESPONSE_CHARS = 20_000
# Limits on the final answer itself. Legitimate answers are far below both
# (e.g. "\left(\frac{3}{2}, -\frac{\sqrt{5}}{2}\right)" is 45 characters, nesting 3); math-verify needs
# about 0.25 s for 10 nested \frac and over 5 s for 30, so deep nesting is rejected before parsing.
MAX_ANSWER_CHARS = 500
MAX_ANSWER_NESTING = 10

# Reasons a response is scored 0 without parsing, in the order they are checked.
REJECT_REASONS = ("not_a_string", "empty", "oversize", "no_answer", "answer_too_long", "answer_too_nested")

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_ANCHOR = re.compile(r"answer\s*(?:is|:)\s*", re.IGNORECASE)
_OPENERS = "([{"
_CLOSERS = ")]}"


def last_boxed_content(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` in ``text``; None if there is none or it is unclosed."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    brace = text.find("{", start)
    # "\boxed" must be followed directly (spaces allowed) by its brace.
    if brace < 0 or text[start:brace].rstrip() not in _BOX_COMMANDS:
        return None
    end = _matching_brace(text, brace)
    if end is None:
        return None
    return text[brace + 1 : end].strip()


def _matching_brace(text: str, open_index: int) -> Optional[int]:
    """Index of the ``}`` closing the ``{`` at ``open_index``; escaped braces ``\\{ \\}`` do not count."""
    depth = 0
    i = open_index
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # skip the escaped character, so "\{" and "\}" are content
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def final_answer(text: str) -> Optional[str]:
    """The final answer of a response (see the module docstring), stripped; None when there is none."""
    if any(command in text for command in _BOX_COMMANDS):
        answer = last_boxed_content(text)
    else:
        anchors = list(_ANSWER_ANCHOR.finditer(text))
        if anchors:
            answer = text[anchors[-1].end() :].split("\n", 1)[0]
        else:
            lines = [line for line in text.splitlines() if line.strip()]
            answer = lines[-1] if lines else None
    if answer is None:
        return None
    answer = answer.strip()
    return answer or None


def nesting_depth(text: str) -> int:
    """Deepest nesting of (), [] and {} in ``text`` (unbalanced closers are ignored)."""
    depth = deepest = 0
    for char in text:
        if char in _OPENERS:
            depth += 1
            deepest = max(deepest, depth)
        elif char in _CLOSERS and depth > 0:
            depth -= 1
    return deepest


def reject_reason(solution_str: Any) -> Optional[str]:
    """Why ``solution_str`` scores 0 without parsing (one of REJECT_REASONS), or None if it must be parsed."""
    if not isinstance(solution_str, str):
        return "not_a_string"
    if not solution_str.strip():
        return "empty"
    if len(solution_str) > MAX_RESPONSE_CHARS:
        return "oversize"
    answer = final_answer(solution_str)
    if answer is None:
        return "no_answer"
    if len(answer) > MAX_ANSWER_CHARS:
        return "answer_too_long"
    if nesting_depth(answer) > MAX_ANSWER_NESTING:
        return "answer_too_nested"
    return None


def reject_oversize(solution_str: Any) -> Optional[str]:
    """The format-free part of reject_reason, for reward plug-ins that read answers their own way."""
    if not isinstance(solution_str, str):
        return "not_a_string"
    if len(solution_str) > MAX_RESPONSE_CHARS:
        return "oversize"
    return None
