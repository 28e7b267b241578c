"""Property tests of what users hand us: any config text, override or data-file content gives a result
or a named error (ConfigError / DataFormatError), never another exception."""
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hacpo_megatron.config import ConfigError, load_config
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


@SETTINGS
@given(key=st.sampled_from(KEYS), value=st.text(max_size=20))
def test_any_override_applies_or_is_a_config_error(key, value):
    try:
        load_config(None, ["agents=[{name: a, model: tiny-qwen3}]", f"{key}={value}"])
    except ConfigError:
        pass


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
