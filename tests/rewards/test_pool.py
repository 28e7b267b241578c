"""The reward pool under hostile input and misbehaving plug-ins: bounded time, no crash, nothing left behind."""

import os
import signal
import threading
import time

import psutil
import pytest

from hacpo_megatron.rewards.math_verify import compute_score
from hacpo_megatron.rewards.pool import RewardItem, RewardPool, score_batch
from tests.rewards.adversarial import TRUTH, adversarial_cases
from tests.rewards.plugins import exact_match, misbehaving_reward

# Generous for 2 busy cores: ~700 parsed responses (a few ms each) + 12 slow ones (1.5 s each, 2 workers).
ADVERSARIAL_TIME_LIMIT_S = 90


def items(responses, truth=TRUTH):
    return [RewardItem("test", response, truth) for response in responses]



@pytest.fixture(scope="module")
def math_pool():
    with RewardPool(compute_score, num_workers=2, timeout_s=1.5, kill_after_s=4.0) as pool:
        yield pool


@pytest.fixture(scope="module")
def plugin_pool():
    # limits in CPU seconds: 1.0 soft, 2.5 hard; on the clock (a plug-in that waits): 4.0 soft, 9.0 hard
    with RewardPool(misbehaving_reward, num_workers=2, timeout_s=1.0, kill_after_s=2.5, wall_limit_s=4.0) as pool:
        yield pool


def test_scores_match_compute_score_in_order(math_pool):
    cases = [("\\boxed{42}", "42"), ("\\boxed{41}", "42"), ("the answer is \\frac{1}{2}", "0.5"), ("12", "12"),
             ("\\boxed{3} \\boxed{5}", "3"), ("", "1"), ("\\boxed{x=5}", "5")] * 5
    scores, stats = math_pool.score([RewardItem("t", r, g) for r, g in cases])
    assert scores == [compute_score("t", r, g) for r, g in cases]
    assert scores[:7] == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert stats["total"] == 35 and stats["nonzero"] == 20 and stats["empty"] == 5 and stats["ok"] == 30


def test_adversarial_answers(math_pool):
    cases = adversarial_cases()
    assert len(cases) == 1000
    start = time.monotonic()
    scores, stats = math_pool.score(items([case.response for case in cases]))
    elapsed = time.monotonic() - start
    assert elapsed < ADVERSARIAL_TIME_LIMIT_S, stats

    # every nonzero score is a legitimately correct answer ...
    wrongly_scored = [case for case, score in zip(cases, scores) if score != 0.0 and not case.may_score]
    assert not wrongly_scored, wrongly_scored[:3]
    assert set(scores) <= {0.0, 1.0}
    # ... and the correct ones are in fact found (a scorer returning 0 for everything fails here)
    correct = [score for case, score in zip(cases, scores) if case.may_score]
    assert sum(correct) >= 0.9 * len(correct), (sum(correct), len(correct))

    kinds = [case.kind for case in cases]
    assert stats["total"] == 1000
    assert stats["oversize"] == kinds.count("huge")
    assert stats["not_a_string"] == kinds.count("not_text")
    assert stats["answer_too_nested"] + stats["answer_too_long"] == kinds.count("deep")
    assert stats["answer_too_nested"] > 0 and stats["answer_too_long"] > 0
    assert stats["no_answer"] == kinds.count("malformed")
    assert stats["timeout"] + stats["killed"] >= kinds.count("slow") // 2, stats
    outcomes = ("ok", "timeout", "killed", "crashed", "error", "not_a_string", "empty", "oversize", "no_answer",
                "answer_too_long", "answer_too_nested")
    assert sum(stats[name] for name in outcomes) == 1000, stats


def test_pool_is_reusable_after_hostile_batch(math_pool):
    scores, _ = math_pool.score(items(["\\boxed{42}", "\\boxed{9^{9^{9^9}}}", "\\boxed{42}"]))
    assert scores == [1.0, 0.0, 1.0]


def test_sleeping_plugin_times_out_and_run_continues(plugin_pool):
    scores, stats = plugin_pool.score(items(["42", "sleep forever", "42", "41"]))
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert stats["timeout"] == 1 and stats["killed"] == 0


def test_computing_plugin_times_out_on_its_cpu_time(plugin_pool):
    scores, stats = plugin_pool.score(items(["spin forever", "42", "spin 0.05"]))
    assert scores == [0.0, 1.0, 1.0]
    assert stats["timeout"] == 1 and stats["killed"] == 0


def test_plugin_computing_beyond_signals_is_killed_by_its_cpu_time_not_the_clock():
    # the clock's hard limit is 121 s away: only the CPU time can end "spin in C" this soon
    with RewardPool(misbehaving_reward, num_workers=1, timeout_s=0.5, kill_after_s=1.0, wall_limit_s=60) as pool:
        scores, stats = pool.score(items(["spin in C", "42"]))
    assert scores == [0.0, 1.0]
    assert stats["killed"] == 1 and stats["timeout"] == 0
    assert stats["seconds"] < 60


