"""docs/config.md is the schema's reference, generated: it must match what the generator writes now."""
import os

from hacpo_megatron.config import __main__ as config_main
from hacpo_megatron.config.reference import COMMAND, DEFAULT_OUTPUT, collect_keys, render, undocumented
from hacpo_megatron.config.schema import Config


def test_committed_reference_is_up_to_date():
    with open(DEFAULT_OUTPUT, encoding="utf-8") as handle:
        committed = handle.read()
    assert committed == render(), (
        f"docs/config.md is stale (schema.py or hacpo_megatron/config/reference.py changed): run `{COMMAND}` "
        "and commit docs/config.md")


def test_every_key_has_a_type_a_default_and_a_description():
    keys = collect_keys()
    assert not undocumented(keys), "comment these fields in schema.py (or add them to NOTES in reference.py)"
    paths = {key.path for key in keys}
    for section in ("run", "agents", "algorithm", "rollout", "data", "reward", "train", "checkpoint", "logging"):
        assert section in paths
    assert {"agents[].parallel.tensor", "rollout.max_staleness", "reward.function", "train.attention"} <= paths
    # every field of every section is listed once
    assert len(paths) == len(keys)
    assert len([k for k in keys if k.path.startswith("algorithm.")]) == len(Config().algorithm.__dataclass_fields__)


def test_the_flag_writes_the_reference(tmp_path, capsys):
    target = tmp_path / "config.md"
    assert config_main.main(["--reference", str(target)]) == 0
    assert target.read_text(encoding="utf-8") == render()
    assert str(target) in capsys.readouterr().out
    assert os.path.basename(DEFAULT_OUTPUT) == "config.md"
