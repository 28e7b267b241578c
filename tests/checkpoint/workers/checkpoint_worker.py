"""Every distributed checkpoint check in one 2-process torchrun world (each launch costs seconds).

For every test architecture (HF folders prepared by the test in IN/<arch>):
  1. convert HF -> Megatron at TP=1, TP=2 and PP=2 (tools/convert_hf_to_megatron.py's function);
  2. compare logits with transformers for each checkpoint at its own layout, and for the TP=2
     checkpoint loaded at TP=1 and at PP=2 (resharding);
  3. sequence log-probs of the TP=2 checkpoint loaded at TP=1 / PP=2 vs. the HF weights loaded
     directly at TP=1 / PP=2 (must be identical);
  4. export the TP=2 and PP=2 checkpoints back to HF (tools/convert_megatron_to_hf.py's function).
Then, once: a training-style save of two agents (one on both ranks at TP=2, one on rank 1 only) with
optimizer state, a crash injected in the middle of the next save, resume, keep_last pruning, a save onto a
disk that fills up (OUT/small_disk, where the test mounted one: as root only), and an export of the run folder
(every agent of `latest`).

usage: torchrun --nproc_per_node 2 checkpoint_worker.py IN OUT ARCH [ARCH ...]
"""
from __future__ import annotations

import errno
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hacpo_megatron.checkpoint import megatron_io
from hacpo_megatron.checkpoint.hf_io import HFWeights, read_hf_config
from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
from hacpo_megatron.checkpoint.local_world import single_agent_parallel
from hacpo_megatron.checkpoint.megatron_io import (
    AgentState, build_agent_from_checkpoint, load_agents_checkpoint, save_agents_checkpoint,
)
from hacpo_megatron.checkpoint.run_folder import latest_checkpoint
from hacpo_megatron.checkpoint.save_agreement import CheckpointSaveError
from hacpo_megatron.config.schema import AgentConfig, ParallelConfig
from hacpo_megatron.models.build import build_agent_model
from hacpo_megatron.models.logprobs import compute_sequence_logprobs
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed
from tests.checkpoint.hf_folders import LAYOUTS
from tests.models.workers.reference import SEQUENCES

TOOLS = Path(__file__).resolve().parents[3] / "tools"
SMALL_DISK = "small_disk"  # OUT/small_disk: a small filesystem of its own, mounted by the test


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


to_megatron = load_tool("convert_hf_to_megatron")
to_hf = load_tool("convert_megatron_to_hf")
compare = load_tool("compare_hf_megatron")


def logprobs_from_hf_and_from_checkpoint(hf_dir: Path, checkpoint: Path, tp: int, pp: int, label: str):
    """Token log-probs at TP x PP: (HF weights loaded directly, checkpoint loaded). None off the agent."""
    hf_config = read_hf_config(hf_dir)
    parallel = single_agent_parallel(label, tp, pp)
    if not parallel.is_member:
        return None
    direct = build_agent_model(hf_config, parallel, seed=1)
    load_hf_state_dict_into_model(direct.model, HFWeights(hf_dir), hf_config, parallel)
    resharded = build_agent_from_checkpoint(checkpoint, parallel, seed=2)
    return [compute_sequence_logprobs(a, SEQUENCES, temperature=0.7, max_sequences_per_micro_batch=2).token_logprobs
            for a in (direct, resharded)]


def conversion_checks(inputs: Path, out: Path, arch: str, report: dict) -> None:
    hf_dir, entry = inputs / arch, {"timings": {}}
    for layout, (tp, pp) in LAYOUTS.items():
        start = time.time()
        to_megatron.convert_hf_to_megatron(str(hf_dir), str(out / arch / layout), tensor_parallel=tp,
                                           pipeline_parallel=pp)
        entry["timings"][f"convert_{layout}"] = time.time() - start
    diffs = {}
    for saved, (load_layout, (tp, pp)) in [("tp1", ("tp1", LAYOUTS["tp1"])), ("tp2", ("tp2", LAYOUTS["tp2"])),
                                           ("pp2", ("pp2", LAYOUTS["pp2"])), ("tp2", ("tp1", LAYOUTS["tp1"])),
                                           ("tp2", ("pp2", LAYOUTS["pp2"]))]:
        diffs[f"{saved}->{load_layout}"] = compare.compare_hf_megatron(
            str(hf_dir), str(out / arch / saved), tensor_parallel=tp, pipeline_parallel=pp)
    entry["logit_diffs"] = diffs
    for load_layout in ("tp1", "pp2"):
        pair = logprobs_from_hf_and_from_checkpoint(hf_dir, out / arch / "tp2", *LAYOUTS[load_layout],
                                                    label=f"{arch}-{load_layout}")
        if pair is not None:
            entry[f"logprobs_tp2->{load_layout}_max_diff"] = (pair[0] - pair[1]).abs().max().item()
            entry[f"logprobs_tp2->{load_layout}_equal"] = bool(torch.equal(pair[0], pair[1]))
    for saved in ("tp2", "pp2"):
        start = time.time()
        to_hf.convert_megatron_to_hf(str(out / arch / saved), str(out / arch / f"hf_from_{saved}"),
                                     max_shard_bytes=300_000)
        entry["timings"][f"export_{saved}"] = time.time() - start
    report[arch] = entry


