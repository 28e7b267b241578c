"""Tokens/s of the log-prob pass and of one training update: the Megatron backend vs. Hugging Face, on CPU.

    .venv/bin/python benchmarks/bench_megatron.py [--models tiny small] [--vocab-sizes 151936]
        [--sequences 32] [--prompt-length 24] [--response-length 8] [--micro-batch 0]
        [--repeats 5] [--warmup 1] [--threads 1] [--json OUT]

Two Qwen3-architecture models with random weights: "tiny" is the `tiny-qwen3` preset (hidden 64, 4 layers,
the runs' default agent) and "small" is hidden 256, 4 layers, 8 heads / 4 KV heads, head_dim 32,
intermediate 768. Both keep the real Qwen3 vocabulary (151,936 rows) unless --vocab-sizes says otherwise:
at these sizes the vocabulary-sized output layer and embedding are most of the work, as they are in runs.

The workload is an RL batch: N sequences of a P-token prompt and an R-token response (random ids, all the
same length, so neither side pays for padding). Each model is measured three ways, with the same weights:

  megatron            this package: `compute_sequence_logprobs` and `AgentTrainer.train_step` (HACPO loss,
                      one mini-batch = one optimizer update), in a one-process gloo world. Its output hook
                      computes logits only at the R response positions of each sequence.
  hf-full-logits      transformers as a plain user calls it: logits at all P+R positions, log_softmax at the
                      response positions; training: GSPO loss (`gspo_policy_loss`), backward, AdamW step.
  hf-response-logits  the same, with `logits_to_keep` = the response positions: the fair comparison.
  hf-amp-response-logits  (a GPU with bf16 megatron) the like-for-like peer, what verl's FSDP backend runs:
                      fp32 weights and AdamW states (fused), bf16 compute under torch.autocast, SDPA attention.

megatron's rows are one per `--attention` kernel (train.attention; `megatron[sdpa]` etc., plain `megatron` for
auto) and `--rows` layout: `shared` (default, as a run trains: train.share_prompts puts each prompt once in a row,
its G responses behind it, so the prompt's tokens are computed once; throughput still counts all N * (P + R)
tokens) and `plain` (one sequence a row, as the HF side: the kernels alone compared; labelled `[plain]`); with
`--max-tokens` its micro-batches by a token budget (train.max_tokens_per_micro_batch). Before 2026-11-27 the
log-prob pass always ran plain rows and the update shared ones.

The HF training update mirrors what megatron's optimizer does here: AdamW (weight decay 0.01) and gradient
clipping at norm 1.0 (the config schema's defaults). Throughput counts all N * (P + R) tokens of the batch.
By default both sides take the whole batch as one micro-batch (--micro-batch N for smaller ones).

Timings are medians of --repeats rounds after --warmup rounds (a round runs every backend once), with
torch.set_num_threads(--threads) (default 1: a single-core comparison): wall-clock ms and tokens/s, and the
process CPU time, which other jobs' load inflates far less. Figures on a shared 2-core machine vary with its
load: the load average is recorded with them. Results and discussion: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from hacpo_megatron.models.presets import PRESETS  # noqa: E402

SMALL_QWEN3 = dict(
    PRESETS["tiny-qwen3"],  # the Qwen3 fields (QK-norm, RoPE base, tied embeddings) of the tiny preset
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    head_dim=32,  # hidden / heads (the tiny preset's heads are 32 wide too, not Qwen3's usual 128)
)
# qwen3-1.7b: Qwen3-1.7B-Base's shape (random init), for GPU runs (docs/gpu.md); far too slow for one CPU core
MODELS = {"tiny": PRESETS["tiny-qwen3"], "small": SMALL_QWEN3, "qwen3-1.7b": PRESETS["qwen3-1.7b-base"]}
SAMPLES_PER_PROMPT = 4  # G in the runs: rows of one prompt share a mini-batch
TEMPERATURE = 1.0
LR = 1e-5  # small: weights change a little per timed update, the numbers stay finite
UPDATE_PEERS = ("hf-full-logits", "hf-response-logits", "hf-amp-response-logits")  # amp: on a bf16 GPU only
# On a GPU both sides run there (megatron picks bf16, the HF model follows it), and each row gets its
# model-FLOPs utilisation against a bf16 GEMM timed in the same run (docs/gpu.md).
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


# ------------------------------------------------------------------------------------------------
# The workload
# ------------------------------------------------------------------------------------------------
@dataclass
class Workload:
    sequences: List[Tuple[List[int], List[int]]]  # (prompt ids, response ids)
    advantages: torch.Tensor  # [N]
    prompt_length: int
    response_length: int

    @property
    def tokens(self) -> int:
        return len(self.sequences) * (self.prompt_length + self.response_length)

    @property
    def num_prompts(self) -> int:
        return len(self.sequences) // SAMPLES_PER_PROMPT


def make_workload(n: int, prompt_length: int, response_length: int, vocab: int, seed: int = 0) -> Workload:
    if n % SAMPLES_PER_PROMPT:
        raise ValueError(f"--sequences must be a multiple of G={SAMPLES_PER_PROMPT}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n, prompt_length + response_length), generator=g)
    sequences = [(row[:prompt_length].tolist(), row[prompt_length:].tolist()) for row in ids]
    advantages = torch.randn(n, generator=g)  # any non-zero values: the backward pass is the same work
    return Workload(sequences, advantages, prompt_length, response_length)


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------
def time_interleaved(calls: Dict[str, Callable[[], object]], *, warmup: int, repeats: int) -> Dict[str, List]:
    """(wall s, CPU s) of each call `repeats` times, after `warmup` untimed rounds (allocator, lazy init).

    Rounds go through every backend once, so a change in the machine's load (shared with other jobs)
    hits all backends alike instead of whichever ran at that moment. The process CPU time (user + sys) of a
    single-threaded run is what the work costs, whatever the load; wall time is what a run waits.
    """
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    times: Dict[str, List] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()  # kernels are asynchronous: wait for them before reading the clock
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def result_row(model: str, vocab: int, backend: str, kind: str, times: List, tokens: int) -> Dict:
    wall = statistics.median(w for w, _ in times)
    cpu = statistics.median(c for _, c in times)
    return dict(model=model, vocab=vocab, backend=backend, kind=kind, ms=1000 * wall, tokens_per_s=tokens / wall,
                cpu_ms=1000 * cpu, tokens_per_cpu_s=tokens / cpu, ms_min=1000 * min(w for w, _ in times),
                ms_all=[round(1000 * w, 1) for w, _ in times], cpu_ms_all=[round(1000 * c, 1) for _, c in times])


def progress(rows: List[Dict]) -> str:
    """Each backend's median ms, printed as soon as measured: a run cut short by its time limit keeps them."""
    return ", ".join(f"{row['backend']} {row['ms']:.0f} ms" for row in rows)


