"""Reward plug-ins by dotted path, e.g. ``reward.function: my_project.rewards.exact_match``.

A plug-in is a module-level function ``fn(data_source, solution_str, ground_truth, extra_info=None) -> float``
(verl's signature). It must be importable by name because reward workers are separate processes.
"""

from __future__ import annotations

import importlib
from typing import Callable

DEFAULT_REWARD_FUNCTION = "hacpo_megatron.rewards.math_verify.compute_score"


class RewardFunctionError(ValueError):
    """The configured reward function cannot be loaded."""


def load_reward_function(dotted_path: str) -> Callable[..., float]:
    """The callable named by ``"package.module.function"``; a RewardFunctionError naming the path otherwise."""
    module_name, _, attribute = (dotted_path or "").strip().rpartition(".")
    if not module_name or not attribute:
        raise RewardFunctionError(
            f"reward function {dotted_path!r}: expected a dotted path 'package.module.function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardFunctionError(
            f"reward function {dotted_path!r}: cannot import module {module_name!r}: {exc}"
        ) from exc
    except Exception as exc:  # the user's module itself fails: a SyntaxError (file, line), or raises at import
        where = f" ({exc.filename}, line {exc.lineno})" if isinstance(exc, SyntaxError) else ""
        raise RewardFunctionError(
            f"reward function {dotted_path!r}: importing module {module_name!r} raised "
            f"{type(exc).__name__}{where}: {exc.msg if isinstance(exc, SyntaxError) else exc}"
        ) from exc
    if not hasattr(module, attribute):
        raise RewardFunctionError(
            f"reward function {dotted_path!r}: module {module_name!r} has no attribute {attribute!r}"
        )
    function = getattr(module, attribute)
    if not callable(function):
        raise RewardFunctionError(
            f"reward function {dotted_path!r}: {attribute!r} is a {type(function).__name__}, not a callable"
        )
    return function
