import pytest

from hacpo_megatron.rewards.answers import (
    MAX_ANSWER_NESTING,
    MAX_RESPONSE_CHARS,
    final_answer,
    last_boxed_content,
    nesting_depth,
    reject_reason,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{12}.", "12"),
        ("\\boxed{3} then \\boxed{5}", "5"),  # the last box, not all of them
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces are content
        ("\\fbox{7}", "7"),
        ("\\boxed {8}", "8"),
        ("\\boxed{3} and \\boxed{5", None),  # truncated last box: no answer, not the earlier one
        ("no box", None),
        ("\\boxed", None),
        ("\\boxedx{1}", None),
    ],
)
def test_last_boxed_content(text, expected):
    assert last_boxed_content(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Reasoning...\n\\boxed{12}", "12"),
        ("3 + 4 = 7, so the answer is 42.", "42."),
        ("The answer is 42.\n\nHope that helps!", "42."),  # the anchor wins over the last line
        ("Final answer: 9", "9"),
        ("7 + 5\n12\n", "12"),  # the last non-empty line
        ("   \n  ", None),
        ("Reasoning \\boxed{12", None),
    ],
)
def test_final_answer(text, expected):
    assert final_answer(text) == expected


def test_nesting_depth():
    assert nesting_depth("12") == 0
    assert nesting_depth("\\frac{\\sqrt{2}}{2}") == 2
    assert nesting_depth("((a)[b{c}])") == 3
    assert nesting_depth(")))(") == 1  # stray closers are ignored


@pytest.mark.parametrize(
    "response, reason",
    [
        (None, "not_a_string"),
        (42, "not_a_string"),
        ("", "empty"),
        ("  \n", "empty"),
        ("x" * MAX_RESPONSE_CHARS + "\\boxed{1}", "oversize"),
        ("\\boxed{1", "no_answer"),
        ("\\boxed{" + "1+" * 300 + "1}", "answer_too_long"),
        ("\\boxed{" + "\\frac{1}{" * (MAX_ANSWER_NESTING + 1) + "2" + "}" * (MAX_ANSWER_NESTING + 1) + "}",
         "answer_too_nested"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", None),
        ("the answer is 12", None),
    ],
)
def test_reject_reason(response, reason):
    assert reject_reason(response) == reason