# ------------------------------------------------------------------------------------------------
# Hugging Face side
# ------------------------------------------------------------------------------------------------
def hf_response_logprobs(model, input_ids: torch.Tensor, prompt_length: int, response_length: int,
                         *, response_logits_only: bool) -> torch.Tensor:
    """[N, R] log softmax(logits / T) of each response token; differentiable when grad is enabled.

    Position t predicts token t + 1, so response token j (at P + j) is read at position P + j - 1.
    `response_logits_only` passes those positions as `logits_to_keep`: the output layer then runs on
    N * R rows instead of N * (P + R), which is what megatron's output hook does.
    """
    positions = torch.arange(prompt_length - 1, prompt_length + response_length - 1)
    if response_logits_only:
        logits = model(input_ids, logits_to_keep=positions).logits
    else:
        logits = model(input_ids).logits[:, positions]
    logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    return logp.gather(-1, input_ids[:, prompt_length:].unsqueeze(-1)).squeeze(-1)


def hf_chunks(work: Workload, micro_batch: int) -> List[Tuple[torch.Tensor, slice]]:
    """The batch as [n, P + R] id tensors of at most `micro_batch` rows, with their rows' slice."""
    ids = torch.tensor([p + r for p, r in work.sequences], device=DEVICE)
    return [(ids[i:i + micro_batch], slice(i, i + micro_batch)) for i in range(0, len(ids), micro_batch)]


