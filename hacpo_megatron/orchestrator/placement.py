"""Where a run's Ray actors go, and what happens when a node of the run dies.

    nodes = gather_rank_nodes()                  collective: the Ray node of every torchrun rank
    engine_nodes(agents_parallel, nodes)         per agent: the node of its engine rank
    pinned_to(node)                              actor options: run on that node and nowhere else
    actor_node(handle)                           the node an actor really runs on (asked inside it)
    NodeWatch(nodes, ...).start()                ends this rank, naming the node, once a node of the run dies

Engines: each agent's rollout engine runs on the node of its engine rank (weight_sync.engine_rank:
TP 0, DP 0, last pipeline stage). That rank sends the agent's whole weights to the engine after every
step, the largest transfer of a step; on one node that transfer stays inside the node (the weight
group's gloo/NCCL connections, or Ray's shared-memory object store with `rollout.weight_transport:
object_store`) instead of crossing the network. The affinity is hard: a restarted engine comes back on the same
node (its rank's node), and if that node is gone the run cannot go on anyway (its ranks are gone too).

Reward workers: placed by Ray's default policy (no config key): in practice the node of rank 0, the
only caller, which sends them the step's texts and gets one number per answer back (kilobytes).

Node loss: torchrun with a static rendezvous has no view of other nodes. Two things end a rank:
* a collective with a process that died fails at once when the dead side's connections were reset
  (gloo: "Connection closed by peer [ADDRESS]:PORT"): the rank's exception ends it, and NodeWatch's
  exception hook adds which of the job's nodes that address is, with its ranks and engines;
* a peer that vanished without a reset (power loss, a cut link) leaves the collective waiting for its
  timeout (parallel/groups.py). Ray's GCS watches every node (health checks every few seconds):
  NodeWatch polls it, and once a node that runs ranks of this job is dead it says which and ends this
  process, so torchrun ends the job on every surviving node within Ray's detection time plus a poll.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import ray
import torch.distributed as dist

NODE_LOST_EXIT_CODE = 75  # EX_TEMPFAIL: the job stopped because of its environment; --resume once it is back
WATCH_PERIOD_S = 2.0


@dataclass(frozen=True)
class RayNode:
    node_id: str  # Ray's hex node id
    node_ip: str

    def short(self) -> str:
        return f"{self.node_ip} (Ray node {self.node_id[:12]})"


def this_node() -> RayNode:
    """The Ray node this process is attached to (the raylet of its machine)."""
    return RayNode(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())


def gather_rank_nodes() -> List[RayNode]:
    """Every rank's Ray node, indexed by global rank. Collective over the torchrun world."""
    nodes: List[Optional[RayNode]] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, this_node())
    return nodes


def engine_nodes(agents_parallel: Sequence[Any], rank_nodes: Sequence[RayNode]) -> List[RayNode]:
    """Per agent (config order), the node of its engine rank."""
    from hacpo_megatron.rollout.weight_sync import engine_rank

    return [rank_nodes[engine_rank(parallel)] for parallel in agents_parallel]


def pinned_to(node: RayNode) -> Dict[str, Any]:
    """Actor options that run it on `node` only (also when Ray restarts it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=False)}


def actor_node(handle: Any) -> RayNode:
    """The node an actor runs on, as the actor itself sees it (`__ray_call__` runs a function in it)."""
    return ray.get(handle.__ray_call__.remote(lambda actor: this_node()))


def ranks_by_node(rank_nodes: Sequence[RayNode]) -> Dict[RayNode, List[int]]:
    """The job's nodes (in order of their first rank) and the ranks on each."""
    out: Dict[RayNode, List[int]] = {}
    for rank, node in enumerate(rank_nodes):
        out.setdefault(node, []).append(rank)
    return out


RESUME_ADVICE = ("bring the node back (or another in its place) and run the same command on every node with "
                 "--resume: it continues from the last complete checkpoint")


def _what_ran(ranks: Sequence[int], engines: Sequence[str]) -> str:
    return (f"ranks {', '.join(map(str, ranks))}"
            + (f" and the rollout engines of {', '.join(engines)}" if engines else ""))


