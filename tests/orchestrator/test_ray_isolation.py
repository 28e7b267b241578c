"""A run without --ray-address starts a Ray of its own, closed to everyone without its token.

Each test points Ray's temp dir (RAY_TMPDIR) at a fresh folder, so the records it writes or reads
(`<tmp>/ray/ray_current_cluster`) are the test's own, never those of other users of the machine.
"""
import http.client
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import psutil
import ray

from hacpo_megatron.orchestrator.ray_runtime import TOKEN_FILE, RayRuntime

LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
# Real, harmless methods of each kind of Ray gRPC server (GCS, raylet, object manager, core worker).
# A server answers UNIMPLEMENTED for a method it does not serve, before it checks the token.
PROBES = ("/ray.rpc.NodeInfoGcsService/GetClusterId", "/ray.rpc.NodeManagerService/GetSystemConfig",
          "/ray.rpc.CoreWorkerService/NumPendingTasks", "/ray.rpc.ObjectManagerService/Pull")
ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_record(base: str, address: str) -> None:
    """What `ray start` leaves behind: the address later `ray.init()` calls attach to."""
    os.makedirs(os.path.join(base, "ray"), exist_ok=True)
    with open(os.path.join(base, "ray", "ray_current_cluster"), "w") as f:
        f.write(address)


@ray.remote
def _where():
    return ray.get_runtime_context().gcs_address, os.environ.get("RAY_AUTH_MODE")


def test_stale_record_and_ray_address_are_ignored(ray_tmp, monkeypatch):
    stale = f"127.0.0.1:{_free_port()}"  # nothing listens there any more
    _write_record(ray_tmp, stale)
    monkeypatch.setenv("RAY_ADDRESS", stale)
    before = {key: os.environ.get(key) for key in ENV}
    runtime = RayRuntime.connect(None, num_cpus=1)
    try:
        assert runtime.started_here and runtime.address != stale
        assert ray.get(_where.remote()) == (runtime.address, "token")
    finally:
        runtime.shutdown()
    assert {key: os.environ.get(key) for key in ENV} == before  # the process's environment is restored


@ray.remote(num_cpus=0)
class _Busy:
    def pid(self):
        return os.getpid()


def test_shutdown_leaves_no_process_of_the_local_ray(ray_tmp):
    """Its processes ignore SIGTERM (they must outlive a preemption signal) and are SIGKILLed at once: the GCS,
    the raylet, what the raylet started (agents, an actor's worker) all end with shutdown."""
    earlier = set(psutil.Process().children(recursive=True))  # an earlier test's helpers in this worker are not Ray's
    runtime = RayRuntime.connect(None, num_cpus=1)
    actor = _Busy.remote()
    worker = psutil.Process(ray.get(actor.pid.remote()))
    family = [p for p in psutil.Process().children(recursive=True) if p not in earlier]
    names = {p.name() for p in family} | {worker.name()}
    assert any("raylet" in n for n in names) and any("gcs_server" in n for n in names), names
    runtime.shutdown()
    _, alive = psutil.wait_procs(family + [worker], timeout=1)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [(p.pid, p.name()) for p in alive]


@ray.remote(num_cpus=0)
def _leave_temporary_files():
    """What a vLLM engine leaves where its process is SIGKILLed: a unix socket (its ZMQ ipc endpoint, in
    tempfile.gettempdir()) and a folder (wandb's, made when megatron-core imports it)."""
    import socket
    import tempfile

    path = os.path.join(tempfile.gettempdir(), "engine.sock")
    endpoint = socket.socket(socket.AF_UNIX)
    endpoint.bind(path)
    _leave_temporary_files.endpoint = endpoint  # kept open: the worker is killed holding it
    return path, tempfile.mkdtemp(prefix="wandb-media"), os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def test_workers_temporary_files_go_with_the_local_ray(ray_tmp):
    """The workers' TMPDIR is a folder of the run's own (0700), removed when the run stops its Ray; Ray's folder
    (its logs) stays, and so does torch's compile cache, outside it."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    runtime = RayRuntime.connect(None, num_cpus=1)
    worker_tmp = os.path.join(runtime.private_dir, "tmp")
    try:
        socket_path, folder, compile_cache = ray.get(_leave_temporary_files.remote())
        assert os.path.dirname(socket_path) == worker_tmp and os.path.dirname(folder) == worker_tmp
        assert compile_cache == (os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
        assert os.stat(worker_tmp).st_mode & 0o777 == 0o700
    finally:
        runtime.shutdown()
    assert not os.path.exists(worker_tmp)
    assert os.path.isdir(os.path.join(runtime.private_dir, "ray"))


OTHER_CLUSTER = r"""
import os, sys, ray
from ray._common.utils import get_ray_address_file
ray.init(address="local", num_cpus=1, resources={"someone_else": 1}, include_dashboard=False,
         _node_ip_address="127.0.0.1", _temp_dir=os.path.join(os.environ["RAY_TMPDIR"], "ray"))
