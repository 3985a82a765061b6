"""The Mooncake backend's server side: the service's own ``mooncake_master`` and the
storage units that mount memory into the Mooncake pool.

TransferQueue's own Mooncake bootstrap (``auto_init``) runs ``pkill -f mooncake_master``
and so kills every master on the host; rlplane never uses it. Instead the store owns:

* ``MooncakeMasterActor`` (detached, named ``{store}-mooncake-master``): starts one
  ``mooncake_master`` process on ports it chooses, keeps its pid, waits for ``/health``
  and stops that pid on :meth:`~MooncakeMasterActor.stop`. The process also gets
  ``PR_SET_PDEATHSIG``, so it dies with the actor even when Ray kills the actor hard.
* ``MooncakeUnitActor`` (detached, named ``{store}-mooncake-unit-{i}``): a Mooncake
  client that mounts ``mooncake_segment_bytes`` of memory. Samples live in these
  segments; rlplane's clients mount nothing (segment size 0), so a rollout worker that
  exits takes no data with it.

TransferQueue's controller keeps the per-sample metadata as with the simple backend.

Example::

    master = MooncakeMaster.start(settings, host="127.0.0.1")
    master.info()      # {"pid": ..., "master_address": "127.0.0.1:...", ...}
    master.stop()
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from rlplane.errors import TransportError
from rlplane_service.net import free_ports
from rlplane_service.settings import ServiceSettings

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_START_TIMEOUT_S = 30.0
_START_ATTEMPTS = 3


def master_binary(settings: ServiceSettings) -> str:
    """The ``mooncake_master`` to run: the configured path, the one beside this Python, or PATH."""
    if settings.mooncake_master_bin is not None:
        candidates = [str(settings.mooncake_master_bin)]
    else:
        candidates = [str(Path(sys.executable).parent / "mooncake_master"), shutil.which("mooncake_master") or ""]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise TransportError(
        "backend 'mooncake' needs the mooncake_master executable: pip install 'rlplane[mooncake]' "
        "(or set RLPLANE_MOONCAKE_MASTER_BIN)"
    )


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class MasterInfo:
    """Where the master listens (what clients and ``/readyz`` need)."""

    pid: int
    host: str
    master_address: str
    metadata_server: str
    metrics_url: str
    log_file: str


class MooncakeMaster:
    """One ``mooncake_master`` process this object started and stops (by pid)."""

    def __init__(self, proc: subprocess.Popen, info: MasterInfo) -> None:
        self._proc = proc
        self._info = info

    @classmethod
    def start(cls, settings: ServiceSettings, host: str) -> MooncakeMaster:
        """Start the master on ``host``; return once it serves on all its ports (TransportError if not).

        Ports left 0 in ``settings`` are chosen free (three different ones). If the master
        exits at start on chosen ports (another process bound one between the choice and
        the master's bind), it is started again on new ones, up to three times.
        """
        chosen = not (settings.mooncake_master_port and settings.mooncake_metadata_port and settings.mooncake_metrics_port)
        attempts = _START_ATTEMPTS if chosen else 1
        for attempt in range(1, attempts + 1):
            try:
                return cls._start_once(settings, host)
            except _ExitedAtStart as err:
                if attempt == attempts:
                    raise  # its log stays: the error names it
                shutil.rmtree(err.log_dir, ignore_errors=True)
                log.warning("mooncake_master exited at start (attempt %d of %d), starting it on new ports: %s",
                            attempt, attempts, err)
        raise AssertionError("unreachable")  # the loop returns or raises

    @classmethod
    def _start_once(cls, settings: ServiceSettings, host: str) -> MooncakeMaster:
        binary = master_binary(settings)
        auto = iter(free_ports(host, 3))
        rpc = settings.mooncake_master_port or next(auto)
        meta = settings.mooncake_metadata_port or next(auto)
        metrics = settings.mooncake_metrics_port or next(auto)
        log_dir = Path(tempfile.mkdtemp(prefix=f"rlplane-{settings.store_name}-mooncake-"))
        log_file = log_dir / "mooncake_master.log"
        cmd = [
            binary,
            f"-rpc_address={host}",
            f"-rpc_port={rpc}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={host}",
            f"-http_metadata_server_port={meta}",
            f"-metrics_host={host}",
            f"-metrics_port={metrics}",
            # rlplane decides what is stored and for how long: nothing is evicted behind
            # its back. A read holds its objects for the lease; clears force past it.
            "-eviction_high_watermark_ratio=1.0",
            "-eviction_ratio=0.0",
            "-allow_evict_soft_pinned_objects=false",
            f"-default_kv_lease_ttl={settings.mooncake_lease_ttl_ms}",
            "-client_ttl=30",
        ]
        with open(log_file, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
            )
        info = MasterInfo(
            pid=proc.pid,
            host=host,
            master_address=f"{host}:{rpc}",
            metadata_server=f"http://{host}:{meta}/metadata",
            metrics_url=f"http://{host}:{metrics}/metrics",
            log_file=str(log_file),
        )
        master = cls(proc, info)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log_file.read_text(errors="replace")[-2000:]
                raise _ExitedAtStart(
                    f"mooncake_master exited with {proc.returncode} at start (log {log_file}):\n{tail}", log_dir)
            # /health answers from the admin server before the RPC server has bound its
            # port; a master whose RPC bind fails still says "ok" for about a second.
            if master.healthy(timeout=1.0) and _listens(proc.pid, {rpc, meta, metrics}):
                log.info("mooncake_master pid %d: rpc %s, metadata %s", proc.pid, info.master_address, info.metadata_server)
                return master
            time.sleep(0.2)
        master.stop()
        raise TransportError(
            f"mooncake_master did not serve on ports {rpc} (rpc), {meta} (metadata) and {metrics} (metrics) "
            f"within {_START_TIMEOUT_S:.0f} s (log {log_file})"
        )

    def info(self) -> dict[str, Any]:
        return asdict(self._info)

    def healthy(self, timeout: float = 2.0) -> bool:
        """Whether the process runs and its admin server says it is serving."""
        if self._proc.poll() is not None:
            return False
        try:
            r = httpx.get(self._info.metrics_url.rsplit("/", 1)[0] + "/health", timeout=timeout)
            return r.status_code == 200 and r.json().get("status") == "ok"
        except (httpx.HTTPError, ValueError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the process this object started (by pid); kill it if it lingers; remove
        its log unless it ended by itself (then the log says why). Idempotent."""
        if self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout)
        shutil.rmtree(Path(self._info.log_file).parent, ignore_errors=True)
        log.info("mooncake_master pid %d stopped", self._proc.pid)


