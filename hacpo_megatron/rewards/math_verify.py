"""The project's default reward: 1.0 when a response's final answer equals the ground truth, else 0.0.

Equality is decided by HuggingFace's math-verify (symbolic and numeric comparison through sympy), so
"\\frac{1}{2}", "1/2", "0.5" and "\\dfrac12" all match a ground truth of "\\frac12".

Decisions a reader should know:
- The final answer is the last ``\\boxed{}``, else a plain final answer ("the answer is 42", a bare "42");
  see ``answers.py``. Only that answer is parsed, never the whole response.
- A final answer that restates the problem is judged by what it states, not by the problem: for a ground truth
  that is no equation, "67 + 75 + 85 = 250" answers 250 (the text after its last "="; math-verify alone parses
  the left side, 227, and calls it right), and for a ground truth that is a plain number, an answer that is
  still an unevaluated sum, difference, product or power ("67 + 75 + 85") scores 0. Found when SmolLM2,
  trained on reasoning-gym's chain_sum, learned within 12 steps to copy the problem and append any number
  (docs/real_model.md). Fractions ("3/4" for 0.75) still count: "/" writes a number.
- Numbers are compared with math-verify's default ``float_rounding=6``: an answer equal to the truth to
  6 decimal places counts, so 0.4999999 is accepted for 1/2. We keep it because published MATH-style
  numbers (and the HACPO authors' scorer) use math-verify's defaults; a stricter grader would make our
  evaluation figures incomparable. No synthetic task of ours has an answer that this could confuse.
- Time limits: math-verify's own limit uses ``signal.alarm`` (whole seconds), which only works in a
  process's main thread and cannot interrupt a long C-level call. We use it only when called directly
  in a main thread with no other alarm armed. Inside the reward pool (``pool.py``) the pool arms its own
  timers (the worker's CPU time, and the clock's as a backstop), and math-verify's is switched off: it counts
  the clock, which a loaded machine stretches, and setting it would cancel the pool's.
  Called from any other thread there is no time limit: score through the pool instead.
- This function never raises: malformed, empty or hostile input scores 0.0.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
from typing import Any, Optional

import math_verify

from hacpo_megatron.rewards.answers import final_answer, last_boxed_content, reject_reason

FLOAT_ROUNDING = 6  # math-verify's default; see the module docstring
MATH_VERIFY_TIMEOUT_S = 5  # math-verify's own limit (whole seconds) for direct main-thread calls

# With its timeout off, math-verify warns once that the caller must enforce one; the pool does.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> float:
    """verl's reward signature: 1.0 if the final answer of ``solution_str`` equals ``ground_truth``, else 0.0.

    ``data_source`` and ``extra_info`` are accepted for compatibility and not used.
    """
    try:
        return 1.0 if answer_is_correct(solution_str, ground_truth) else 0.0
    except Exception:  # math-verify and sympy can raise almost anything on hostile input
        return 0.0


def answer_is_correct(solution_str: str, ground_truth: Any) -> bool:
    if reject_reason(solution_str) is not None:
        return False
    truth = ground_truth_answer(ground_truth)
    if truth is None:
        return False
    answer = _as_parse_input(solution_str, truth)
    if answer is None:
        return False
    timeout_s = _math_verify_timeout_s()
    gold = math_verify.parse(_boxed(truth), parsing_timeout=timeout_s)
    predicted = math_verify.parse(answer, parsing_timeout=timeout_s)
    if not gold or not predicted:
        return False
    return math_verify.verify(gold, predicted, float_rounding=FLOAT_ROUNDING, timeout_seconds=timeout_s)


def ground_truth_answer(ground_truth: Any) -> Optional[str]:
    """The answer inside a ground truth given boxed ("\\boxed{12}"), plain ("12") or as a number (12)."""
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int, float)):
        return None
    text = str(ground_truth).strip()
    if "\\boxed" in text or "\\fbox" in text:
        text = last_boxed_content(text) or ""
    elif len(text) > 1 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()  # inline math "$\frac{1}{2}$"
    return text or None


_BARE_EQUALS = re.compile(r"(?<![<>!=:\\])=(?!=)")  # "=", not "<=", ">=", "!=", "==", ":=" or LaTeX's "\="
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_UNEVALUATED = re.compile(r"\d\s*(?:[-+*^×÷]|\\times|\\cdot|\\div)\s*\(?-?\d")  # "67 + 75", "3 \times 4"


def _as_parse_input(solution_str: str, truth: str) -> Optional[str]:
    """What math-verify parses for a response: its final answer (boxed when it came from a box), by what it
    states (module docstring); None when it is an unevaluated expression where a number is due."""
    boxed = last_boxed_content(solution_str)
    answer = boxed if boxed is not None else final_answer(solution_str)
    if answer is None:
        return None
    if not _BARE_EQUALS.search(truth):
        answer = _BARE_EQUALS.split(answer)[-1].strip()  # "67 + 75 + 85 = 227": the stated result
    if _PLAIN_NUMBER.fullmatch(truth.strip()) and _UNEVALUATED.search(answer):
        return None
    return _boxed(answer) if boxed is not None else answer  # plain text: math-verify finds the expression ("42.")


def _boxed(answer: str) -> str:
    return "\\boxed{" + answer + "}"


def _math_verify_timeout_s() -> Optional[int]:
    """math-verify's own time limit, or None where it cannot or must not be used (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        return None  # signal.alarm raises outside the main thread
    if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return None  # an outer limit (the reward pool's) is armed; math-verify's alarm(0) would cancel it
    return MATH_VERIFY_TIMEOUT_S
