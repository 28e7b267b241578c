"""Property tests of what users hand us: any config text, override or data-file content gives a result
or a named error (ConfigError / DataFormatError), never another exception; an override that is accepted holds."""
import dataclasses
import json
import os
import typing

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hacpo_megatron.checkpoint.derived_models import DERIVED_MODELS
from hacpo_megatron.checkpoint.gguf_sources import names_gguf_model
from hacpo_megatron.config import Config, ConfigError, load_config
from hacpo_megatron.data import DataFormatError
from hacpo_megatron.data.prompts import load_prompt_file

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
KEYS = ["run.seed", "run.total_steps", "agents.0.name", "agents.0.model", "agents.1.parallel.tensor", "algorithm.name",
        "algorithm.alpha", "algorithm.omega_clamp", "rollout.samples_per_prompt", "data.prompt_batch_size",
        "train.mini_batch_size", "train.lr", "checkpoint.save_every", "base", "nosuch.key", "agents", "agents.x.y"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12))
yaml_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                           max_leaves=8)


@SETTINGS
@given(text=st.text(max_size=300))
def test_any_config_text_loads_or_is_a_config_error(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_config(str(path))
    except ConfigError:
        pass


@SETTINGS
@given(document=st.dictionaries(st.sampled_from(["run", "agents", "algorithm", "rollout", "data", "train", "base",
                                                 "x"]),
                                yaml_values, max_size=4))
def test_any_yaml_structure_loads_or_is_a_config_error(tmp_path, document):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(document), encoding="utf-8")  # JSON is YAML
    try:
        load_config(str(path))
    except ConfigError:
        pass


# Two agents: the default algorithm (HACPO) refuses one, and with one every override would be a ConfigError and none
# would reach the check that an accepted override was applied
AGENTS = "agents=[{name: a, model: tiny-qwen3}, {name: b, model: tiny-llama}]"
# Besides any text, values of each key's own type, so that a good share of the overrides is accepted and checked:
# random text is rarely an integer, an algorithm name or a model preset
numbers = st.one_of(st.integers(-2, 8).map(str), st.integers(-10**6, 10**6).map(str), st.floats().map(repr),
                    st.sampled_from(["1e-5", "2.5E-3", "32", "256", "true", "'7'"]))
typed_values = {
    "agents.0.name": st.sampled_from(["zz", "b", "x.y-z", "$HOME", "''"]),
    "agents.0.model": st.sampled_from(["tiny-llama", "tiny-gemma3", "qwen3-moe-tiny", "nope"]),
    "algorithm.name": st.sampled_from(["gspo", "gspo_x2", "naive", "grpo", "hacpo", "ppo"]),
    "algorithm.omega_clamp": st.sampled_from(["[0.5, 2]", "[1e-1, 3]", "null", "~", "[2, 3]", "[1]"]),
    "agents": st.sampled_from(["[]", "null"]),
}
overrides = st.sampled_from(KEYS).flatmap(
    lambda key: st.tuples(st.just(key), st.one_of(st.text(max_size=20), typed_values.get(key, numbers))))


def test_the_fuzzed_overrides_start_from_a_config_that_loads():
    cfg = load_config(None, [AGENTS])  # else every override below is a ConfigError and nothing is checked
    assert [a.name for a in cfg.agents] == ["a", "b"]


def _assert_holds(got, tp, raw, key):
    """`got`, read back from the loaded Config, is the override's YAML value `raw` after the loader's documented
    coercion (config/loader.py: _convert) to the field's type `tp`."""
    if typing.get_origin(tp) is typing.Union:
        if raw is None:  # Optional field given null
            assert got is None, key
            return
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if dataclasses.is_dataclass(tp):  # a whole section: each key written holds, the rest keep their defaults
        hints = typing.get_type_hints(tp)
        for name, value in (raw or {}).items():
            _assert_holds(getattr(got, name), hints[name], value, f"{key}.{name}")
    elif typing.get_origin(tp) is list:
        assert len(got) == len(raw), key
        for i, (g, r) in enumerate(zip(got, raw)):
            _assert_holds(g, typing.get_args(tp)[0], r, f"{key}.{i}")
    elif tp is float:
        # ints become floats; so does a number PyYAML 1.1 reads as text (an exponent without a dot, "1e-5")
        assert isinstance(got, float) and (got == float(raw) or got != got and float(raw) != float(raw)), (key, got)
    elif tp is str:
        if key.rsplit(".", 1)[-1] in ("model", "init_from") and (raw in DERIVED_MODELS or names_gguf_model(raw)):
            # a GGUF or derived model's name is replaced by its converted folder (loader._resolve_model_names)
            assert got != raw and os.path.isdir(got), (key, got)
        else:
            assert got == os.path.expandvars(raw), (key, got)  # ${HACPO_MODELS}/... is expanded
    else:  # int, bool, Literal: the YAML value as written (bool is not taken for an int)
        assert got == raw and type(got) is type(raw), (key, got, raw)


@SETTINGS
@given(override=overrides)
def test_any_override_applies_or_is_a_config_error(override):
    key, value = override
    try:
        cfg = load_config(None, [AGENTS, f"{key}={value}"])
    except ConfigError:
        return
    # accepted: the loaded config holds the value at that key. `--set k=` (nothing after =) is the empty string, any
    # other value is read as YAML (loader._parse_override)
    raw = yaml.safe_load(value) if value.strip() else ""
    node, tp = cfg, Config
    for part in key.split("."):
        if typing.get_origin(tp) is list:
            assert part.isdigit(), f"{key}: accepted, but KEYS address list items by index only"
            node, tp = node[int(part)], typing.get_args(tp)[0]
        else:
            assert dataclasses.is_dataclass(tp) and part in typing.get_type_hints(tp), f"{key}: accepted, not a key"
            node, tp = getattr(node, part), typing.get_type_hints(tp)[part]
    _assert_holds(node, tp, raw, key)


rows = st.one_of(st.text(max_size=80), st.dictionaries(
    st.sampled_from(["question", "problem", "answer", "solution", "prompt", "reward_model", "data_source",
                     "extra_info", "uid"]), yaml_values, max_size=5).map(json.dumps))


@SETTINGS
@given(lines=st.lists(rows, max_size=5), raw=st.binary(max_size=40))
def test_any_data_file_loads_or_is_a_data_format_error(tmp_path, lines, raw):
    path = tmp_path / "d.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8") + raw)
    try:
        records = load_prompt_file(path)
    except DataFormatError:
        return
    assert records and all(r.messages and r.ground_truth is not None for r in records)
