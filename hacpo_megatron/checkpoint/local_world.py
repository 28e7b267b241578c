"""Run a command-line tool's collective function in a world of N processes, from one plain `python`.

Megatron's distributed checkpoints do not depend on the layout that wrote them: converting or
comparing at a layout (TP x PP, and the replicas that EP needs: checkpoint/tool_layout.py) needs its
processes only while the tool runs. `run_collective(fn, ..., world_size=N)` gives a tool those processes
whichever way it was started:

* under torchrun (or any launcher that set up a world of more than one process), or when N == 1:
  calls `fn` right here, on this rank, as before; the world must then have at least N ranks;
* as a plain process (a world of one) with N > 1: starts N worker processes (spawn) and returns rank
  0's result. Each worker gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1,
  MASTER_PORT, OMP_NUM_THREADS=1) and calls `fn(*args, **kwargs)`, which sets up torch.distributed as
  under torchrun (`init_distributed`: gloo on CPU). The rendezvous store is held by this process on a
  port the OS picked (as torchrun's agent does), so no two runs race for a port.

Failures: a worker's exception is raised here again, with the same type and message (so the tool turns
a bad-input error into the same one-line message) and the worker's traceback as its cause; a worker that
dies without one (a signal, os._exit) raises `WorkerError`. Either way the other workers, and the
processes they started, are stopped first, by process id: a rank blocked in a collective never hangs
the tool. Workers ignore Ctrl-C (this process handles it and stops them) and die with this process.

Inside the world, `fn` joins it with `ensure_distributed()` (torchrun's environment, or a world of this one
process when a tool runs plainly at TP = PP = 1) and takes one agent's process groups from
`single_agent_parallel`.

`fn` must be a module-level function of an importable module or of the script being run (it is passed
by name), its arguments and rank 0's result picklable. Input checks belong before the call, in the
caller: they then run once, before any process starts.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import psutil
import torch
import torch.distributed as dist

from hacpo_megatron.checkpoint.tool_layout import ToolLayout
from hacpo_megatron.config.schema import AgentConfig
from hacpo_megatron.environment import environment_set
from hacpo_megatron.parallel.groups import AgentParallel, create_agent_groups, init_distributed

HOST = "127.0.0.1"
STOP_GRACE_S = 5.0  # after SIGTERM, before SIGKILL
EXIT_GRACE_S = 60.0  # for a worker to exit once every rank returned its result (then it is stopped)
# after a first failure, for the others to be seen: a worker killed in a collective makes its peers raise a connection
# error, which can reach the parent before the killed worker's exit does
FAILURE_GRACE_S = 2.0


class WorkerError(RuntimeError):
    """A worker process died without reporting an exception (killed by a signal, os._exit, ...)."""


class _RemoteTraceback(Exception):
    """The worker's own traceback, shown as the cause of the exception raised in the parent."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


# ------------------------------------------------------------------------------------------------
# The tool's side
# ------------------------------------------------------------------------------------------------
def launched_world_size() -> int:
    """Processes in this program's world: torch.distributed's, else the launcher's WORLD_SIZE, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_collective(fn: Callable[..., Any], *args: Any, world_size: int, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a world of (at least) `world_size` processes; see the module docstring.

    Returns fn's result: this rank's under a launcher or when world_size == 1, rank 0's otherwise.
    """
    if world_size <= 1 or launched_world_size() > 1:
        return fn(*args, **kwargs)
    return _spawn_and_wait(_FunctionRef.of(fn), args, kwargs, world_size)


def is_first_rank() -> bool:
    """True in the process that should print a tool's result: rank 0, or a process outside any world."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def finish() -> None:
    """Tear down torch.distributed if this process joined a world (under torchrun, or at TP=PP=1)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# Inside the world: what a tool's collective function calls first
# ------------------------------------------------------------------------------------------------
def ensure_distributed() -> None:
    """torch.distributed from torchrun's environment, or a world of this one process when run plainly."""
    if not dist.is_initialized() and "RANK" not in os.environ:
        import socket

        with socket.socket() as s:  # a free port for the one-process rendezvous
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR=HOST, MASTER_PORT=str(port))
    init_distributed()


def single_agent_parallel(name: str, tensor_parallel: int, pipeline_parallel: int,
                          expert_parallel: int = 1) -> AgentParallel:
    """Process groups for one agent on global ranks 0 .. TP*PP*DP-1 (DP 1, or the replicas EP needs:
    checkpoint/tool_layout.py). Collective over the world.

    Ranks beyond those are not members; they still take part in saves (checkpoint/megatron_io.py).
    """
    layout = ToolLayout(tensor_parallel, pipeline_parallel, expert_parallel)
    needed = layout.world_size
    if dist.get_world_size() < needed:
        raise ValueError(f"{layout} needs {needed} processes, the world has {dist.get_world_size()}: run under "
                         f"`torchrun --nproc_per_node {needed}`")
    return create_agent_groups([AgentConfig(name=name, parallel=layout.parallel_config())])[0]


# ------------------------------------------------------------------------------------------------
# The parent: start, watch, stop
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _FunctionRef:
    """A module-level function by name (also for modules loaded from a file, e.g. a tool script)."""

    module: str
    qualname: str
    file: Optional[str]

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> "_FunctionRef":
        code = getattr(fn, "__code__", None)
        return cls(fn.__module__, fn.__qualname__, code.co_filename if code is not None else None)

    def resolve(self) -> Callable[..., Any]:
        module = sys.modules.get(self.module)  # "__main__": spawn ran the parent's script as the main module
        if module is None:
            try:
                module = importlib.import_module(self.module)
            except ImportError:
                if self.file is None:
                    raise
                spec = importlib.util.spec_from_file_location(self.module, self.file)
                module = importlib.util.module_from_spec(spec)
                sys.modules[self.module] = module
                spec.loader.exec_module(module)
        target: Any = module
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return target


