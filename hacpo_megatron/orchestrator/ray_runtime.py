"""Ray for a torchrun job: rank 0 starts a local Ray of the run's own (or joins `--ray-address`);
every rank connects.

Every rank connects because each agent pushes its weights to its engine actor from its own engine
rank, and Ray object transfers then go straight from that process to the actor. A joined cluster
(`--ray-address`) is used as its owner set it up (its auth mode and token come from the user's
environment) and left running. A local Ray (no `--ray-address`) is private to the run:

* **Always new.** `ray.init(address="local")`: never a cluster named by `RAY_ADDRESS`, by the record
  a `ray start` leaves in `<tmp>/ray/ray_current_cluster` (even a stale one), or any other running Ray.
* **Closed.** Token authentication (`RAY_AUTH_MODE=token`) with a fresh 256-bit token per run: every
  TCP port of the local Ray (GCS, raylet, object manager, each worker's gRPC server, the runtime-env
  agent's HTTP server) rejects calls without it. The token reaches Ray's processes through the
  environment (`RAY_AUTH_TOKEN`, inherited by the GCS and raylet rank 0 starts and by the workers they
  start; readable only by this user and root via /proc/PID/environ). The other ranks read it from a
  0600 file in the run's 0700 folder; rank 0 deletes that file once every rank has connected. Nothing
  is written to ~/.ray.
* **Its own folder.** Ray's temp dir (unix sockets of the raylet and object store, logs, spilled
  objects) is `<RAY_TMPDIR|TMPDIR|/tmp>/hacpo-ray-XXXXXXXX/ray`, inside a folder only this user can
  enter (Ray makes its own folders world-writable; the 0700 parent keeps others out). The folder and
  Ray's logs stay after the run, like Ray's own /tmp/ray/session_* folders.
* **Its workers' temporary files in it.** The actors' TMPDIR is `hacpo-ray-XXXXXXXX/tmp`, removed when the
  run stops its Ray: what they make there (vLLM's ZMQ sockets between an engine and its engine core and its
  `vllm_dist_*` files, the folders wandb makes when megatron-core imports it) would stay in /tmp otherwise, as
  the workers are SIGKILLed at the end, and the sockets sit behind the 0700 folder while the run lasts.
  torch's compile cache stays where it was, shared between runs.
* **Loopback.** Its processes bind and advertise 127.0.0.1; no dashboard. Rank 0 stops it at the end.
* **Outlives a preemption signal.** torchrun forwards SIGTERM to each rank's whole process group, and
  Ray's own processes (GCS, raylet, ...) are in rank 0's. They are started with SIGTERM blocked (the
  mask is inherited through fork and exec; Ray itself blocks SIGINT there), so the step in flight can
  finish and be checkpointed (orchestrator/preemption.py); rank 0 then stops them as usual.

docs/security.md lists every listening socket of a run and what protects it.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from typing import Dict, Optional

import psutil
import ray
import torch.distributed as dist
from ray._private import ray_constants

from hacpo_megatron.orchestrator.preemption import signal_blocked
from hacpo_megatron.orchestrator.shared_memory import shared_memory_files, unlink_all

NAMESPACE = "hacpo"
TOKEN_FILE = "auth_token"
WORKER_TMP = "tmp"  # the TMPDIR of a local Ray's workers, inside the run's private folder (module docstring)
# Longest path Ray puts under its temp dir: a unix socket, whose path the kernel limits to 107 bytes.
_SOCKET_TAIL = "/ray/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store"
_UNIX_PATH_MAX = 107


def _set_ray_env(values: Dict[str, Optional[str]]) -> Dict[str, Optional[str]]:
    """Set (None: remove) Ray's variables in this process (and so in the processes it starts);
    returns their previous values.

    Ray reads its auth mode and token in C++ and caches both: reload its config and token cache
    (what Ray's own `_enable_token_auth` does), so that the change holds although ray is imported.
    """
    previous = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    # Ray turns 127.0.0.1 into the machine's "remotely reachable" address unless its cluster mode is
    # off (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), a constant computed at import: recompute it.
    ray_constants.ENABLE_RAY_CLUSTER = ray_constants.env_bool(
        ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, not ray_constants.IS_WINDOWS_OR_OSX)
    return previous


def _private_folder() -> str:
    """A new folder only this user can enter (mkdtemp: 0700), where Ray's temp dir would be
    (RAY_TMPDIR, TMPDIR or /tmp), or in /tmp if that path is too long for Ray's unix sockets."""
    from ray._common.utils import get_default_system_temp_dir

    base = get_default_system_temp_dir()
    if len(base) + len("/hacpo-ray-XXXXXXXX") + len(_SOCKET_TAIL) > _UNIX_PATH_MAX:
        base = "/tmp"
    return tempfile.mkdtemp(prefix="hacpo-ray-", dir=base)


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _remove(path: Optional[str]) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


@dataclass
class RayRuntime:
    address: str
    started_here: bool
    private_dir: Optional[str] = None  # a local Ray's folder (0700): Ray's temp dir is private_dir/ray
    _token_file: Optional[str] = field(default=None, repr=False)  # rank 0, until every rank has read it
    _saved_env: Optional[Dict[str, Optional[str]]] = field(default=None, repr=False)

    @staticmethod
    def connect(ray_address: Optional[str], *, num_cpus: Optional[int] = None) -> "RayRuntime":
        """Collective over the torchrun world: rank 0 starts or joins, then the others join its address."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        shared = [None]  # (address, token file of the run's local Ray or None, its folder)
        runtime = None
        if rank == 0:
            if ray_address:
                ray.init(address=ray_address, namespace=NAMESPACE, log_to_driver=False)
                runtime = RayRuntime(address=ray.get_runtime_context().gcs_address, started_here=False)
            else:
                runtime = RayRuntime._start_local(num_cpus)
            shared = [(runtime.address, runtime._token_file, runtime.private_dir)]
        if dist.is_initialized():
            dist.broadcast_object_list(shared, src=0)
        address, token_file, private_dir = shared[0]
        if rank != 0:
            runtime = RayRuntime(address=address, started_here=False, private_dir=private_dir)
            if token_file:
                runtime._saved_env = _set_ray_env({**_local_env(), "RAY_AUTH_TOKEN": _read_token(token_file, rank)})
            try:
                ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
            except BaseException:
                runtime._restore_env()
                raise
        if token_file:
            if dist.is_initialized():
                dist.barrier()  # every rank has read the token: the file can go
            if rank == 0:
                _remove(runtime._token_file)
                runtime._token_file = None
        return runtime

    @staticmethod
    def _start_local(num_cpus: Optional[int]) -> "RayRuntime":
        private_dir = _private_folder()
        token = secrets.token_hex(32)  # what `ray get-auth-token --generate` makes: 256 random bits
        token_file = os.path.join(private_dir, TOKEN_FILE)
        _write_private(token_file, token)
        os.mkdir(os.path.join(private_dir, WORKER_TMP), 0o700)
        saved = _set_ray_env({**_local_env(), "RAY_AUTH_TOKEN": token})
        try:
            with signal_blocked(signal.SIGTERM):  # Ray's processes inherit the mask: see the module docstring
                ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                         namespace=NAMESPACE, _node_ip_address="127.0.0.1",
                         _temp_dir=os.path.join(private_dir, "ray"), log_to_driver=False,
                         runtime_env={"env_vars": _worker_env(private_dir)})
        except BaseException:
            _remove(token_file)
            _set_ray_env(saved)
            raise
        return RayRuntime(address=ray.get_runtime_context().gcs_address, started_here=True,
                          private_dir=private_dir, _token_file=token_file, _saved_env=saved)

    def _restore_env(self) -> None:
        if self._saved_env is not None:
            _set_ray_env(self._saved_env)
            self._saved_env = None

    def shutdown(self) -> None:
        """Disconnect; rank 0 of a local Ray stops the whole local cluster (its processes included)."""
        try:
            if ray.is_initialized():
                if self.started_here:
                    _shutdown_without_graceful_waits()
                else:
                    ray.shutdown()
        finally:
            if self.started_here and self.private_dir:  # its workers' temporary files, their processes gone
                shutil.rmtree(os.path.join(self.private_dir, WORKER_TMP), ignore_errors=True)
            _remove(self._token_file)  # only left if connect() did not get to its end
            self._token_file = None
            self._restore_env()


def leave_ray(runtime: Optional[RayRuntime], reward_actor, *, orderly: bool) -> None:
    """Every rank's last step with Ray. An orderly end (the last step, or a preemption at a step boundary): rank 0
    closes the reward actor's worker pool, the other ranks leave first, then rank 0 stops the local Ray. After an
    error no collective may run (the other ranks may be anywhere): each rank leaves Ray and lets the exception end
    its process, so that torchrun stops the others."""
    rank = dist.get_rank()
    if orderly:
        if rank == 0 and reward_actor is not None:
            ray.get(reward_actor.close.remote())
        dist.barrier()
        if rank != 0 and runtime is not None:
            runtime.shutdown()
        dist.barrier()
    if (rank == 0 or not orderly) and runtime is not None:
        runtime.shutdown()


def _shutdown_without_graceful_waits() -> None:
    """`ray.shutdown()` of the local Ray this process started, with SIGKILL for its processes at once.

    They run with SIGTERM blocked (module docstring), so the graceful stop that `ray.shutdown` tries first, SIGTERM
    and then a second's wait for each of its five process types before SIGKILL, only ever waits: ~5 s at the end of
    every run. Here the order of `ray.shutdown` is kept (the driver disconnects, then the raylet goes first) without
    the waits; what the raylet started (its agents, the workers) is SIGKILLed after it, by process id, as nothing
    is left to stop them.
    """
    node = getattr(ray._private.worker, "_global_node", None)
    raylets = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []) if node is not None else []
    started_by_raylet = []
    for info in raylets:
        try:
            started_by_raylet += psutil.Process(info.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    shared_files = shared_memory_files(started_by_raylet)
    if node is not None:
        kill_all = node.kill_all_processes
        node.kill_all_processes = lambda check_alive=True, allow_graceful=False, wait=False: kill_all(
            check_alive=check_alive, allow_graceful=False, wait=wait)
    try:
        ray.shutdown()
    finally:
        if node is not None:
            node.kill_all_processes = kill_all
        for process in started_by_raylet:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(started_by_raylet, timeout=10)
        unlink_all(shared_files)  # the processes of the run's Ray that mapped them are gone now


TASK_EVENTS_KEPT = "1000"


def _local_env() -> Dict[str, Optional[str]]:
    """Ray's variables for the run's local Ray (the token is added by the caller)."""
    # NOSET: Ray hides every GPU (CUDA_VISIBLE_DEVICES="") from an actor that reserves none; the engines
    # reserve none (the torchrun ranks hold the GPUs, outside Ray's accounting) and use their rank's GPU.
    # TASK_EVENTS: the GCS keeps an event record of every task and actor call (~3.6 KiB each) up to 100,000 by
    # default, for the state API and the dashboard (off here): a soak's GCS grew 4 MiB per 100 steps. 1,000 keeps
    # the recent calls for `ray list tasks` and bounds the rest (docs/reliability.md).
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": None, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "RAY_task_events_max_num_task_in_gcs": TASK_EVENTS_KEPT}


def _worker_env(private_dir: str) -> Dict[str, str]:
    """The environment of the local Ray's workers: one thread each, their TMPDIR in the run's folder (module
    docstring), and torch's compile cache where it would be without that: vLLM compiles its model there, and the
    next run (each test's engine too) reuses what this one compiled."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TMPDIR": os.path.join(private_dir, WORKER_TMP),
            "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()}


def _read_token(token_file: str, rank: int) -> str:
    try:
        with open(token_file, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as error:
        raise RuntimeError(
            f"rank {rank} cannot read the token of the job's local Ray ({token_file}: {error.strerror}). "
            "Without --ray-address rank 0 starts Ray on its own machine, bound to 127.0.0.1, and every "
            "rank must run on that machine; on several machines start a Ray cluster and pass "
            "--ray-address (README)") from None


def object_store_stats() -> Dict[str, float]:
    """The Ray cluster's object store as this driver sees it, for each step's record (a leak of objects shows as
    `ray/object_store_bytes` that does not come back down; spilling as `ray/spilled_bytes_total`). {} where it
    cannot be read: a metric never stops a run."""
    try:
        from ray._private.internal_api import get_memory_info_reply
        from ray._private.state import state

        stats = get_memory_info_reply(state, timeout_seconds=10.0).store_stats
    except Exception:  # noqa: BLE001 (an old Ray, a raylet that is restarting: no figure this step)
        return {}
    return {"ray/object_store_bytes": float(stats.object_store_bytes_used),
            "ray/object_store_objects": float(stats.num_local_objects),
            "ray/spilled_bytes_total": float(stats.spilled_bytes_total)}
