"""Per-agent process groups inside one torchrun world, without megatron's global parallel state.

Every agent is its own megatron model with its own TP x PP x DP layout on its own block of global
ranks (`layout.agent_rank_ranges`). Megatron's `initialize_model_parallel` can describe only ONE
layout per process, so it is never called; instead each agent gets a `ProcessGroupCollection`
built from a `HyperCommGrid` over its ranks, and every megatron call that communicates is handed
that collection (or one of its groups) explicitly. See docs/parallelism.md for the decision.

Rank order inside an agent is megatron's default "tp-cp-dp-pp" (TP fastest, PP slowest):
    agent_rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank))

A mixture-of-experts agent's experts see the same ranks through megatron's second grid, the expert grid (its
order "tp-cp-ep-dp-pp" without cp): each stage's TP x DP ranks again, as ETP x EP x expert-DP (EP takes no ranks of
its own, so EP x ETP must divide TP x DP: models/presets.layout_problems):
    agent_rank = etp_rank + ETP * (ep_rank + EP * (expert_dp_rank + EDP * pp_rank))
EP ranks hold different experts and exchange tokens in every MoE layer; expert-DP ranks hold the same experts, whose
gradients megatron's DDP sums over them (the dense weights' over DP). `expert_rank_groups` is that arithmetic.

Group creation is collective over the WHOLE world (torch's `new_group`), so every rank builds
every agent's groups, in config order, even for agents it is not part of.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hacpo_megatron.config.schema import AgentConfig
from hacpo_megatron import megatron_cpu
from hacpo_megatron.parallel.layout import agent_rank_ranges

# The decoder grid's dimensions, fastest-varying first (megatron's `order="tp-cp-ep-dp-pp"` without ep).
_GRID_DIMS = ["tp", "cp", "dp", "pp"]
# The expert grid's (megatron's expert RankGenerator: the same order without cp; "tp" is the experts' own TP, ETP)
EXPERT_GRID_DIMS = ("tp", "ep", "dp", "pp")


def expert_grid_shape(tp: int, dp: int, pp: int, ep: int, etp: int) -> Tuple[int, int, int, int]:
    """(ETP, EP, expert-DP, PP): megatron's expert grid over an agent's TP x DP x PP ranks."""
    if min(tp, dp, pp, ep, etp) < 1 or (tp * dp) % (ep * etp):
        raise ValueError(f"EP={ep} x ETP={etp} must divide each stage's TP={tp} x DP={dp} ranks")
    return etp, ep, tp * dp // (ep * etp), pp


def expert_rank_groups(first_rank: int, tp: int, dp: int, pp: int, ep: int, etp: int,
                       dims: Sequence[str]) -> List[List[int]]:
    """The global rank groups along `dims` (names of EXPERT_GRID_DIMS) of an agent whose ranks start at
    `first_rank`: every group, each in rank order, in megatron's order (`RankGenerator.get_ranks` of
    `initialize_model_parallel` with the same sizes and order "tp-cp-ep-dp-pp"). Pure arithmetic."""
    shape = expert_grid_shape(tp, dp, pp, ep, etp)
    if not dims or any(d not in EXPERT_GRID_DIMS for d in dims):
        raise ValueError(f"dims must be names of {EXPERT_GRID_DIMS}, got {list(dims)}")
    # agent_rank = etp_rank + ETP * (ep_rank + EP * (edp_rank + EDP * pp_rank)): an array whose axes are pp, dp, ep, tp
    grid = torch.arange(first_rank, first_rank + etp * ep * shape[2] * pp).reshape(tuple(reversed(shape)))
    axis_of = {name: len(shape) - 1 - i for i, name in enumerate(EXPERT_GRID_DIMS)}
    inside = sorted(axis_of[d] for d in set(dims))
    outside = [a for a in range(len(shape)) if a not in inside]
    members = 1
    for a in inside:
        members *= grid.shape[a]
    # a group per position of the other dims, the fastest of them varying fastest (megatron's group order)
    groups = grid.permute(*outside, *inside).reshape(-1, members)
    return [sorted(int(r) for r in group) for group in groups]


@dataclass(frozen=True)
class AgentParallel:
    """One agent's place in the world: its ranks, layout, and (on its members) its process groups."""

    name: str
    ranks: Tuple[int, ...]  # global ranks, agent rank order
    tp_size: int
    pp_size: int
    dp_size: int
    rank: int  # this process's global rank
    pg_collection: Optional[Any]  # megatron ProcessGroupCollection; None where not a member
    group: Optional[dist.ProcessGroup] = None  # all of the agent's ranks; None where not a member
    # the expert grid (module docstring): EP, and the experts' TP (megatron's default, TP, where EP and ETP are 1)
    ep_size: int = 1
    etp_size: int = 1

    @property
    def is_member(self) -> bool:
        return self.rank in self.ranks

    @property
    def agent_rank(self) -> int:
        """This rank's index inside the agent (0 .. world_size-1)."""
        self._require_member()
        return self.ranks.index(self.rank)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def tp_rank(self) -> int:
        return self.agent_rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return (self.agent_rank // self.tp_size) % self.dp_size

    @property
    def pp_rank(self) -> int:
        return self.agent_rank // (self.tp_size * self.dp_size)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        """The one rank per data-parallel replica that reports results (last stage, TP rank 0)."""
        return self.is_last_stage and self.tp_rank == 0

    def global_rank_of(self, *, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return self.ranks[tp_rank + self.tp_size * (dp_rank + self.dp_size * pp_rank)]

    # ---- the expert grid (module docstring)
    @property
    def expert_dp_size(self) -> int:
        """Replicas of each expert: the ranks of a stage over EP x ETP."""
        return self.tp_size * self.dp_size // (self.ep_size * self.etp_size)

    @property
    def etp_rank(self) -> int:
        return self.agent_rank % self.etp_size

    @property
    def ep_rank(self) -> int:
        """Which share of each layer's experts this rank holds: experts [ep_rank * E / EP, (ep_rank + 1) * E / EP)."""
        return (self.agent_rank // self.etp_size) % self.ep_size

    @property
    def expert_dp_rank(self) -> int:
        return (self.agent_rank // (self.etp_size * self.ep_size)) % self.expert_dp_size

    def expert_global_rank_of(self, *, etp_rank: int, ep_rank: int, expert_dp_rank: int, pp_rank: int) -> int:
        return self.ranks[etp_rank + self.etp_size * (ep_rank + self.ep_size * (expert_dp_rank
                                                                              + self.expert_dp_size * pp_rank))]

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self._groups().tp

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self._groups().pp

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self._groups().dp

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self._groups().ep

    @property
    def expert_tp_group(self) -> dist.ProcessGroup:
        return self._groups().expt_tp

    @property
    def model_parallel_group(self) -> dist.ProcessGroup:
        """TP x PP: all ranks holding one copy of the model."""
        return self._groups().mp

    def _groups(self) -> Any:
        self._require_member()
        return self.pg_collection

    def _require_member(self) -> None:
        if not self.is_member:
            raise RuntimeError(f"rank {self.rank} is not a member of agent {self.name!r} (ranks {self.ranks})")


class _GroupFactory:
    """Creates one torch process group per distinct rank set, collectively on every rank.

    Several fields of a collection often have the same members (with TP=1 the tp group and the
    expert-tp group are both this rank alone); they share one group instead of opening another
    communicator. Identical enumerations across agents cannot occur: agents' rank blocks differ.
    """

    def __init__(self, backend: Optional[str], timeout: Optional[timedelta]):
        self.backend = backend
        self.timeout = timeout
        self._created: Dict[Tuple[Tuple[int, ...], ...], Optional[dist.ProcessGroup]] = {}

    def group_for(self, enumeration: Sequence[Sequence[int]]) -> Optional[dist.ProcessGroup]:
        """This rank's group among `enumeration` (a partition of some ranks); None if in none. Keyed by members
        alone (torch orders a group's ranks itself), so the decoder and the expert grid share equal groups."""
        key = tuple(sorted(tuple(sorted(int(r) for r in ranks)) for ranks in enumeration))
        if key not in self._created:
            mine = None
            for ranks in key:
                group = dist.new_group(ranks=list(ranks), backend=group_backend(ranks, self.backend),
                                       timeout=self.timeout)
                if dist.get_rank() in ranks:
                    mine = group
            self._created[key] = mine
        return self._created[key]


def _agent_pg_collection(
    ranks: range, tp: int, pp: int, dp: int, factory: _GroupFactory, *, ep: int = 1, etp: int = 1,
) -> Tuple[Optional[Any], Optional[dist.ProcessGroup]]:
    """The `ProcessGroupCollection` of one agent and its all-ranks group (None outside it). Collective.

    `etp` is the experts' own TP where EP x ETP > 1; otherwise megatron's default (ETP = TP) holds."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    cp = 1  # context parallelism: not used yet; the grid keeps its slot so it can be turned on
    grid = HyperCommGrid([tp, cp, dp, pp], list(_GRID_DIMS), rank_offset=ranks.start)

    def group(dims: List[str]) -> Optional[dist.ProcessGroup]:
        return factory.group_for(grid.get_rank_enum(dims))

    each_rank_alone = factory.group_for([[r] for r in ranks])
    whole_agent = factory.group_for([list(ranks)])
    groups: Dict[str, Optional[dist.ProcessGroup]] = dict(
        tp=group(["tp"]),
        cp=each_rank_alone,
        dp=group(["dp"]),
        pp=group(["pp"]),
        mp=group(["tp", "pp"]),
        tp_cp=group(["tp", "cp"]),
        dp_cp=group(["cp", "dp"]),
        tp_dp_cp=group(["tp", "cp", "dp"]),
    )
    if ep == 1 and etp == 1:
        # A dense model, or experts all on every rank (EP=1, expert-TP = TP, expert-DP = DP x CP; the *_remat variants
        # equal their plain groups at remat size 1). megatron's DDP/optimizer helpers read these fields and, when they
        # are missing, create groups of their own over the whole world: wrong members and a deadlock when only some
        # ranks get there.
        groups.update(
            ep=each_rank_alone,
            expt_tp=groups["tp"],
            expt_dp=groups["dp_cp"],
            tp_ep=groups["tp"],
            tp_ep_pp=groups["mp"],
        )
    else:  # the expert grid (module docstring), as megatron's initialize_model_parallel builds it
        def expert_group(dims: List[str]) -> Optional[dist.ProcessGroup]:
            return factory.group_for(expert_rank_groups(ranks.start, tp, dp, pp, ep, etp, dims))

        groups.update(
            ep=expert_group(["ep"]),  # the experts' token exchange (all-to-all)
            expt_tp=expert_group(["tp"]),
            expt_dp=expert_group(["dp"]),  # DDP sums the experts' gradients over it
            tp_ep=expert_group(["tp", "ep"]),  # the dispatcher's token counts
            tp_ep_pp=expert_group(["tp", "ep", "pp"]),  # the expert optimizer's gradient norm
        )
    groups.update(
        tp_ep_pp_with_egtp_remat=groups["tp_ep_pp"],
        intra_dp_cp=groups["dp_cp"],  # one distributed-optimizer instance: partial DP = full DP
        intra_expt_dp=groups["expt_dp"],
        dp_cp_gtp_remat=groups["dp_cp"],
        expt_dp_gtp_remat=groups["expt_dp"],
    )
    # The first and last pipeline stages share the word embeddings when they are tied; their
    # gradients are summed over this group (one per pipeline, i.e. per TP x DP position).
    stage_ends = [[p[0], p[-1]] if len(p) > 1 else [p[0]] for p in grid.get_rank_enum("pp")]
    groups["embd"] = factory.group_for(stage_ends)
    groups["pos_embd"] = factory.group_for([[p[0]] for p in grid.get_rank_enum("pp")])
    # The distributed optimizer (on GPU) reduces its gradient statistics (norm for clipping, zero count) over
    # every rank of its one instance: the whole agent, as parallel_state builds it for one optimizer instance.
    groups["intra_dist_opt"] = whole_agent
    if dist.get_rank() not in ranks:
        return None, None
    return ProcessGroupCollection(**groups), whole_agent


def create_agent_groups(
    agents: Sequence[AgentConfig],
    *,
    backend: Optional[str] = None,
    timeout: Optional[timedelta] = None,
) -> List[AgentParallel]:
    """Every agent's process groups, in config order. Collective: call on every rank, same args.

    `torch.distributed` must be initialised with a world at least `required_world_size(agents)`.
    Also sets up the few megatron globals the models still read (`initialize_megatron_globals`).
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before creating agent groups")
    initialize_megatron_globals()
    factory = _GroupFactory(backend, timeout or collective_timeout())  # torch's new_group does not inherit it
    world, rank = dist.get_world_size(), dist.get_rank()
    result: List[AgentParallel] = []
    for agent, ranks in zip(agents, agent_rank_ranges(agents)):
        p = agent.parallel
        if ranks.stop > world:
            raise ValueError(f"agent {agent.name!r} needs ranks {ranks.start}..{ranks.stop - 1}, "
                             f"but the world has {world} processes")
        ep, etp = p.expert, p.expert_tensor
        expert_grid_shape(p.tensor, p.data, p.pipeline, ep, etp)  # ValueError: the config check names the key
        collection, whole_agent = _agent_pg_collection(ranks, p.tensor, p.pipeline, p.data, factory, ep=ep, etp=etp)
        result.append(AgentParallel(
            name=agent.name, ranks=tuple(ranks), tp_size=p.tensor, pp_size=p.pipeline, dp_size=p.data,
            rank=rank, pg_collection=collection, group=whole_agent,
            ep_size=ep, etp_size=etp if ep * etp > 1 else p.tensor,
        ))
    return result


def initialize_megatron_globals() -> None:
    """The megatron globals that per-agent groups cannot replace. Idempotent.

    The local attention spec draws its scratch tensors from parallel_state's global memory buffer
    (a cache of reusable tensors, nothing about groups); it must exist before a forward pass.
    """
    megatron_cpu.apply()
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


# How long a collective may wait for its slowest rank before it fails (the world and every agent group).
# Legitimate waits are long: the other ranks wait in a broadcast while rank 0 drives a step's rollouts
# and scoring, or while an agent's first rank runs the supervised warm-up. A lost node is detected far
# sooner by orchestrator/placement.py (NodeWatch); this bounds what nothing else catches.
COLLECTIVE_TIMEOUT_ENV = "HACPO_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0


def collective_timeout() -> timedelta:
    value = os.environ.get(COLLECTIVE_TIMEOUT_ENV, str(DEFAULT_COLLECTIVE_TIMEOUT_S))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"{COLLECTIVE_TIMEOUT_ENV}={value!r}: expected a positive number of seconds")
    return timedelta(seconds=seconds)


def _ranks_per_machine() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def local_gpu(rank: int) -> int:
    """The GPU of a torchrun rank on its machine: its local rank, wrapped round when a machine runs more
    ranks than it has GPUs (two one-GPU agents on a one-GPU machine share it)."""
    return (rank % _ranks_per_machine()) % max(torch.cuda.device_count(), 1)


def gpus_shared() -> bool:
    """Do ranks of this machine share a GPU? NCCL refuses a communicator with two ranks on one device."""
    return torch.cuda.is_available() and _ranks_per_machine() > torch.cuda.device_count()


def group_backend(ranks: Sequence[int], default: Optional[str] = None) -> Optional[str]:
    """NCCL for a group whose ranks each have a GPU of their own, gloo (CUDA tensors staged through host
    memory) for one where two of its ranks share a GPU; `default` (the world's) when no GPU is shared."""
    if not gpus_shared():
        return default
    devices = [local_gpu(r) for r in ranks]
    return "nccl" if len(set(devices)) == len(devices) else "gloo"


def collective_device() -> torch.device:
    """Where this process's collective buffers go: its GPU where it has one (NCCL groups need CUDA tensors and
    gloo groups take them too, staged through host memory), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed(backend: Optional[str] = None) -> None:
    """`torch.distributed.init_process_group` from torchrun's environment: nccl on GPU, gloo on CPU,
    with a collective timeout of HACPO_COLLECTIVE_TIMEOUT_S (default 30 min) for gloo and NCCL alike.
    Where ranks share a GPU the world group is gloo (see `group_backend`)."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(local_gpu(int(os.environ.get("RANK", "0"))))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and not gpus_shared() else "gloo"
    dist.init_process_group(backend=backend, timeout=collective_timeout())


@contextlib.contextmanager
def world_collectives_within(agent: AgentParallel) -> Iterator[None]:
    """Run megatron code that still talks to the whole world inside one agent's ranks instead.

    megatron-core 0.19's `get_megatron_optimizer` aligns parameter groups with an
    `all_gather_object` over the default (world) group, so building one agent's optimizer would
    wait for every rank of every agent. Inside this context the default-group world size and
    object gather are the agent's; calls that name a group are untouched. Single-threaded use only.
    """
    group = agent.group
    if group is None:
        raise RuntimeError(f"rank {agent.rank} is not a member of agent {agent.name!r}")
    gather, world_size = dist.all_gather_object, dist.get_world_size

    def agent_gather(object_list, obj, group_=None, **kwargs):
        return gather(object_list, obj, group=kwargs.pop("group", None) or group_ or group, **kwargs)

    def agent_world_size(group_=None, **kwargs):
        return world_size(kwargs.pop("group", None) or group_ or group, **kwargs)

    dist.all_gather_object, dist.get_world_size = agent_gather, agent_world_size
    try:
        yield
    finally:
        dist.all_gather_object, dist.get_world_size = gather, world_size
