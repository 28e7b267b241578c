"""Reward plug-ins for the tests. Module-level, so that spawned reward workers can import them by name."""

import math
import os
import signal
import threading
import time


def misbehaving_reward(data_source, solution_str, ground_truth, extra_info=None):
    """Does what ``solution_str`` says, to exercise each failure of a plug-in; else exact match."""
    if solution_str == "sleep forever":
        time.sleep(1e9)  # interruptible: the worker's timer on the clock ends it
    if solution_str == "hang in C":
        # the timers' signals blocked: like a long C-level call that waits, the worker's timers cannot end it; only
        # the parent can, on the clock (it uses no CPU)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGPROF})
        time.sleep(1e9)
    if solution_str == "spin in C":
        # the same, computing: only the parent can end it, by the CPU time it has used
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGPROF})
        spin(1e9)
    if solution_str == "spin forever":
        spin(1e9)  # interruptible: the worker's CPU timer ends it
    if solution_str.startswith("spin "):  # "spin 0.3": right after 0.3 s of CPU time
        spin(float(solution_str.split()[1]))
        return 1.0
    if solution_str == "stray alarm":
        # a timer's signal that reaches the worker after the call, while it waits for the next answer
        threading.Thread(target=lambda: (time.sleep(0.3), os.kill(os.getpid(), signal.SIGALRM)), daemon=True).start()
        return 1.0
    if solution_str == "raise":
        raise RuntimeError("plug-in bug")
    if solution_str == "nan":
        return math.nan
    if solution_str == "not a number":
        return "high"
    return 1.0 if solution_str == ground_truth else 0.0


def spin(cpu_seconds: float) -> None:
    end = time.process_time() + cpu_seconds
    while time.process_time() < end:
        pass


def exact_match(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == str(ground_truth).strip())


NOT_CALLABLE = 42
