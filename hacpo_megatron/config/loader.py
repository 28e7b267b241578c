"""YAML -> typed Config, with `--set key=value` overrides and validation before any work starts.

Every problem is reported at once, each with the file, the line where the key stands, and the key:

    configs/x.yaml:12: algorithm.alhpa: unknown key (known: alpha, capability_aware_advantage, ...)

A config may start from another one: ``base: ../default.yaml`` (relative to the file) takes every section
of that file and the keys written here replace its keys one by one (mappings merge, lists and values are
replaced whole). So a baseline is the default run plus the three lines that differ, and a problem is
reported in the file where its key was written.
"""
from __future__ import annotations

import dataclasses
import os
import re
import typing
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from hacpo_megatron.config.checks import config_problems
from hacpo_megatron.config.schema import Config

Path = Tuple[Any, ...]
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class ConfigError(ValueError):
    """A config that cannot run; the message lists every problem found."""


# ----------------------------------------------------------------------------- locating keys
def _key_lines(text: str) -> Dict[Path, int]:
    """Map every key path in a YAML document to its 1-based line number."""
    lines: Dict[Path, int] = {}

    def walk(node: yaml.Node, path: Path) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                child = path + (key_node.value,)
                lines[child] = key_node.start_mark.line + 1
                walk(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                lines[path + (index,)] = item.start_mark.line + 1
                walk(item, path + (index,))

    root = yaml.compose(text)
    if root is not None:
        walk(root, ())
    return lines


Lines = Dict[Path, Tuple[str, int]]  # key path -> (file, line) where it was written


def _read_layers(path: str, chain: Tuple[str, ...] = ()) -> Tuple[Dict[str, Any], Lines]:
    """The data of a config file with its ``base`` files merged in, and where every key was written."""
    if not os.path.isfile(path):
        raise ConfigError(f"{chain[-1] + ': base: ' if chain else ''}{path}: config file not found")
    if os.path.realpath(path) in chain:
        raise ConfigError(f"{path}: base files form a cycle: {' -> '.join(chain + (os.path.realpath(path),))}")
    with open(path) as f:
        text = f.read()
    try:
        data = yaml.safe_load(text)
        lines = {key: (path, line) for key, line in _key_lines(text).items()}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data, lines
    if not isinstance(base, str):
        raise ConfigError(f"{path}:{lines[('base',)][1]}: base: must be a file name, got {base!r}")
    base_data, base_lines = _read_layers(os.path.join(os.path.dirname(path), base),
                                         chain + (os.path.realpath(path),))
    return _merge(base_data, base_lines, data, lines, ())


def _merge(base: Dict[str, Any], base_lines: Lines, over: Dict[str, Any], over_lines: Lines,
           at: Path) -> Tuple[Dict[str, Any], Lines]:
    merged, lines = dict(base), dict(base_lines)
    for key, value in over.items():
        path = at + (key,)
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key], lines = _merge(base[key], lines, value, over_lines, path)
            if path in over_lines:
                lines[path] = over_lines[path]
            continue
        merged[key] = value  # replaced whole: forget where the base's version of it was written
        lines = {p: w for p, w in lines.items() if p[: len(path)] != path}
        lines.update({p: w for p, w in over_lines.items() if p[: len(path)] == path})
    return merged, lines


class _Where:
    """Formats 'file:line: key' for a key path; overrides are named as such."""

    def __init__(self, source: str, lines: Lines, overridden: Dict[Path, str]):
        self.source, self.lines, self.overridden = source, lines, overridden

    def __call__(self, path: Path) -> str:
        key = ".".join(str(p) for p in path) or "<top level>"
        for length in range(len(path), 0, -1):
            if path[:length] in self.overridden:
                return f"--set {self.overridden[path[:length]]}: {key}"
        for length in range(len(path), -1, -1):
            if path[:length] in self.lines:
                file, line = self.lines[path[:length]]
                return f"{file}:{line}: {key}"
        return f"{self.source}: {key}"


# ----------------------------------------------------------------------------- overrides
def _parse_override(text: str) -> Tuple[List[str], Any]:
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected KEY=VALUE, e.g. --set algorithm.alpha=3")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"--set {text}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text}: value is not valid YAML: {exc}") from None
    return key.strip().split("."), value


def _apply_override(data: Dict[str, Any], text: str) -> Path:
    """Set one dotted key in the raw dict. List items are addressed by index or, for agents, by name."""
    parts, value = _parse_override(text)
    node: Any = data
    path: List[Any] = []
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(node, list):
            index = _list_index(node, part, text)
            path.append(index)
            if last:
                node[index] = value
            else:
                node = node[index]
        elif isinstance(node, dict):
            path.append(part)
            if last:
                node[part] = value
            else:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
        else:
            raise ConfigError(f"--set {text}: {'.'.join(map(str, path))} is a value, not a section")
    return tuple(path)