address = ray.get_runtime_context().gcs_address
with open(get_ray_address_file(None), "w") as f:  # as `ray start` does
    f.write(address)
print(address, flush=True)
sys.stdin.read()
ray.shutdown()
"""


def test_a_running_cluster_is_left_alone(ray_tmp):
    """Someone else's Ray (no auth, its address recorded like `ray start` does) is running: the job
    starts its own beside it, never attaches, and leaves it running."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    other = subprocess.Popen([sys.executable, "-c", OTHER_CLUSTER], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        other_address = other.stdout.readline().strip()
        assert other_address, "the other cluster did not start"
        runtime = RayRuntime.connect(None, num_cpus=1)
        try:
            assert runtime.address != other_address
            assert "someone_else" not in ray.cluster_resources()
            assert len(ray.nodes()) == 1
        finally:
            runtime.shutdown()
        assert other.poll() is None, "the job's shutdown stopped someone else's Ray"
    finally:
        other.stdin.close()
        try:
            other.wait(timeout=30)
        except subprocess.TimeoutExpired:
            other.kill()
            other.wait()


def _grpc_answer(port: int, token=None) -> str:
    import grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for method in PROBES:
            try:
                channel.unary_unary(method)(b"", metadata=metadata, timeout=10)
                return f"OK {method}"
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                    return f"{error.code().name} {method}"
    return "UNIMPLEMENTED"