def hf_logprob_pass(model, chunks, work: Workload, response_logits_only: bool) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([hf_response_logprobs(model, ids, work.prompt_length, work.response_length,
                                               response_logits_only=response_logits_only) for ids, _ in chunks])


def autocast(fn, *args):
    """fn(*args) with bf16 compute over fp32 weights (torch.autocast), as FSDP's mixed precision runs it."""
    with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
        return fn(*args)


def hf_train_update(model, optimizer, chunks, work: Workload, old_seq_logp: torch.Tensor,
                    response_logits_only: bool) -> float:
    """One optimizer update: GSPO loss summed over micro-batches (each its share of the batch mean)."""
    from hacpo_megatron.algorithms import LossParams, PolicyBatch, gspo_policy_loss, resolve_algorithm
    from hacpo_megatron.config.schema import AlgorithmConfig

    params = LossParams.from_config(AlgorithmConfig(), resolve_algorithm("gspo"))  # the trainer's: the defaults
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for ids, rows in chunks:
        logp = hf_response_logprobs(model, ids, work.prompt_length, work.response_length,
                                    response_logits_only=response_logits_only)
        mask = torch.ones_like(logp, dtype=torch.bool)
        batch = PolicyBatch(logp, mask, work.advantages[rows].to(DEVICE), old_seq_logp[rows].to(DEVICE),
                            torch.zeros(ids.shape[0], dtype=torch.bool, device=DEVICE),
                            num_global_seqs=len(work.sequences))
        loss, _ = gspo_policy_loss(batch, params)
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # megatron clips at 1.0 too (grad_clip default)
    optimizer.step()
    model.eval()
    return total


# ------------------------------------------------------------------------------------------------
# Megatron side
# ------------------------------------------------------------------------------------------------
def init_single_rank_world() -> None:
    """A one-process gloo world, so the script runs with plain python (torchrun sets these itself)."""
    from hacpo_megatron.parallel.groups import init_distributed

    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:  # a free port: other jobs on this machine may hold the usual ones
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    init_distributed("gloo" if DEVICE.type == "cpu" else None)


