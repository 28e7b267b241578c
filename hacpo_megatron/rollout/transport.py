"""How a bucket of weights travels from an agent's engine rank to its engine: three transports.

    object_store   safetensors bytes through Ray's object store to the engine actor, which hands the
                   tensors to the engine (and vLLM passes them on to its workers). Works for any engine
                   on any node; two serialisations and host copies per bucket. The fallback.
    process_group  the engine rank and the engine's receiving processes (the actor itself for the
                   embedded engine, every vLLM worker) form a torch.distributed group of their own —
                   gloo on CPU, NCCL on GPU, made from a TCPStore without touching Megatron's or vLLM's
                   default groups — and each bucket is broadcast as one flat byte tensor. Only a small
                   header travels through Ray. What verl, slime, NeMo-RL and OpenRLHF do between
                   separate GPUs; here it runs on gloo, and the same code is the NCCL path.
    cuda_ipc       colocated on one GPU: the bucket stays in the trainer's GPU memory and the engine
                   maps it through a CUDA IPC handle. Run once, on an H200 with the embedded engine
                   (docs/gpu.md); not in CI (these machines have no GPU).

This module is the torch side of the last two: packing a bucket into one tensor, making a group,
and `BucketReceiver`, which checks that buckets arrive in order, each once, and that none is missing
at the end (a dropped or repeated bucket is an error, never a silently wrong model). The senders,
which talk to engine actors through Ray, are in orchestrator/weight_senders.py; the receivers run
wherever the engine's weights are (`RolloutEngine.join_weight_group` and `receive_bucket`).
"""
from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

WeightBucket = List[Tuple[str, torch.Tensor]]  # (Hugging Face name, full tensor) pairs sent as one
TRANSPORTS = ("object_store", "process_group", "cuda_ipc")
ALIGNMENT = 64  # bytes; every dtype's element size divides it
GROUP_TIMEOUT = datetime.timedelta(minutes=10)  # a broadcast whose peer died fails after this, not never


class WeightTransportError(RuntimeError):
    """Buckets of an update arrived out of order, twice, or not at all."""


@dataclass(frozen=True)
class BucketHeader:
    """What the receiver must know to take one bucket: where it belongs and how to cut it up."""

    index: int  # position in its update, from 0: the receiver checks order and completeness
    names: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[str, ...]  # torch dtype names ("float32")

    @property
    def nbytes(self) -> int:
        return _layout(self)[-1]


@dataclass(frozen=True)
class GroupAddress:
    """Where a weight group's members meet: the sender's TCPStore, and the group's size."""

    host: str
    port: int
    world_size: int
    backend: str  # "gloo" or "nccl"


# ----------------------------------------------------------------------------------- packing
def pack_bucket(bucket: WeightBucket, index: int,
                device: Optional[torch.device] = None) -> Tuple[BucketHeader, torch.Tensor]:
    """One flat uint8 tensor holding every tensor of the bucket (any dtypes), and its header."""
    header = BucketHeader(index=index, names=tuple(name for name, _ in bucket),
                          shapes=tuple(tuple(t.shape) for _, t in bucket),
                          dtypes=tuple(str(t.dtype).removeprefix("torch.") for _, t in bucket))
    offsets = _layout(header)
    flat = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
    for (_, tensor), start in zip(bucket, offsets):
        part = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[start:start + part.numel()].copy_(part)
    return header, flat


def unpack_bucket(header: BucketHeader, flat: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a received flat bucket; the tensors are views of `flat`."""
    out = []
    for name, shape, dtype_name, start in zip(header.names, header.shapes, header.dtypes, _layout(header)):
        dtype = _dtype(dtype_name)
        out.append((name, flat[start:start + _numel(shape) * dtype.itemsize].view(dtype).view(shape)))
    return out


def _layout(header: BucketHeader) -> List[int]:
    """Where each tensor starts in the flat bucket, then its total size. Starts are multiples of
    ALIGNMENT bytes: a tensor viewed from a byte buffer must start at a multiple of its element size."""
    offsets, end = [], 0
    for shape, dtype_name in zip(header.shapes, header.dtypes):
        start = -(-end // ALIGNMENT) * ALIGNMENT
        offsets.append(start)
        end = start + _numel(shape) * _dtype(dtype_name).itemsize
    return offsets + [end]


# ----------------------------------------------------------------------------------- groups
def open_group(world_size: int, backend: str, host: str) -> Tuple[GroupAddress, Any]:
    """The sender's side, part 1: a TCPStore on a free port of `host` (the address the receivers
    reach this process at). Returns the address to send to the receivers and the store.

    The store is handed a socket we bound to `host`: given only an address, torch's TCPStore
    listens on every interface (docs/security.md); this one listens on `host` alone.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen()
    port = listener.getsockname()[1]
    store = torch.distributed.TCPStore(host, port, world_size, is_master=True, timeout=GROUP_TIMEOUT,
                                       wait_for_workers=False, master_listen_fd=listener.detach())
    return GroupAddress(host=host, port=port, world_size=world_size, backend=backend), store


