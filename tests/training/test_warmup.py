"""The supervised warm-up: it learns, trains on answer tokens only, is deterministic, and caches safely."""
import copy
import glob
import json
import os

import pytest
import torch

from hacpo_megatron.bridge.tokenizers import load_tokenizer, pad_token_id
from hacpo_megatron.data import load_prompts
from hacpo_megatron.models.presets import PRESETS
from hacpo_megatron.rollout.embedded import hf_model_from_config
from hacpo_megatron.training import warmup
from hacpo_megatron.training.warmup import (
    INFO_FILE, WEIGHTS_FILE, answer_loss, build_examples, supervised_warmup, train_warmup_model, warmup_key,
)

TASK = "synthetic:arithmetic?max_operand=5"
# A body much smaller than the presets'; the real Llama vocabulary (the tokenizer's ids must fit).
CONFIG = dict(PRESETS["tiny-llama"], hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, head_dim=8)
SETTINGS = dict(steps=4, batch_size=4, lr=1e-2, seed=3)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic sums and fair on a shared machine
    yield
    torch.set_num_threads(threads)


def _examples(n=4):
    tokenizer = load_tokenizer("llama3.2")
    return tokenizer, build_examples(tokenizer, load_prompts(TASK, "train")[:n])


def test_examples_end_with_the_turn_end_token():
    tokenizer, examples = _examples()
    for prompt, answer in examples:
        assert answer[-1] == tokenizer.convert_tokens_to_ids("<|eot_id|>") == tokenizer.eos_token_id
        assert prompt[-1] != answer[0]
    qwen = load_tokenizer("qwen3")
    (_, answer), = build_examples(qwen, load_prompts(TASK, "train")[:1])
    assert answer[-1] == qwen.convert_tokens_to_ids("<|im_end|>")


def test_loss_goes_down():
    _, info = train_warmup_model(CONFIG, "llama3.2", TASK, steps=30, batch_size=8, lr=1e-2, seed=0, measure=False)
    assert info["final_loss"] < 0.5 * info["first_loss"], info


def test_only_answer_positions_count():
    tokenizer, examples = _examples(3)
    pad = pad_token_id(tokenizer)
    model = hf_model_from_config(copy.deepcopy(CONFIG), seed=0)
    loss = answer_loss(model, examples, pad)
    # The same loss as transformers' own, with every prompt position's label masked out (-100)...
    ids = [p + a for p, a in examples]
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), pad)
    labels = torch.full((len(ids), width), -100)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, (prompt, answer) in enumerate(examples):
        input_ids[i, : len(ids[i])] = torch.tensor(ids[i])
        mask[i, : len(ids[i])] = 1
        labels[i, len(prompt): len(ids[i])] = torch.tensor(answer)
    reference = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
    # ...so what the prompt tokens would have had as targets changes nothing: label them with anything.
    labels_noise = labels.clone()
    labels_noise[labels == -100] = 7
    labels_noise[:, 0] = -100  # (transformers shifts labels left: position 0 is never a target)
    noisy = model(input_ids=input_ids, attention_mask=mask, labels=labels_noise).loss
    assert not torch.isclose(noisy, reference)  # the prompt targets would matter if they counted
    # And padding does not leak: an example's loss is the same alone and in a batch with a longer one.
    alone = answer_loss(model, examples[:1], pad)
    longer = (examples[1][0] + examples[1][0], examples[1][1])
    in_batch = warmup.collate([examples[0], longer], pad)
    ids_b, att_b, rows_b, cols_b, targets_b = in_batch
    logits = warmup.answer_logits(model, ids_b, att_b, rows_b, cols_b)
    first = rows_b == 0
    torch.testing.assert_close(torch.nn.functional.cross_entropy(logits[first], targets_b[first]), alone,
                               rtol=1e-5, atol=1e-5)


def test_deterministic_given_the_seed(tmp_path):
    a = supervised_warmup(CONFIG, "llama3.2", TASK, cache_dir=str(tmp_path / "a"), **SETTINGS)
    b = supervised_warmup(CONFIG, "llama3.2", TASK, cache_dir=str(tmp_path / "b"), **SETTINGS)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    c = supervised_warmup(CONFIG, "llama3.2", TASK, cache_dir=str(tmp_path / "c"), **dict(SETTINGS, seed=4))
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])


