"""This project beside TRL: seconds per GSPO step for the same seeded work, in one invocation.

    .venv/bin/python benchmarks/bench_vs_trl.py [--sizes tiny small] [--warmup 1] [--steps 1] [--rounds 2]
        [--old-logprobs trainer engine] [--threads 2] [--micro-batch 16] [--task synthetic:largest]
        [--work-dir DIR] [--json OUT] [--write-docs]
    .venv/bin/python benchmarks/bench_vs_trl.py --from-json OUT [--write-docs]     (show a saved result again)

Needs `.venv-bench` (.venv plus TRL 1.16.0; TRL is no dependency of the package): `make setup-bench`.

One task, one tokenizer, one model per size, run by both sides:
  * prompts: `--task` (a built-in synthetic task of hacpo_megatron.data), train split, drawn in the order this
    project's PromptSampler draws them with the run's seed; TRL gets the same prompts in the same order
    (`shuffle_dataset=False`), so step s of both sides sees the same 8 prompts. The chat-rendered prompt ids
    TRL generates from are checked against the project's `render_prompt` (the benchmark fails if they differ);
  * tokenizer: the real Qwen3 tokenizer the project ships (`load_tokenizer("qwen3")`), for both;
  * model: Qwen3 architecture with the real vocabulary (151,936 rows, tied embeddings), random weights drawn
    once with a fixed seed and saved as a Hugging Face folder; TRL loads that folder, this project starts
    from it (`init_from`). Sizes: `tiny` hidden 128, 2 layers, 16 new tokens; `small` hidden 512, 4 layers,
    64 new tokens; `smollm2` (only when named: slow) the real SmolLM2-135M-Instruct, 48 new tokens;
  * reward: hacpo_megatron.rewards.math_verify.compute_score on both sides;
  * GSPO with B = 8 prompts x G = 8 answers per step, exactly one optimizer update per step in micro-batches
    of `--micro-batch` sequences, temperature 1, top-p 1, fp32 on CPU, no reference model / KL, clip
    3e-4 / 4e-4 on the sequence ratio, lr 1e-6 constant, AdamW-style optimizer with weight decay 0.01 and
    gradient clipping at 1.0 on both sides.

The two sides:
  trl            TRL's `GRPOTrainer` configured as GSPO (`importance_sampling_level="sequence"`,
                 `loss_type="grpo"`: per-sequence mean, then mean over sequences, as this project's GSPO loss;
                 `beta=0`, `gradient_checkpointing=False`, `bf16=False`, no logging, saving or evaluation),
                 run by `.venv-bench/bin/python` in a subprocess (this file with --trl-worker). It generates
                 with transformers' `generate` in the training process and, since one generation feeds exactly
                 one update, skips the old-log-prob pass. Its phases are timed by wrapping its methods:
                 rollout `_generate_single_turn`, reward `_calculate_rewards`, the rest of
                 `_generate_and_score_completions` (tokenising, advantages) counts as "score", and the rest of
                 the step (forward, backward, optimizer) as train.
  ours/trainer   this project's loop with one agent, `algorithm.name: gspo`, launched as a user launches it
                 (`.venv/bin/python -m hacpo_megatron.launch --config CFG --output-dir DIR`): torchrun, one
                 Megatron rank, Ray, the embedded engine in its own actor, the reward in a worker process;
                 `rollout.old_logprobs: trainer` (the default: a log-prob pass over the responses every step).
  ours/engine    the same with `rollout.old_logprobs: engine` (the engine's own log-probs, after the trainer's
                 pass vouched for them on step 1): no old-log-prob pass on measured steps, as TRL.
  Both sides use `--threads` torch threads everywhere: TRL's process; this project's trainer rank
  (`train.cpu_threads`) and engine actor (`rollout.cpu_threads`). Evaluation, supervised warm-up,
  TensorBoard, plots and the progress bar are off; the final checkpoint (`checkpoint.save_every: 0` still
  saves at the end) is written after the last step and is not timed.

Timing: each run makes `--warmup` + `--steps` steps; the first `--warmup` (start-up, first-call costs, and
ours/engine's check step) are left out, and a run's figure is the mean seconds per step over the other
`--steps`: TRL's from the trainer's on_step_begin to on_step_end, ours the loop's own `time/step` from
metrics.jsonl (both exclude start-up and the end of the run). Rounds alternate the sides (trl, ours/trainer,
ours/engine, trl, ...), every run a fresh process, so the shared machine's load changes hit all sides alike;
the fastest round of each side is kept. Random-init models almost never emit an end token, so both sides
generate the whole token budget: the mean response length of each side is printed to show it. The machine's
load average (os.getloadavg) is printed at the start and end. `--write-docs` replaces the results block of
docs/benchmarks.md's section "This project beside TRL"; otherwise the table is only printed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_PYTHON = os.path.join(REPO, ".venv-bench", "bin", "python")
SETUP_COMMAND = "make setup-bench  (or: bash tools/setup_env.sh --with-bench)"
DOCS = os.path.join(REPO, "docs", "benchmarks.md")
DOCS_BEGIN = "<!-- bench_vs_trl results: begin (benchmarks/bench_vs_trl.py --write-docs rewrites this block) -->"
DOCS_END = "<!-- bench_vs_trl results: end -->"
DOCS_HEADING = "# This project beside TRL (`benchmarks/bench_vs_trl.py`)"

PROMPTS_PER_STEP = 8  # B
SAMPLES_PER_PROMPT = 8  # G
SEED = 1234  # the run seed of both sides (prompt order, sampling)
MODEL_SEED = 0  # the random weights, drawn once per size and shared
LR = 1e-6
WEIGHT_DECAY = 0.01
GRAD_CLIP = 1.0
CLIP_LOW, CLIP_HIGH = 3e-4, 4e-4  # GSPO's clip range on the sequence ratio (this project's defaults)
MAX_PROMPT_LENGTH = 512  # no synthetic prompt comes near it: none is left out

# Qwen3 shapes with the real vocabulary (hacpo_megatron/models/presets.py's Qwen3 fields). heads x head_dim = hidden.
QWEN3_FIELDS = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", attention_bias=False,
    rms_norm_eps=1e-6, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=2048,
    bos_token_id=151643, eos_token_id=151643, tie_word_embeddings=True,
)
SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(new_tokens=16, hf_config=dict(QWEN3_FIELDS, hidden_size=128, intermediate_size=384,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=32)),
    "small": dict(new_tokens=64, hf_config=dict(QWEN3_FIELDS, hidden_size=512, intermediate_size=1536,
                                                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                                head_dim=64)),
    # the real pretrained model (converted once from the GGUF file into .cache/models), its own tokenizer
    "smollm2": dict(new_tokens=48, init_from="smollm2-135m-instruct", tokenizer="smollm2"),
}
SIDES = ("trl", "ours/trainer", "ours/engine")
TABLE_NOTE = ("s/step: mean over the measured steps of the fastest round; the phases split it (seconds). rollout: "
              "generation; reward: math-verify; score: TRL's rest of _generate_and_score_completions (tokenising, "
              "advantages), ours' building of the learner's rows; old log-prob: ours' trainer pass (none in TRL here, "
              "nor in ours/engine after step 1); train: forward, backward, optimizer; weight sync: ours' push to the "
              "engine actor; other: the rest of ours' step (metrics, collectives). resp. tokens: mean response length.")
PHASES = ("rollout", "reward", "score", "logprob", "train", "weight_sync", "other")


# ------------------------------------------------------------------------------------------------
# Pure helpers (tested in tests/benchmarks/test_bench_vs_trl.py without TRL)
# ------------------------------------------------------------------------------------------------
def summarize_ours(records: Sequence[Dict[str, Any]], warmup: int) -> Dict[str, Any]:
    """Mean seconds per step and phase split of this project's run (its metrics.jsonl training records),
    leaving out the first `warmup` steps."""
    train = sorted((r for r in records if r.get("kind", "train") == "train"), key=lambda r: r["step"])
    measured = [r for r in train if r["step"] > warmup]
    if not measured:
        raise ValueError(f"no training step after the {warmup} warm-up steps in the run's metrics.jsonl")
    phases = {"rollout": "time/rollout", "reward": "time/reward", "logprob": "time/logprob", "train": "time/train",
              "weight_sync": "time/weight_sync"}
    split = {name: _mean(r.get(key, 0.0) for r in measured) for name, key in phases.items()}
    split["score"] = _mean(r.get("time/bridge", 0.0) for r in measured)  # building the learner's rows
    step = _mean(r["time/step"] for r in measured)
    split["other"] = step - sum(split.values())
    return {"step_s": step, "split": split, "steps": len(measured),
            "response_length": _mean(r["response_length_mean"] for r in measured)}


def summarize_trl(steps: Sequence[Dict[str, float]], warmup: int) -> Dict[str, Any]:
    """The same for TRL's run: `steps` holds per optimizer step its time and the wrapped phases' times."""
    measured = list(steps)[warmup:]
    if not measured:
        raise ValueError(f"TRL made {len(steps)} steps: none after the {warmup} warm-up steps")
    step = _mean(s["step"] for s in measured)
    rollout = _mean(s["rollout"] for s in measured)
    reward = _mean(s["reward"] for s in measured)
    prepare = _mean(s["prepare"] for s in measured)
    split = {"rollout": rollout, "reward": reward, "score": prepare - rollout - reward, "logprob": 0.0,
             "train": step - prepare, "weight_sync": 0.0, "other": 0.0}
    return {"step_s": step, "split": split, "steps": len(measured),
            "response_length": _mean(s["response_length"] for s in measured)}


def fastest(rounds: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The round with the fewest seconds per step, with every round's figure kept beside it."""
    best = dict(min(rounds, key=lambda r: r["step_s"]))
    best["all_rounds"] = [r["step_s"] for r in rounds]
    return best


