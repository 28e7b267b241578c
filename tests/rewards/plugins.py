"""Reward plug-ins for the tests. Module-level, so that spawned reward workers can import them by name."""

import math
import signal
import time


def misbehaving_reward(data_source, solution_str, ground_truth, extra_info=None):
    """Does what ``solution_str`` says, to exercise each failure of a plug-in; else exact match."""
    if solution_str == "sleep forever":
        time.sleep(1e9)  # interruptible: the worker's timer ends it
    if solution_str == "hang in C":
        # SIGALRM blocked: like a long C-level call, the worker's timer cannot end it; only the parent can.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(1e9)
    if solution_str == "raise":
        raise RuntimeError("plug-in bug")
    if solution_str == "nan":
        return math.nan
    if solution_str == "not a number":
        return "high"
    return 1.0 if solution_str == ground_truth else 0.0


def exact_match(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == str(ground_truth).strip())


NOT_CALLABLE = 42
