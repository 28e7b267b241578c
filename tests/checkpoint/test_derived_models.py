"""A derived model (checkpoint/derived_models.py: the stronger state of the state pair) is named in a config like a
known model; missing or damaged, it is a config error that names the command making it, before any work."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hacpo_megatron.checkpoint.derived_models import DERIVED_MODELS, RECORD_FILE, resolve_derived_model
from hacpo_megatron.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m-instruct-gspo8"


def exported(cache: Path, *, record: bool = True, truncated: bool = False) -> Path:
    folder = cache / NAME
    folder.mkdir(parents=True)
    save_file({"w": torch.zeros(64)}, str(folder / "model.safetensors"))
    if truncated:  # a copy cut short: the header promises more bytes than the file holds
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:-16])
    if record:
        (folder / RECORD_FILE).write_text(json.dumps({"name": NAME, "step": 8}))
    return folder


def test_a_complete_export_resolves_to_its_folder(tmp_path):
    folder = exported(tmp_path)
    assert resolve_derived_model(NAME, tmp_path) == folder


@pytest.mark.parametrize("state", ["missing", "no record", "truncated"])
def test_a_missing_unfinished_or_damaged_export_names_the_command_that_makes_it(tmp_path, state):
    if state != "missing":
        exported(tmp_path, record=state != "no record", truncated=state == "truncated")
    with pytest.raises(ValueError) as error:
        resolve_derived_model(NAME, tmp_path)
    assert DERIVED_MODELS[NAME].make_command in str(error.value)
    assert ("damaged" in str(error.value)) == (state == "truncated")


def test_the_config_loader_names_file_line_and_key_of_a_derived_model_not_yet_made(tmp_path, monkeypatch):
    monkeypatch.setenv("HACPO_MODEL_CACHE", str(tmp_path / "empty"))
    config = tmp_path / "pair.yaml"
    config.write_text("agents:\n  - name: a\n    model: tiny-qwen3\n  - name: b\n    init_from: " + NAME + "\n")
    with pytest.raises(ConfigError) as error:
        load_config(str(config))
    assert f"{config}:5: agents.1.init_from: {NAME} is made by training" in str(error.value)
    assert "tools/make_state.py --config configs/real/smollm2_gspo_state.yaml --steps 8" in str(error.value)


def test_make_state_refuses_a_step_that_is_no_known_model_before_any_work(tmp_path, monkeypatch, capsys):
    """The tool's main() in this process (a process of it costs seconds of imports): it ends with
    sys.exit(message), which a process prints to stderr, exiting with code 1; training or exporting fails the test."""
    spec = importlib.util.spec_from_file_location("make_state", REPO / "tools" / "make_state.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    def work(*args):
        raise AssertionError("make_state went on to work")

    monkeypatch.setattr(tool, "train", work)
    monkeypatch.setattr(tool, "export", work)
    monkeypatch.chdir(REPO)  # as the command runs: its default config is a path in the repository
    with pytest.raises(SystemExit) as stop:  # any other exception: a traceback
        tool.main(["--steps", "5", "--run-dir", str(tmp_path / "run")])
    message = stop.value.code
    assert isinstance(message, str) and message and "Traceback" not in message + capsys.readouterr().err
    assert "no known model is configs/real/smollm2_gspo_state.yaml at step(s) [5]" in message
    assert not (tmp_path / "run").exists()