def results_table(results: Dict[str, Dict[str, Dict[str, Any]]]) -> str:
    """Markdown table: per size and side, s/step, ratio to TRL, phase split, response tokens, every round."""
    lines = ["| size | side | s/step | ours / TRL | rollout | reward | score | old log-prob | train | weight sync "
             "| other | resp. tokens | rounds (s/step) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for size, sides in results.items():
        trl = sides.get("trl")
        for side, r in sides.items():
            ratio = "1.00" if side == "trl" else (f"{r['step_s'] / trl['step_s']:.2f}" if trl else "-")
            split = r["split"]
            cells = [_seconds(split.get(p, 0.0)) for p in PHASES]
            rounds = ", ".join(f"{x:.3g}" for x in r.get("all_rounds", [r["step_s"]]))
            lines.append(f"| {size} | {side} | {r['step_s']:.3f} | {ratio} | " + " | ".join(cells)
                         + f" | {r['response_length']:.1f} | {rounds} |")
    return "\n".join(lines)


def replace_docs_block(text: str, block: str) -> str:
    """`text` with the results block between DOCS_BEGIN and DOCS_END replaced by `block`; with no such block,
    the section's heading and the block appended at the end."""
    wrapped = f"{DOCS_BEGIN}\n{block.rstrip()}\n{DOCS_END}"
    if DOCS_BEGIN in text and DOCS_END in text:
        start, end = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END)
        return text[:start] + wrapped + text[end:]
    return text.rstrip("\n") + f"\n\n{DOCS_HEADING}\n\n{wrapped}\n"


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else float("nan")


