"""Two hosts on one Linux machine, for multi-node runs and tests (root only).

Each host is a network namespace plus a PID namespace: a veth pair joins the hosts (host 0:
10.77.0.1/24, host 1: 10.77.0.2/24), and each host's processes see only each other (Ray finds "its"
raylet by listing processes: with one process table, a driver on host 1 would attach to host 0's
head node). A Ray cluster spans them (head on host 0, port 6379; a worker node on host 1). The file
system is shared, so both hosts see the repository, its .venv and the run folder, as the nodes of a
cluster with a shared file system do. Docs: docs/multi_node.md.

    python tools/local_cluster.py up [--name dev] [--num-cpus 1]
    python tools/local_cluster.py exec --host 1 [--name dev] -- COMMAND ...   # inside host 1, job env set
    python tools/local_cluster.py kill --host 1 [--name dev]   # SIGKILL every process of host 1
    python tools/local_cluster.py boot --host 1 [--name dev]   # start host 1 again (after kill), Ray included
    python tools/local_cluster.py down [--name dev]
    python tools/local_cluster.py clean                        # what tests that died left behind

Names: namespaces `hacpo-<name>-<i>`, links `hacpo<name>-<i>`, state folder (mode 0700: Ray's temp
dirs, the cluster's Ray token) `/tmp/hacpo-cluster-<name>`. Only these are ever created or removed.
A cluster named `t<pid>` belongs to that process (the tests): `clean` removes it once the process is
gone. Processes are stopped by id (`ip netns pids`), never by name: `ray stop` would stop every Ray
on the machine.

Nothing listens outside the namespaces (a socket bound in a namespace, even to 0.0.0.0, is reachable
only through that namespace's interfaces: its loopback and its end of the veth pair). Ray's ports ask
for the cluster's token (RAY_AUTH_MODE=token), except the autoscaler monitor's metrics port (44217,
HTTP, read-only), as in any Ray cluster.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Sequence

PREFIX = "hacpo"
SUBNET = "10.77.0"
RAY_PORT = 6379
STATE_ROOT = Path("/tmp")
RAY = Path(sys.executable).with_name("ray")
_MAX_NAME = 8  # a link name `hacpo<name>-<i>` must fit the kernel's 15 characters
_OWNED = re.compile(rf"^{PREFIX}-t(\d+)-\d$")  # a test's cluster: t<pid of its owner>


class ClusterError(RuntimeError):
    """A host or its Ray could not be set up; the message names the command and its output."""


def _ip(*args: str, check: bool = True) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}"
                           + (" (creating network namespaces needs root)" if "ermission" in result.stderr else ""))
    return result.stdout


@dataclass(frozen=True)
class Host:
    index: int
    namespace: str  # its network namespace (`ip netns pids <namespace>`: every process of the host)
    link: str  # its end of the veth pair: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
    address: str


@dataclass
class LocalCluster:
    name: str
    hosts: List[Host]
    state_dir: Path
    token: str
    _inits: Dict[int, subprocess.Popen] = field(default_factory=dict, repr=False)  # this process's children

    # ------------------------------------------------------------------------------- set-up
    @classmethod
    def up(cls, name: str = "dev", *, num_cpus: int = 1) -> "LocalCluster":
        """Create both hosts and start Ray on them; on any failure remove what was made, then raise."""
        cluster = cls.describe(name)
        if set(cluster.namespaces()) & set(_namespaces()) or cluster.state_dir.exists():
            raise ClusterError(f"cluster {name!r} is up or was not taken down: "
                               f"`python tools/local_cluster.py down --name {name}` first")
        try:
            cluster._create_network()
            for host in cluster.hosts:
                cluster.boot(host.index, num_cpus=num_cpus)
        except BaseException:
            cluster.down()
            raise
        return cluster

    @classmethod
    def describe(cls, name: str) -> "LocalCluster":
        """The cluster called `name` (whether up or not); its token is read from its state folder."""
        if not re.fullmatch(r"[a-z0-9]{1,%d}" % _MAX_NAME, name):
            raise ClusterError(f"cluster name {name!r}: 1-{_MAX_NAME} lower-case letters or digits")
        hosts = [Host(i, f"{PREFIX}-{name}-{i}", f"{PREFIX}{name}-{i}", f"{SUBNET}.{i + 1}") for i in range(2)]
        state_dir = STATE_ROOT / f"{PREFIX}-cluster-{name}"
        token_file = state_dir / "token"
        token = token_file.read_text().strip() if token_file.is_file() else secrets.token_hex(32)
        return cls(name, hosts, state_dir, token)

    def _create_network(self) -> None:
        self.state_dir.mkdir(mode=0o700)
        token_file = self.state_dir / "token"
        token_file.touch(mode=0o600)
        token_file.write_text(self.token)
        a, b = self.hosts
        for host in self.hosts:
            _ip("netns", "add", host.namespace)
        _ip("link", "add", a.link, "type", "veth", "peer", "name", b.link)
        for host in self.hosts:
            _ip("link", "set", host.link, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.link)
            _ip("-n", host.namespace, "link", "set", host.link, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")

    @property
    def head_address(self) -> str:
        return f"{self.hosts[0].address}:{RAY_PORT}"

    def boot(self, index: int, *, num_cpus: int = 1) -> None:
        """Start host `index` (after `up`, or again after `kill`): its first process, then its Ray node."""
        self._start_init(index)
        self.start_ray(index, num_cpus=num_cpus)

    def _start_init(self, index: int) -> None:
        """The host's PID namespace, held by an init process that reaps orphans (as a machine's init
        does: Ray's daemons are orphans once `ray start` returns). Commands join it with nsenter."""
        namespace = self.hosts[index].namespace
        unshare = subprocess.Popen(["ip", "netns", "exec", namespace, "unshare", "--pid", "--fork", "--mount-proc",
                                    sys.executable, "-c", _INIT], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + 10
        while not (children := _children(unshare.pid)):  # unshare forks the namespace's pid 1
            if unshare.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"could not start host {index}: {unshare.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
        unshare.stderr.close()
        self._inits[index] = unshare
        (self.state_dir / f"init{index}.pid").write_text(str(children[0]))

    def init_pid(self, index: int) -> int:
        path = self.state_dir / f"init{index}.pid"
        if not path.is_file():
            raise ClusterError(f"host {index} of cluster {self.name!r} is not up ({path} is missing)")
        return int(path.read_text())

    def start_ray(self, index: int, *, num_cpus: int = 1) -> None:
        """Ray's head (host 0) or a worker node joining it (other hosts), bound to the host's address."""
        host = self.hosts[index]
        role = (["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if index == 0
                else [f"--address={self.head_address}"])  # (a worker node has no dashboard to turn off)
        command = [str(RAY), "start", *role, f"--node-ip-address={host.address}", f"--num-cpus={num_cpus}",
                   "--disable-usage-stats",
                   f"--temp-dir={self.state_dir / f'ray{index}'}"]
        result = subprocess.run(self.command(index, command), capture_output=True, text=True, timeout=180,
                                env=self._ray_env())
        if result.returncode != 0:
            raise ClusterError(f"ray start on host {index} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")

    # ------------------------------------------------------------------------------- use
    def _ray_env(self) -> Dict[str, str]:
        """Ray's variables for its processes and for the jobs that join it (token authentication,
        no usage reports, nothing written to ~/.ray)."""
        return dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, RAY_USAGE_STATS_ENABLED="0")

    def env(self, index: int) -> Dict[str, str]:
        """The environment of a job's process on host `index`: the Ray token, and the interface gloo
        and NCCL must use (otherwise gloo advertises 127.0.0.1 and the other host cannot connect)."""
        link = self.hosts[index].link
        return dict(self._ray_env(), GLOO_SOCKET_IFNAME=link, NCCL_SOCKET_IFNAME=link)

    def command(self, index: int, argv: Sequence[str]) -> List[str]:
        """`argv` run on host `index`, in the current folder (give it `env=cluster.env(index)`)."""
        return ["nsenter", f"--target={self.init_pid(index)}", "--net", "--pid", "--mount", f"--wd={os.getcwd()}",
                "--", *argv]

    def pids(self, index: int) -> List[int]:
        """Every process of host `index` (an empty list once the host is gone)."""
        out = _ip("netns", "pids", self.hosts[index].namespace, check=False)
        return [int(p) for p in out.split()]

    def kill(self, index: int) -> None:
        """SIGKILL every process of host `index`, as a host that dies. The host's pid 1 first: the kernel
        then kills every process of its PID namespace and `unshare` reaps it (killed in any order, the
        orphans would be left for the machine's init to reap); then whatever else is in the network
        namespace (nsenter wrappers), until none is left."""
        init = self._inits.pop(index, None)
        pid_file = self.state_dir / f"init{index}.pid"
        if pid_file.is_file():
            pid = int(pid_file.read_text())
            if pid in self.pids(index):  # (a stale number may belong to another process by now)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            pid_file.unlink()
        if init is not None:  # our child: reap it, or it stays a zombie
            init.wait(timeout=30)
        deadline = time.monotonic() + 30
        while pids := self.pids(index):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise ClusterError(f"processes {pids} of host {index} survive SIGKILL")
            time.sleep(0.1)

    def link_bytes(self, index: int) -> int:
        """Bytes received plus sent so far by host `index`'s end of the link (what crossed between the hosts)."""
        stats = json.loads(_ip("-n", self.hosts[index].namespace, "-s", "-j", "link", "show", self.hosts[index].link))
        return int(stats[0]["stats64"]["rx"]["bytes"]) + int(stats[0]["stats64"]["tx"]["bytes"])

    def namespaces(self) -> List[str]:
        return [host.namespace for host in self.hosts]

    # ------------------------------------------------------------------------------- teardown
    def down(self) -> None:
        """Stop every process of both hosts (by id), remove the namespaces (their links go with
        them), a link left in this namespace by an interrupted `up`, and the state folder."""
        existing = _namespaces()
        for host in self.hosts:
            if host.namespace in existing:
                self.kill(host.index)
                _ip("netns", "del", host.namespace)
        for host in self.hosts:
            if _link_exists(host.link):
                _ip("link", "del", host.link)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def leftovers(self) -> List[str]:
        """What of this cluster still exists (empty after `down`)."""
        left = [f"namespace {ns}" for ns in set(self.namespaces()) & set(_namespaces())]
        left += [f"link {host.link}" for host in self.hosts if _link_exists(host.link)]
        return left + ([f"folder {self.state_dir}"] if self.state_dir.exists() else [])


@contextlib.contextmanager
def local_cluster(name: str, *, num_cpus: int = 1) -> Iterator[LocalCluster]:
    """A cluster for the duration of a `with` block, removed when it ends, even on an error."""
    cluster = LocalCluster.up(name, num_cpus=num_cpus)
    try:
        yield cluster
    finally:
        cluster.down()


# pid 1 of a host: reaps every orphan, as init does (a pid 1 ignores signals it has no handler for;
# SIGKILL from outside the namespace still ends it, and with it every process of the host).
_INIT = """
import os, time
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(1)
"""


def _children(pid: int) -> List[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _namespaces() -> List[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def clean_stale() -> List[str]:
    """Remove the clusters of tests whose process is gone (names `t<pid>`); returns their names."""
    stale = sorted({m.group(1) for ns in _namespaces() if (m := _OWNED.match(ns)) and not _alive(int(m.group(1)))})
    for pid in stale:
        LocalCluster.describe(f"t{pid}").down()
    return [f"t{pid}" for pid in stale]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "down", "exec", "kill", "boot", "clean"])
    parser.add_argument("--name", default="dev")
    parser.add_argument("--host", type=int, choices=[0, 1], default=0)
    parser.add_argument("--num-cpus", type=int, default=1, help="CPUs each Ray node offers (default 1)")
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []  # exec's command, after `--`
    args = parser.parse_args(argv[:len(argv) - len(command) - (1 if "--" in argv else 0)])
    try:
        if args.action == "clean":
            print("removed:", " ".join(clean_stale()) or "nothing")
            return 0
        if args.action == "up":
            cluster = LocalCluster.up(args.name, num_cpus=args.num_cpus)
            for host in cluster.hosts:
                print(f"host {host.index}: namespace {host.namespace}, address {host.address}, interface {host.link}")
            print(f"Ray: {cluster.head_address}; run commands with `python tools/local_cluster.py exec --host I "
                  f"--name {args.name} -- COMMAND`")
            return 0
        cluster = LocalCluster.describe(args.name)
        if args.action == "down":
            cluster.down()
        elif args.action == "kill":
            cluster.kill(args.host)
        elif args.action == "boot":
            cluster.boot(args.host, num_cpus=args.num_cpus)
        else:  # exec: replace this process, so signals reach the command
            if not command:
                parser.error("exec needs a command after --")
            os.execvpe("nsenter", cluster.command(args.host, command), cluster.env(args.host))
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
