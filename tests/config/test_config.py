import glob
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from hacpo_megatron.config import ConfigError, load_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOOD = """\
run:
  name: t
agents:
  - name: a
    model: tiny-qwen3
  - name: b
    model: tiny-llama
algorithm:
  alpha: 2.0
data:
  prompt_batch_size: 8
train:
  mini_batch_size: 4
"""


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_good_config_loads_with_typed_values(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.algorithm.alpha == 2.0 and isinstance(cfg.algorithm.alpha, float)
    assert [a.name for a in cfg.agents] == ["a", "b"]
    assert cfg.agents[1].parallel.tensor == 1
    assert cfg.rollout.samples_per_prompt == 8  # paper default


@pytest.fixture(scope="module")
def metadata_folders(tmp_path_factory):
    """Where the GGUF files' config.json folders go, made once per module: reading Gemma 3's metadata (its 262k-token
    vocabulary with it) takes 20-60 s, and five shipped configs use SmolLM2."""
    return tmp_path_factory.mktemp("gguf_metadata")


@pytest.fixture
def gguf_models_from_metadata(monkeypatch, metadata_folders):
    """Known GGUF models resolved to a folder of what validation reads (config.json), taken from the file's
    metadata instead of de-quantising its weights (Gemma 3 270M: 48 s of CI). The conversion itself is
    checked in tests/checkpoint (test_gguf.py, test_smollm2_conversion.py, test_gemma3_conversion.py)."""
    from transformers import AutoConfig

    from hacpo_megatron.checkpoint import derived_models, gguf_sources

    def metadata_folder(name_or_path, cache_dir=None):
        if os.path.isdir(os.fspath(name_or_path)):
            return name_or_path
        path = gguf_sources.locate_gguf(name_or_path)  # every check a real resolution makes of the file
        folder = metadata_folders / path.stem
        if not folder.exists():
            AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(folder)
        return folder

    monkeypatch.setattr(gguf_sources, "resolve_model_source", metadata_folder)
    # a derived model (the state pair's stronger state) has its base's architecture; the export is not made here
    monkeypatch.setattr(derived_models, "resolve_derived_model",
                        lambda name, cache_dir=None: metadata_folder(derived_models.DERIVED_MODELS[name].base))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True)))
def test_every_shipped_config_validates(path, gguf_models_from_metadata):
    cfg = load_config(path)
    assert cfg.agents


def test_paper_configs_carry_the_appendix_hyperparameters():
    table = {  # alpha, 1 - delta, delta_step
        "qwen3-4b_qwen3-4b-instruct": (3.0, 0.8, 0.01),
        "qwen3-1.7b-base_qwen3-4b-base": (1.0, 0.8, 0.025),
        "qwen3-4b-base_qwen3-8b-base": (3.0, 0.8, 0.025),
        "llama3.2-1b-instruct_llama3.2-3b-instruct": (1.0, 0.9, 0.01),
        "qwen3-1.7b-base_llama3.2-1b-instruct": (1.0, 0.8, 0.025),
        "qwen3-4b-base_llama3.2-3b-instruct": (1.0, 0.8, 0.025),
    }
    for name, (alpha, one_minus_delta, step) in table.items():
        cfg = load_config(os.path.join(REPO, "configs", "paper", name + ".yaml"))
        a = cfg.algorithm
        assert (a.alpha, round(1 - a.delta, 6), a.delta_step) == (alpha, one_minus_delta, step), name
        assert (cfg.data.prompt_batch_size, cfg.train.mini_batch_size, cfg.rollout.samples_per_prompt) == (128, 64, 8)
        assert cfg.train.lr == 1e-6 and (a.clip_low, a.clip_high) == (3e-4, 4e-4)