def _list_index(items: list, part: str, text: str) -> int:
    if part.lstrip("-").isdigit():
        index = int(part)
        if not -len(items) <= index < len(items):
            raise ConfigError(f"--set {text}: index {index} out of range (the list has {len(items)} items)")
        return index % len(items)
    names = [item.get("name") if isinstance(item, dict) else None for item in items]
    if part in names:
        return names.index(part)
    raise ConfigError(f"--set {text}: no list item named {part!r} (names: {[n for n in names if n]})")


# ----------------------------------------------------------------------------- typed conversion
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, List):
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: Path, where: _Where, errors: List[str]) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, where, errors)
    if origin is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path, where, errors)
    if origin is typing.Literal:
        # YAML 1.1 (PyYAML) reads an unquoted off / on as false / true: for a key whose values include "off" or
        # "on" (agents[].moe.routing_replay) that is what was written
        word = {False: "off", True: "on"}.get(value) if isinstance(value, bool) else None
        if word in typing.get_args(tp):
            return word
        if value not in typing.get_args(tp):
            errors.append(f"{where(path)}: {value!r} is not {_type_name(tp)}")
        return value
    if origin in (list, List):
        if not isinstance(value, list):
            errors.append(f"{where(path)}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
            return value
        (item_type,) = typing.get_args(tp)
        return [_convert(item_type, v, path + (i,), where, errors) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            errors.append(f"{where(path)}: expected true or false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            errors.append(f"{where(path)}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value)  # PyYAML reads 1e-5 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            errors.append(f"{where(path)}: expected a number, got {type(value).__name__} {value!r}")
            return value
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            errors.append(f"{where(path)}: expected a string, got {type(value).__name__} {value!r}")
            return value
        return os.path.expandvars(value)  # ${HACPO_MODELS}/...; unset variables stay as written
    raise TypeError(f"config schema uses an unsupported type {tp!r} at {path}")


def _build(cls: type, value: Any, path: Path, where: _Where, errors: List[str]) -> Any:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        errors.append(f"{where(path)}: expected a section (a mapping), got {type(value).__name__} {value!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in value:
        if key not in fields:
            errors.append(f"{where(path + (key,))}: unknown key (known: {', '.join(sorted(fields))})")
    kwargs = {k: _convert(hints[k], v, path + (k,), where, errors) for k, v in value.items() if k in fields}
    return cls(**kwargs)


# ----------------------------------------------------------------------------- model names
def _resolve_model_names(cfg: Config, where: _Where, errors: List[str]) -> None:
    """A known GGUF model name (e.g. "smollm2-135m-instruct") or a .gguf file as an agent's `model` or
    `init_from` becomes its Hugging Face folder, converted once and cached (checkpoint/gguf_sources.py); a derived
    model's name (checkpoint/derived_models.py) its exported folder, which tools/make_state.py makes. A `model`
    left out is the `init_from` folder's architecture."""
    from hacpo_megatron.checkpoint.derived_models import DERIVED_MODELS, resolve_derived_model
    from hacpo_megatron.checkpoint.gguf_sources import names_gguf_model, resolve_model_source

    for i, agent in enumerate(cfg.agents):
        for key in ("model", "init_from"):
            value = getattr(agent, key)
            resolve = (resolve_derived_model if value in DERIVED_MODELS
                       else resolve_model_source if value and names_gguf_model(value) else None)
            if resolve is not None:
                try:
                    setattr(agent, key, str(resolve(value)))
                except (ValueError, OSError) as exc:
                    errors.append(f"{where(('agents', i, key))}: {exc}")
        if not agent.model and agent.init_from:
            agent.model = agent.init_from


# ----------------------------------------------------------------------------- entry points
def load_config(path: Optional[str], overrides: Sequence[str] = ()) -> Config:
    """Read, override and validate a config. Raises ConfigError listing every problem."""
    if path is None:
        data, lines, source = {}, {}, "<defaults>"
    else:
        (data, lines), source = _read_layers(path), path
    overridden: Dict[Path, str] = {}
    for text_override in overrides:
        overridden[_apply_override(data, text_override)] = text_override
    where = _Where(source, lines, overridden)
    errors: List[str] = []
    cfg = _build(Config, data, (), where, errors)
    if not errors:
        _resolve_model_names(cfg, where, errors)
    if not errors:
        errors.extend(config_problems(cfg, where))
    if errors:
        raise ConfigError(f"invalid config ({len(errors)} problem{'s' if len(errors) > 1 else ''}):\n  "
                          + "\n  ".join(errors))
    return cfg


def config_to_dict(cfg: Config) -> Dict[str, Any]:
    """The resolved config as plain data (written next to a run's outputs)."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False)