def test_a_starved_worker_scores_as_an_idle_one():
    # A loaded machine must not change a score (a resumed run reproduces the one it continues): the worker is
    # stopped for 3 s of the clock in the middle of a response that needs 0.6 s of CPU, against CPU limits of
    # 1 s (soft) and 2 s (hard). Timed on the clock, as before, this response timed out or was killed.
    with RewardPool(misbehaving_reward, num_workers=1, timeout_s=1.0, kill_after_s=2.0, wall_limit_s=60) as pool:
        assert pool.score(items(["42"]))[0] == [1.0]  # started and ready
        pid = pool.worker_pids()[0]

        def starve():
            time.sleep(0.2)
            os.kill(pid, signal.SIGSTOP)
            time.sleep(3.0)
            os.kill(pid, signal.SIGCONT)

        thread = threading.Thread(target=starve)
        thread.start()
        scores, stats = pool.score(items(["spin 0.6"]))
        thread.join()
    assert scores == [1.0]
    assert stats["ok"] == 1 and stats["timeout"] == 0 and stats["killed"] == 0
    assert stats["seconds"] > 3.0  # it was starved while it scored


def test_a_timers_signal_after_the_call_is_ignored():
    # a timer that fires while the worker waits for the next answer (as one can while the other is disarmed) must not
    # end the worker: the next answers score, nothing crashed, the same process
    with RewardPool(misbehaving_reward, num_workers=1, timeout_s=1.0) as pool:
        pid = pool.worker_pids()[0]
        assert pool.score(items(["stray alarm"]))[0] == [1.0]
        time.sleep(1.0)  # the signal arrives while the worker is idle
        scores, stats = pool.score(items(["42", "42"]))
        assert scores == [1.0, 1.0] and stats["crashed"] == 0 and pool.worker_pids() == [pid]


def test_plugin_stuck_beyond_signals_is_killed_and_replaced(plugin_pool):
    pids_before = plugin_pool.worker_pids()
    scores, stats = plugin_pool.score(items(["hang in C", "42", "42", "42"]))
    assert scores == [0.0, 1.0, 1.0, 1.0]
    assert stats["killed"] == 1
    replaced = set(pids_before) - set(plugin_pool.worker_pids())
    assert len(replaced) == 1
    assert not psutil.pid_exists(replaced.pop())  # killed and reaped, not a zombie
    assert plugin_pool.score(items(["42"]))[0] == [1.0]


def test_plugin_errors_are_counted_not_raised(plugin_pool):
    scores, stats = plugin_pool.score(items(["raise", "nan", "not a number", "42"]))
    assert scores == [0.0, 0.0, 0.0, 1.0]
    assert stats["error"] == 3
    # workers score in parallel, so which error comes first is not fixed; it is one of the three
    assert any(reason in stats["first_error"] for reason in ("plug-in bug", "returned nan", "returned 'high'"))


def test_plugin_pool_screens_only_size():
    # a plug-in reads answers its own way: no "final answer" screen, but huge responses are still refused
    scores, stats = score_batch(
        items(["42", "x" * 30_000, None]), reward_fn=exact_match, timeout_s=2.0, num_workers=1
    )
    assert scores == [1.0, 0.0, 0.0]
    assert stats["oversize"] == 1 and stats["not_a_string"] == 1 and stats["no_answer"] == 0


def test_close_leaves_no_child_process():
    me = psutil.Process(os.getpid())
    before = {child.pid for child in me.children(recursive=True)}
    pool = RewardPool(misbehaving_reward, num_workers=2, timeout_s=0.3, kill_after_s=1.0, wall_limit_s=0.5)
    pids = pool.worker_pids()
    pool.score(items(["42", "sleep forever"]))
    pool.close()
    pool.close()  # idempotent
    for pid in pids:
        assert not psutil.pid_exists(pid), pid
    assert {child.pid for child in me.children(recursive=True)} <= before
    with pytest.raises(RuntimeError, match="after close"):
        pool.score(items(["42"]))


def test_close_while_a_worker_hangs():
    # As after Ctrl-C in the middle of score(): a worker is stuck in a job nobody will wait for.
    pool = RewardPool(misbehaving_reward, num_workers=1, timeout_s=0.3, kill_after_s=60)
    pids = pool.worker_pids()
    worker = pool._workers[0]
    while not worker.ready:
        pool._collect(scores=[], stats={})
    worker.assign(0, RewardItem("t", "hang in C", "42"))
    pool.close()
    assert not any(psutil.pid_exists(pid) for pid in pids)