def _spawn_and_wait(ref: _FunctionRef, args: tuple, kwargs: dict, world_size: int) -> Any:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    # The rendezvous store lives here (torchrun's agent does the same): workers connect as clients.
    store = dist.TCPStore(HOST, 0, world_size=None, is_master=True, wait_for_workers=False)
    processes: List[Any] = []
    connections: List[Any] = []
    leftovers: list = []
    try:
        for rank in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_worker, name=f"{ref.qualname}-rank{rank}",
                                      args=(ref, args, kwargs, rank, sender, os.getpid()))
            environment = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                               LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR=HOST,
                               MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
                               OMP_NUM_THREADS="1")
            with environment_set(environment):  # a spawned child starts with this environment
                process.start()
            sender.close()
            processes.append(process)
            connections.append(receiver)
        result, failure, leftovers = _wait(processes, connections)
    finally:
        _stop(processes, leftovers)
        for connection in connections:
            connection.close()
        del store
    if failure is not None:
        error, remote_traceback = failure
        if remote_traceback:
            raise error from _RemoteTraceback(remote_traceback)
        raise error
    return result


def _wait(processes: List[Any], connections: List[Any]) -> Tuple[Any, Optional[Tuple[BaseException, str]], list]:
    """Until every worker reported its result and exited, or one failed: (rank 0's result, failure, the processes the
    workers had started when the first failure came: a worker that exits in the grace after it leaves them behind)."""
    from multiprocessing.connection import wait

    results: Dict[int, Any] = {}
    errors: List[Tuple[float, int, BaseException, str]] = []  # (when, rank, exception, traceback)
    open_connections = {connection: rank for rank, connection in enumerate(connections)}
    running = {process.sentinel: rank for rank, process in enumerate(processes)}

    def receive(connection: Any) -> None:
        rank = open_connections[connection]
        try:
            message = connection.recv()
        except (EOFError, OSError):
            del open_connections[connection]
            return
        if message[0] == "ok":
            results[rank] = message[1]
        else:
            _, when, error, text = message
            errors.append((when, rank, error, text))

    failed_by: Optional[float] = None  # when to stop collecting failures
    leftovers: list = []
    while running:
        if errors and failed_by is None:
            failed_by = time.monotonic() + FAILURE_GRACE_S
            leftovers = _descendants([processes[rank] for rank in running.values()])
        if failed_by is not None:
            timeout: Optional[float] = max(0.0, failed_by - time.monotonic())
        else:
            finished = len(results) == len(processes)  # the work is done: only the exits remain
            timeout = EXIT_GRACE_S if finished else None
        ready = wait(list(open_connections) + list(running), timeout=timeout)
        if not ready:
            break  # the failures are in; or a worker that does not exit after its result: the caller stops it
        for connection in [r for r in ready if r in open_connections]:
            receive(connection)
        for sentinel in [r for r in ready if r in running]:
            rank = running.pop(sentinel)
            process = processes[rank]
            process.join()
            connection = connections[rank]
            while connection in open_connections and connection.poll():
                receive(connection)  # what it sent just before exiting
            if rank not in results and not any(e[1] == rank for e in errors):
                errors.append((time.time(), rank, WorkerError(
                    f"worker rank {rank} of {len(processes)} {_exit_description(process.exitcode)} before it "
                    f"finished; the other workers were stopped"), ""))
    if errors:
        # A worker that died without a word (a signal, a crash) is the cause of its peers' errors, whenever the parent
        # saw it; otherwise the first error reported: later ones follow from it.
        silent = [e for e in errors if not e[3]]
        _, rank, error, text = min(silent or errors, key=lambda e: e[0])
        return None, (error, text), leftovers
    return results.get(0), None, leftovers


def _exit_description(exitcode: Optional[int]) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _descendants(processes: List[Any]) -> list:
    """Every process the given workers started (psutil.Process), as now."""
    found = []
    for process in processes:
        if process.pid is not None and process.exitcode is None:
            with contextlib.suppress(psutil.Error):
                found += psutil.Process(process.pid).children(recursive=True)
    return found


def _stop(processes: List[Any], leftovers: Sequence[Any] = ()) -> None:
    """Stop every worker still running and every process it started (or had started: `leftovers`), by process id."""
    alive = [p for p in processes if p.pid is not None and p.exitcode is None and p.is_alive()]
    descendants = list(leftovers) + _descendants(alive)
    for process in alive:
        with contextlib.suppress(OSError):
            process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in alive:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    for child in descendants:
        with contextlib.suppress(psutil.Error):
            child.kill()
    if descendants:
        psutil.wait_procs(descendants, timeout=STOP_GRACE_S)


# ------------------------------------------------------------------------------------------------
# The worker
# ------------------------------------------------------------------------------------------------
def _worker(ref: _FunctionRef, args: tuple, kwargs: dict, rank: int, sender: Any, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops us
    torch.set_num_threads(1)
    try:
        result = ref.resolve()(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - every failure goes to the parent, which re-raises it
        _report(sender, ("error", time.time(), _portable(error), traceback.format_exc()))
        sys.exit(1)
    _report(sender, ("ok", result if rank == 0 else None))
    if dist.is_initialized():
        dist.destroy_process_group()


def _report(sender: Any, message: tuple) -> None:
    with contextlib.suppress(OSError):  # the parent stopped listening: it is stopping us anyway
        sender.send(message)
    sender.close()


def _portable(error: BaseException) -> BaseException:
    """The exception itself if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this worker when the parent dies, even by SIGKILL (PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before that
        os._exit(1)