def test_unknown_key_names_file_line_and_key(tmp_path):
    path = write(tmp_path, GOOD.replace("  alpha: 2.0", "  alpha: 2.0\n  alhpa: 3"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}:10: algorithm.alhpa: unknown key" in str(err.value)
    assert "alpha" in str(err.value)  # lists the known keys


def test_wrong_type_names_the_key(tmp_path):
    path = write(tmp_path, GOOD.replace("alpha: 2.0", "alpha: high"))
    with pytest.raises(ConfigError, match=r"c.yaml:9: algorithm.alpha: expected a number, got str 'high'"):
        load_config(path)
    path = write(tmp_path, GOOD.replace("prompt_batch_size: 8", "prompt_batch_size: 8.5"))
    with pytest.raises(ConfigError, match="data.prompt_batch_size: expected an integer"):
        load_config(path)


def test_all_problems_are_reported_at_once(tmp_path):
    path = write(tmp_path, GOOD + "rollout:\n  samples_per_prompt: true\n  top_k: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "2 problems" in str(err.value)
    assert "rollout.samples_per_prompt: expected an integer" in str(err.value)
    assert "rollout.top_k: unknown key" in str(err.value)


@pytest.mark.parametrize("overrides,message,updates", [
    (["algorithm.name=gspo", "train.mini_batch_size=16"], "must divide the 8 prompts' worth of rows a gspo learner",
     None),
    # M = S * B * G' / (mini_batch_size * G) (docs/algorithm.md), GOOD's B = 8 and default G = 8: GSPO x2 trains on
    # its own answers only (S = 1) at G' = 2G = 16, so 1 * 8 * 16 = 128 rows, 16 * 8 = 128 an update: M = 1
    (["algorithm.name=gspo_x2", "train.mini_batch_size=16"], None, 1),
    (["algorithm.name=gspo", "algorithm.cross_old_logprob=learner"], "applies to algorithms that share rollouts", None),
    # Naive trains on both agents' answers (S = 2) at G' = G: 2 * 8 * 8 = 128 rows, GOOD's mini 4 * 8 = 32 an
    # update: M = 4
    (["algorithm.name=naive", "algorithm.cross_old_logprob=source"], None, 4),
])
def test_updates_per_step_follow_the_algorithm(tmp_path, overrides, message, updates):
    path = write(tmp_path, GOOD)
    if message is None:  # imported here: settings.py brings Ray's import, seconds the other tests need not pay
        from hacpo_megatron.algorithms.registry import algorithm_spec, step_advantages
        from hacpo_megatron.training.batch import UpdateSchedule
        from hacpo_megatron.training.settings import run_settings

        cfg = load_config(path, overrides)
        spec = algorithm_spec(cfg.algorithm)
        if cfg.algorithm.cross_old_logprob is not None:  # Naive's own default is learner: the key holds
            assert spec.cross_old_logprob == cfg.algorithm.cross_old_logprob
        # each learner's schedule as the learner side builds it (training/learner_side.py): G' and rows per update
        # from the run's settings, the sources from the step's advantages (whose answers the learner trains on)
        learners = run_settings(cfg, spec, weight_check=False).learners
        n, B = len(cfg.agents), cfg.data.prompt_batch_size
        trains_on = step_advantages(torch.zeros(n, B, learners.answers_per_prompt, dtype=torch.float64),
                                    torch.full((n,), 0.5, dtype=torch.float64), spec).trains_on
        for k in range(n):
            schedule = UpdateSchedule(B, learners.answers_per_prompt, tuple(int(j) for j in trains_on[k].nonzero()),
                                      rows_per_update=learners.rows_per_update)
            assert schedule.num_updates == updates, (k, schedule)
        return
    with pytest.raises(ConfigError, match=message):
        load_config(path, overrides)


@pytest.mark.parametrize(
    "override,message",
    [
        ("algorithm.alpha=-1", "algorithm.alpha: must be >= 0"),
        ("algorithm.delta=1.5", "algorithm.delta: must be in (0, 1)"),
        ("algorithm.delta=0", "algorithm.delta: must be in (0, 1)"),
        ("rollout.samples_per_prompt=1", "G must be >= 2"),
        ("agents.1.name=a", "duplicate agent name 'a'"),
        ("agents.a.parallel.tensor=3", "TP=3 must divide the attention heads (4)"),
        ("agents.b.parallel.pipeline=3", "PP=3 must divide the 2 layers"),
        ("agents=[]", "at least one agent is required"),
        ("agents.0.model=no-such-model", "neither a built-in preset"),
        ("algorithm.name=ppo", "is not one of 'hacpo'"),
        ("algorithm.omega_clamp=[2, 3]", "omega_clamp"),
        ("train.mini_batch_size=3", "must divide the 16 prompts' worth of rows a hacpo learner trains on"),
        ("train.mini_batch_size=16", None),  # HACPO: 2 agents x B=8 rows / G, one update
        ("train.mini_batch_size=32", "must divide the 16 prompts' worth"),
        ("algorithm.cross_old_logprob=learner", None),
        ("algorithm.cross_old_logprob=other", "is not one of 'source', 'learner'"),
        ("algorithm.name=gspo", None),
        ("rollout.temperature=0", "rollout.temperature: must be > 0"),
        ("algorithm.cross_clip_fit_quantile=0.25", None),
        ("algorithm.cross_clip_fit_quantile=1", "algorithm.cross_clip_fit_quantile: must be in (0, 1) or null"),
        ("algorithm.name=gspo_x2;algorithm.cross_clip_fit_quantile=0.25", "fits HACPO's cross clip, which 'gspo_x2'"),
        ("algorithm.cross_clip=false;algorithm.cross_clip_fit_quantile=0.25", "'hacpo' with cross_clip false"),
        ("rollout.cpu_kv_cache_gib=0", "rollout.cpu_kv_cache_gib: must be > 0"),
        ("train.sft_warmup_stop_accuracy=1.5", "train.sft_warmup_stop_accuracy: must be in (0, 1]"),
        ("agents.b.sft_warmup_stop_accuracy=0", "agents.1.sft_warmup_stop_accuracy: must be in (0, 1]"),
        ("agents.b.same_init_as=zz", "agents.1.same_init_as: names no agent ('zz'); name another of ['a']"),
        ("agents.b.same_init_as=b", "agents.1.same_init_as: names this agent ('b')"),
        ("agents.b.same_init_as=a", "'a' is a tiny-qwen3 agent and this one a tiny-llama one"),
        ("agents.b.model=tiny-qwen3;agents.a.init_from=/x;agents.b.same_init_as=a", "pretrained weights replace"),
        ("agents.b.sft_warmup_gain_beyond=0.1", "agents.1.sft_warmup_gain_beyond: continues the warm-up of the agent "
         "same_init_as names"),
        ("logging.trackers=[tensorboard, neptune]", "logging.trackers.1: 'neptune' is not one of 'tensorboard'"),
        ("logging.trackers=[wandb, mlflow, wandb]", "logging.trackers: wandb listed more than once"),
        ("logging.project=' '", "logging.project: must not be empty"),
        ("checkpoint.save_every=-1", None),
        ("checkpoint.save_every=-2", "checkpoint.save_every: must be >= 0, or -1 for never"),
        ("rollout.max_staleness=1", None),
        ("rollout.max_staleness=-1", "rollout.max_staleness: must be >= 0"),
        ("run.mode=rollout_only;rollout.max_staleness=1", "run.mode 'rollout_only' has only one of them"),
        ("rollout.max_staleness=2;rollout.old_logprobs=engine", "must be trainer with rollout.max_staleness >= 1"),
        ("train.max_tokens_per_micro_batch=4096", None),
        ("train.max_tokens_per_micro_batch=0", "train.max_tokens_per_micro_batch: must be >= 1 or null"),
        ("train.attention=sdpa", None),
        ("train.attention=fast", "train.attention: 'fast' is not one of 'auto'"),
        ("train.attention=flex", "flex trains only on a GPU"),  # these machines have none
        ("run.device=cpu", None),
        ("run.device=cuda", "run.device: cuda, but this machine has no GPU"),  # nor this one
        ("train.min_lr=1", "train.min_lr: must be in [0, lr] = [0, "),
    ],
)
def test_out_of_range_values_are_rejected(tmp_path, override, message):
    path = write(tmp_path, GOOD)
    overrides = override.split(";")  # several at once where a check relates two keys
    if message is None:
        section, rest = override.split(".", 1)
        key, value = rest.split("=")
        assert str(getattr(getattr(load_config(path, overrides), section), key)) == value
        return
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    assert message in str(err.value)
    assert f"--set {overrides[-1]}" in str(err.value) or override.startswith("agents")


def test_same_init_as_names_the_first_agent_of_a_chain(tmp_path):
    three = ("agents=[{name: a, model: tiny-qwen3}, {name: b, model: tiny-qwen3, same_init_as: a}, "
             "{name: c, model: tiny-qwen3, same_init_as: b}]")
    with pytest.raises(ConfigError, match="agents.2.same_init_as: 'b' itself starts as 'a': name 'a' directly"):
        load_config(write(tmp_path, GOOD), [three])


@pytest.mark.parametrize("b_keys,message", [
    ("sft_warmup_gain_beyond: 0.1", None),
    ("sft_warmup_gain_beyond: 0", "must be in (0, 1), with train.sft_warmup_steps > 0"),
    ("sft_warmup_gain_beyond: 1.0", "must be in (0, 1), with train.sft_warmup_steps > 0"),
    ("sft_warmup_gain_beyond: 0.1, sft_warmup_stop_accuracy: 0.5", "no sft_warmup_stop_accuracy of this agent's own"),
    ("sft_warmup_gain_beyond: 0.1, sft_warmup_task: 'synthetic:largest?parts=2&part=2'",
     "continues a's warm-up, so needs its sft_warmup_task (None, not 'synthetic:largest?parts=2&part=2')"),
    ("sft_warmup_gain_beyond: 0.1, prompt_format: plain", "needs its prompt_format ('chat', not 'plain')"),
])
def test_a_warm_up_continued_past_another_needs_its_problems_and_prompts(tmp_path, b_keys, message):
    agents = ("agents=[{name: a, model: tiny-qwen3, sft_warmup_stop_accuracy: 0.2}, "
              "{name: b, model: tiny-qwen3, same_init_as: a, %s}]" % b_keys)
    overrides = [agents, "train.sft_warmup_steps=100"]
    if message is None:
        assert load_config(write(tmp_path, GOOD), overrides).agents[1].sft_warmup_gain_beyond == 0.1
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(write(tmp_path, GOOD), overrides)


def test_flex_attention_is_refused_only_where_it_would_train_on_a_cpu(tmp_path):
    path = write(tmp_path, GOOD)
    cfg = load_config(path, ["run.mode=rollout_only", "train.attention=flex"])  # no learner, no backward
    assert cfg.train.attention == "flex"


def test_overrides_set_any_key_by_index_or_agent_name(tmp_path):
    path = write(tmp_path, GOOD)
    cfg = load_config(path, ["algorithm.alpha=3", "agents.b.parallel.tensor=2", "agents.0.lr=1e-5",
                             "algorithm.omega_clamp=null", "run.name=x"])
    assert cfg.algorithm.alpha == 3.0
    assert cfg.agents[1].parallel.tensor == 2
    assert cfg.agents[0].lr == 1e-5
    assert cfg.algorithm.omega_clamp is None
    assert cfg.run.name == "x"
    with pytest.raises(ConfigError, match="no list item named 'zz'"):
        load_config(path, ["agents.zz.lr=1"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(path, ["algorithm.alpha"])
    with pytest.raises(ConfigError, match="--set algorithm.alhpa=3: algorithm.alhpa: unknown key"):
        load_config(path, ["algorithm.alhpa=3"])


def test_ablation_switch_on_a_baseline_is_rejected(tmp_path):
    path = write(tmp_path, GOOD)
    with pytest.raises(ConfigError, match="do not apply to 'gspo'"):
        load_config(path, ["algorithm.name=gspo", "algorithm.cross_clip=false"])
    assert load_config(path, ["algorithm.cross_clip=false"]).algorithm.cross_clip is False


def test_hacpo_needs_two_agents(tmp_path):
    path = write(tmp_path, GOOD)
    with pytest.raises(ConfigError, match="needs at least 2"):
        load_config(path, ["agents=[{name: a, model: tiny-qwen3}]"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "run: [unclosed\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_environment_variables_expand_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HACPO_MODELS", "/models")
    cfg = load_config(os.path.join(REPO, "configs", "paper", "qwen3-1.7b-base_qwen3-4b-base.yaml"))
    assert cfg.agents[0].init_from == "/models/Qwen3-1.7B-Base"


def test_bad_config_fails_fast_from_the_command_line(tmp_path):
    path = write(tmp_path, GOOD.replace("alpha: 2.0", "alpha: 2.0\n  alhpa: 3"))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hacpo_megatron.config", "--config", path],
                          capture_output=True, text=True, cwd=REPO)
    assert time.monotonic() - start < 10
    assert proc.returncode == 2
    assert "algorithm.alhpa: unknown key" in proc.stderr


def test_base_file_merges_key_by_key(tmp_path):
    write(tmp_path, GOOD, "base.yaml")
    (tmp_path / "sub").mkdir()
    child = write(tmp_path, "base: ../base.yaml\nalgorithm:\n  name: gspo\ntrain:\n  lr: 3.0e-4\n", "sub/c.yaml")
    cfg = load_config(child)
    # the child's keys replace the base's one by one; everything else comes from the base
    assert (cfg.algorithm.name, cfg.algorithm.alpha, cfg.train.lr) == ("gspo", 2.0, 3e-4)
    assert (cfg.run.name, [a.name for a in cfg.agents], cfg.train.mini_batch_size) == ("t", ["a", "b"], 4)
    # a list is replaced whole
    one = write(tmp_path, "base: base.yaml\nagents:\n  - name: solo\n    model: tiny-qwen3\n", "one.yaml")
    assert [a.name for a in load_config(one, ["algorithm.name=grpo"]).agents] == ["solo"]


def test_base_file_errors_name_the_file_that_wrote_the_key(tmp_path):
    base = write(tmp_path, GOOD.replace("  alpha: 2.0", "  alpha: -2.0"), "base.yaml")
    child = write(tmp_path, "base: base.yaml\n\ntrain:\n  lr: -1\n", "c.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(child)
    assert f"{base}:9: algorithm.alpha" in str(err.value)  # written in the base...
    assert f"{child}:4: train.lr" in str(err.value)  # ...and in the child
    missing = write(tmp_path, "base: nowhere.yaml\n", "m.yaml")
    with pytest.raises(ConfigError, match="base: .*nowhere.yaml: config file not found"):
        load_config(missing)
    write(tmp_path, "base: loop_b.yaml\n", "loop_a.yaml")
    with pytest.raises(ConfigError, match="base files form a cycle"):
        load_config(write(tmp_path, "base: loop_a.yaml\n", "loop_b.yaml"))
    with pytest.raises(ConfigError, match="base: must be a file name"):
        load_config(write(tmp_path, "base: [a, b]\n", "bad.yaml"))


def test_a_known_gguf_model_name_becomes_its_converted_folder(tmp_path, monkeypatch):
    """`init_from: smollm2-135m-instruct` (no `model`): both become the folder the GGUF cache gives."""
    from hacpo_megatron.checkpoint import gguf_sources
    from hacpo_megatron.models.presets import PRESETS

    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "config.json").write_text(__import__("json").dumps(PRESETS["tiny-llama"]))
    asked = []
    monkeypatch.setattr(gguf_sources, "resolve_model_source", lambda name: asked.append(name) or folder)
    text = GOOD.replace("    model: tiny-llama", "    init_from: smollm2-135m-instruct")
    cfg = load_config(write(tmp_path, text))
    assert asked == ["smollm2-135m-instruct"]
    assert cfg.agents[1].init_from == cfg.agents[1].model == str(folder)
    assert cfg.agents[0].model == "tiny-qwen3"  # preset names are left alone


def test_a_missing_gguf_file_names_the_file_line_and_key(tmp_path):
    path = write(tmp_path, GOOD.replace("    model: tiny-llama", "    init_from: /nowhere/model.Q4.gguf"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}:7: agents.1.init_from: /nowhere/model.Q4.gguf: no such GGUF file" in str(err.value)


@pytest.mark.parametrize("text, problem", [
    ('{"model_type": "llama",\n "hidden_size": 64\n', "config.json:3:1: not valid JSON (Expecting ',' delimiter)"),
    ('{"model_type": "llama", "hidden_size": 64}', "config.json has no 'num_attention_heads'"),
])
def test_a_model_folders_broken_config_json_is_named_with_the_file(tmp_path, text, problem):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(text)
    path = write(tmp_path, GOOD.replace("    model: tiny-llama", f"    model: {folder}"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}:7: agents.1.model: {folder / problem}" in str(err.value)


def test_a_bad_learning_rate_is_named_once_not_again_through_min_lr(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, GOOD), ["train.lr=-1"])
    assert str(err.value).startswith("invalid config (1 problem):") and "train.lr: must be > 0" in str(err.value)


def test_a_prompt_format_is_checked_where_it_is_written(tmp_path):
    shots = tmp_path / "shots.txt"
    shots.write_text("Question: What is 2 + 2?\nAnswer: 2 + 2 = 4. The answer is 4.\n", encoding="utf-8")
    cfg = load_config(write(tmp_path, GOOD.replace("    model: tiny-llama",
                                                   f"    model: tiny-llama\n    prompt_format: few_shot:{shots}")))
    assert (cfg.agents[0].prompt_format, cfg.agents[1].prompt_format) == ("chat", f"few_shot:{shots}")
    path = write(tmp_path, GOOD.replace("    model: tiny-llama",
                                        "    model: tiny-llama\n    prompt_format: few_shot:nope.txt"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}:8: agents.1.prompt_format: nope.txt: No such file or directory" in str(err.value)


@pytest.mark.parametrize("save_every,due", [(2, [2, 4, 5]), (0, [5]), (-1, [])])
def test_checkpoints_are_due_every_n_steps_and_at_the_end_unless_never(tmp_path, save_every, due):
    from hacpo_megatron.training.loop import _checkpoint_due

    cfg = load_config(write(tmp_path, GOOD), ["run.total_steps=5", f"checkpoint.save_every={save_every}"])
    assert [done for done in range(1, 6) if _checkpoint_due(cfg, done)] == due
