"""benchmarks/bench_vs_trl.py without TRL and without models: its summaries of both sides' step records, the
table, the docs block, the config it gives this project's loop, the prompts it gives TRL, and the clear stop
when .venv-bench is missing."""
import json
import math

import pytest
import yaml

from tests.benchmarks.scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_vs_trl")


def _ours_record(step, total, **phases):
    record = {"step": step, "agent": "agent", "kind": "train", "time/step": total, "response_length_mean": 16.0,
              "timestamp": 1000.0 + step}
    record.update({f"time/{k}": v for k, v in phases.items()})
    return record


def test_summarize_ours_leaves_out_warmup_and_splits_the_step(bench):
    records = [_ours_record(1, 50.0, rollout=40.0, reward=1.0, logprob=2.0, train=5.0, weight_sync=1.0, bridge=0.5),
               _ours_record(2, 10.0, rollout=4.0, reward=0.5, logprob=2.0, train=3.0, weight_sync=0.25, bridge=0.05),
               _ours_record(3, 12.0, rollout=6.0, reward=0.5, logprob=2.0, train=3.0, weight_sync=0.25, bridge=0.05),
               {"step": 3, "agent": "agent", "kind": "eval", "accuracy": 0.0}]  # an evaluation record is no step
    summary = bench.summarize_ours(records, warmup=1)
    assert summary["steps"] == 2
    assert summary["step_s"] == pytest.approx(11.0)
    split = summary["split"]
    assert split["rollout"] == pytest.approx(5.0) and split["train"] == pytest.approx(3.0)
    assert split["score"] == pytest.approx(0.05)
    assert sum(split.values()) == pytest.approx(summary["step_s"])  # "other" is what the phases leave
    assert split["other"] == pytest.approx(11.0 - 5.0 - 0.5 - 2.0 - 3.0 - 0.25 - 0.05)
    with pytest.raises(ValueError, match="no training step after the 3 warm-up steps"):
        bench.summarize_ours(records, warmup=3)


def test_summarize_trl_derives_score_and_train_from_the_wrapped_phases(bench):
    steps = [dict(step=9.0, rollout=5.0, reward=1.0, prepare=7.0, response_length=16.0),
             dict(step=4.0, rollout=2.0, reward=0.5, prepare=3.0, response_length=16.0),
             dict(step=6.0, rollout=2.0, reward=0.5, prepare=3.0, response_length=15.0)]
    summary = bench.summarize_trl(steps, warmup=1)
    assert summary["step_s"] == pytest.approx(5.0)
    assert summary["response_length"] == pytest.approx(15.5)
    split = summary["split"]
    assert split["score"] == pytest.approx(0.5) and split["train"] == pytest.approx(2.0)
    assert split["logprob"] == 0.0 and split["weight_sync"] == 0.0
    assert sum(split.values()) == pytest.approx(summary["step_s"])
    with pytest.raises(ValueError):
        bench.summarize_trl(steps, warmup=3)


def test_fastest_round_is_kept_with_every_round(bench):
    rounds = [{"step_s": 3.0, "split": {}, "response_length": 16.0},
              {"step_s": 2.0, "split": {}, "response_length": 16.0}]
    best = bench.fastest(rounds)
    assert best["step_s"] == 2.0 and best["all_rounds"] == [3.0, 2.0]


def test_results_table_ratio_to_trl(bench):
    split = {p: 0.0 for p in bench.PHASES}
    results = {"tiny": {"trl": {"step_s": 4.0, "split": dict(split, rollout=3.0), "response_length": 16.0},
                        "ours/trainer": {"step_s": 2.0, "split": dict(split, train=1.5), "response_length": 16.0,
                                         "all_rounds": [2.5, 2.0]}}}
    lines = bench.results_table(results).splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| tiny | trl | 4.000 | 1.00 | 3.000 |")
    assert lines[3].startswith("| tiny | ours/trainer | 2.000 | 0.50 | - |")  # a phase that took nothing: "-"
    assert lines[3].endswith("| 16.0 | 2.5, 2 |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_docs_block_replaced_in_place_or_appended(bench):
    text = (f"# Other\n\nprose\n\n{bench.DOCS_HEADING}\n\nwhat is compared\n\n"
            f"{bench.DOCS_BEGIN}\nold\n{bench.DOCS_END}\n\nafter\n")
    once = bench.replace_docs_block(text, "new table")
    assert "old" not in once and "new table" in once and once.endswith("after\n")
    assert once.count(bench.DOCS_BEGIN) == 1 and once.index("what is compared") < once.index("new table")
    assert bench.replace_docs_block(once, "new table") == once
    appended = bench.replace_docs_block("# Other\n", "table")
    assert appended.startswith("# Other\n\n" + bench.DOCS_HEADING)
    assert appended.index(bench.DOCS_BEGIN) < appended.index("table") < appended.index(bench.DOCS_END)


def test_ours_config_is_a_valid_one_agent_gspo_config(bench, tmp_path):
    from hacpo_megatron.config import load_config

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(bench.SIZES["tiny"]["hf_config"]))
    args = type("Args", (), dict(warmup=2, steps=3, task="synthetic:largest", micro_batch=16, threads=2))()
    path = tmp_path / "bench.yaml"
    config = bench.ours_config({"folder": str(folder), "tokenizer": "qwen3"}, 16, "engine", args)
    path.write_text(yaml.safe_dump(config))
    cfg = load_config(str(path))
    assert cfg.algorithm.name == "gspo" and len(cfg.agents) == 1
    assert cfg.run.total_steps == 5 and cfg.train.sft_warmup_steps == 0 and cfg.rollout.old_logprobs == "engine"
    assert cfg.data.prompt_batch_size * cfg.rollout.samples_per_prompt == cfg.train.mini_batch_size * 8  # one update
    assert cfg.rollout.max_response_length == 16 and cfg.data.eval_every == 0 and cfg.checkpoint.save_every == 0
    assert not (cfg.logging.trackers or cfg.logging.plots or cfg.logging.progress_bar)


