"""A training run's checkpoint of an MoE agent at expert parallelism 2 (issue 52, items 2 and 5): saved and resumed
through the run's own functions (training/run_checkpoints.py `save`, `choose_checkpoint`, `load_checkpoint`), then
loaded at EP 1. One 2-rank torchrun world (gloo, CPU).

usage: torchrun --nproc_per_node 2 moe_ep_checkpoint_worker.py OUT_DIR
       (or a plain `python` in a world of one process, RANK=0 WORLD_SIZE=1 MASTER_ADDR/PORT set: the same at EP 1,
       DP 1, without the EP 1 load; how the worker is checked without a world)

The agent "moe", the tiny random Qwen3-MoE of tests/models/test_moe.py (8 experts, top-2, 2 layers) at DP = EP =
world size: rank r holds experts 4r .. 4r + 3 of both layers, and megatron's optimizer is two (the dense weights',
the experts'). Then:

1. trainer A, loaded with the random transformers weights: one GSPO update (5 rows, unequal shares), its state
   kept (`snapshot`: every weight and both Adam moments by name, each expert by its global index; Adam's step, the
   learning rate, the LR schedule's and the trainer's step counts);
2. `run_checkpoints.save` of step 1 (the tokenizer folder a run writes first; the capability tracker and the prompt
   sampler a run has);
3. A's second update (3 other rows): the reference;
4. trainer B at the same layout with other random weights (megatron's own initialisation): `choose_checkpoint`,
   `load_checkpoint`, its state kept, then the same second update;
5. (2 ranks) trainer C at EP 1 (DP 2), random: `choose_checkpoint` with the agent at EP 1 and `load_checkpoint` (both
   must refuse: the optimizer's state is split by EP), then the weights alone
   (`megatron_io.load_agent_checkpoint` without optimizer, what the export tool does).

Every rank writes OUT_DIR/rank{r}.pt.
"""
from __future__ import annotations

import dataclasses
import re
import sys
import time
from pathlib import Path
from typing import Dict

import torch
import torch.distributed as dist

from hacpo_megatron.algorithms.capability import CapabilityTracker
from hacpo_megatron.algorithms.registry import algorithm_spec
from hacpo_megatron.checkpoint.format import CheckpointError, read_checkpoint_metadata
from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
from hacpo_megatron.checkpoint.megatron_io import load_agent_checkpoint
from hacpo_megatron.config.schema import AgentConfig, AlgorithmConfig, ParallelConfig
from hacpo_megatron.data.sampler import PromptSampler
from hacpo_megatron.models.build import build_agent_model
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed
from hacpo_megatron.training import run_checkpoints
from hacpo_megatron.training.agents import Agents
from hacpo_megatron.training.logprob_passes import agent_logprobs
from hacpo_megatron.training.preflight import InputError
from hacpo_megatron.training.trainer import AgentTrainer
from tests.models.test_moe import random_hf_model, tiny_config
from tests.models.workers.moe_ep_worker import rows_of, sequences
from tests.training.workers.trainer_config import trainer_config

NAME = "moe"
EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


class Tokenizer:
    """What the run's `save_tokenizers` asks of a tokenizer: a folder with a tokenizer file, which every checkpoint
    then carries."""

    def save_pretrained(self, folder: str) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "tokenizer.json").write_text("{}\n")


def trainer_of(parallel, hf_config, state=None) -> AgentTrainer:
    """The agent's trainer as a run builds it (DDP, megatron's Adam, a cosine LR schedule over 4 steps, so that a
    step count or schedule not restored changes the second update's learning rate). `state`: HF weights to load;
    None keeps megatron's random initialisation (seed 3, not the weights saved)."""
    agent = build_agent_model(hf_config, parallel, seed=3, params_dtype=torch.float32)
    if state is not None:
        load_hf_state_dict_into_model(agent.model, state, hf_config, parallel)
    config = trainer_config(lr=1e-2, grad_clip=1.0, adam_eps=1e-3, micro_batch_size=1, lr_schedule="cosine",
                            total_steps=4)
    return AgentTrainer(agent, algorithm_spec(AlgorithmConfig(name="gspo")), config)


def agents_of(parallel, hf_config, trainer) -> Agents:
    return Agents(configs=[AgentConfig(name=NAME, model="x")], parallel=[parallel], hf_configs=[hf_config],
                  tokenizers=[Tokenizer()], trainers={0: trainer} if trainer is not None else {})


def run_state():
    """The capability tracker and prompt sampler a run checkpoints with its agents."""
    return CapabilityTracker(1, window=2), PromptSampler(list(range(10)), batch_size=3, seed=0)


def global_names(model) -> Dict[int, str]:
    """id(parameter) -> its name, a local expert named by its global index (local i of EP rank r: experts of the
    layer's `local_expert_indices`)."""
    layers = {f"decoder.layers.{i}.": layer.mlp.local_expert_indices for i, layer in enumerate(model.decoder.layers)}
    out = {}
    for name, param in model.named_parameters():
        match = EXPERT.match(name)
        if match:
            [indices] = [v for prefix, v in layers.items() if name.startswith(prefix)]
            name = f"{match[1]}{indices[int(match[2])]}{match[3]}"
        out[id(param)] = name
    return out


