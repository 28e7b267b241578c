"""A reward function of your own (docs/bring_your_own.md), in verl's signature, named in a config by its dotted path:

    reward:
      function: examples.bring_your_own.reward.last_number_matches

The run imports it by that path in the reward's worker processes: keep it a module-level function, in a module
importable from the folder the run starts in (`make run` starts in the repository root, which Ray puts on its
workers' path; elsewhere, install your package or put its folder on PYTHONPATH).
"""
import re

# an integer or decimal, with an optional sign and thousands separators: "13", "-2", "1,000", "3.14", ".5"
NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def last_number_matches(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 if the last number of the answer equals the reference answer, within the row's `extra_info["tolerance"]`
    (0 when the row sets none), else 0.0. `data_source` is the row's source (every source is scored alike here);
    the return value must lie in `reward.range` ([0, 1] unless the config widens it)."""
    numbers = NUMBER.findall(solution_str)
    if not numbers:
        return 0.0
    try:
        answer = float(numbers[-1].replace(",", ""))
        reference = float(str(ground_truth).replace(",", ""))
    except ValueError:  # a reference answer that is no number: this function cannot judge it
        return 0.0
    tolerance = float((extra_info or {}).get("tolerance", 0.0))
    return 1.0 if abs(answer - reference) <= tolerance else 0.0
