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


@dataclass
class RayRuntime:
    address: str
    started_here: bool

    @staticmethod
    def connect(ray_address: Optional[str], *, num_cpus: Optional[int] = None) -> "RayRuntime":
        """Collective over the torchrun world: rank 0 starts or joins, then the others join its address."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        address = [None]
        started_here = False
        if rank == 0:
            if ray_address:
                ray.init(address=ray_address, namespace=NAMESPACE, log_to_driver=False)
            else:
                os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback only; no token file in ~/.ray
                ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, namespace=NAMESPACE,
                         _node_ip_address="127.0.0.1", log_to_driver=False,
                         runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
                started_here = True
            address = [ray.get_runtime_context().gcs_address]
        if dist.is_initialized():
            dist.broadcast_object_list(address, src=0)
        if rank != 0:
            ray.init(address=address[0], namespace=NAMESPACE, log_to_driver=False)
        return RayRuntime(address=address[0], started_here=started_here)

    def shutdown(self) -> None:
        """Disconnect; rank 0 of a local Ray stops the whole local cluster (its processes included)."""
        if ray.is_initialized():
            ray.shutdown()