def megatron_rows(work: Workload, old_seq_logp: torch.Tensor):
    from hacpo_megatron.training.batch import SequenceRow

    return [SequenceRow(prompt_ids=p, response_ids=r, advantage=float(a), old_seq_logp=float(o), is_cross=False,
                        source=0, prompt_index=i // SAMPLES_PER_PROMPT)
            for i, ((p, r), a, o) in enumerate(zip(work.sequences, work.advantages, old_seq_logp))]


def megatron_label(variant: Tuple[str, str]) -> str:
    """(train.attention, rows) -> "megatron" for a run's defaults (auto, shared), else e.g. megatron[local,plain]."""
    kernel, rows = variant
    tags = [tag for tag, default in ((kernel, "auto"), (rows, "shared")) if tag != default]
    return f"megatron[{','.join(tags)}]" if tags else "megatron"


# ------------------------------------------------------------------------------------------------
# One model, three backends, two passes
# ------------------------------------------------------------------------------------------------
def bench_model(name: str, hf_config: Dict, parallel, args) -> Tuple[List[Dict], Dict]:
    from hacpo_megatron.algorithms import resolve_algorithm
    from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
    from hacpo_megatron.models.attention import resolve_attention
    from hacpo_megatron.models.build import build_agent_model
    from hacpo_megatron.models.logprobs import compute_sequence_logprobs
    from hacpo_megatron.rollout.embedded import hf_model_from_config
    from hacpo_megatron.config.schema import Config, RolloutConfig, TrainConfig
    from hacpo_megatron.training.trainer import AgentTrainer

    vocab = hf_config["vocab_size"]
    work = make_workload(args.sequences, args.prompt_length, args.response_length, vocab)
    micro_batch = args.micro_batch or len(work.sequences)
    timing = dict(warmup=args.warmup, repeats=args.repeats)
    label = f"{name}" if vocab == MODELS[name]["vocab_size"] else f"{name}/v{vocab}"

    agent = build_agent_model(hf_config, parallel, seed=1)
    hf = hf_model_from_config(hf_config, seed=1, dtype=agent.config.params_dtype).to(DEVICE)
    load_hf_state_dict_into_model(agent.model, hf.state_dict(), hf_config, parallel)  # the same weights
    info = dict(model=label, vocab=vocab, parameters=sum(p.numel() for p in hf.parameters()),
                hidden=hf_config["hidden_size"], layers=hf_config["num_hidden_layers"])
    print(f"[{label}] {info['parameters'] / 1e6:.1f}M parameters (tied embeddings counted once)", flush=True)

    # ---- log-prob pass (no weight changes yet, so the three can be checked against each other)
    rows = []
    chunks = hf_chunks(work, micro_batch)
    # megatron's variants: (train.attention, rows): "shared" puts a prompt's G responses in one row behind it
    # (train.share_prompts, a run's default), "plain" gives every sequence its own row (as the HF side does)
    kernels = {(kernel, rows): resolve_attention(kernel, DEVICE) for rows in args.rows for kernel in args.attention}

    def megatron_lp(variant: Tuple[str, str] = (args.attention[0], args.rows[0])):
        return compute_sequence_logprobs(dataclasses.replace(agent, attention=kernels[variant]), work.sequences,
                                         temperature=TEMPERATURE, max_sequences_per_micro_batch=micro_batch,
                                         max_tokens_per_micro_batch=args.max_tokens,
                                         share_prompts=variant[1] == "shared" and agent.takes_attention_mask)

    # The peer verl's FSDP backend is: fp32 weights and Adam states, bf16 compute under autocast, SDPA attention
    # (megatron keeps fp32 main weights and Adam states the same way); on a GPU with a bf16 megatron only.
    amp = None
    if DEVICE.type == "cuda" and agent.config.params_dtype == torch.bfloat16:
        amp = hf_model_from_config(hf_config, seed=1, dtype=torch.float32).to(DEVICE)
        amp.load_state_dict({k: v.float() for k, v in hf.state_dict().items()})
    peers = {"hf-amp-response-logits": lambda: autocast(hf_logprob_pass, amp, chunks, work, True)} if amp else {}
    times = time_interleaved({
        **{megatron_label(kernel): partial(megatron_lp, kernel) for kernel in kernels},
        "hf-full-logits": lambda: hf_logprob_pass(hf, chunks, work, False),
        "hf-response-logits": lambda: hf_logprob_pass(hf, chunks, work, True),
        **peers,
    }, **timing)
    rows += [result_row(label, vocab, backend, "logprob", t, work.tokens) for backend, t in times.items()]
    print(f"[{label}] log-prob pass done: " + progress(rows[-len(times):]), flush=True)
    if args.profile:
        profile_calls({megatron_label(k): partial(megatron_lp, k) for k in kernels}
                      | {"hf-response-logits": lambda: hf_logprob_pass(hf, chunks, work, True)} | peers,
                      {"megatron": agent.model, "hf": hf, "hf-amp": amp}, args.profile, label, "logprob")
    reference = megatron_lp()
    info["max_abs_logprob_diff_megatron_vs_hf"] = float(
        (reference.token_logprobs - hf_logprob_pass(hf, chunks, work, True).cpu()).abs().max())
    old_seq_logp = reference.sums / reference.lengths  # what the RL step passes as old log-probs

    # ---- training update (megatron and HF each update their own copy of the weights)
    run_cfg = Config(train=TrainConfig(lr=LR, micro_batch_size=micro_batch, max_tokens_per_micro_batch=args.max_tokens),
                     rollout=RolloutConfig(temperature=TEMPERATURE))
    trainer = AgentTrainer(agent, resolve_algorithm("hacpo"), run_cfg)
    train_rows = megatron_rows(work, old_seq_logp)
    optimizer = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=0.01)  # megatron's "adam" decays like AdamW
    amp_optimizer = torch.optim.AdamW(amp.parameters(), lr=LR, weight_decay=0.01, fused=True) if amp else None

    def megatron_update(variant: Tuple[str, str]):  # one update of every row, with this kernel and rows
        trainer.agent = dataclasses.replace(trainer.agent, attention=kernels[variant])
        trainer.share_prompts = variant[1] == "shared" and agent.takes_attention_mask
        return trainer.train_step([train_rows])

    trainable = [k for k in kernels if not (kernels[k] == "flex" and DEVICE.type == "cpu")]  # no CPU flex backward
    peer_updates = {
        "hf-full-logits": lambda: hf_train_update(hf, optimizer, chunks, work, old_seq_logp, False),
        "hf-response-logits": lambda: hf_train_update(hf, optimizer, chunks, work, old_seq_logp, True),
        **({"hf-amp-response-logits": lambda: autocast(hf_train_update, amp, amp_optimizer, chunks, work, old_seq_logp,
                                                       True)} if amp else {}),
    }
    times = time_interleaved({
        **{megatron_label(kernel): partial(megatron_update, kernel) for kernel in trainable},
        **{backend: update for backend, update in peer_updates.items() if backend in args.update_peers},
    }, **timing)
    rows += [result_row(label, vocab, backend, "train", t, work.tokens) for backend, t in times.items()]
    print(f"[{label}] training update done: " + progress(rows[-len(times):]), flush=True)
    if args.profile:
        profile_calls({megatron_label(k): partial(megatron_update, k) for k in trainable}
                      | {backend: update for backend, update in peer_updates.items()
                         if backend in args.update_peers and backend != "hf-full-logits"},
                      {"megatron": agent.model, "hf": hf, "hf-amp": amp}, args.profile, label, "train")
    return rows, info


