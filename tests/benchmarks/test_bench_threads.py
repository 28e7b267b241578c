"""benchmarks/bench_threads.py without running anything: its overrides make a valid config that sets both
thread counts, its summary leaves out warm-up steps and evaluations, its docs block replaces only itself."""
import argparse

import pytest

from hacpo_megatron.config.loader import load_config
from tests.benchmarks.scripts import REPO, load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_threads")


def test_a_settings_overrides_make_a_valid_config_with_its_thread_counts(bench):
    args = argparse.Namespace(warmup=2, steps=3, set=["data.prompt_batch_size=8"])
    cfg = load_config(REPO / "configs" / "default.yaml", overrides=bench.overrides("2x3", args))
    assert (cfg.train.cpu_threads, cfg.rollout.cpu_threads) == (2, 3)
    assert cfg.run.total_steps == 5 and cfg.data.eval_every == 0 and cfg.checkpoint.save_every == 0
    assert cfg.data.prompt_batch_size == 8


def test_summary_leaves_out_warmup_steps_and_evaluations(bench):
    def record(step, agent, seconds, mfu, train):
        return {"kind": "train", "step": step, "agent": agent, "time/step": seconds, "perf/mfu": mfu,
                **{key: seconds / 10 for key in bench.PHASES}, "time/train": train}
    records = [record(1, "a", 50.0, 0.01, 9.0), record(1, "b", 50.0, 0.01, 9.0),  # the warm-up step
               record(2, "a", 4.0, 0.2, 2.0), record(2, "b", 4.0, 0.4, 1.0), {"kind": "eval", "step": 2, "agent": "a"},
               record(3, "a", 6.0, 0.3, 1.0), record(3, "b", 6.0, None, 3.0)]  # an agent without the figure
    result = bench.summarize(records, warmup=1)
    assert result["time/step"] == pytest.approx(5.0)
    assert result["time/train"] == pytest.approx(2.5)  # the slower agent's, step by step: 2 and 3
    assert result["learners"] == pytest.approx(5.0 - 3 * 0.5)  # the step less rollout, reward, log-probs
    assert result["mfu"] == pytest.approx(0.3)
    with pytest.raises(RuntimeError, match="no training step after the 3"):
        bench.summarize(records, warmup=3)


def test_write_docs_replaces_only_its_block(bench, tmp_path, monkeypatch):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"before\n{bench.BEGIN} (old) -->\nold table\n{bench.END}\nafter\n")
    monkeypatch.setattr(bench, "DOCS", docs)
    bench.write_docs("new table")
    text = docs.read_text()
    assert text.startswith("before\n") and text.endswith(f"new table\n{bench.END}\nafter\n")
    assert "old table" not in text
