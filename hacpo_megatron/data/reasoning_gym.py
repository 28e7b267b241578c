"""reasoning-gym's seeded generators as a prompt source: ``reasoning_gym:<generator>[?settings]``.

reasoning-gym (Apache-2.0, `pip install .[reasoning-gym]`) ships ~100 procedural task generators with their
answers, used in RL papers: GSM8K-style word problems (`gsm_symbolic`), arithmetic (`basic_arithmetic`,
`chain_sum`), algebra and more; a user can cite the source and its seed instead of the project's own tasks.

    data:
      train: reasoning_gym:gsm_symbolic?size=2000&seed=1
      eval: reasoning_gym:gsm_symbolic?size=256

Settings: `size` (how many problems the split keeps; train 2000, eval 256 by default), `seed` (the generator's
seed, default 1; the eval split draws from seed + 1, another seed as held-out data should), and any field of the
generator's own config (`difficulty`, `min_terms`, ...: numbers, true/false or text), passed to it unchanged.
Train and eval never share a question: each keeps only the problems that a fixed hash of the question text puts
in its split (as the synthetic tasks do), so the two are disjoint whatever their seeds and sizes; repeats within a
split are dropped. The answer is reasoning-gym's own reference answer; the run scores responses on it as on any
other source (math-verify on the final answer), so a generator whose answers are not mathematical expressions
(words, lists, grids) is loaded but scores poorly: pick one with numeric answers.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Dict, List, Tuple
from urllib.parse import parse_qsl

from hacpo_megatron.data.records import PromptRecord, user_prompt
from hacpo_megatron.data.synthetic import EVAL_SHARE, split_of

SPEC_PREFIX = "reasoning_gym:"
DEFAULT_SIZES = {"train": 2000, "eval": 256}
SEED_OFFSETS = {"train": 0, "eval": 1}  # the eval split draws from another seed
INSTALL_HINT = "pip install '.[reasoning-gym]' (make test installs it)"


def _value(text: str) -> Any:
    """A setting's text as the generator's config expects it: int, float, bool or the text itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> Tuple[str, Dict[str, int], Dict[str, Any]]:
    """``"reasoning_gym:chain_sum?size=100&min_terms=3"`` -> ("chain_sum", {"size": 100}, {"min_terms": 3})."""
    name, _, query = spec.removeprefix(SPEC_PREFIX).partition("?")
    ours, theirs = {}, {}
    for key, text in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key in ("size", "seed"):
            value = _value(text)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "size" else 0):
                raise ValueError(f"{spec!r}: {key} must be an integer >= {1 if key == 'size' else 0}, got {text!r}")
            ours[key] = value
        else:
            theirs[key] = _value(text)
    return name, ours, theirs


def _generator(spec: str, name: str) -> Tuple[Any, Any]:
    """(dataset class, config class) of reasoning-gym's generator `name`; a named error otherwise."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError(f"{spec!r}: the reasoning-gym package is not installed: {INSTALL_HINT}") from None
    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=3)
        hint = (f"; did you mean {', '.join(close)}?" if close
                else f"; {len(DATASETS)} known, e.g. gsm_symbolic, chain_sum")
        raise ValueError(f"{spec!r}: reasoning-gym has no generator {name!r}{hint}")
    return DATASETS[name]


def load_reasoning_gym(spec: str, split: str = "train") -> List[PromptRecord]:
    """The split's problems of one generator, always the same ones in the same order."""
    if split not in DEFAULT_SIZES:
        raise ValueError(f"{spec!r}: split must be one of {sorted(DEFAULT_SIZES)}, got {split!r}")
    name, ours, settings = parse_spec(spec)
    dataset_class, config_class = _generator(spec, name)
    fields = [f.name for f in dataclasses.fields(config_class)]
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise ValueError(f"{spec!r}: generator {name!r} has no setting {unknown[0]!r}; "
                         f"its settings: size, seed, {', '.join(f for f in fields if f not in ('size', 'seed'))}")
    wanted = ours.get("size", DEFAULT_SIZES[split])
    seed = ours.get("seed", 1) + SEED_OFFSETS[split]
    # the split's share, and then some
    draws = int(wanted / (EVAL_SHARE if split == "eval" else 1 - EVAL_SHARE) * 1.5) + 16
    try:
        config = config_class(**settings, size=draws, seed=seed)
        config.validate()
        dataset = dataset_class(config)
    except (TypeError, ValueError, AssertionError) as error:
        raise ValueError(f"{spec!r}: generator {name!r} refused its settings: {error}") from None
    problems: Dict[str, Tuple[str, int]] = {}  # question -> (answer, index), in drawing order
    for index in range(draws):
        item = dataset[index]
        question = item["question"]
        if split_of(question) == split and question not in problems:
            problems[question] = (str(item["answer"]), index)
            if len(problems) == wanted:
                break
    if not problems:
        raise ValueError(f"{spec!r}: generator {name!r} gave no {split} problem in {draws} draws")
    source = SPEC_PREFIX + name
    return [PromptRecord(f"{source}/{split}/{seed}/{index}", user_prompt(question), answer, source,
                         {"split": split, "seed": seed, "index": index})
            for question, (answer, index) in problems.items()]
