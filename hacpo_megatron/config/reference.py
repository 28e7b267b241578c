"""docs/config.md, generated from the schema: every key, its type, its default and what it does.

    python -m hacpo_megatron.config --reference             # rewrites docs/config.md
    python -m hacpo_megatron.config --reference OTHER.md    # writes elsewhere

The text of each key is the comment next to its field in schema.py (the comment lines right above the field,
then the comment at the end of its line), read with `tokenize`, so the schema stays the one place a key is
described. Three small tables fill in where a comment cannot serve alone: `NOTES` for fields with no comment,
`LEADS` for a sentence before a comment that is only a symbol or a unit ("G", "per response"), and `REPLACED`
for the comment that runs over two fields (train.sft_warmup_steps). A key with no text is an error here, and
tests/config/test_reference.py fails on it.
"""
from __future__ import annotations

import ast
import dataclasses
import io
import os
import re
import tokenize
import typing
from typing import Dict, List, Tuple

from hacpo_megatron.config import schema

SCHEMA_FILE = os.path.abspath(schema.__file__)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(SCHEMA_FILE)))
DEFAULT_OUTPUT = os.path.join(REPO, "docs", "config.md")
COMMAND = "python -m hacpo_megatron.config --reference"

# Keys whose schema field carries no comment of its own (or one that continues onto the next field's lines).
NOTES: Dict[str, str] = {
    "run.name": "The run's name: its folder (runs/<name>) unless run.output_dir or --output-dir says otherwise, and "
                "the run's name in W&B and MLflow.",
    "run.seed": "Seed of everything random: prompt order, sampling, initial weights, warm-up (each agent's "
                "model gets seed + its index, or + the index of the agent its same_init_as names). On CPU a run is "
                "deterministic for its seed and code.",
    "run.total_steps": "RL steps (Algorithm 1's outer loop): each samples data.prompt_batch_size prompts, "
                       "generates, scores and makes M updates per learner.",
    "agents[].name": "The agent's name: its folder in checkpoints, its prefix in metrics (<agent>/<metric>), and "
                     "how --set addresses it (--set agents.NAME.lr=...). Letters, digits, '-', '_', '.'.",
    "agents[].parallel": "The agent's own Megatron layout (tensor x pipeline x data parallel ranks; a mixture of "
                         "experts' experts also split over expert-parallel ranks taken from those).",
    "agents[].parallel.tensor": "Tensor-parallel size; must divide the attention and key/value heads.",
    "agents[].parallel.pipeline": "Pipeline-parallel size; must divide the layers.",
    "agents[].parallel.data": "Data-parallel size.",
    "agents[].sft_warmup_stop_accuracy": "Overrides train.sft_warmup_stop_accuracy for this agent (see "
                                         "agents[].sft_warmup_task).",
    "agents[].engine": "The rollout engine: embedded (transformers in a Ray actor, CPU or one GPU), vllm (CPU build "
                       "or CUDA), sglang (CUDA only). docs/rollout.md.",
    "algorithm.name": "hacpo (the paper's algorithm), naive (shared answers, the learner's own ratio), gspo (each "
                      "agent alone), gspo_x2 (alone, 2G answers: the resource-equivalent baseline), grpo "
                      "(token-level, alone). docs/algorithm.md.",
    "algorithm.clip_high": "GSPO clip on own responses: upper side (the ratio is clipped to "
                           "[1 - clip_low, 1 + clip_high]).",
    "algorithm.grpo_clip_low": "GRPO's token-level clip, lower side (algorithm.name: grpo).",
    "algorithm.grpo_clip_high": "GRPO's token-level clip, upper side.",
    "algorithm.gradient_modulation": "HACPO ablation: scale the other agents' advantages by the capability ratio "
                                     "(omega). None: what the algorithm name implies.",
    "algorithm.cross_clip": "HACPO ablation: clip the other agents' ratios to [lo_m, 1]. None: what the algorithm "
                            "name implies.",
    "algorithm.stepwise_clip": "HACPO ablation: raise the cross clip's lower bound by delta_step per update. None: "
                               "what the algorithm name implies.",
    "algorithm.advantage_eps": "Added to the group's standard deviation when advantages are normalised.",
    "rollout.temperature": "Sampling temperature of every engine; the trainer divides its logits by it too, so "
                           "old and new log-probs are the same quantity.",
    "rollout.top_p": "Nucleus sampling threshold (1.0: the full distribution).",
    "data.eval": "Held-out prompts for evaluation, in the forms data.train takes; null: no evaluation.",
    "data.eval_max_prompts": "Evaluate on the first N held-out prompts only; null: all of them.",
    "data.shuffle": "Draw training prompts in a seeded shuffle per epoch; false: in file order.",
    "reward.function": "The reward, by dotted path: a module-level function fn(data_source, solution_str, "
                       "ground_truth, extra_info=None) -> float (verl's signature), importable in the reward's "
                       "worker processes. The default scores the final answer with math-verify.",
    "reward.num_workers": "Worker processes that score answers (each answer has reward.timeout_s).",
    "train.lr": "Learning rate of every agent (agents[].lr overrides it for one).",
    "train.min_lr": "The learning rate a cosine or linear schedule decays to (in [0, lr]).",
    "train.lr_warmup_steps": "Steps of linear learning-rate warm-up from 0 (the schedule advances once per RL step).",
    "train.lr_schedule": "Learning-rate schedule over run.total_steps: constant, cosine or linear decay to min_lr.",
    "train.weight_decay": "AdamW weight decay.",
    "train.adam_beta1": "Adam's beta1.",
    "train.adam_beta2": "Adam's beta2.",
    "train.adam_eps": "Adam's epsilon.",
    "train.sft_warmup_batch_size": "Problems per supervised warm-up step.",
    "train.sft_warmup_lr": "Learning rate of the supervised warm-up.",
    "checkpoint.keep_last": "How many complete checkpoints to keep (older ones are deleted once a new one is "
                            "complete).",
    "logging.plots": "Draw curves.png and eval_accuracy.png in the run folder at the end.",
    "logging.progress_bar": "Show a progress bar on rank 0.",
}

