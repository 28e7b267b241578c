"""What a run starts and must end however it ends, as one context manager around the training loop.

    with RunLifecycle(options.ray_address) as lifecycle:
        reward_actor = lifecycle.start_actors(settings, agents, rank, output_dir)  # Ray, engines, reward
        reporter = lifecycle.reporting(make_reporter())     # rank 0's metrics file, summary and trackers
        preemption = lifecycle.watch_signals()              # a preemption's signal: stop at the step's end
        ... the steps ...

At the end, in reverse order: the signal handlers are restored, the reporter closes (its trackers marked failed
unless the end was orderly), and every rank leaves Ray (`leave_ray`). Orderly: the block ended, or a preemption
stopped it at a step boundary with its checkpoint written (`Preempted`, which still propagates); anything else is
an error, after which no collective may run (the ranks may be anywhere). Whatever fails between the start of Ray
and the first step leaves Ray too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from hacpo_megatron.orchestrator.preemption import Preempted, PreemptionGuard
from hacpo_megatron.orchestrator.ray_runtime import RayRuntime, leave_ray
from hacpo_megatron.orchestrator.run_agents import RunAgents
from hacpo_megatron.orchestrator.startup import ActorSettings, start_actors

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from hacpo_megatron.reporting import RunReporter


class RunLifecycle:
    def __init__(self, ray_address: Optional[str]):
        self.ray_address = ray_address
        self.runtime: Optional[RayRuntime] = None
        self.reward_actor: Optional[ActorHandle] = None
        self.reporter: Optional[RunReporter] = None
        self.preemption: Optional[PreemptionGuard] = None

    def __enter__(self) -> "RunLifecycle":
        return self

    def start_actors(self, settings: ActorSettings, agents: RunAgents, rank: int,
                     output_dir: str) -> Optional["ActorHandle"]:
        """Connect to Ray (or start a local one), then the agents' engine actors and the reward actor; the
        engines and their weight senders go into `agents`. Returns the reward actor (rank 0's handle; None
        elsewhere)."""
        self.runtime = RayRuntime.connect(self.ray_address)
        agents.engines, agents.senders, self.reward_actor = start_actors(settings, agents, rank, output_dir)
        return self.reward_actor

    def reporting(self, reporter: "RunReporter") -> "RunReporter":
        """Closed at the end (rank 0's reporter: metrics file, summary, trackers)."""
        self.reporter = reporter
        return reporter

    def watch_signals(self) -> PreemptionGuard:
        self.preemption = PreemptionGuard.install()
        return self.preemption

    def __exit__(self, exc_type, exc, traceback) -> bool:
        orderly = exc_type is None or issubclass(exc_type, Preempted)
        if self.preemption is not None:
            self.preemption.uninstall()
        if self.reporter is not None:
            self.reporter.close(failed=not orderly)
        leave_ray(self.runtime, self.reward_actor, orderly=orderly)
        return False  # an exception, Preempted included, goes on to the caller