class _ExitedAtStart(TransportError):
    """The master process ended before it served (a port taken, a bad flag): its log says why."""

    def __init__(self, message: str, log_dir: Path) -> None:
        super().__init__(message)
        self.log_dir = log_dir


def _listens(pid: int, ports: set[int]) -> bool:
    """Whether process ``pid`` itself listens on every one of ``ports`` (not some other process)."""
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return False
    return ports <= {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


def mount_segment(settings: ServiceSettings, master: dict[str, Any], hostname: str, segment_bytes: int) -> Any:
    """A Mooncake store client that mounts ``segment_bytes`` into the pool of ``master``."""
    from mooncake.store import MooncakeDistributedStore

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", hostname)  # else the first interface Mooncake finds
    store = MooncakeDistributedStore()
    rc = store.setup(
        hostname,
        master["metadata_server"],
        segment_bytes,
        settings.mooncake_buffer_bytes,
        settings.mooncake_protocol,
        settings.mooncake_device_name,
        master["master_address"],
    )
    if rc != 0:
        raise TransportError(f"a Mooncake storage unit could not mount its segment (code {rc}) at {master['master_address']}")
    return store


def stop_master(settings: ServiceSettings, timeout: float = 30.0) -> None:
    """Stop the ``mooncake_master`` of the store ``settings`` names, if it runs (needs a
    connected Ray). The embedded service calls this before it shuts Ray down."""
    import ray

    try:
        actor = ray.get_actor(f"{settings.store_name}-mooncake-master", namespace=settings.namespace)
        ray.get(actor.stop.remote(), timeout=timeout)
    except ValueError:  # no such actor: nothing to stop
        return
    except (ray.exceptions.RayError, TimeoutError) as err:
        log.warning("could not stop mooncake_master cleanly (it dies with its actor): %s", err)


@functools.cache
def ray_actors() -> tuple[Any, Any]:
    """The Ray actor classes (defined lazily so importing this module needs no Ray)."""
    import ray

    @ray.remote(num_cpus=0)
    class MooncakeMasterActor:
        """Owns the store's ``mooncake_master`` process (see the module docstring)."""

        def __init__(self, args: dict[str, Any]) -> None:
            settings = ServiceSettings(**args)
            host = settings.mooncake_hostname or ray.util.get_node_ip_address()
            self._master = MooncakeMaster.start(settings, host)

        def info(self) -> dict[str, Any]:
            return self._master.info()

        def healthy(self) -> bool:
            return self._master.healthy()

        def stop(self) -> None:
            self._master.stop()

    @ray.remote(num_cpus=0)
    class MooncakeUnitActor:
        """Mounts one segment of the Mooncake pool: the memory samples live in."""

        def __init__(self, args: dict[str, Any], master: dict[str, Any]) -> None:
            settings = ServiceSettings(**args)
            self.hostname = settings.mooncake_hostname or ray.util.get_node_ip_address()
            self._store = mount_segment(settings, master, self.hostname, settings.mooncake_segment_bytes)

        def info(self) -> dict[str, Any]:
            # endpoint: where the pool's replica descriptors say a value on this segment lives
            return {"hostname": self.hostname, "endpoint": self._store.get_hostname()}

        def stop(self) -> None:
            self._store.close()

    return MooncakeMasterActor, MooncakeUnitActor


__all__ = ["MasterInfo", "MooncakeMaster", "master_binary", "mount_segment", "ray_actors", "stop_master"]
