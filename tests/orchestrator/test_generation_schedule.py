"""GenerationSchedule against a simulated engine that runs its calls in order, one at a time (as a Ray actor does):
the version the schedule records for each step is the version the engine really generated it with."""
import pytest

from hacpo_megatron.orchestrator.generation_schedule import GenerationSchedule, PhaseClock, TimedAnswers, seconds_inside


class FifoEngine:
    """Calls queue and run in order; `run_until(call)` runs everything up to that call (a blocking wait on it)."""

    def __init__(self):
        self.version, self.queue, self.generated_with = 0, [], {}

    def generate(self, step):
        self.queue.append(("generate", step))
        return ("generate", step)

    def push(self, version):
        self.queue.append(("push", version))
        return ("push", version)

    def run_until(self, call):
        while self.queue:
            kind, value = self.queue.pop(0)
            if kind == "generate":
                self.generated_with[value] = self.version
            else:
                self.version = value
            if (kind, value) == call:
                return


def simulate(max_staleness, total_steps=8, start=0, engine=None):
    engine = engine or FifoEngine()
    prompts = iter(range(100))
    schedule = GenerationSchedule(max_staleness=max_staleness, total_steps=total_steps,
                                  next_prompts=lambda: [next(prompts)], launch=lambda s, p: {0: engine.generate(s)})
    schedule.start_at(start)
    engine.version = start
    trained = {}
    for t in range(start, total_steps):
        schedule.launch_up_to(t, trained=t)
        work = schedule.take(t)
        engine.run_until(work.handles[0])          # the learners wait for step t's answers
        trained[t] = (work.prompts, work.generated_by, work.staleness(t))
        engine.run_until(engine.push(t + 1))      # train, then the push waits for the engine's earlier calls
    assert not schedule.in_flight()
    return trained, engine


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_every_step_is_trained_once_on_answers_at_most_k_versions_old(k):
    trained, engine = simulate(k)
    assert [p for p, _, _ in trained.values()] == [[s] for s in range(8)]  # the sampler's order, nothing skipped
    for t, (_, generated_by, staleness) in trained.items():
        assert generated_by == engine.generated_with[t]  # what the engine really held
        assert staleness == min(t, k)
    assert max(s for _, _, s in trained.values()) == k


def test_k_0_launches_each_step_when_it_is_taken():
    launched = []
    schedule = GenerationSchedule(max_staleness=0, total_steps=3, next_prompts=list,
                                  launch=lambda s, p: launched.append(s) or {})
    for t in range(3):
        assert schedule.launch_up_to(t, trained=t) == [t] and launched == list(range(t + 1))
        schedule.take(t)


def test_resume_starts_afresh_and_order_mistakes_are_errors():
    trained, _ = simulate(1, start=5)
    assert sorted(trained) == [5, 6, 7] and trained[5][2] == 0 and trained[6][2] == 1
    schedule = GenerationSchedule(max_staleness=1, total_steps=4, next_prompts=list, launch=lambda s, p: {})
    with pytest.raises(ValueError, match="step 2 is taken before steps 0..1 were launched"):
        schedule.launch_up_to(2, trained=2)
    schedule.launch_up_to(0, trained=0)
    assert [w.step for w in schedule.in_flight()] == [0, 1]
    schedule.take(0)
    with pytest.raises(KeyError, match="step 0 is not in flight"):
        schedule.take(0)
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        GenerationSchedule(max_staleness=-1, total_steps=4, next_prompts=list, launch=lambda s, p: {})


def test_seconds_inside_sums_the_parts_of_a_span_within_each_window():
    windows = [(10.0, 14.0), (20.0, 24.0)]
    assert seconds_inside((12.0, 22.0), windows) == 4.0  # 12-14 and 20-22
    assert seconds_inside((15.0, 19.0), windows) == 0.0
    assert seconds_inside((0.0, 30.0), windows) == 8.0


def test_phase_clock_a_generation_hidden_behind_training_and_one_the_learners_waited_for():
    clock = PhaseClock()
    clock.learners_start(10.0)  # step 1 trains from 10 to 14 while the engine answers step 2 (k = 1)
    clock.learners_stop(14.0)  # step 2 asks for its answers: they are read now
    first = clock.generation(0, TimedAnswers([], started=11.0, ended=13.0))
    assert first == {"pipeline/generation_s": 2.0, "pipeline/hidden_frac": 1.0}  # no idle time before the first
    # step 3's answers start when step 2's weights arrive, 1.5 s after the engine's last answer, and run while
    # the learners wait: nothing hidden
    second = clock.generation(0, TimedAnswers([], started=14.5, ended=16.0))
    assert second == {"pipeline/generation_s": 1.5, "pipeline/hidden_frac": 0.0, "pipeline/engine_idle_s": 1.5}
    clock.learners_start(16.0)
    clock.learners_stop(18.0)
    half = clock.generation(0, TimedAnswers([], started=17.0, ended=19.0))  # 17-18 inside the window 16-18
    assert half["pipeline/hidden_frac"] == 0.5 and half["pipeline/engine_idle_s"] == 1.0
    assert "pipeline/engine_idle_s" not in clock.generation(1, TimedAnswers([], started=17.0, ended=19.0))
