import pytest

from hacpo_megatron.rewards.math_verify import compute_score
from hacpo_megatron.rewards.registry import DEFAULT_REWARD_FUNCTION, RewardFunctionError, load_reward_function
from tests.rewards.plugins import exact_match


def test_loads_default_and_plugins():
    assert load_reward_function(DEFAULT_REWARD_FUNCTION) is compute_score
    assert load_reward_function("tests.rewards.plugins.exact_match") is exact_match


@pytest.mark.parametrize(
    "path, message",
    [
        ("compute_score", "expected a dotted path"),
        ("", "expected a dotted path"),
        ("no_such_package.scores.fn", "cannot import module 'no_such_package.scores'"),
        ("tests.rewards.plugins.missing_fn", "has no attribute 'missing_fn'"),
        ("tests.rewards.plugins.NOT_CALLABLE", "not a callable"),
    ],
)
def test_errors_name_the_path(path, message):
    with pytest.raises(RewardFunctionError, match=message) as error:
        load_reward_function(path)
    assert repr(path) in str(error.value)


@pytest.mark.parametrize("source, message", [
    ("def score(a, b:\n    return 1.0\n",
     r"importing module 'user_reward' raised SyntaxError \(.*user_reward.py, line 1\): "),
    ("import json\nTABLE = json.loads('{')\n", r"importing module 'user_reward' raised JSONDecodeError: Expecting"),
])
def test_a_module_that_fails_as_it_imports_is_named_with_what_it_raised(tmp_path, monkeypatch, source, message):
    """Not only a missing module: the user's own file with a syntax error (its file and line), or one that raises
    at import, is a RewardFunctionError, which the launcher reports before any work, not a traceback."""
    (tmp_path / "user_reward.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "user_reward", raising=False)
    with pytest.raises(RewardFunctionError, match=message):
        load_reward_function("user_reward.score")
