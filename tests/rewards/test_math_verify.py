"""Hand cases of the default reward; each line is one a plausible wrong implementation gets wrong."""

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hacpo_megatron.rewards.math_verify import compute_score, ground_truth_answer


def score(response, truth):
    return compute_score("test", response, truth)


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        # boxed answers
        ("Adding them: \\boxed{42}", "42", 1.0),
        ("Adding them: \\boxed{41}", "42", 0.0),
        ("First \\boxed{5} then, correcting myself, \\boxed{3}", "3", 1.0),
        ("First \\boxed{3} then, correcting myself, \\boxed{5}", "3", 0.0),  # only the last box counts
        ("\\boxed{-7}", "7", 0.0),
        # fractions, decimals, LaTeX forms
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac12", 1.0),
        ("\\boxed{1/2}", "$\\frac{1}{2}$", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "\\boxed{\\frac34}", 1.0),
        ("\\boxed{0.49}", "1/2", 0.0),
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", 0.0),
        ("\\boxed{\\pi}", "\\pi", 1.0),
        ("\\boxed{3.14}", "\\pi", 0.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{(1,2)}", "(1,2)", 1.0),
        ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),
        ("\\boxed{1234}", "1,234", 1.0),
        ("\\boxed{10\\%}", "10\\%", 1.0),
        # plain final answers
        ("So 3 + 4 = 7. The answer is 42.", "42", 1.0),
        ("The answer is 42.\n\nHope this helps!", "42", 1.0),
        ("12", "12", 1.0),
        ("-3", "-3", 1.0),
        ("7 + 5 = 13\n13", "12", 0.0),
        ("answer: 7", "7", 1.0),
        # ground truth as a number
        ("\\boxed{12}", 12, 1.0),
        # malformed or empty: 0, no exception
        ("\\boxed{12", "12", 0.0),
        ("\\boxed{}", "12", 0.0),
        ("", "12", 0.0),
        (None, "12", 0.0),
        ("\\boxed{12}", "", 0.0),
        ("\\boxed{12}", None, 0.0),
        ("\\boxed{12}", ["12"], 0.0),
        ("\\boxed{\\frac{}{}}", "1", 0.0),
        ("x" * 20_001 + "\\boxed{1}", "1", 0.0),  # oversize: not even parsed
    ],
)
def test_hand_cases(response, truth, expected):
    assert score(response, truth) == expected


@pytest.mark.parametrize("response, truth, expected", [
    # SmolLM2's answers after 12 steps on reasoning-gym's chain_sum: the problem restated, any number appended.
    # math-verify alone parses the left side (the problem, which equals the truth) and scored them all 1.
    ("The final answer to the arithmetic problem is 67 + 75 + 85 = 250.", "227", 0.0),
    ("The final answer to the arithmetic problem is 3 - 7 = 2.", "-4", 0.0),
    ("\\boxed{67+75+85=250}", "227", 0.0),
    ("The final answer to the arithmetic problem is 67 + 75 + 85 = 227.", "227", 1.0),  # the stated result counts
    ("3 - 7 = -4", "-4", 1.0),
    ("so he has 5 + 8 = 13 pencils.", "13", 1.0),
    ("so he has 5 + 8 = 14 pencils.", "13", 0.0),
    # an unevaluated expression where a number is due: the problem copied, nothing computed
    ("The answer is 67 + 75 + 85", "227", 0.0),
    ("\\boxed{2^3}", "8", 0.0),
    ("The answer is 6 \\times 7", "42", 0.0),
    # what stays right: equations as truths, fractions and negatives as numbers, relations
    ("\\boxed{y = 2x + 3}", "y=2x+3", 1.0),
    ("x = 5", "5", 1.0),
    ("The answer is 3/4", "0.75", 1.0),
    ("The answer is -4.", "-4", 1.0),
    ("\\boxed{x \\leq 3}", "x \\leq 3", 1.0),
])
def test_an_answer_is_judged_by_what_it_states_not_by_the_problem_it_restates(response, truth, expected):
    assert compute_score("reasoning_gym:chain_sum", response, truth) == expected


def test_float_rounding_decision_is_math_verify_default():
    # Documented decision: agreement to 6 decimal places counts (comparable with published graders).
    assert score("\\boxed{0.4999999}", "\\frac{1}{2}") == 1.0
    assert score("\\boxed{0.49999}", "\\frac{1}{2}") == 0.0


@pytest.mark.parametrize(
    "truth, answer",
    [("\\boxed{12}", "12"), ("Thus \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"), (" 7 ", "7"), (3, "3"), ("$x$", "x"),
     ("", None)],
)
def test_ground_truth_answer(truth, answer):
    assert ground_truth_answer(truth) == answer


def test_works_outside_the_main_thread():
    # math-verify's own timeout raises outside the main thread; compute_score must switch it off there.
    results = []
    thread = threading.Thread(target=lambda: results.append(score("\\boxed{\\frac{2}{4}}", "1/2")))
    thread.start()
    thread.join()
    assert results == [1.0]


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200), st.text(max_size=20))
def test_never_raises_and_is_binary(response, truth):
    assert score(response, truth) in (0.0, 1.0)