# ------------------------------------------------------------------------------------------------
# Where the time goes: torch.profiler, by kernel and by module
# ------------------------------------------------------------------------------------------------
@contextmanager
def module_ranges(model):
    """Every submodule's forward inside a profiler range named `module::ClassName` (forward only: the backward's
    kernels run outside the module calls, so they show in the by-kernel table alone)."""
    from torch.profiler import record_function

    open_ranges, handles = {}, []
    if model is not None:
        for module in model.modules():
            if module is model:
                continue

            def enter(m, *_):
                open_ranges.setdefault(id(m), []).append(record_function(f"module::{type(m).__name__}").__enter__())

            def leave(m, *_):
                open_ranges[id(m)].pop().__exit__(None, None, None)

            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def profile_calls(calls: Dict[str, Callable[[], object]], models: Dict[str, object], out_dir: str, label: str,
                  kind: str) -> None:
    """One call of each backend under torch.profiler (after one unprofiled call): the top kernels by their own
    device time and the modules by the device time inside them, written to OUT_DIR/profile_LABEL_KIND.txt."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = DEVICE.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    sort_key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    total_key = "device_time_total" if on_gpu else "cpu_time_total"
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"profile_{label.replace('/', '_')}_{kind}.txt")
    with open(path, "w") as out:
        for backend, call in calls.items():
            model = models["megatron" if backend.startswith("megatron") else "hf-amp" if "amp" in backend else "hf"]
            call()
            synchronize()
            with module_ranges(model), profile(activities=activities) as prof:
                call()
                synchronize()
            averages = prof.key_averages()
            out.write(f"## {label} {kind} {backend}: top kernels and ops by self time\n\n")
            out.write(averages.table(sort_by=sort_key, row_limit=30) + "\n\n")
            modules = sorted((e for e in averages if e.key.startswith("module::")),
                             key=lambda e: -getattr(e, total_key))
            out.write(f"## {label} {kind} {backend}: modules by time inside them (forward)\n\n")
            for event in modules[:25]:
                out.write(f"{event.key:<60} {getattr(event, total_key) / 1e3:10.2f} ms  x{event.count}\n")
            out.write("\n")
    print(f"[{label}] {kind} profile: {path}", flush=True)


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def markdown_table(rows: Sequence[Dict]) -> str:
    """One line per model and backend; log-prob pass and training update side by side.

    "ms" and "tok/s" are wall-clock medians (what the brief asks for); "CPU ms" is the median process CPU
    time, which load from other jobs inflates far less, so the speed ratio to megatron is taken from it.
    """
    by_key = {(r["model"], r["backend"], r["kind"]): r for r in rows}
    speed_key = "cpu_ms" if DEVICE.type == "cpu" else "ms"  # a GPU run's CPU time is not its cost
    models = list(dict.fromkeys(r["model"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    head = "| model | backend |" + "".join(f" {k} ms | {k} tok/s | {k} CPU ms | {k} speed vs {backends[0]} |"
                                        for k in ("log-prob", "train"))
    lines = [head, "|---|---|" + "---:|" * 8]
    reference = backends[0]  # the first megatron kernel (--attention's first)
    for model in models:
        for backend in backends:
            cells = [model, backend]
            for kind in ("logprob", "train"):
                row, base = by_key.get((model, backend, kind)), by_key[(model, reference, kind)]
                if row is None:  # FlexAttention's update on a CPU: torch has no backward for it there
                    cells += ["-"] * 4
                    continue
                cells += [f"{row['ms']:.0f}", f"{row['tokens_per_s']:,.0f}", f"{row['cpu_ms']:.0f}",
                          f"{base[speed_key] / row[speed_key]:.2f}x"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_model_flops_utilisation(rows: List[Dict], infos: List[Dict], machine: Dict) -> None:
    """MFU of each row: model FLOPs per token (2 x parameters for a forward pass, 6 x for forward and
    backward: the usual approximation, attention's quadratic term left out) x tokens/s, over the FLOP/s of a
    bf16 8192^3 GEMM timed now, on the same GPU, rather than a datasheet figure."""
    from hacpo_megatron.training.utilisation import gemm_peak_flops

    peak = gemm_peak_flops(torch.bfloat16, DEVICE)
    machine.update(gpu=torch.cuda.get_device_name(), bf16_gemm_tflops=round(peak / 1e12, 1),
                   peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    parameters = {info["model"]: info["parameters"] for info in infos}
    for row in rows:
        per_token = (2 if row["kind"] == "logprob" else 6) * parameters[row["model"]]
        row["mfu"] = per_token * row["tokens_per_s"] / peak


def machine_info(threads: int) -> Dict:
    # the commit measured: HACPO_COMMIT where the tree travelled without .git (tools/gpu_pack.sh writes it)
    return dict(commit=os.environ.get("HACPO_COMMIT") or git_commit(), cpus=os.cpu_count(),
                processor=platform.processor() or platform.machine(),
                torch=torch.__version__, torch_threads=threads,
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                load_before=[round(x, 2) for x in os.getloadavg()])


def git_commit() -> str:
    import subprocess
    result = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], choices=sorted(MODELS))
    parser.add_argument("--vocab-sizes", nargs="+", type=int, default=[151936],
                        help="run every model with each vocabulary size (151936: the real Qwen3 one)")
    parser.add_argument("--sequences", type=int, default=32, help="N: sequences per batch (8 prompts x G=4)")
    parser.add_argument("--prompt-length", type=int, default=24)
    parser.add_argument("--response-length", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=0, help="sequences per micro-batch; 0: the whole batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: single-core comparison)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--attention", nargs="+", default=["auto"], choices=["auto", "flex", "sdpa", "local"],
                        help="train.attention choices to time for megatron (the first also gives the reference "
                             "log-probs); auto is labelled plain 'megatron'")
    parser.add_argument("--rows", nargs="+", default=["shared"], choices=["shared", "plain"],
                        help="megatron's rows: shared (a prompt once, its responses behind it: train.share_prompts, "
                             "a run's default) and/or plain (one sequence a row, as the HF side); shared is unlabelled")
    parser.add_argument("--profile", metavar="DIR", help="also profile one call of each backend (torch.profiler: "
                                                          "by kernel and by module) into DIR")
    parser.add_argument("--update-peers", nargs="+", default=list(UPDATE_PEERS), choices=UPDATE_PEERS,
                        help="the transformers backends timed in the training update; each holds its own gradients "
                             "and Adam state beside megatron's (at Qwen3-1.7B's shape all three need ~90 GiB: on an "
                             "80 GB GPU time hf-amp-response-logits alone, the like-for-like peer)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="train.max_tokens_per_micro_batch for megatron (default: --micro-batch sequences)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    machine = machine_info(torch.get_num_threads())

    from hacpo_megatron.config.schema import AgentConfig, ParallelConfig
    from hacpo_megatron.parallel.groups import create_agent_groups

    init_single_rank_world()
    (parallel,) = create_agent_groups([AgentConfig(name="bench", parallel=ParallelConfig())])
    rows, infos = [], []
    for vocab in args.vocab_sizes:
        for name in args.models:
            model_rows, info = bench_model(name, dict(MODELS[name], vocab_size=vocab), parallel, args)
            rows += model_rows
            infos.append(info)
    machine["load_after"] = [round(x, 2) for x in os.getloadavg()]
    if DEVICE.type == "cuda":
        add_model_flops_utilisation(rows, infos, machine)

    settings = dict(sequences=args.sequences, prompt_length=args.prompt_length, response_length=args.response_length,
                    tokens_per_batch=args.sequences * (args.prompt_length + args.response_length),
                    micro_batch=args.micro_batch or args.sequences, repeats=args.repeats, warmup=args.warmup,
                    temperature=TEMPERATURE, lr=LR)
    print(f"\n{machine['cpus']} cores ({machine['processor']}), torch {machine['torch']} with "
          f"{machine['torch_threads']} thread(s); load average before {machine['load_before']}, "
          f"after {machine['load_after']}")
    print(f"batch: {args.sequences} sequences x ({args.prompt_length} prompt + {args.response_length} response) "
          f"= {settings['tokens_per_batch']} tokens, micro-batch {settings['micro_batch']}; "
          f"median of {args.repeats} after {args.warmup} warm-up\n")
    for info in infos:
        print(f"{info['model']}: {info['parameters'] / 1e6:.1f}M parameters, max |megatron - hf| log-prob "
              f"{info['max_abs_logprob_diff_megatron_vs_hf']:.2e}")
    print("\n" + markdown_table(rows))
    if DEVICE.type == "cuda":
        print(f"\n{machine['gpu']}: bf16 GEMM {machine['bf16_gemm_tflops']} TFLOP/s, peak memory "
              f"{machine['peak_memory_gib']} GiB")
        for row in rows:
            print(f"MFU {row['model']:>12} {row['backend']:>18} {row['kind']:>7}: {100 * row['mfu']:.1f} %")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine, settings=settings, models=infos, results=rows), f, indent=1)
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