# ------------------------------------------------------------------------------------------------
# Training-style checkpoints: two agents, optimizer state, a crash, resume, pruning
# ------------------------------------------------------------------------------------------------
# alpha: TP=2 on both ranks; beta: data parallel over both ranks (only replica 0 writes); gamma: rank 1
# only, without an optimizer (rank 0 enters its save with an empty state). Every rank must build the
# same number of megatron optimizers: `get_megatron_optimizer` all-gathers over the whole world.
TRAIN_AGENTS = [AgentConfig(name="alpha", parallel=ParallelConfig(tensor=2, first_rank=0)),
                AgentConfig(name="beta", parallel=ParallelConfig(data=2, first_rank=0)),
                AgentConfig(name="gamma", parallel=ParallelConfig(tensor=1, first_rank=1))]
WITH_OPTIMIZER = {"alpha", "beta"}


def build_trainable(hf_dir: Path, parallel, seed: int):
    """Model (loaded from HF), DDP wrapper and megatron Adam, as training builds them on CPU."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    hf_config = read_hf_config(hf_dir)
    agent = build_agent_model(hf_config, parallel, seed=seed)
    load_hf_state_dict_into_model(agent.model, HFWeights(hf_dir), hf_config, parallel)
    ddp = DistributedDataParallel(config=agent.config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False),
        module=agent.model, pg_collection=parallel.pg_collection)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=0.0, bf16=False,
                        params_dtype=torch.float32, use_distributed_optimizer=False),
        [ddp], use_gloo_process_groups=False, pg_collection=parallel.pg_collection)
    agent.model = ddp
    return agent, optimizer, hf_config


def adam_step(agent, optimizer) -> None:
    """One optimizer step on a simple differentiable function of this rank's parameters."""
    ddp = agent.model
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = sum((p.float() ** 2).mean() for p in ddp.parameters())
    loss.backward()
    ddp.finish_grad_sync()
    optimizer.step()


def snapshot(agent, optimizer) -> dict:
    params = {n: p.detach().clone() for n, p in agent.model.named_parameters()}
    state = optimizer.state_dict()
    moments = []
    for group_state in (state if isinstance(state, list) else [state]):
        for _index, values in sorted(group_state["state"].items()):
            moments += [values["exp_avg"].clone(), values["exp_avg_sq"].clone()]
    return {"params": params, "moments": moments}


def same(a: dict, b: dict) -> bool:
    return (a["params"].keys() == b["params"].keys()
            and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
            and len(a["moments"]) == len(b["moments"]) > 0
            and all(torch.equal(x, y) for x, y in zip(a["moments"], b["moments"])))


