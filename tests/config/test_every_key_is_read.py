"""Every key of the config schema does something: each is read somewhere in the package or its entry
point, outside the config module itself (which only parses and validates). A key that is validated
but read nowhere fails here, with its name."""
import dataclasses
import re
from pathlib import Path

from hacpo_megatron.config import schema

REPO = Path(__file__).resolve().parents[2]
CONFIG_MODULE = REPO / "hacpo_megatron" / "config"


def schema_keys():
    """(section path, field name) of every dataclass field reachable from Config."""
    keys, pending = [], [("", schema.Config)]
    while pending:
        prefix, cls = pending.pop()
        for f in dataclasses.fields(cls):
            keys.append((prefix + f.name, f.name))
            nested = {"agents": schema.AgentConfig, "parallel": schema.ParallelConfig}.get(f.name)
            if dataclasses.is_dataclass(f.type if not isinstance(f.type, str) else None) or nested:
                pending.append((prefix + f.name + ".", nested))
            elif isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
                pending.append((prefix + f.name + ".", f.default_factory))
    return keys


def reader_sources():
    files = [p for p in (REPO / "hacpo_megatron").rglob("*.py") if CONFIG_MODULE not in p.parents]
    files += list((REPO / "examples").glob("*.py"))
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def test_schema_walk_finds_every_section():
    names = {path for path, _ in schema_keys()}
    assert {"run.seed", "agents.parallel.first_rank", "rollout.max_prompt_length", "train.mini_batch_size",
            "algorithm.cross_old_logprob", "checkpoint.keep_last", "logging.plots"} <= names


def test_every_schema_key_is_read_outside_the_config_module():
    source = reader_sources()
    unread = [path for path, name in schema_keys()
              if not re.search(rf"\.{name}\b|[\"']{name}[\"']", source)]
    assert not unread, f"config keys validated but read nowhere in the package: {unread}"
