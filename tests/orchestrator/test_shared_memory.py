"""/dev/shm files of SIGKILLed engine processes: a restarted engine actor removes its predecessor's, and the run's
end removes what its Ray's processes mapped (orchestrator/shared_memory.py, orchestrator/ray_runtime.py).

The engine here is a stand-in for vLLM's engine core: a child process of the actor that maps a file in /dev/shm and,
unlike vLLM's, does not notice its parent's death (so the successor has to end it as well). The real vLLM engine's
files are checked in tests/e2e/test_vllm_run.py.
"""
import os
import secrets
import subprocess
import sys

import psutil
import pytest
import ray

from hacpo_megatron.orchestrator.actors import wait_until_alive
from hacpo_megatron.orchestrator.ray_runtime import RayRuntime
from hacpo_megatron.orchestrator.shared_memory import (record_engine_files, remove_files_of_ended_engine,
                                                       shared_memory_files, unlink_all)

# under xdist, on the worker of tests/e2e/test_vllm_run.py, not beside it: the files it makes in /dev/shm would
# count as that run's leftovers
pytestmark = pytest.mark.xdist_group("dev_shm")

CHILD = r"""
import mmap, os, secrets, time
path = "/dev/shm/hacpo-test-" + secrets.token_hex(6)
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 1 << 16)
mapped = mmap.mmap(fd, 1 << 16)
print(path, flush=True)
time.sleep(600)
"""

# a process holding a named semaphore that it made itself, as vLLM's engine core does for its workers' start-up
SEMAPHORE_HOLDER = r"""
import multiprocessing, time
lock = multiprocessing.get_context("spawn").Lock()
print("/dev/shm/sem." + lock._semlock.name.lstrip("/"), flush=True)
time.sleep(600)
"""


@ray.remote(num_cpus=0, max_restarts=1)
class _EngineWithAProcess:
    def __init__(self):
        self.removed = []
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self.removed = remove_files_of_ended_engine(wait_s=2.0)
        self.child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        self.path = self.child.stdout.readline().strip()
        record_engine_files()

    def pid(self):
        return os.getpid()

    def state(self):
        return os.getpid(), self.child.pid, self.path, self.removed


def test_a_restarted_engine_removes_its_predecessors_files_and_the_run_end_its_own(ray_tmp):
    bystander = f"/dev/shm/hacpo-test-bystander-{secrets.token_hex(6)}"  # this user's, mapped by nobody
    open(bystander, "wb").close()
    try:
        runtime = RayRuntime.connect(None, num_cpus=1)
        actor = _EngineWithAProcess.remote()
        first_actor, first_child, first_file, removed = ray.get(actor.state.remote())
        assert removed == [] and os.path.exists(first_file)

        ray.kill(actor, no_restart=False)  # SIGKILL, as a crash or Ray's memory monitor: Ray starts it again
        psutil.wait_procs([psutil.Process(first_actor)], timeout=30)
        wait_until_alive(actor, timeout_s=120)
        second_actor, second_child, second_file, removed = ray.get(actor.state.remote())
        assert second_actor != first_actor
        assert removed == [first_file] and not os.path.exists(first_file)
        assert not psutil.pid_exists(first_child)  # still running after the wait: an orphan, ended
        assert os.path.exists(second_file) and os.path.exists(bystander)
        runtime.shutdown()
        # the run's end SIGKILLs the actor's process tree and removes what it mapped; nothing else
        assert not psutil.pid_exists(second_child)
        assert not os.path.exists(second_file)
        assert os.path.exists(bystander)
    finally:
        os.unlink(bystander)


def test_a_semaphore_its_creator_alone_holds_is_found_though_its_map_names_a_deleted_file():
    """glibc maps a new semaphore under a temporary name before linking it to its own, so the creator's map names a
    deleted file: the semaphore is found by its inode (two were left by a CI run when found by name)."""
    holder = subprocess.Popen([sys.executable, "-c", SEMAPHORE_HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        semaphore = holder.stdout.readline().strip()
        assert os.path.exists(semaphore)
        with open(f"/proc/{holder.pid}/maps") as maps:
            assert semaphore not in maps.read()  # not mapped under its own name
        assert semaphore in shared_memory_files([psutil.Process(holder.pid)])
        assert shared_memory_files([psutil.Process()]).isdisjoint({semaphore})  # this process does not map it
    finally:
        holder.kill()
        holder.wait()
        unlink_all([semaphore])
