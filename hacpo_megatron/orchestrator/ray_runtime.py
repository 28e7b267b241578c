"""Ray for a torchrun job: rank 0 starts a local Ray (or joins `--ray-address`); every rank connects.

Every rank connects because each agent pushes its weights to its engine actor from its own engine
rank, and Ray object transfers then go straight from that process to the actor. A local Ray is bound
to loopback with no dashboard, and rank 0 stops it at the end; a joined cluster is left running.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import ray
import torch.distributed as dist

NAMESPACE = "hacpo"


def _loopback_only() -> None:
    """Make a local Ray advertise 127.0.0.1 instead of the machine's network address.

    Ray turns 127.0.0.1 into the "remotely reachable" address unless its cluster mode is off
    (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, read at import: set for the processes Ray starts, and
    patched into this already-imported one). Ray 2.60's gRPC servers still listen on every
    interface; nothing here contacts them from outside the machine.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local job needs no token file in ~/.ray
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


@dataclass
class RayRuntime:
    address: str
    started_here: bool

    @staticmethod
    def connect(ray_address: Optional[str], *, num_cpus: Optional[int] = None) -> "RayRuntime":
        """Collective over the torchrun world: rank 0 starts or joins, then the others join its address."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        shared = [None]  # (address, whether it is a local Ray started by this job)
        if rank == 0:
            if ray_address:
                ray.init(address=ray_address, namespace=NAMESPACE, log_to_driver=False)
            else:
                _loopback_only()
                ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, namespace=NAMESPACE,
                         _node_ip_address="127.0.0.1", log_to_driver=False,
                         runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
            shared = [(ray.get_runtime_context().gcs_address, not ray_address)]
        if dist.is_initialized():
            dist.broadcast_object_list(shared, src=0)
        address, started_here = shared[0]
        if rank != 0:
            if started_here:
                _loopback_only()
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        return RayRuntime(address=address, started_here=started_here and rank == 0)

    def shutdown(self) -> None:
        """Disconnect; rank 0 of a local Ray stops the whole local cluster (its processes included)."""
        if ray.is_initialized():
            ray.shutdown()
