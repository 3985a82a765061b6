"""A two-node Ray cluster on one machine's loopback: the setup that stands for "units on
another host" where only one host is at hand.

The head node (127.0.0.3) runs the driver, the Serve proxy and the client; a second node
(127.0.0.2) offers the storage resource, so every storage unit of the native engine is
placed there (``storage_resource``) and binds its sockets and transfer engine on
127.0.0.2 (with ``storage_nodes=2``, a third node on 127.0.0.4 offers it too: the units
spread over both, as over a cluster's storage nodes). Each node is a ``ray start
--block`` process of ours, stopped with its whole process tree by pid. (Ray turns a head
address of 127.0.0.1 into the machine's external address unless it runs single-node, so
the head takes 127.0.0.3: every address stays on loopback.)

``rlplane two-node`` deploys the rlplane app on it and moves the vlm-step batch through
the transfer engine (and the other paths asked for), checked bit for bit.

Example::

    with LoopbackCluster() as cluster:
        url = cluster.deploy(ServiceSettings(port=free_port(), te_protocol="tcp",
                                             storage_resource=cluster.storage_resource))
        client = rlplane.connect(url, data_path="te")
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from rlplane.errors import TransportError
from rlplane_service.embedded import wait_ready
from rlplane_service.net import free_port
from rlplane_service.settings import ServiceSettings

HEAD_IP, NODE_IP = "127.0.0.3", "127.0.0.2"
#: The storage nodes' addresses, in the order they start.
NODE_IPS = (NODE_IP, "127.0.0.4", "127.0.0.5", "127.0.0.6")
STORAGE_RESOURCE = "rlplane_storage"
#: How long a stop lets the nodes' processes end on SIGTERM before it kills them. Ray's own
#: shutdown of a node (raylet, GCS, Serve's actors) ran past 15 s on the 2-core VM; nothing
#: of this throwaway cluster outlives it (its temp dir is removed, the units' slabs are memfds).
STOP_GRACE_S = 3.0


class ClusterError(RuntimeError):
    """The loopback cluster did not come up (the message says which node and where its log is)."""


class LoopbackCluster:
    """Head on ``head_ip`` and ``storage_nodes`` storage nodes, the first on ``node_ip``
    (see the module docstring).

    ``units``: how many storage units each storage node may take (its ``storage_resource``)."""

    def __init__(self, *, units: int = 2, head_ip: str = HEAD_IP, node_ip: str = NODE_IP, storage_nodes: int = 1,
                 storage_resource: str = STORAGE_RESOURCE, num_cpus: int = 4, ready_timeout_s: float = 120.0,
                 say: Callable[[str], None] = lambda msg: None) -> None:
        if not 1 <= storage_nodes <= len(NODE_IPS):
            raise ValueError(f"storage_nodes must be 1 to {len(NODE_IPS)}")
        self.units, self.head_ip, self.node_ip = units, head_ip, node_ip
        self.node_ips = [node_ip, *[ip for ip in NODE_IPS if ip != node_ip][: storage_nodes - 1]]
        self.storage_resource, self.num_cpus, self.ready_timeout_s, self.say = storage_resource, num_cpus, ready_timeout_s, say
        self.port = 0
        # Ray's temp dir of its own: `ray start` records its address there, and one recorded in
        # the default /tmp/ray is where every later ray.init() on this machine would connect.
        # (Short: Ray's Unix socket paths under it must stay within 107 bytes.)
        self.logs = Path(tempfile.mkdtemp(prefix="rlp-"))
        self._procs: list[subprocess.Popen] = []
        self._driver = False
        self._failed = False  # keep the logs (the error names them)
        # Ray's token authentication (its default) unless the caller opted out: the same mode
        # for both nodes and this driver (a joining node does not pick it up by itself).
        self.auth_mode = os.environ.get("RAY_AUTH_MODE") or "token"

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"

    def start(self) -> LoopbackCluster:
        """Start the nodes; return once each says it runs. This process will be their
        driver: it takes their authentication mode (RAY_AUTH_MODE, read when Ray is first imported)."""
        if "ray" in sys.modules and os.environ.get("RAY_AUTH_MODE") != self.auth_mode:
            raise ClusterError("ray was imported before the loopback cluster started; start it first")
        os.environ["RAY_AUTH_MODE"] = self.auth_mode
        self.port = free_port()
        self.say(f"starting the head node on {self.address}")
        self._node("head", ["--head", "--node-ip-address", self.head_ip, "--port", str(self.port),
                            "--include-dashboard", "false", "--temp-dir", str(self.logs / "ray")])
        self._wait_log("head", "Ray runtime started")
        for k, ip in enumerate(self.node_ips):
            self.say(f"starting a storage node on {ip} ({self.units} x {self.storage_resource})")
            self._node(f"node-{k}", ["--address", self.address, "--node-ip-address", ip,
                                     "--resources", f'{{"{self.storage_resource}": {self.units}}}'])
            self._wait_log(f"node-{k}", "Ray runtime started")
        return self

    def connect(self, namespace: str) -> None:
        """Make this process the cluster's driver, on the head node."""
        import ray

        # ray.init installs its own SIGINT/SIGTERM handlers (SIGTERM aborts the process, which
        # would leave both nodes running): put back the caller's, so a stop always runs.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        ray.init(address=self.address, _node_ip_address=self.head_ip, namespace=namespace, log_to_driver=False,
                 logging_level="WARNING")
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
        self._driver = True
        deadline = time.monotonic() + self.ready_timeout_s
        while sum(1 for n in ray.nodes() if n["Alive"]) < 1 + len(self.node_ips):
            if time.monotonic() > deadline:
                raise ClusterError(f"the storage nodes did not join within {self.ready_timeout_s:.0f} s; "
                                   f"see {self.logs}")
            time.sleep(0.5)

    def deploy(self, settings: ServiceSettings) -> str:
        """Deploy the rlplane app with ``settings`` (its HTTP proxy on the head, at
        ``settings.host:settings.port``); returns its URL once ``/readyz`` says 200
        (TransportError after ``ready_timeout_s``)."""
        from ray import serve

        from rlplane_service.app import build_app

        if not self._driver:
            self.connect(settings.namespace)
        url = f"http://{settings.host}:{settings.port}"
        self.say(f"deploying rlplane at {url} ({settings.storage_units} storage units on {', '.join(self.node_ips)})")
        serve.start(http_options={"host": settings.host, "port": settings.port, "location": "HeadOnly"},
                    logging_config={"log_level": "WARNING"})
        serve.run(build_app(settings.as_args()), name="rlplane", route_prefix="/", blocking=False)
        try:
            wait_ready(url, self.ready_timeout_s)
        except TransportError:
            self._failed = True  # keep the logs
            raise
        return url

    def pids(self) -> list[int]:
        """Every live process of the nodes (the ``ray start`` processes and what they started)."""
        out = []
        for p in self._procs:
            try:
                root = psutil.Process(p.pid)
                out += [root.pid] + [c.pid for c in root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        return out

    def stop(self) -> None:
        """Disconnect the driver, then end the nodes' process trees by pid. Idempotent.

        No ``serve.shutdown()`` first: everything Serve and the app run lives in these
        two process trees and goes with them, and a graceful Serve shutdown waits up to
        30 s for its controller on a loaded machine."""
        if self._driver:
            import ray

            ray.shutdown()
            self._driver = False
        procs = []
        for p in reversed(self._procs):  # the storage nodes first, then the head
            try:
                root = psutil.Process(p.pid)
                procs += [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for proc in procs:
            try:
                proc.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(procs, timeout=STOP_GRACE_S)
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs = []
        if not self._failed:
            shutil.rmtree(self.logs, ignore_errors=True)

    def _node(self, name: str, args: list[str]) -> None:
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE=self.auth_mode)
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus", str(self.num_cpus),
               "--disable-usage-stats", *args]
        log = open(self.logs / f"{name}.log", "wb")
        try:
            self._procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                start_new_session=True))
        finally:
            log.close()

    def _wait_log(self, name: str, marker: str) -> None:
        path, proc = self.logs / f"{name}.log", self._procs[-1]
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if marker in path.read_text(errors="replace"):
                return
            if proc.poll() is not None:
                break
            time.sleep(0.3)
        tail = path.read_text(errors="replace")[-1500:]
        self._failed = True
        self.stop()
        raise ClusterError(f"the {name} node did not start (log {path}):\n{tail}")

    def __enter__(self) -> LoopbackCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def check(url: str, paths: list[str], *, batch: int, seqlen: int, node_ip: str, reps: int = 3,
          node_ips: list[str] | None = None, say: Callable[[str], None] = lambda msg: None) -> dict[str, Any]:
    """Put the vlm-step batch and read it back through each data path in ``paths`` (a client
    forced onto it), checked bit for bit; where the units live (on the storage nodes
    ``node_ips``, default ``[node_ip]``, spread over them) and which path each took.

    Returns ``{"units": [[name, endpoint], ...], "paths": {path: {"taken", "put_ms",
    "get_ms", "gb_per_s", "problems"}}, "problems": [...]}`` (median ms of ``reps``)."""
    import statistics

    import rlplane
    from rlplane.testing.verify import diff_fields
    from rlplane.testing.workloads import vlm_step

    work = vlm_step(batch=batch, seqlen=seqlen)
    ids = [f"s-{i}" for i in range(work.batch)]
    nodes = node_ips or [node_ip]
    out: dict[str, Any] = {"node_ip": node_ip, "node_ips": nodes, "batch": work.batch, "seqlen": seqlen,
                           "nbytes": work.nbytes, "paths": {}, "problems": []}
    for path in paths:
        client = rlplane.connect(url, data_path=path)
        try:
            transport = client.transport
            units = [[name, endpoint] for name, endpoint in transport.units]
            out["units"] = units
            on = {name: endpoint.removeprefix("tcp://").rpartition(":")[0] for name, endpoint in units}
            away = [name for name, ip in on.items() if ip not in nodes]
            if away:
                out["problems"].append(f"units {away} are not on the storage nodes {nodes}")
            if len(set(on.values())) < min(len(units), len(nodes)):  # two copies could share a host
                out["problems"].append(f"the units are packed on {sorted(set(on.values()))} of the storage nodes "
                                       f"{nodes}")
            row: dict[str, Any] = {"taken": transport.paths(), "problems": []}
            put, get = [], []
            for rep in range(reps):
                key = f"two-node-{path}-{rep}"
                t0 = time.perf_counter()
                meta = client.put_samples(key, work.fields, sample_ids=ids)
                t1 = time.perf_counter()
                got = client.read_columns(meta, sorted(meta.fields))
                t2 = time.perf_counter()
                row["problems"] += diff_fields(client.registry, work.fields, got, work.lengths, sample_ids=ids)
                client.clear(key)
                put.append(t1 - t0)
                get.append(t2 - t1)
            row.update(put_ms=statistics.median(put) * 1e3, get_ms=statistics.median(get) * 1e3,
                       put_ms_each=[t * 1e3 for t in put], get_ms_each=[t * 1e3 for t in get],
                       gb_per_s=2 * work.nbytes / (statistics.median(put) + statistics.median(get)) / 1e9)
            wrong = {u: p for u, p in row["taken"].items() if p != path}
            if wrong:
                row["problems"].append(f"units read over another path than {path}: {wrong}")
            say(f"{path}: put {row['put_ms']:.1f} ms, read {row['get_ms']:.1f} ms "
                f"({row['gb_per_s']:.2f} GB/s both ways), {len(row['problems'])} problem(s)")
            out["paths"][path] = row
            out["problems"] += [f"{path}: {p}" for p in row["problems"]]
        finally:
            client.close()
    return out


__all__ = ["LoopbackCluster", "ClusterError", "HEAD_IP", "NODE_IP", "NODE_IPS", "STORAGE_RESOURCE", "check"]