def _http_status(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/")
        return connection.getresponse().status
    finally:
        connection.close()


def _is_autoscaler_metrics(process, port: int) -> bool:
    """Ray's autoscaler monitor serves its Prometheus metrics over plain HTTP (no token) when
    prometheus_client is installed, which vLLM brings in (docs/security.md): allowed if it serves
    metrics text and nothing else."""
    from ray.autoscaler._private.constants import AUTOSCALER_METRIC_PORT

    if port != AUTOSCALER_METRIC_PORT or not any("autoscaler/_private/monitor.py" in part
                                                 for part in process.cmdline()):
        return False
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/metrics")
        body = connection.getresponse().read().decode()
        connection.request("POST", "/metrics", body="x")
        post_status = connection.getresponse().status
    finally:
        connection.close()
    assert body.startswith("# HELP") and post_status >= 400, (body[:200], post_status)
    return True


def test_local_ray_is_closed_without_the_token(ray_tmp, monkeypatch, tmp_path):
    import psutil

    monkeypatch.setenv("HOME", str(tmp_path))  # Ray would write ~/.ray/auth_token if it made a token itself
    # what this test process listened on before Ray started is not Ray's (an earlier test's in-process gloo world
    # keeps its listener while megatron holds its groups)
    before = {c.laddr.port for c in psutil.net_connections(kind="tcp")
              if c.status == psutil.CONN_LISTEN and c.pid == os.getpid()}
    runtime = RayRuntime.connect(None, num_cpus=1)
    try:
        @ray.remote
        class Echo:
            def ping(self):
                return "pong"

        echo = Echo.remote()
        assert ray.get(echo.ping.remote()) == "pong"  # a worker with its own gRPC server is up

        me = psutil.Process()
        pids = {p.pid: p.name() for p in [me] + me.children(recursive=True)}
        listening = [c for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.pid in pids]
        names = {pids[c.pid] for c in listening}
        assert {"gcs_server", "raylet"} <= names, names
        answers = {}
        for conn in listening:
            if conn.pid == os.getpid() and conn.laddr.port in before:
                continue
            assert conn.laddr.ip in LOOPBACK, (pids[conn.pid], conn.laddr)
            if _is_autoscaler_metrics(psutil.Process(conn.pid), conn.laddr.port):
                continue  # read-only Prometheus metrics, checked below
            answer = _grpc_answer(conn.laddr.port)
            if answer.startswith("UNAVAILABLE"):  # not gRPC: the runtime-env agent's HTTP server
                answer = f"HTTP {_http_status(conn.laddr.port)}"
            answers[(pids[conn.pid], conn.laddr.port)] = answer
        refused = {key: a for key, a in answers.items() if a.startswith("UNAUTHENTICATED") or a == "HTTP 401"}
        assert refused == answers, answers  # every port refuses a caller without the token
        # ... and accepts the run's token (so the refusals above are about the token).
        gcs_port, token = int(runtime.address.rsplit(":", 1)[1]), os.environ.get("RAY_AUTH_TOKEN")
        assert _grpc_answer(gcs_port, token).startswith("OK"), _grpc_answer(gcs_port, token)
        assert _grpc_answer(gcs_port, "0" * 64).startswith("UNAUTHENTICATED")

        # Its files: sockets and logs in a folder only this user can enter; the token file is gone.
        assert os.stat(runtime.private_dir).st_mode & 0o077 == 0
        node = ray._private.worker._global_node
        for path in (node.raylet_socket_name, node.plasma_store_socket_name, node.get_session_dir_path()):
            assert path.startswith(runtime.private_dir + os.sep), path
        assert not os.path.exists(os.path.join(runtime.private_dir, TOKEN_FILE))
        assert not (tmp_path / ".ray").exists()
    finally:
        runtime.shutdown()


def _rank(rank: int, init_file: str, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    runtime = RayRuntime.connect(None, num_cpus=1)
    try:
        results.put((rank, runtime.address, runtime.started_here, ray.get(_where.remote()),
                     os.path.exists(os.path.join(runtime.private_dir, TOKEN_FILE))))
        dist.barrier()  # the orderly end of training/loop.py: the others leave first, then rank 0 stops Ray
        if rank != 0:
            runtime.shutdown()
        dist.barrier()
    finally:
        runtime.shutdown()
        dist.destroy_process_group()


def test_other_ranks_join_with_the_token(ray_tmp, tmp_path):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, str(tmp_path / "init"), results)) for r in range(2)]
    for process in ranks:
        process.start()
    try:
        got = sorted(results.get(timeout=120) for _ in ranks)
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    (_, address0, started0, seen0, file0), (_, address1, started1, seen1, file1) = got
    assert address0 == address1 and started0 and not started1
    assert seen0 == seen1 == (address0, "token")
    assert not file0 and not file1  # the token file is deleted once both ranks have connected
    assert [p.exitcode for p in ranks] == [0, 0]


def test_the_local_gcs_keeps_a_bounded_record_of_calls(ray_tmp):
    """Ray's GCS records every actor call (~3.6 KiB each, up to 100,000 by default): measured on a 300-step soak as
    4 MiB per 100 steps. The run's local Ray keeps 1,000: past them, 6,000 more calls must not grow the GCS by
    the ~20 MiB they took without the bound (measured: 2.6 MiB with it)."""
    runtime = RayRuntime.connect(None, num_cpus=1)
    try:
        @ray.remote
        class Echo:
            def ping(self, x):
                return x

        echo = Echo.remote()
        me = psutil.Process()
        (gcs,) = [p for p in me.children(recursive=True) if p.name() == "gcs_server"]

        def settled_rss_after(calls: int) -> float:
            """The GCS's lowest resident memory over the 5 s after the calls (task events reach it in batches, every
            second). Kept records stay in the lowest sample; a moment's peak does not: one reading 2 s after the calls
            once gave 10.3 MiB in a fresh-clone CI run, beside the suite's other worker, where alone it gives ~2.6."""
            ray.get([echo.ping.remote(i) for i in range(calls)])
            time.sleep(1)
            samples = []
            for _ in range(9):
                samples.append(gcs.memory_info().rss / 2**20)
                time.sleep(0.5)
            return min(samples)

        before = settled_rss_after(3000)  # the first 1,000 records and the GCS's own warm-up
        assert settled_rss_after(6000) - before < 8.0
    finally:
        runtime.shutdown()