def test_trl_gets_the_prompts_in_the_order_of_the_loop(bench):
    from hacpo_megatron.data import PromptSampler, load_prompts

    prompts = bench.step_prompts("synthetic:largest", "qwen3", 3)
    assert len(prompts) == 3 * bench.PROMPTS_PER_STEP
    sampler = PromptSampler(load_prompts("synthetic:largest", "train"), bench.PROMPTS_PER_STEP, seed=bench.SEED)
    expected = [p for _ in range(3) for p in sampler.next_batch()]
    assert [p["prompt"] for p in prompts] == [list(map(dict, p.messages)) for p in expected]
    assert [p["ground_truth"] for p in prompts] == [p.ground_truth for p in expected]
    json.dumps(prompts)  # handed to the TRL process as JSON


def test_missing_bench_env_names_the_setup_command(bench, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "BENCH_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    with pytest.raises(SystemExit) as stop:
        bench.check_bench_env()
    assert "make setup-bench" in str(stop.value) and "--with-bench" in str(stop.value)


def test_model_sizes(bench):
    for size in ("tiny", "small"):
        config = bench.SIZES[size]["hf_config"]
        assert config["num_attention_heads"] * config["head_dim"] == config["hidden_size"]
        assert config["vocab_size"] == 151936  # the real Qwen3 vocabulary: the shipped tokenizer's ids fit
    assert (bench.SIZES["tiny"]["hf_config"]["hidden_size"], bench.SIZES["tiny"]["hf_config"]["num_hidden_layers"],
            bench.SIZES["tiny"]["new_tokens"]) == (128, 2, 16)
    assert (bench.SIZES["small"]["hf_config"]["hidden_size"], bench.SIZES["small"]["hf_config"]["num_hidden_layers"],
            bench.SIZES["small"]["new_tokens"]) == (512, 4, 64)
    assert not math.isnan(bench._mean([1, 2]))


def test_main_alternates_the_sides_keeps_the_fastest_round_and_writes_docs(bench, monkeypatch, tmp_path, capsys):
    """The benchmark's loop with both sides faked: order of the runs, the kept round, --json, --write-docs."""
    order, figures = [], iter([5.0, 3.0, 2.0, 4.0, 1.0, 2.5])  # trl, ours/trainer, ours/engine, then again

    def fake(side):
        def run(*a, **k):
            order.append(side)
            result = {"step_s": next(figures), "split": {p: 0.0 for p in bench.PHASES}, "response_length": 16.0,
                      "steps": 2}
            return dict(result, versions={"trl": "x", "torch": "y", "transformers": "z"}) if side == "trl" else result
        return run

    monkeypatch.setattr(bench, "check_bench_env", lambda: "x")
    monkeypatch.setattr(bench, "make_model", lambda size, work: {"folder": work, "tokenizer": "qwen3"})
    monkeypatch.setattr(bench, "step_prompts", lambda task, tokenizer, count: [])
    monkeypatch.setattr(bench, "run_trl", fake("trl"))
    monkeypatch.setattr(bench, "run_ours", lambda model, tokens, old, *a: fake(f"ours/{old}")())
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# Other\n\n{bench.DOCS_HEADING}\n\nprose\n\n{bench.DOCS_BEGIN}\n{bench.DOCS_END}\n")
    monkeypatch.setattr(bench, "DOCS", str(docs))
    out = tmp_path / "out.json"
    bench.main(["--sizes", "tiny", "--rounds", "2", "--work-dir", str(tmp_path / "work"), "--json", str(out),
                "--write-docs"])
    assert order == ["trl", "ours/trainer", "ours/engine"] * 2
    saved = json.loads(out.read_text())
    kept = saved["results"]["tiny"]
    assert (kept["trl"]["step_s"], kept["ours/trainer"]["step_s"], kept["ours/engine"]["step_s"]) == (4.0, 1.0, 2.0)
    assert kept["ours/trainer"]["all_rounds"] == [3.0, 1.0]
    assert "load average" in saved["header"] and len(saved["load"]) == 2
    text = docs.read_text()
    assert "| tiny | ours/trainer | 1.000 | 0.25 |" in text and "prose" in text
    assert "| tiny | ours/trainer | 1.000 | 0.25 |" in capsys.readouterr().out
