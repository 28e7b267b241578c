"""Files in /dev/shm that SIGKILLed engines leave behind, and their removal.

vLLM's engine core and its workers talk through ring buffers in /dev/shm (`psm_*`, 160-250 MiB each, sparse)
and multiprocessing's named semaphores (`sem.*`); their creators unlink them only when they exit cleanly.
Two moments end engines without a clean exit, and each removes what the ended processes mapped:

* **The run's end** SIGKILLs its local Ray's processes (orchestrator/ray_runtime.py): it reads what they map
  first (`shared_memory_files`) and removes it once they are gone.
* **An engine's death during the run** (a crash, Ray's memory monitor, a test's kill), after which Ray starts
  its actor again: each engine actor writes down what its process tree maps and which processes those are
  (`record_engine_files`, in the Ray session's folder on the engine's own node, keyed by the actor's id,
  which a restart keeps), and the actor Ray starts in its place removes those files once that tree is gone
  (`remove_files_of_ended_engine`).

Only files a recorded or killed process mapped are removed: never a pattern, since `psm_*` is every Python
program's default shared-memory name.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, List, Optional, Set

import psutil

SHARED_MEMORY = "/dev/shm/"


def shared_memory_files(processes: Iterable[psutil.Process]) -> Set[str]:
    """The files in /dev/shm that these processes map and nobody has unlinked yet.

    A file is found by the inode a process maps, not by the name in its map: glibc's `sem_open` creates a named
    semaphore under a temporary name, maps it, then links it to its real name (`sem.mp-*`) and unlinks the
    temporary one, so its creator's map names a deleted file. vLLM's engine core makes such a semaphore for its
    workers' start-up; once they have closed it, the creator alone holds it (stop 45's CI run found two left)."""
    inodes = set()
    for process in processes:
        try:
            with open(f"/proc/{process.pid}/maps") as maps:
                for line in maps:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[5].startswith(SHARED_MEMORY):
                        inodes.add(int(fields[4]))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass  # ended meanwhile
    found = set()
    if inodes:
        with os.scandir(SHARED_MEMORY) as entries:
            for entry in entries:
                try:
                    if entry.inode() in inodes and entry.is_file(follow_symlinks=False):
                        found.add(entry.path)
                except OSError:
                    pass  # unlinked meanwhile
    return found


def unlink_all(paths: Iterable[str]) -> List[str]:
    """Remove these files; returns those that were there."""
    removed = []
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _record_path() -> Optional[str]:
    """Where this engine actor writes down its files: the Ray session's folder on this node (private to the
    run for a local Ray), one file per actor id. None outside a Ray actor."""
    import ray

    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    actor = context.get_actor_id()
    node = getattr(ray._private.worker.global_worker, "node", None)
    if actor is None or node is None:
        return None
    return os.path.join(node.get_session_dir_path(), f"hacpo-engine-{actor}.shm.json")


def record_engine_files() -> None:
    """Write down the /dev/shm files this actor's process tree maps (its engine's own processes included) and
    those processes, so that a successor can remove the files once the tree is gone. Called once its engine
    has started and after each weight update (files its engine made while serving are found then)."""
    path = _record_path()
    if path is None:
        return
    me = psutil.Process()
    tree = [me] + me.children(recursive=True)
    files = shared_memory_files(tree)
    if not files:
        return  # an engine in this process alone (embedded): nothing to leave
    processes = []
    for process in tree:
        try:
            processes.append([process.pid, process.create_time()])
        except psutil.NoSuchProcess:
            pass
    temporary = f"{path}.{me.pid}"
    with open(temporary, "w") as f:
        json.dump({"processes": processes, "files": sorted(files)}, f)
    os.replace(temporary, path)  # a kill mid-write leaves the previous record whole


def remove_files_of_ended_engine(wait_s: float = 30.0) -> List[str]:
    """In an actor Ray started again: remove the files its predecessor's tree mapped, once every process of that
    tree has ended. vLLM's own processes end when they see the actor die; one still there after `wait_s` is an
    orphan of a dead actor and is killed. Returns the files removed (and says how many in the actor's log)."""
    path = _record_path()
    if path is None or not os.path.exists(path):
        return []
    with open(path) as f:
        record = json.load(f)
    left = []
    for pid, started in record["processes"]:
        try:
            process = psutil.Process(pid)
            if abs(process.create_time() - started) < 0.01:  # not a new process with a reused id
                left.append(process)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(left, timeout=wait_s)
    for process in alive:
        print(f"engine actor {os.getpid()}: process {process.pid} of the engine that ended is still running "
              f"after {wait_s:.0f} s: killing it", flush=True)
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    removed = unlink_all(record["files"])
    os.unlink(path)
    if removed:
        print(f"engine actor {os.getpid()}: removed {len(removed)} files in /dev/shm of the engine that ended "
              "before it", flush=True)
    return removed