def join_group(address: GroupAddress, rank: int, store: Any = None) -> Any:
    """A process group of `address.world_size` members in which this process is `rank` (the sender
    is 0). Blocks until every member has joined. Made directly from the store, so that no default
    group (Megatron's, vLLM's) is created, used or changed."""
    if store is None:
        store = torch.distributed.TCPStore(address.host, address.port, address.world_size, is_master=False,
                                           timeout=GROUP_TIMEOUT)
    if address.backend == "gloo":
        options = torch.distributed.ProcessGroupGloo._Options()
        options._timeout = GROUP_TIMEOUT
        # the interface that reaches the sender, not the one the hostname resolves to (multi-homed nodes)
        options._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=_local_address_towards(address))]
        return torch.distributed.ProcessGroupGloo(store, rank, address.world_size, options)
    if address.backend == "nccl":  # the GPU path: same protocol, NCCL's broadcast (not run here: no GPU)
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        return torch.distributed.ProcessGroupNCCL(store, rank, address.world_size, options)
    raise ValueError(f"weight group backend must be gloo or nccl, got {address.backend!r}")


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Rank 0's tensor into every member's tensor of the same size."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    group.broadcast([tensor], options).wait()


def _local_address_towards(address: GroupAddress) -> str:
    """This host's address on the route to the sender (no packet is sent: UDP connect only routes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address.host, address.port))
        return probe.getsockname()[0]


# ----------------------------------------------------------------------------------- receiving
class BucketReceiver:
    """The receiving end of a weight group: takes each bucket's bytes, then checks its place.

    The bytes are always received first, so the sender's broadcast completes even when the bucket
    is refused; the refusal then reaches the sender as the error of its header call.
    """

    def __init__(self, group: Any, device: Optional[torch.device] = None):
        self.group = group
        self.device = device
        self.begin()

    def begin(self) -> None:
        self.next_index = 0
        self.names: set = set()

    def receive(self, header: BucketHeader) -> List[Tuple[str, torch.Tensor]]:
        flat = torch.empty(header.nbytes, dtype=torch.uint8, device=self.device)
        broadcast(self.group, flat)
        if header.index != self.next_index:
            kind = "sent twice" if header.index < self.next_index else "dropped"
            raise WeightTransportError(f"weight bucket {header.index} arrived where bucket {self.next_index} was due: "
                                       f"a bucket was {kind}")
        repeated = self.names.intersection(header.names)
        if repeated:
            raise WeightTransportError(f"weights sent twice in one update: {sorted(repeated)[:5]}")
        self.next_index += 1
        self.names.update(header.names)
        return unpack_bucket(header, flat)

    def finish(self, buckets_sent: int) -> None:
        """The update's last bucket is in: were they all? Then ready for the next update."""
        arrived = self.next_index
        self.begin()
        if buckets_sent != arrived:
            raise WeightTransportError(f"the trainer sent {buckets_sent} weight buckets, {arrived} arrived")


def copy_ipc_bucket(header: BucketHeader, handle: Tuple[Any, tuple]) -> List[Tuple[str, torch.Tensor]]:
    """The tensors of a bucket sent through a CUDA IPC handle (`reduce_tensor` of the trainer's flat
    bucket; orchestrator/weight_senders.CudaIpcSender), copied: the trainer's memory is only lent
    until the call returns. Run on an H200 with the embedded engine (docs/gpu.md); not in CI."""
    rebuild, args = handle
    return [(name, tensor.clone()) for name, tensor in unpack_bucket(header, rebuild(*args))]


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightTransportError(f"unknown dtype {name!r} in a weight bucket header")
    return dtype