def snapshot(trainer: AgentTrainer) -> dict:
    """Every weight and Adam moment by name (experts by global index), Adam's step per parameter, which optimizer of
    megatron's chain holds each parameter, the learning rates and the step counts."""
    model = trainer.ddp_model.module
    names = global_names(model)
    out: dict = {"weights": {names[id(p)]: p.detach().clone() for p in model.parameters()},
                 "exp_avg": {}, "exp_avg_sq": {}, "step": {}, "optimizer_of": {}, "lr": [],
                 "steps_done": trainer.steps_done, "scheduler_steps": trainer.scheduler.num_steps}
    for index, inner in enumerate(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])):
        for group in inner.optimizer.param_groups:
            out["lr"].append(group["lr"])
            for param in group["params"]:
                name, state = names[id(param)], inner.optimizer.state.get(param, {})
                out["optimizer_of"][name] = index
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        out[key][name] = state[key].detach().clone()
                if "step" in state:
                    out["step"][name] = float(state["step"])
    return out


def update(trainer: AgentTrainer, seqs) -> dict:
    """One GSPO step on `seqs` (old log-probs from the trainer's pass: ratio 1), as a run makes it."""
    old = agent_logprobs(trainer, None, seqs)
    [figures] = trainer.train_step([rows_of(seqs, old)])
    return figures


def refusal(call) -> str:
    try:
        call()
    except (CheckpointError, InputError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


def main(out_dir: str) -> None:
    init_distributed()
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    layouts = {NAME: ParallelConfig(data=world, expert=world, first_rank=0)}
    if world > 1:
        layouts["moe_ep1"] = ParallelConfig(data=world, first_rank=0)
    groups = create_agent_groups([AgentConfig(name=n, model="x", parallel=p) for n, p in layouts.items()])
    parallel = groups[0]
    hf_config = tiny_config().to_dict()
    run_dir = Path(out_dir) / "run"
    report: dict = {"ep_size": parallel.ep_size, "seconds": {}}
    start = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal start
        report["seconds"][phase] = time.perf_counter() - start
        start = time.perf_counter()

    # 1-3. A: one update, the run's save of step 1, a second update
    a = trainer_of(parallel, hf_config, random_hf_model(tiny_config(), seed=7).state_dict())
    report["update_1"] = update(a, sequences(5, seed=0))
    report["saved"] = snapshot(a)
    lap("build_and_update")
    tracker, sampler = run_state()
    tracker.update(torch.tensor([[[1.0, 0.0]]]))
    sampler.next_batch()
    agents = agents_of(parallel, hf_config, a)
    run_checkpoints.save_tokenizers(str(run_dir), agents)
    step_dir = run_checkpoints.save(str(run_dir), 1, agents, tracker, sampler.state_dict(), keep_last=2)
    report["metadata"] = dataclasses.asdict(read_checkpoint_metadata(step_dir / NAME))
    lap("save")
    second = sequences(3, seed=2)
    update(a, second)
    report["direct_2"] = snapshot(a)
    lap("second_update")

    # 4. B: fresh, other weights; the run's resume; the same second update
    b = trainer_of(parallel, hf_config)
    report["fresh"] = snapshot(b)
    tracker_b, sampler_b = run_state()
    as_saved = [AgentConfig(name=NAME, model="x", parallel=layouts[NAME])]
    chosen = run_checkpoints.choose_checkpoint(str(run_dir), as_saved)
    report["resumed_step"] = run_checkpoints.load_checkpoint(chosen, str(run_dir), agents_of(parallel, hf_config, b),
                                                             tracker_b, sampler_b)
    report["run_state"] = {"tracker": tracker_b.state_dict() == tracker.state_dict(),
                           "sampler": sampler_b.state_dict() == sampler.state_dict()}
    report["loaded"] = snapshot(b)
    lap("build_and_resume")
    update(b, second)
    report["resumed_2"] = snapshot(b)
    lap("second_update_resumed")

    # 5. C at EP 1: the run's resume refuses the optimizer's state; the weights alone load
    if world > 1:
        ep1 = dataclasses.replace(groups[1], name=NAME)  # the saved agent's name: its folder in the step
        c = trainer_of(ep1, hf_config)
        at_ep1 = [AgentConfig(name=NAME, model="x", parallel=layouts["moe_ep1"])]
        report["ep1_choose"] = refusal(lambda: run_checkpoints.choose_checkpoint(str(run_dir), at_ep1))
        report["ep1_resume"] = refusal(lambda: run_checkpoints.load_checkpoint(
            str(step_dir), str(run_dir), agents_of(ep1, hf_config, c), *run_state()))
        load_agent_checkpoint(step_dir / NAME, c.agent)
        report["ep1_weights"] = snapshot(c)["weights"]
        lap("ep1")
    torch.save(report, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
