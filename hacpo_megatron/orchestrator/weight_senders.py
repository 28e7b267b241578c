"""The engine rank's end of each weight transport (rollout/transport.py says what each one is).

Every sender is a `RemoteEngine` over the agent's EngineActor handle whose three weight calls
(begin / update per bucket / finish, driven by `rollout/weight_sync.sync_weights`) move the buckets
its own way; generation and the check mode go through Ray as for any remote engine. `object_store`
is `RemoteEngine` itself (safetensors bytes in one actor call per bucket).

    sender = make_sender("process_group", handle)   # once per agent, on its engine rank
    sync_weights(model, hf_config, parallel, sender)
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import ray
import torch

from hacpo_megatron.orchestrator.actors import RemoteEngine, engine_lost_if_actor_dies
from hacpo_megatron.rollout.transport import TRANSPORTS, broadcast, join_group, open_group, pack_bucket


class ProcessGroupSender(RemoteEngine):
    """`process_group`: one broadcast per bucket in a group of this rank and the engine's receivers.

    The group is made on the first update, and again whenever the actor's process is not the one
    that joined it (Ray restarted it, seen or not). Each bucket: its header goes to the actor
    (non-blocking), then the bytes are broadcast, then the actor's answer is awaited — the receivers check
    order and completeness, and `finish_weight_update` tells them how many buckets were sent.
    """

    backend = "gloo"

    def __init__(self, handle: Any):
        super().__init__(handle)
        self.group = None
        self.group_pid = None  # the engine actor's process that joined the group
        self.sent = 0

    def _connect(self) -> None:
        self.group_pid = ray.get(self.handle.pid.remote())
        # NCCL between GPUs; gloo (through host memory) where the engine is on this rank's own GPU, since NCCL
        # refuses a group with two members on one device (`cuda_ipc` is the fast path for that case)
        if torch.cuda.is_available():
            shared = ray.get(self.handle.gpu.remote()) == torch.cuda.current_device()
            self.backend = "gloo" if shared else "nccl"
        receivers = ray.get(self.handle.weight_receivers.remote())
        # this process's address as its Ray node advertises it: where the engine's node reaches it
        address, store = open_group(1 + receivers, self.backend, ray.util.get_node_ip_address())
        joined = self.handle.join_weight_group.remote(address)
        # returns once every receiver has joined
        self.group = _alongside(joined, lambda: join_group(address, 0, store))

    def begin_weight_update(self) -> None:
        with engine_lost_if_actor_dies(self.handle):
            # a new actor process (Ray restarted it, perhaps unseen) has not joined the group
            pid = ray.get(self.handle.pid.remote())
            if self.group is not None and pid != self.group_pid:  # say so: nothing else in the run would
                print(f"weight push: engine process {self.group_pid} was replaced by {pid} since the last push (Ray "
                      "restarted the actor: its memory monitor ends actors when the machine passes 95 % of its "
                      "memory); the new process joins the weight group and gets these weights", flush=True)
            if self.group is None or pid != self.group_pid:
                self._connect()
            ray.get(self.handle.begin_weight_update.remote())
        self.sent = 0

    def update_weights(self, bucket) -> None:
        header, flat = pack_bucket(bucket, self.sent, self._device())
        with engine_lost_if_actor_dies(self.handle):
            received = self.handle.receive_bucket.remote(header)
            _alongside(received, lambda: broadcast(self.group, flat))
        self.sent += 1

    def finish_weight_update(self) -> None:
        with engine_lost_if_actor_dies(self.handle):
            ray.get(self.handle.finish_weight_update.remote(self.sent))

    def _device(self):
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None


class CudaIpcSender(ProcessGroupSender):
    """`cuda_ipc`: the engine shares the trainer's GPU and maps each bucket through a CUDA IPC handle.

    The bucket is packed on this rank's GPU and stays alive until the actor's call returns, after the
    engine has copied it, as CUDA IPC requires.
    """

    def _device(self):
        return torch.device("cuda", torch.cuda.current_device())

    def finish_weight_update(self) -> None:
        # no stream to count: each bucket's call returned only once the engine had copied it, or raised
        with engine_lost_if_actor_dies(self.handle):
            ray.get(self.handle.finish_weight_update.remote())

    def _connect(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("rollout.weight_transport=cuda_ipc needs the trainer and its engine on one GPU")
        self.group_pid = ray.get(self.handle.pid.remote())
        self.group = "cuda_ipc"  # no group: the handle travels in the bucket's call

    def update_weights(self, bucket) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        header, flat = pack_bucket(bucket, self.sent, self._device())
        with engine_lost_if_actor_dies(self.handle):
            ray.get(self.handle.receive_ipc_bucket.remote(header, reduce_tensor(flat)))
        self.sent += 1


def _alongside(call: Any, collective: Callable[[], Any]) -> Any:
    """Run this side of a collective while the actor's call runs the other side; returns the
    collective's result once both are done. If the call fails first (the engine refused or could not
    join), its error is raised at once instead of waiting out the collective's timeout (the thread
    left in the collective is a daemon: it does not keep the process alive)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = collective()
        except BaseException as error:  # handed to the caller below
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True, name="weight-collective")
    thread.start()
    while thread.is_alive():
        finished, _ = ray.wait([call], timeout=0.5)
        if finished:
            ray.get(call)  # raises the actor's error; after a success, our side ends shortly
            thread.join()
    ray.get(call)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def make_sender(transport: str, handle: Any) -> RemoteEngine:
    """The engine rank's view of its engine actor for weight transport `transport`."""
    senders = {"object_store": RemoteEngine, "process_group": ProcessGroupSender, "cuda_ipc": CudaIpcSender}
    if transport not in senders:
        raise ValueError(f"unknown weight transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    return senders[transport](handle)