def lost_node_message(node: RayNode, ranks: Sequence[int], engines: Sequence[str], reason: str = "") -> str:
    """What a surviving rank says when Ray reports `node` dead."""
    why = f" ({reason})" if reason else ""
    return (f"node {node.short()} is lost{why}: it ran {_what_ran(ranks, engines)} of this job, which cannot "
            f"go on without them: {RESUME_ADVICE}")


def lost_connection_message(node: RayNode, ranks: Sequence[int], engines: Sequence[str]) -> str:
    """What a rank adds to an error that names `node`'s address (a peer there closed the connection)."""
    return (f"the error above names node {node.short()}, which ran {_what_ran(ranks, engines)} of this job: "
            f"one of those processes, or the whole node, is gone (see that node's log); if the node is lost, "
            f"{RESUME_ADVICE}")


def nodes_named_in(text: str, nodes: Sequence[RayNode]) -> List[RayNode]:
    """The nodes whose address appears in `text` as a whole address (10.0.0.1 is not in 10.0.0.12)."""
    return [n for n in nodes if re.search(rf"(?<![\d.]){re.escape(n.node_ip)}(?![\d.])", text)]


def _exception_text(error: BaseException) -> str:
    """An exception's message and those of its causes and contexts."""
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        parts.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(parts)


class NodeWatch:
    """A daemon thread that polls Ray's node table and ends this process when a node of the job dies.

    Only a node that Ray reports dead (or no longer lists) counts; an error while asking (Ray already
    shut down at the end of a run, or the head itself unreachable, which Ray's own GCS reconnection
    timeout then handles) stops the watch quietly.
    """

    def __init__(self, rank_nodes: Sequence[RayNode], engine_nodes_by_agent: Dict[str, RayNode], rank: int,
                 period_s: float = WATCH_PERIOD_S):
        self.nodes = ranks_by_node(rank_nodes)
        self.own_node = rank_nodes[rank]
        self.engines = engine_nodes_by_agent
        self.rank = rank
        self.period_s = period_s
        self._thread = threading.Thread(target=self._run, name="hacpo-node-watch", daemon=True)

    def start(self) -> "NodeWatch":
        """Start polling and hook this process's uncaught exceptions; nothing on a one-node job (there
        that node's death is this process's death, and every address in an error is its own)."""
        if len(self.nodes) > 1:
            self._thread.start()
            previous = sys.excepthook

            def explain_then(kind, error, traceback):
                previous(kind, error, traceback)
                for line in self.explain(error):
                    print(f"rank {self.rank}: {line}", file=sys.stderr, flush=True)

            sys.excepthook = explain_then
        return self

    def engines_on(self, node: RayNode) -> List[str]:
        return [agent for agent, where in self.engines.items() if where == node]

    def explain(self, error: BaseException) -> List[str]:
        """For an error that names addresses of the job's other nodes: which ranks and engines ran there."""
        named = nodes_named_in(_exception_text(error), [node for node in self.nodes if node != self.own_node])
        return [lost_connection_message(node, self.nodes[node], self.engines_on(node)) for node in named]

    def dead_nodes(self, table: Sequence[Dict[str, Any]]) -> List[tuple]:
        """(node, Ray's death reason) for each of the job's nodes that Ray's node table (`ray.nodes()`)
        shows dead or no longer lists."""
        by_id = {entry["NodeID"]: entry for entry in table}
        dead = []
        for node in self.nodes:
            entry = by_id.get(node.node_id)
            if entry is None or not entry["Alive"]:
                dead.append((node, (entry or {}).get("DeathReasonMessage", "") or "not in Ray's node table"))
        return dead

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s)
            try:
                if not ray.is_initialized():
                    return
                dead = self.dead_nodes(ray.nodes())
            except Exception:  # noqa: BLE001 - see the class docstring: not a node loss
                return
            if dead:
                for node, reason in dead:
                    print(f"rank {self.rank}: "
                          f"{lost_node_message(node, self.nodes[node], self.engines_on(node), reason)}",
                          file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(NODE_LOST_EXIT_CODE)  # the main thread may be blocked in a collective for good
