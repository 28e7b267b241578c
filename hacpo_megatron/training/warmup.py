"""Supervised warm-up of a randomly initialised agent, cached on disk.

Random weights earn no reward, so RL would have nothing to reinforce. Before RL each tiny agent is taught
the task directly for up to ``steps`` Adam steps (optionally stopping early at a measured accuracy, see
``train_warmup_model``): (the agent's chat-rendered prompt -> the bare answer followed
by the token that ends an assistant turn, ``tokenizer.eos_token``), with next-token cross-entropy on the
answer tokens only.

    state = supervised_warmup(PRESETS["tiny-qwen3"], "qwen3", "synthetic:largest", steps=1500, batch_size=16,
                              lr=5e-3, seed=1234, cache_dir=".cache/warmup", stop_accuracy=0.3)
    # -> {"model.embed_tokens.weight": ..., "lm_head.weight": ..., ...}  (Hugging Face names)

Cost on CPU. The tiny models have a huge vocabulary (152k / 128k rows) and a tiny body, so the output layer
is nearly all of the compute: the base model runs on the whole (right-padded, attention-masked) batch, and
the output layer only on the few positions that predict an answer token (2-4 per example).

Cache. The trained weights are stored under ``<cache_dir>/<key>/`` with ``key`` = SHA-256 of every setting
that changes the result (the config, tokenizer name, task spec, steps, batch size, lr, seed, stop accuracy
or gain, and FORMAT_VERSION). A folder is built under a temporary name and renamed into place when complete, so a crash
never leaves a usable-looking half cache; a folder without its ``warmup.json`` marker is ignored and
rebuilt. ``warmup.json`` also holds the settings and cheap accuracy measurements (see ``answer_metrics``).

Determinism: the same settings and seed give the same weights (same torch build and thread count).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from hacpo_megatron.environment import glibc, return_freed_memory

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # bump when the training recipe changes: old caches are then never reused
WEIGHTS_FILE = "model.safetensors"
INFO_FILE = "warmup.json"  # written last: its presence marks a complete cache folder
LOG_EVERY = 50  # steps between loss log lines
MAX_METRIC_EXAMPLES = 256  # examples per split for the accuracy measured after training
STOP_CHECK_EVERY = 10  # steps between checks of the stop_accuracy rule
STOP_PROBE_EXAMPLES = 128  # training problems the stop rule measures (one cheap teacher-forced pass)

Example = Tuple[List[int], List[int]]  # (prompt ids, answer ids ending with EOS)

# The settings tuned for the default run's tiny agents (benchmarks/bench_warmup.py measures them).
RECOMMENDED = dict(task_spec="synthetic:largest", steps=1500, batch_size=16, lr=5e-3, stop_accuracy=0.3)

# Counts trainings actually run in this process (tests check that a cache hit trains nothing).
TRAINING_RUNS = 0


# ---------------------------------------------------------------------------------------------- data
def build_examples(tokenizer, records) -> List[Example]:
    """(rendered prompt ids, answer ids) per record; the answer is target_text + the token that ends an answer
    (the tokenizer's EOS, or a line break in a line prompt format: bridge/prompt_formats.py)."""
    from hacpo_megatron.bridge.prompt_formats import answer_end_id
    from hacpo_megatron.bridge.retokenize import render_prompt
    from hacpo_megatron.data import target_text

    eos = answer_end_id(tokenizer)
    examples = []
    for record in records:
        answer = tokenizer.encode(target_text(record), add_special_tokens=False) + [eos]
        examples.append((render_prompt(tokenizer, record.messages), answer))
    return examples


def collate(examples: Sequence[Example], pad_id: int):
    """Right-padded inputs (prompt + answer without its last token), attention mask, and where the answer is.

    Returns ids [n, width], attention [n, width], rows and cols (the positions whose next token is an
    answer token), targets (those answer tokens) and owner (the example index of each target).
    """
    inputs = [list(prompt) + list(answer[:-1]) for prompt, answer in examples]
    width = max(len(x) for x in inputs)
    ids = torch.full((len(inputs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(inputs), width), dtype=torch.long)
    rows, cols, targets = [], [], []
    for i, ((prompt, answer), x) in enumerate(zip(examples, inputs)):
        if not prompt or not answer:
            raise ValueError(f"example {i} has an empty prompt or answer")
        ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        attention[i, : len(x)] = 1
        for j, token in enumerate(answer):
            rows.append(i)
            cols.append(len(prompt) - 1 + j)  # the position whose output predicts answer token j
            targets.append(token)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return ids, attention, as_long(rows), as_long(cols), as_long(targets)


def answer_logits(model, ids, attention, rows, cols) -> torch.Tensor:
    """Logits [num_targets, vocab] at the answer positions only: base model on the batch, lm_head on few rows."""
    hidden = model.model(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
    return model.lm_head(hidden[rows, cols])


def answer_loss(model, examples: Sequence[Example], pad_id: int) -> torch.Tensor:
    """Mean next-token cross-entropy over the answer tokens of the batch (prompt tokens contribute nothing)."""
    ids, attention, rows, cols, targets = collate(examples, pad_id)
    return F.cross_entropy(answer_logits(model, ids, attention, rows, cols).float(), targets)


@torch.no_grad()
def answer_metrics(model, examples: Sequence[Example], pad_id: int, batch_size: int = 64) -> Dict[str, float]:
    """Cheap, noise-free accuracy estimates from one teacher-forced pass (no generation).

    p_exact: mean probability that sampling at temperature 1 reproduces the target tokens exactly (a lower
      bound on the T=1 accuracy: another spelling of the right number would score too).
    greedy: fraction of examples whose every answer token is the argmax (= greedy decoding gives the target).
    """
    was_training = model.training
    model.eval()
    p_exact, greedy = [], []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        ids, attention, rows, cols, targets = collate(chunk, pad_id)
        logits = answer_logits(model, ids, attention, rows, cols).float()
        token_lp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
        hit = (logits.argmax(-1) == targets).float()
        seq_lp = torch.zeros(len(chunk)).index_add_(0, rows, token_lp)
        seq_miss = torch.zeros(len(chunk)).index_add_(0, rows, 1.0 - hit)
        p_exact += seq_lp.exp().tolist()
        greedy += (seq_miss == 0).float().tolist()
    model.train(was_training)
    n = max(len(examples), 1)
    return {"p_exact": sum(p_exact) / n, "greedy": sum(greedy) / n, "examples": len(examples)}


# ---------------------------------------------------------------------------------------------- cache
def warmup_key(hf_config: dict, tokenizer_name: str, task_spec: str, *, steps: int, batch_size: int,
               lr: float, seed: int, stop_accuracy: Optional[float] = None, prompt_format: str = "chat",
               stop_gain: Optional[Tuple[int, float]] = None) -> str:
    settings = _settings(hf_config, tokenizer_name, task_spec, steps, batch_size, lr, seed, stop_accuracy, stop_gain)
    if prompt_format != "chat":  # the prompts' text, a few-shot file's content included (chat: keys as before)
        from hacpo_megatron.bridge.prompt_formats import parse_prompt_format

        fmt = parse_prompt_format(prompt_format)
        settings["prompt_format"] = dict(kind=fmt.kind, examples=fmt.examples)
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def _canonical_config(hf_config: dict) -> dict:
    """A deep copy, without what building a model adds to it: transformers copies ``rope_theta`` into the
    (shared, nested) ``rope_scaling`` dict of the config it was given, so the same preset would otherwise
    key differently before and after a model was built from it."""
    config = copy.deepcopy(dict(hf_config))
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_theta") == config.get("rope_theta"):
        config["rope_scaling"] = {k: v for k, v in scaling.items() if k != "rope_theta"}
    return config


def _settings(hf_config, tokenizer_name, task_spec, steps, batch_size, lr, seed, stop_accuracy, stop_gain=None) -> dict:
    settings = dict(hf_config=_canonical_config(hf_config), tokenizer=tokenizer_name, task=task_spec, steps=int(steps),
                    batch_size=int(batch_size), lr=float(lr), seed=int(seed), format_version=FORMAT_VERSION,
                    stop_accuracy=None if stop_accuracy is None else float(stop_accuracy))
    if stop_gain is not None:  # only when set: the keys of caches made without it stay as they were
        settings["stop_gain"] = [int(stop_gain[0]), float(stop_gain[1])]
    return settings


def _load_cached(folder: str) -> Optional[Dict[str, torch.Tensor]]:
    info_path, weights_path = os.path.join(folder, INFO_FILE), os.path.join(folder, WEIGHTS_FILE)
    if not (os.path.isfile(info_path) and os.path.isfile(weights_path)):
        return None
    try:
        from safetensors.torch import load_file

        with open(info_path) as f:
            info = json.load(f)
        state = load_file(weights_path)
        for alias, source in info.get("aliases", {}).items():  # tied weights are stored once
            state[alias] = state[source]
        return state
    except Exception as error:  # unreadable: treat as a miss and rebuild
        logger.warning("warm-up cache %s is unreadable (%s); retraining", folder, error)
        return None


def _save(folder: str, state: Dict[str, torch.Tensor], info: dict) -> None:
    """Write weights + info into a temporary sibling folder, then rename it into place."""
    from safetensors.torch import save_file

    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    stored, aliases, seen = {}, {}, {}
    for name, tensor in state.items():
        ptr = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if ptr in seen:
            aliases[name] = seen[ptr]
        else:
            seen[ptr] = name
            stored[name] = tensor.detach().contiguous()
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(folder)[:16]}-", dir=parent)
    try:
        save_file(stored, os.path.join(tmp, WEIGHTS_FILE))
        with open(os.path.join(tmp, INFO_FILE), "w") as f:
            json.dump(dict(info, aliases=aliases), f, indent=1, sort_keys=True, default=str)
        if os.path.isdir(folder):  # an incomplete leftover (complete ones were returned as hits)
            shutil.rmtree(folder, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished the same key first: keep theirs
            if _load_cached(folder) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- training
@contextlib.contextmanager
def _keep_freed_memory(threshold: int = 1 << 30):
    """Make glibc keep freed blocks below ``threshold`` bytes instead of returning them to the OS.

    Every step allocates several vocabulary-sized tensors (logits, the tied embedding's gradients, ~80 MB
    each); by default glibc maps each with mmap and unmaps it on free, so every step pays the page faults
    of fresh memory again, which halves the step rate on CPU. Afterwards the thresholds are set to glibc's
    own dynamic maximum (32 MB mmap, 64 MB trim), close to what a long-running process ends up with anyway.
    No-op where glibc's mallopt is unavailable.
    """
    libc = glibc()
    mallopt = libc.mallopt if libc is not None else None
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, threshold)
        mallopt(M_TRIM_THRESHOLD, threshold)
    try:
        yield
    finally:
        if mallopt is not None:
            mallopt(M_MMAP_THRESHOLD, 32 << 20)
            mallopt(M_TRIM_THRESHOLD, 64 << 20)
        return_freed_memory()


def supervised_warmup(hf_config: dict, tokenizer_name: str, task_spec: str, *, steps: int, batch_size: int,
                      lr: float, seed: int, cache_dir: str, stop_accuracy: Optional[float] = None,
                      prompt_format: str = "chat",
                      stop_gain: Optional[Tuple[int, float]] = None) -> Dict[str, torch.Tensor]:
    """Weights (Hugging Face names, tied ones under both names) of the warmed-up model; cached on disk.

    The model is ``hf_model_from_config(hf_config, seed=seed)`` trained for at most ``steps`` Adam steps of
    ``batch_size`` training-split problems of ``task_spec`` (epochs shuffled with ``seed``), learning rate
    ``lr`` (schedule: ``lr_factor``), gradient norm clipped at 1. With ``stop_accuracy`` it stops at the first
    check (every STOP_CHECK_EVERY steps) where the T=1 accuracy on training problems (``p_exact`` of
    ``answer_metrics``) reaches it: see ``train_warmup_model``. With ``stop_gain`` = (step, gain) it stops at
    the first step past ``step`` where that accuracy exceeds the one at ``step`` by ``gain``, checked every step
    (the schedule still spans ``steps``).
    """
    key = warmup_key(hf_config, tokenizer_name, task_spec, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                     stop_accuracy=stop_accuracy, prompt_format=prompt_format, stop_gain=stop_gain)
    folder = os.path.join(cache_dir, key)
    cached = _load_cached(folder)
    if cached is not None:
        logger.info("warm-up cache hit: %s", folder)
        return cached

    model, info = train_warmup_model(hf_config, tokenizer_name, task_spec, steps=steps, batch_size=batch_size,
                                     lr=lr, seed=seed, stop_accuracy=stop_accuracy, prompt_format=prompt_format,
                                     stop_gain=stop_gain)
    state = dict(model.state_dict())
    _save(folder, state, dict(info, key=key))
    return state


def agent_warmup(cfg, agent_cfg, hf_config: dict, seed: int) -> Dict[str, torch.Tensor]:
    """An agent's warmed-up weights from ``seed`` (cached), by its plan (``agent_warmup_plan``); with
    ``sft_warmup_gain_beyond``, the warm-up of the agent its ``same_init_as`` names (the same seed and problems:
    validated) run on past where that one stopped, until its accuracy on the stop rule's problems has risen by that
    much: one model at two states, the second measurably further along."""
    t = cfg.train

    def settings(agent, stop_accuracy, stop_gain=None):
        task, _ = agent_warmup_plan(cfg, agent)
        return dict(hf_config=hf_config, tokenizer_name=agent.tokenizer_source, task_spec=task,
                    steps=t.sft_warmup_steps, batch_size=t.sft_warmup_batch_size, lr=t.sft_warmup_lr, seed=seed,
                    stop_accuracy=stop_accuracy, prompt_format=agent.prompt_format, stop_gain=stop_gain)

    if agent_cfg.sft_warmup_gain_beyond is None:
        _, stop_accuracy = agent_warmup_plan(cfg, agent_cfg)
        return supervised_warmup(cache_dir=t.sft_warmup_cache, **settings(agent_cfg, stop_accuracy))
    first = next(a for a in cfg.agents if a.name == agent_cfg.same_init_as)
    first_settings = settings(first, agent_warmup_plan(cfg, first)[1])
    supervised_warmup(cache_dir=t.sft_warmup_cache, **first_settings)  # trained here if no cache holds it yet
    with open(os.path.join(t.sft_warmup_cache, warmup_key(**first_settings), INFO_FILE)) as f:
        first_steps = json.load(f)["steps_run"]
    if first_steps >= t.sft_warmup_steps:
        logger.warning("%s's warm-up ran all its %d steps, so %s's ends there too", first.name, first_steps,
                       agent_cfg.name)
    stop_gain = (first_steps, agent_cfg.sft_warmup_gain_beyond)
    return supervised_warmup(cache_dir=t.sft_warmup_cache, **settings(agent_cfg, None, stop_gain=stop_gain))


def agent_warmup_plan(cfg, agent_cfg) -> Tuple[str, Optional[float]]:
    """(the problems an agent is warmed up on, the accuracy that stops it): the agent's own sft_warmup_task and
    sft_warmup_stop_accuracy where it sets them, else train's, else data.train and no early stop."""
    task = agent_cfg.sft_warmup_task or cfg.train.sft_warmup_task or cfg.data.train
    stop = agent_cfg.sft_warmup_stop_accuracy
    return task, stop if stop is not None else cfg.train.sft_warmup_stop_accuracy


def lr_factor(step: int, *, steps: int) -> float:
    """Warm-up-stable-decay: linear warm-up over the first 5 % of the steps, constant, then a linear decay
    to 10 % over the last 20 %. (A cosine decay spends too little time at full rate: the tiny models sit
    on a plateau, predicting the answers' marginal distribution, until attention to the operands forms.)"""
    warm, decay_start = max(1, steps // 20), int(0.8 * steps)
    if step < warm:
        return (step + 1) / warm
    if step < decay_start:
        return 1.0
    return 1.0 - 0.9 * (step - decay_start) / max(steps - decay_start, 1)


def train_warmup_model(hf_config: dict, tokenizer_name: str, task_spec: str, *, steps: int, batch_size: int,
                       lr: float, seed: int, stop_accuracy: Optional[float] = None, measure: bool = True,
                       prompt_format: str = "chat", stop_gain: Optional[Tuple[int, float]] = None):
    """The uncached training: returns (the trained transformers model, info dict with settings and metrics).

    Why ``stop_accuracy``. Tiny models learn these tasks in a sudden transition: a plateau where they predict
    the answers' marginal distribution, then within a few dozen steps the attention to the operands forms and
    accuracy jumps (on ``synthetic:largest`` from ~0.2 to ~0.9 held-out). Where that happens depends on the
    seed, the architecture and the schedule, so a fixed step count lands the agents anywhere from "knows only
    the prior" to "solved". Stopping at a measured accuracy on training problems instead leaves every agent in
    the middle of the transition: its greedy answer is often right but sampling at T = 1 still often misses,
    which is the state RL improves (it sharpens a half-formed skill shared by every problem, held-out ones
    included). The held-out split is never looked at.

    Why ``stop_gain`` = (step, gain). One model at two states is one warm-up stopped twice. A fixed number of steps
    past the first stop makes a stronger state only where that stop lies inside the transition (on the plateau a
    few steps change nothing); the second stop is therefore measured too: the first step past ``step`` whose
    accuracy on the same probe exceeds the accuracy at ``step`` by ``gain``, checked every step, since within the
    transition ten steps can move it by more than half.
    """
    global TRAINING_RUNS
    from hacpo_megatron.bridge.tokenizers import load_tokenizer, pad_token_id
    from hacpo_megatron.data import load_prompts
    from hacpo_megatron.rollout.embedded import hf_model_from_config

    TRAINING_RUNS += 1
    started = time.perf_counter()
    tokenizer = load_tokenizer(tokenizer_name, prompt_format)
    pad_id = pad_token_id(tokenizer)
    train = build_examples(tokenizer, load_prompts(task_spec, split="train"))
    if not train:
        raise ValueError(f"{task_spec!r} has no training problems")
    model = hf_model_from_config(hf_config, seed=seed).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98), fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, steps=steps))

    probe = train[:STOP_PROBE_EXAMPLES]  # fixed training problems on which the stop rule is measured
    probe_accuracy = lambda: answer_metrics(model, probe, pad_id)["p_exact"]  # noqa: E731
    stopped_at, probe_gain = None, {}  # probe_gain: the accuracies stop_gain compared, for warmup.json
    rng = random.Random(f"warmup:{seed}")
    order: List[int] = []
    losses: List[float] = []
    with torch.random.fork_rng(devices=[]), _keep_freed_memory():
        torch.manual_seed(seed)
        for step in range(steps):
            if stop_gain is not None and step >= stop_gain[0]:
                accuracy = probe_accuracy()
                if step == stop_gain[0]:
                    probe_gain = dict(gain_from_accuracy=accuracy)
                elif accuracy >= probe_gain["gain_from_accuracy"] + stop_gain[1]:
                    stopped_at, probe_gain["gain_reached_accuracy"] = step, accuracy
                    logger.info("warm-up %s gained %.2f on training problems %d steps past step %d: stopping",
                                tokenizer_name, accuracy - probe_gain["gain_from_accuracy"], step - stop_gain[0],
                                stop_gain[0])
                    break
            if stop_accuracy is not None and step > 0 and step % STOP_CHECK_EVERY == 0:
                if probe_accuracy() >= stop_accuracy:
                    stopped_at = step
                    logger.info("warm-up %s reached accuracy %.2f on training problems at step %d: stopping",
                                tokenizer_name, stop_accuracy, step)
                    break
            batch = []
            while len(batch) < batch_size:
                if not order:
                    order = list(range(len(train)))
                    rng.shuffle(order)
                batch.append(train[order.pop()])
            loss = answer_loss(model, batch, pad_id)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
                recent = losses[-LOG_EVERY:]
                logger.info("warm-up %s step %d/%d: loss %.4f", tokenizer_name, step + 1, steps,
                            sum(recent) / len(recent))
    model.eval()
    train_seconds = time.perf_counter() - started
    info = dict(_settings(hf_config, tokenizer_name, task_spec, steps, batch_size, lr, seed, stop_accuracy, stop_gain),
                steps_run=stopped_at if stopped_at is not None else steps,
                train_seconds=round(train_seconds, 2), threads=torch.get_num_threads(), **probe_gain,
                first_loss=losses[0] if losses else None,
                final_loss=sum(losses[-10:]) / max(len(losses[-10:]), 1) if losses else None)
    if measure:
        evaluation = build_examples(tokenizer, load_prompts(task_spec, split="eval"))
        info["metrics"] = {"train": answer_metrics(model, train[:MAX_METRIC_EXAMPLES], pad_id),
                           "eval": answer_metrics(model, evaluation[:MAX_METRIC_EXAMPLES], pad_id)}
        logger.info("warm-up %s done in %.1fs: %s", tokenizer_name, train_seconds, info["metrics"])
    return model, info