def training_checks(inputs: Path, out: Path, report: dict) -> None:
    root, hf_dir = out / "run", inputs / "qwen2"
    groups = create_agent_groups(TRAIN_AGENTS)

    def states(seed: int):
        items, trainable, models = [], {}, {}
        for parallel in groups:
            if parallel.is_member and parallel.name in WITH_OPTIMIZER:
                agent, optimizer, hf_config = build_trainable(hf_dir, parallel, seed)
                trainable[parallel.name] = (agent, optimizer)
                items.append(AgentState(parallel, hf_config, agent, optimizer, tokenizer_dir=hf_dir))
            elif parallel.is_member:
                hf_config = read_hf_config(hf_dir)
                agent = build_agent_model(hf_config, parallel, seed=seed)  # random weights differ by seed
                models[parallel.name] = agent
                items.append(AgentState(parallel, hf_config, agent))
            else:
                items.append(AgentState(parallel))
        return items, trainable, models

    items, trainable, models = states(seed=1)
    for agent, optimizer in trainable.values():
        adam_step(agent, optimizer)
    save_agents_checkpoint(root, 1, items, keep_last=1, trainer_state={"step": 1, "note": "after one update"})
    at_step_1 = {name: snapshot(*pair) for name, pair in trainable.items()}
    gamma_at_step_1 = {n: p.detach().clone() for n, p in models["gamma"].model.named_parameters()} if models else None
    for agent, optimizer in trainable.values():
        adam_step(agent, optimizer)

    # A crash in the middle of the step-2 save: alpha's and beta's files are written, then gamma's save raises.
    real_save = megatron_io.save_agent_checkpoint

    def crashing_save(folder, agent, *, step=None):
        if agent.parallel.name == "gamma":
            raise RuntimeError("simulated crash")
        real_save(folder, agent, step=step)

    megatron_io.save_agent_checkpoint = crashing_save
    try:
        save_agents_checkpoint(root, 2, items, keep_last=1)
        report["crash_raised"] = False
    except RuntimeError:
        report["crash_raised"] = True
    finally:
        megatron_io.save_agent_checkpoint = real_save
    dist.barrier()
    report["after_crash"] = {"latest": latest_checkpoint(root).name, "entries": sorted(p.name for p in root.iterdir()),
                             "alpha_written_in_tmp": (root / "step_00000002.tmp" / "alpha" / "metadata.json").is_file()}

    # Resume in fresh models and optimizers (other seed): step 1's weights and Adam moments come back.
    fresh_items, fresh, fresh_models = states(seed=7)
    step_dir, trainer_state = load_agents_checkpoint(root, fresh_items)
    restored = {n: same(snapshot(*fresh[n]), at_step_1[n]) for n in fresh}
    if fresh_models:
        restored["gamma"] = all(torch.equal(p, gamma_at_step_1[n])
                                for n, p in fresh_models["gamma"].model.named_parameters())
    report["resume"] = {"step_dir": step_dir.name, "trainer_state": trainer_state, "restored": restored}
    for name in fresh:  # the restored optimizer keeps working
        adam_step(*fresh[name])

    save_agents_checkpoint(root, 2, fresh_items, keep_last=1)
    report["after_save_2"] = {"latest": latest_checkpoint(root).name,
                              "entries": sorted(p.name for p in root.iterdir())}
    if (out / SMALL_DISK).is_dir():  # the test mounted a small disk there (as root only)
        full_disk_checks(out / SMALL_DISK / "run", fresh_items, report)
    # Export every agent of the run's latest step in one call.
    exported = to_hf.convert_megatron_to_hf(str(root), str(out / "run_hf"))
    report["run_export"] = {name: str(path) for name, path in exported.items()}


def fill(path: Path) -> None:
    """Write zeros into `path` until its filesystem refuses another byte."""
    with open(path, "wb", buffering=0) as file:
        for chunk in (2**20, 2**12, 1):
            try:
                while True:
                    file.write(b"\0" * chunk)
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise


def full_disk_checks(root: Path, items, report: dict) -> None:
    """A disk that fills up under a save (a small tmpfs the test mounted at OUT/small_disk): step 1 fits, then a
    file takes the rest. The step-2 save must fail on every rank together (no rank left at a barrier) with one
    message, leave `latest` on step 1 and no partial folder, and succeed once the space is back."""
    filler = root.parent / "filler"
    save_agents_checkpoint(root, 1, items)
    if dist.get_rank() == 0:
        fill(filler)
    dist.barrier()
    try:
        save_agents_checkpoint(root, 2, items)
        outcome = "saved"
    except CheckpointSaveError as error:
        outcome = str(error)
    report["full_disk"] = {"outcome": outcome, "latest": latest_checkpoint(root).name,
                           "entries": sorted(p.name for p in root.iterdir())}
    if dist.get_rank() == 0:
        filler.unlink()
    dist.barrier()
    save_agents_checkpoint(root, 2, items)
    report["full_disk"]["after_freeing"] = latest_checkpoint(root).name


def main(inputs: Path, out: Path, archs) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)  # a hang shows where, instead of a silent timeout
    init_distributed()
    report: dict = {"timings": {}}
    for arch in archs:
        start = time.time()
        conversion_checks(inputs, out, arch, report)
        report["timings"][arch] = time.time() - start
    start = time.time()
    training_checks(inputs, out, report)
    report["timings"]["training"] = time.time() - start
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report, indent=2, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