# A sentence put before a field's comment that alone is a symbol, a unit or a default.
LEADS: Dict[str, str] = {
    "run.output_dir": "The run folder (--output-dir wins);",
    "algorithm.alpha": "alpha:",
    "algorithm.delta": "delta:",
    "algorithm.delta_step": "delta_step: the cross clip's lower bound, 1 - delta at the first update",
    "algorithm.clip_low": "Lower side of the",
    "algorithm.omega_clamp": "[low, high] bounds of the capability ratio omega = P_k / P_j;",
    "rollout.samples_per_prompt": "Answers each agent samples per prompt:",
    "rollout.max_prompt_length": "Longest prompt, in",
    "rollout.max_response_length": "Longest answer, in",
    "rollout.gpu_memory_utilization": "Share of the GPU's memory a GPU engine may take:",
    "data.train": "Training prompts:",
    "data.prompt_batch_size": "Prompts per RL step:",
    "data.eval_every": "Held-out evaluation every this many",
    "reward.timeout_s": "Time limit for scoring one answer (a timeout scores 0),",
    "reward.range": "[low, high] every reward must lie in (a reward outside is an error);",
    "train.micro_batch_size": "Rows per micro-batch:",
    "train.grad_clip": "Gradient-norm clipping;",
    "train.params_dtype": "Parameter dtype;",
    "train.sft_warmup_task": "Problems of the supervised warm-up;",
    "train.sft_warmup_cache": "Folder of warmed-up weights,",
    "checkpoint.save_every": "Checkpoint every this many",
    "logging.mlflow_tracking_uri": "Where MLflow writes,",
}

# Fields whose schema comment runs on over the next field's lines: the whole text, for both.
REPLACED: Dict[str, str] = {
    "train.sft_warmup_steps": "Supervised warm-up before RL for random-init agents (0: none): at most this many "
                              "steps; with sft_warmup_stop_accuracy it stops earlier (training/warmup.py).",
    "train.sft_warmup_stop_accuracy": "Stop the warm-up once the agent's sampled (T = 1) accuracy on training "
                                      "problems reaches this; null: run all sft_warmup_steps.",
}


@dataclasses.dataclass
class Key:
    path: str
    type: str
    default: str
    text: str


