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