def test_cache_hit_and_miss(tmp_path, monkeypatch):
    cache = str(tmp_path)
    runs = warmup.TRAINING_RUNS
    first = supervised_warmup(CONFIG, "llama3.2", TASK, cache_dir=cache, **SETTINGS)
    assert warmup.TRAINING_RUNS == runs + 1
    key = warmup_key(CONFIG, "llama3.2", TASK, **SETTINGS)
    folder = tmp_path / key
    assert (folder / WEIGHTS_FILE).is_file() and (folder / INFO_FILE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == [key]  # no temporary folder left behind

    def no_training(*args, **kwargs):
        raise AssertionError("a cache hit must not train")

    with monkeypatch.context() as patch:
        patch.setattr(warmup, "train_warmup_model", no_training)
        second = supervised_warmup(CONFIG, "llama3.2", TASK, cache_dir=cache, **SETTINGS)
    assert second.keys() == first.keys()  # tied weights come back under both names...
    assert second["lm_head.weight"] is second["model.embed_tokens.weight"]  # ...stored once
    for name in first:
        assert torch.equal(first[name], second[name]), name

    # Every setting is part of the key: changing any one trains again, into its own folder.
    changes = [dict(SETTINGS, steps=5), dict(SETTINGS, batch_size=3), dict(SETTINGS, lr=2e-2),
               dict(SETTINGS, seed=4), dict(SETTINGS, stop_accuracy=0.5)]
    keys = {warmup_key(CONFIG, "llama3.2", TASK, **s) for s in changes}
    keys |= {warmup_key(dict(CONFIG, hidden_size=32), "llama3.2", TASK, **SETTINGS),
             warmup_key(CONFIG, "llama3.2", TASK + "&num_operands=3", **SETTINGS),
             warmup_key(CONFIG, "other-tokenizer", TASK, **SETTINGS)}
    assert len(keys) == 8 and key not in keys
    supervised_warmup(CONFIG, "llama3.2", TASK, cache_dir=cache, **dict(SETTINGS, steps=5))
    assert warmup.TRAINING_RUNS == runs + 2
    assert len(list(tmp_path.iterdir())) == 2


def test_key_ignores_what_model_building_adds_to_the_config():
    config = copy.deepcopy(CONFIG)
    before = warmup_key(config, "llama3.2", TASK, **SETTINGS)
    hf_model_from_config(config)  # transformers writes rope_theta into config["rope_scaling"]
    assert warmup_key(config, "llama3.2", TASK, **SETTINGS) == before


def test_half_written_cache_is_ignored(tmp_path):
    key = warmup_key(CONFIG, "llama3.2", TASK, **SETTINGS)
    folder = tmp_path / key
    folder.mkdir()
    (folder / WEIGHTS_FILE).write_bytes(b"\x00" * 100)  # a crash before the marker file was written
    runs = warmup.TRAINING_RUNS
    state = supervised_warmup(CONFIG, "llama3.2", TASK, cache_dir=str(tmp_path), **SETTINGS)
    assert warmup.TRAINING_RUNS == runs + 1
    assert (folder / INFO_FILE).is_file() and os.path.getsize(folder / WEIGHTS_FILE) > 100
    again = supervised_warmup(CONFIG, "llama3.2", TASK, cache_dir=str(tmp_path), **SETTINGS)
    assert warmup.TRAINING_RUNS == runs + 1
    assert all(torch.equal(state[name], again[name]) for name in state)
    # A corrupt weights file with its marker is a miss too (retrained), never an exception.
    (folder / WEIGHTS_FILE).write_bytes(b"garbage")
    supervised_warmup(CONFIG, "llama3.2", TASK, cache_dir=str(tmp_path), **SETTINGS)
    assert warmup.TRAINING_RUNS == runs + 2


def test_weights_load_into_a_fresh_model(tmp_path):
    state = supervised_warmup(CONFIG, "llama3.2", TASK, cache_dir=str(tmp_path), **SETTINGS)
    model = hf_model_from_config(copy.deepcopy(CONFIG), seed=0)
    model.load_state_dict(state)  # strict: every name present, shapes right


def test_stops_at_the_first_check_that_reaches_the_accuracy(monkeypatch):
    # Record the real accuracies the stop rule measures on a run that never reaches its target...
    measured = []
    real_metrics = warmup.answer_metrics

    def recording(model, examples, pad_id, **kwargs):
        result = real_metrics(model, examples, pad_id, **kwargs)
        measured.append(result["p_exact"])
        return result

    monkeypatch.setattr(warmup, "answer_metrics", recording)
    settings = dict(steps=60, batch_size=8, lr=1e-2, seed=0, measure=False)
    _, info = train_warmup_model(CONFIG, "llama3.2", TASK, stop_accuracy=1.0, **settings)
    assert info["steps_run"] == 60 and len(measured) == 5  # checks at steps 10, 20, ..., 50
    assert measured[-1] > measured[0]  # it learns, so the rule has something to see

    # ...then aim at the third check's value: the same (seeded) run stops exactly at the first check that
    # reaches it, never earlier, and with the accuracy it saw at that check.
    target = measured[2]
    first = next(i for i, p in enumerate(measured) if p >= target)
    trajectory, measured[:] = list(measured), []
    model, info = train_warmup_model(CONFIG, "llama3.2", TASK, stop_accuracy=target, **settings)
    assert info["steps_run"] == warmup.STOP_CHECK_EVERY * (first + 1) and info["stop_accuracy"] == target
    assert measured == trajectory[: first + 1]
    tokenizer = load_tokenizer("llama3.2")
    probe = build_examples(tokenizer, load_prompts(TASK, "train"))[: warmup.STOP_PROBE_EXAMPLES]
    assert real_metrics(model, probe, pad_token_id(tokenizer))["p_exact"] == pytest.approx(measured[-1], abs=1e-6)


def test_each_agent_may_be_warmed_up_on_its_own_problems():
    from hacpo_megatron.config import load_config

    agents = ("agents=[{name: a, model: tiny-qwen3, tokenizer: qwen3, "
              "sft_warmup_task: 'synthetic:largest?part=1&parts=2',"
              " sft_warmup_stop_accuracy: 0.5}, {name: b, model: tiny-qwen3, tokenizer: qwen3}]")
    cfg = load_config(None, [agents, "data.train=synthetic:largest"])
    assert [warmup.agent_warmup_plan(cfg, agent) for agent in cfg.agents] == [
        ("synthetic:largest?part=1&parts=2", 0.5), ("synthetic:largest", None)]
    cfg.train.sft_warmup_task, cfg.train.sft_warmup_stop_accuracy = "synthetic:largest?part=2&parts=2", 0.3
    assert [warmup.agent_warmup_plan(cfg, agent) for agent in cfg.agents] == [
        ("synthetic:largest?part=1&parts=2", 0.5), ("synthetic:largest?part=2&parts=2", 0.3)]


def test_same_init_as_and_gain_beyond_make_one_model_at_two_states(monkeypatch, tmp_path):
    # agents[].same_init_as gives b a's seed; sft_warmup_gain_beyond runs a's warm-up on past a's stop until the probe
    # accuracy has risen by that much, checked every step. So b's weights are exactly those a's warm-up reaches at the
    # first such step after a stopped (recorded below from an unstopped run); c, without the key, gets its own seed.
    from hacpo_megatron.config import load_config
    from hacpo_megatron.training.agents import init_seed

    snapshots, measured = {}, {}
    real_metrics = warmup.answer_metrics

    def recording(model, examples, pad_id, **kwargs):  # called before each step's update: the weights so far
        step = len(snapshots) + 1
        snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}
        measured[step] = real_metrics(model, examples, pad_id, **kwargs)["p_exact"]
        return {"p_exact": measured[step]}

    monkeypatch.setattr(warmup, "answer_metrics", recording)
    monkeypatch.setattr(warmup, "STOP_CHECK_EVERY", 1)
    train_warmup_model(CONFIG, "llama3.2", TASK, steps=30, batch_size=8, lr=1e-2, seed=7, stop_accuracy=1.0,
                       measure=False)  # never stops: every step's weights
    monkeypatch.setattr(warmup, "answer_metrics", real_metrics)
    monkeypatch.setattr(warmup, "STOP_CHECK_EVERY", 10)
    # a gain first reached a few steps past step 10, not at the next step nor at the stop rule's next check (20)
    gain = (measured[15] - measured[10]) * 0.999
    expected = next(step for step in range(11, 30) if measured[step] >= measured[10] + gain)
    assert gain > 0 and 11 < expected < 20, (measured, expected)

    agent = "{name: %s, model: tiny-llama, tokenizer: llama3.2%s}"
    cfg = load_config(None, [
        # a stops at step 10 (its first check), below where b's gain is counted from: measured[10]
        "agents=[%s, %s, %s]" % (agent % ("a", f", sft_warmup_stop_accuracy: {measured[10] / 2}"),
                                 agent % ("b", f", same_init_as: a, sft_warmup_gain_beyond: {gain}"),
                                 agent % ("c", "")),
        "run.seed=7", f"data.train={TASK}", "train.sft_warmup_steps=30", "train.sft_warmup_batch_size=8",
        "train.sft_warmup_lr=1e-2", f"train.sft_warmup_cache={tmp_path}"])
    seeds = [init_seed(cfg, k) for k in range(3)]
    assert seeds == [7, 7, 9]
    a = warmup.agent_warmup(cfg, cfg.agents[0], CONFIG, seeds[0])  # stops at its first check: step 10
    runs = warmup.TRAINING_RUNS
    b = warmup.agent_warmup(cfg, cfg.agents[1], CONFIG, seeds[1])
    assert warmup.TRAINING_RUNS == runs + 1  # b's own; a's was read from the cache
    for name, value in a.items():
        assert torch.equal(value, snapshots[10][name]), name
        assert torch.equal(b[name], snapshots[expected][name]), name
    [info] = [json.load(open(path)) for path in glob.glob(f"{tmp_path}/*/{warmup.INFO_FILE}")
              if json.load(open(path)).get("stop_gain")]
    assert (info["steps_run"], info["gain_from_accuracy"], info["gain_reached_accuracy"]) == (
        expected, measured[10], measured[expected])