def _seconds(value: float) -> str:
    return "-" if abs(value) < 5e-4 else f"{value:.3f}"


# ------------------------------------------------------------------------------------------------
# Shared set-up (this project's environment)
# ------------------------------------------------------------------------------------------------
def check_bench_env() -> str:
    """The TRL version in .venv-bench; exits with the setup command when it is missing."""
    if not os.path.isfile(BENCH_PYTHON):
        sys.exit(f"error: {BENCH_PYTHON} is missing: TRL lives in a separate environment. Set it up with\n"
                 f"    {SETUP_COMMAND}")
    probe = subprocess.run([BENCH_PYTHON, "-c", "import importlib.metadata as m; print(m.version('trl'))"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        sys.exit(f"error: .venv-bench has no TRL ({probe.stderr.strip().splitlines()[-1:]}). Set it up with\n"
                 f"    {SETUP_COMMAND}")
    return probe.stdout.strip()


def make_model(size: str, work: str) -> Dict[str, str]:
    """(model folder, tokenizer name) of a size: a random Qwen3 saved once, or the converted SmolLM2."""
    spec = SIZES[size]
    if "init_from" in spec:
        from hacpo_megatron.checkpoint.gguf_sources import resolve_model_source

        return {"folder": str(resolve_model_source(spec["init_from"])), "tokenizer": spec["tokenizer"]}
    from transformers.utils import logging as hf_logging

    from hacpo_megatron.rollout.embedded import hf_model_from_config

    hf_logging.disable_progress_bar()
    folder = os.path.join(work, f"model-{size}")
    model = hf_model_from_config(spec["hf_config"], seed=MODEL_SEED)
    model.save_pretrained(folder)
    return {"folder": folder, "tokenizer": "qwen3"}


def step_prompts(task: str, tokenizer_name: str, count: int) -> List[Dict[str, Any]]:
    """The first `count` steps' prompts in the order this project's loop draws them (same filter, sampler, seed)."""
    from hacpo_megatron.bridge import load_tokenizer
    from hacpo_megatron.data import PromptSampler, load_prompts
    from hacpo_megatron.training.step_data import drop_overlong_prompts

    prompts, _ = drop_overlong_prompts(load_prompts(task, "train"), [load_tokenizer(tokenizer_name)], MAX_PROMPT_LENGTH)
    sampler = PromptSampler(prompts, PROMPTS_PER_STEP, seed=SEED, shuffle=True)
    return [{"prompt": [dict(m) for m in p.messages], "ground_truth": p.ground_truth}
            for _ in range(count) for p in sampler.next_batch()]


def ours_config(model: Dict[str, str], new_tokens: int, old_logprobs: str, args) -> Dict[str, Any]:
    return {
        "run": {"name": "bench_vs_trl", "seed": SEED, "total_steps": args.warmup + args.steps, "device": "cpu"},
        "agents": [{"name": "agent", "model": model["folder"], "init_from": model["folder"],
                    "tokenizer": model["tokenizer"], "parallel": {"tensor": 1, "pipeline": 1, "data": 1}}],
        "algorithm": {"name": "gspo", "clip_low": CLIP_LOW, "clip_high": CLIP_HIGH},
        "rollout": {"samples_per_prompt": SAMPLES_PER_PROMPT, "temperature": 1.0, "top_p": 1.0,
                    "max_prompt_length": MAX_PROMPT_LENGTH, "max_response_length": new_tokens,
                    "old_logprobs": old_logprobs, "cpu_threads": args.threads},
        "data": {"train": args.task, "eval": None, "prompt_batch_size": PROMPTS_PER_STEP, "eval_every": 0},
        "reward": {"num_workers": 1},
        "train": {"mini_batch_size": PROMPTS_PER_STEP, "micro_batch_size": args.micro_batch, "lr": LR,
                  "lr_warmup_steps": 0, "lr_schedule": "constant", "weight_decay": WEIGHT_DECAY,
                  "grad_clip": GRAD_CLIP, "params_dtype": "fp32", "cpu_threads": args.threads,
                  "sft_warmup_steps": 0},
        "checkpoint": {"save_every": 0, "keep_last": 1},
        "logging": {"trackers": [], "plots": False, "progress_bar": False},
    }


def run_ours(model, new_tokens: int, old_logprobs: str, args, work: str, tag: str) -> Dict[str, Any]:
    import yaml

    run_dir = os.path.join(work, tag)
    config = os.path.join(work, f"{tag}.yaml")
    with open(config, "w") as f:
        yaml.safe_dump(ours_config(model, new_tokens, old_logprobs, args), f, sort_keys=False)
    command = [sys.executable, "-m", "hacpo_megatron.launch", "--config", config, "--output-dir", run_dir]
    _run_logged(command, dict(os.environ), os.path.join(work, f"{tag}.log"), args.timeout)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    result = summarize_ours(records, args.warmup)
    shutil.rmtree(run_dir, ignore_errors=True)  # its final checkpoint: the size of the model and its optimizer
    return result


def run_trl(model, new_tokens: int, prompts, args, work: str, tag: str) -> Dict[str, Any]:
    spec = {"model_folder": model["folder"], "tokenizer": model["tokenizer"], "prompts": prompts,
            "new_tokens": new_tokens, "steps": args.warmup + args.steps, "threads": args.threads,
            "micro_batch": args.micro_batch, "output_dir": os.path.join(work, tag)}
    spec_file, out_file = os.path.join(work, f"{tag}.spec.json"), os.path.join(work, f"{tag}.result.json")
    with open(spec_file, "w") as f:
        json.dump(spec, f)
    command = [BENCH_PYTHON, os.path.abspath(__file__), "--trl-worker", spec_file, out_file]
    _run_logged(command, dict(os.environ, PYTHONWARNINGS="ignore"), os.path.join(work, f"{tag}.log"), args.timeout)
    with open(out_file) as f:
        result = json.load(f)
    shutil.rmtree(spec["output_dir"], ignore_errors=True)
    summary = summarize_trl(result["steps"], args.warmup)
    summary["versions"] = result["versions"]
    return summary


def _run_logged(command: List[str], env, log: str, timeout: float) -> None:
    with open(log, "w") as out:
        try:
            code = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {timeout:.0f} s"
    if code != 0:
        with open(log) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"error: {' '.join(command[:4])} ... failed ({code}); the end of {log}:\n{tail}")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = re.findall(r"^model name\s*:\s*(.+)$", f.read(), flags=re.M)
        cpu = names[0].strip() if names else cpu
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def _load() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ------------------------------------------------------------------------------------------------
# The TRL side (runs in .venv-bench)
# ------------------------------------------------------------------------------------------------
def trl_worker(spec_file: str, out_file: str) -> None:
    """One TRL GRPOTrainer run as GSPO; writes per-step times, phase times and response lengths."""
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, REPO)
    import importlib.metadata as metadata

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from hacpo_megatron.bridge import load_tokenizer
    from hacpo_megatron.bridge.retokenize import render_prompt
    from hacpo_megatron.rewards.math_verify import compute_score

    hf_logging.set_verbosity_error()
    with open(spec_file) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    tokenizer = load_tokenizer(spec["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_folder"], dtype=torch.float32)
    dataset = Dataset.from_list(spec["prompts"])
    rows_per_step = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    if rows_per_step % spec["micro_batch"]:
        raise SystemExit(f"--micro-batch {spec['micro_batch']} must divide {rows_per_step}")

    def math_verify_reward(completions, ground_truth, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [compute_score("bench", text, truth) for text, truth in zip(texts, ground_truth)]

    config = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=spec["steps"], seed=SEED, use_cpu=True, bf16=False, fp16=False,
        # B x G completions per optimizer step, generated at once, trained in micro-batches of --micro-batch
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=rows_per_step // spec["micro_batch"],
        num_generations=SAMPLES_PER_PROMPT, num_iterations=1, shuffle_dataset=False,
        max_completion_length=spec["new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        # GSPO
        importance_sampling_level="sequence", loss_type="grpo", beta=0.0, epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH,
        scale_rewards="group", mask_truncated_completions=False,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=WEIGHT_DECAY,
        max_grad_norm=GRAD_CLIP, gradient_checkpointing=False,
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False,
    )
    steps: List[Dict[str, float]] = []
    current: Dict[str, float] = {}
    prompt_mismatch: List[str] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current.clear()
            current.update(rollout=0.0, reward=0.0, prepare=0.0, response_length=float("nan"),
                           start=time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            current["step"] = time.perf_counter() - current.pop("start")
            steps.append(dict(current))

    trainer = GRPOTrainer(model=model, reward_funcs=[math_verify_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimer()])

    def timed(method, phase, after=None):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = method(*a, **k)
            current[phase] = current.get(phase, 0.0) + time.perf_counter() - start
            if after is not None:
                after(a, out)
            return out
        return wrapper

    def record_lengths(_, out):
        completion_ids = out[0]
        current["response_length"] = sum(len(c) for c in completion_ids) / len(completion_ids)

    def check_prompts(a, out):
        for messages, ids in zip(a[0], out[0]):
            if list(ids) != render_prompt(tokenizer, messages):
                prompt_mismatch.append(str(messages)[:200])

    trainer._generate_single_turn = timed(trainer._generate_single_turn, "rollout", record_lengths)
    trainer._calculate_rewards = timed(trainer._calculate_rewards, "reward")
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "prepare")
    trainer._tokenize_prompts = timed(trainer._tokenize_prompts, "tokenize", check_prompts)
    trainer.train()
    if prompt_mismatch:
        raise SystemExit(f"TRL rendered {len(prompt_mismatch)} prompts differently from render_prompt, e.g. "
                         f"{prompt_mismatch[0]}")
    versions = {p: metadata.version(p) for p in ("trl", "torch", "transformers", "accelerate", "datasets")}
    versions["optim"] = str(config.optim)
    with open(out_file, "w") as f:
        json.dump({"steps": steps, "versions": versions}, f)


# ------------------------------------------------------------------------------------------------
# The benchmark
# ------------------------------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=list(SIZES))
    parser.add_argument("--warmup", type=int, default=1, help="steps left out at the start of every run (>= 1)")
    parser.add_argument("--steps", type=int, default=1, help="measured steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating; the fastest is kept")
    parser.add_argument("--old-logprobs", nargs="+", default=["trainer", "engine"], choices=["trainer", "engine"],
                        help="this project's rollout.old_logprobs settings to run (one side each)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every process that computes")
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward, both sides")
    parser.add_argument("--task", default="synthetic:largest")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    parser.add_argument("--work-dir", default=None, help="models, configs, logs (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--write-docs", action="store_true", help="rewrite the results block in docs/benchmarks.md")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="run nothing: print (and with --write-docs, write) the results of an earlier --json")
    parser.add_argument("--trl-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        trl_worker(*args.trl_worker)
        return
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        report(saved["header"], saved["results"], args.write_docs)
        return
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first step pays start-up costs; "
                     "ours/engine checks its log-probs there)")
    if (PROMPTS_PER_STEP * SAMPLES_PER_PROMPT) % args.micro_batch:
        parser.error(f"--micro-batch must divide {PROMPTS_PER_STEP * SAMPLES_PER_PROMPT}")
    trl_version = check_bench_env()
    sys.path.insert(0, REPO)
    started, load_start = time.time(), _load()
    print(f"bench_vs_trl: TRL {trl_version}; {machine()}; load average at start {load_start}", flush=True)
    work = args.work_dir or tempfile.mkdtemp(prefix="bench_vs_trl-")
    os.makedirs(work, exist_ok=True)
    sides = ["trl"] + [f"ours/{o}" for o in args.old_logprobs]
    results: Dict[str, Dict[str, Dict[str, Any]]] = {}
    versions: Dict[str, str] = {}
    try:
        for size in args.sizes:
            new_tokens = SIZES[size]["new_tokens"]
            model = make_model(size, work)
            prompts = step_prompts(args.task, model["tokenizer"], args.warmup + args.steps + 1)
            rounds: Dict[str, List[Dict[str, Any]]] = {side: [] for side in sides}
            for round_index in range(args.rounds):
                for side in sides:
                    tag = f"{size}-{side.replace('/', '-')}-r{round_index}"
                    t = time.time()
                    if side == "trl":
                        result = run_trl(model, new_tokens, prompts, args, work, tag)
                        versions = result.pop("versions")
                    else:
                        result = run_ours(model, new_tokens, side.split("/")[1], args, work, tag)
                    rounds[side].append(result)
                    if args.json:  # what is done so far survives a later failure (--from-json shows it)
                        done = dict(results, **{size: {s: fastest(r) for s, r in rounds.items() if r}})
                        _save_json(args.json, f"partial: {size} {side} round {round_index + 1}", done, versions, args)
                    print(f"  {size:6s} {side:13s} round {round_index + 1}/{args.rounds}: "
                          f"{result['step_s']:.3f} s/step, "
                          f"{result['response_length']:.1f} response tokens ({time.time() - t:.0f} s, "
                          f"load {_load()[0]})", flush=True)
            results[size] = {side: fastest(r) for side, r in rounds.items()}
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    load_end = _load()
    minutes = (time.time() - started) / 60
    header = (f"{datetime.date.today().isoformat()}: {machine()}, TRL {versions.get('trl', trl_version)}, "
              f"torch {versions.get('torch', '?')}, transformers {versions.get('transformers', '?')}; "
              f"--threads {args.threads} --micro-batch {args.micro_batch} --warmup {args.warmup} --steps {args.steps} "
              f"--rounds {args.rounds}, {args.task}; load average (1, 5, 15 min) {load_start} at the start, "
              f"{load_end} at the end; {minutes:.1f} min in all.")
    if args.json:
        _save_json(args.json, header, results, versions, args, load=[load_start, load_end])
    report(header, results, args.write_docs)


def _save_json(path: str, header: str, results, versions, args, **extra) -> None:
    with open(path, "w") as f:
        json.dump({"header": header, "results": results, "versions": versions, **extra,
                   "args": {k: v for k, v in vars(args).items() if k != "trl_worker"}}, f, indent=1)


def report(header: str, results: Dict[str, Dict[str, Dict[str, Any]]], write_docs: bool) -> None:
    """Print the table; with `write_docs`, also put it into docs/benchmarks.md's results block."""
    table = results_table(results)
    print()
    print(header)
    print(table)
    print("\n" + TABLE_NOTE)
    if write_docs:
        with open(DOCS) as f:
            text = f.read()
        with open(DOCS, "w") as f:
            f.write(replace_docs_block(text, f"Measured {header}\n\n{table}\n\n{TABLE_NOTE}\n"))
        print(f"wrote the results block of {os.path.relpath(DOCS, REPO)}")


if __name__ == "__main__":
    main()