def _field_comments(source: str) -> Dict[Tuple[str, str], str]:
    """{(class name, field name): its comment text}, from the comment lines right above each field and the
    comment at the end of the field's own line(s)."""
    comments: Dict[int, str] = {}
    whole_line: Dict[int, bool] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            line = token.start[0]
            comments[line] = token.string.lstrip("#").strip()
            whole_line[line] = not token.line[: token.start[1]].strip()
    result: Dict[Tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            above: List[str] = []
            line = item.lineno - 1
            while whole_line.get(line):
                above.insert(0, comments[line])
                line -= 1
            trailing = [comments[n] for n in range(item.lineno, item.end_lineno + 1) if n in comments
                        and not whole_line[n]]
            result[(node.name, item.target.id)] = " ".join(above + trailing)
    return result


def _type_name(annotation: str) -> str:
    """The field's annotation as a reader writes YAML: Literal["a", "b"] -> "a" | "b", Optional[X] -> X | null."""
    text = annotation.replace("typing.", "")
    optional = text.startswith("Optional[") and text.endswith("]")
    if optional:
        text = text[len("Optional["):-1]
    literal = re.fullmatch(r"Literal\[(.*)\]", text)
    if literal:
        text = " | ".join(part.strip().strip("'\"") for part in literal.group(1).split(","))
    list_of = re.fullmatch(r"List\[(.*)\]", text)
    if list_of:
        inner = list_of.group(1)
        inner_literal = re.fullmatch(r"Literal\[(.*)\]", inner)
        inner = (" | ".join(p.strip().strip("'\"") for p in inner_literal.group(1).split(","))
                 if inner_literal else inner)
        text = f"list of {inner}"
    return f"{text} | null" if optional else text


def _default_text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"' if value else '""'
    if isinstance(value, list):
        return "[" + ", ".join(_default_text(v) for v in value) + "]"
    return repr(value)


def _nested(annotation: str):
    """The dataclass an annotation names (a section, or a list of sections), else None."""
    match = re.fullmatch(r"(?:List\[)?(\w+)\]?", annotation)
    candidate = getattr(schema, match.group(1), None) if match else None
    return candidate if dataclasses.is_dataclass(candidate) else None


def collect_keys() -> List[Key]:
    """Every key of the schema, in schema order, with its type, default and text."""
    with open(SCHEMA_FILE, encoding="utf-8") as handle:
        comments = _field_comments(handle.read())
    keys: List[Key] = []

    def walk(cls, prefix: str) -> None:
        for item in dataclasses.fields(cls):
            annotation = item.type if isinstance(item.type, str) else typing.get_type_hints(cls)[item.name]
            path = f"{prefix}{item.name}"
            nested = _nested(str(annotation))
            listed = str(annotation).startswith("List[") and nested is not None
            if item.default is not dataclasses.MISSING:
                default = item.default
            elif item.default_factory is not dataclasses.MISSING:
                default = item.default_factory()
            else:
                default = None
            comment = comments.get((cls.__name__, item.name), "")
            if path in REPLACED:
                text = REPLACED[path]
            elif comment:
                text = f"{LEADS[path]} {comment}" if path in LEADS else comment
            else:
                text = NOTES.get(path, "")
            if nested is not None:
                keys.append(Key(path, "list of sections" if listed else "section",
                                "[]" if listed else "", text))
                walk(nested, f"{path}[]." if listed else f"{path}.")
            else:
                keys.append(Key(path, _type_name(str(annotation)), _default_text(default), text))

    walk(schema.Config, "")
    return keys


def undocumented(keys: List[Key]) -> List[str]:
    """The keys with no text: a field without a comment in schema.py and no entry in NOTES."""
    return [key.path for key in keys if not key.text and key.type not in ("section", "list of sections")]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    keys = collect_keys()
    missing = undocumented(keys)
    if missing:
        raise ValueError(f"keys with no description (comment the field in schema.py, or add it to NOTES in "
                         f"hacpo_megatron/config/reference.py): {', '.join(missing)}")
    sections = [key for key in keys if "." not in key.path and key.type in ("section", "list of sections")]
    lines = [
        "# Configuration reference",
        "",
        f"Generated from `hacpo_megatron/config/schema.py` by `{COMMAND}`; do not edit by hand",
        "(`tests/config/test_reference.py` fails when this file is stale). Each key's text is the comment beside its",
        "field in schema.py.",
        "",
        "A config is YAML with these sections; every key is optional (the default applies). A config may start from",
        "another with `base: other.yaml` (relative to the file) and override keys one by one. On the command line",
        "`--set KEY=VALUE` overrides any key, list items by index or by agent name",
        "(`--set agents.qwen3-tiny.parallel.tensor=2`); `${VAR}` in a string expands from the environment.",
        "`python -m hacpo_megatron.config --config FILE [--set ...]` checks a config and prints it resolved.",
        "",
        "Sections: " + ", ".join(f"[`{key.path}`](#{key.path})" for key in sections) + ".",
        "",
    ]
    for section in sections:
        lines += [f"## {section.path}", ""]
        if section.type == "list of sections":
            lines += [f"A list; each item is one agent with the keys below (`{section.path}[].KEY`).", ""]
        lines += ["| key | type | default | what it does |", "| --- | --- | --- | --- |"]
        for key in keys:
            if key.path.startswith(section.path + ".") or key.path.startswith(section.path + "[]."):
                default = f"`{key.default}`" if key.default else ""
                lines.append(f"| `{key.path}` | {_cell(key.type)} | {_cell(default)} | {_cell(key.text)} |")
        lines.append("")
    return "\n".join(lines)


def write(path: str = DEFAULT_OUTPUT) -> str:
    text = render()
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    return path
