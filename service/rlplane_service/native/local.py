"""The native engine in this process, without Ray: storage units and a controller served
on loopback threads, wired as the service wires them (a data secret for clients, the
controller's own credential on the units' control sockets).

For tests and local experiments; the service runs the same cores in Ray actors. A unit
counts as dead (``is_dead``) once it was stopped with :meth:`LocalEngine.kill_unit`.
``processes=True`` runs each unit in a child process of its own instead (``python -m
rlplane_service.native.local``), so a test can stop it with a signal by pid
(``unit_pid(i)``); such a unit is dead once its process has exited.

Example::

    with LocalEngine(units=2, slab_bytes=64 << 20) as engine:
        client = Client(default_registry(), NativeTransport(engine.info, timeout=30))
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

from rlplane_service.native.controller import ControllerCore
from rlplane_service.native.journal import JournalWriter
from rlplane_service.native.server import Server
from rlplane_service.native.unit import DEFAULT_SLAB_BYTES, TransferEngineConfig, UnitCore


class LocalEngine:
    """A controller and ``units`` storage units on loopback (see the module docstring).

    ``hosts``: the address each unit binds (127.0.0.x stand for distinct nodes); the
    other keywords go to :class:`ControllerCore`."""

    def __init__(self, units: int = 2, *, secret: bytes | None = b"local-engine-secret",
                 slab_bytes: int = DEFAULT_SLAB_BYTES, hosts: Sequence[str] | None = None, processes: bool = False,
                 tenants: Mapping[str, tuple[bytes, tuple[Sequence[str], bool]]] | None = None,
                 te_protocol: str = "", journal_dir: str | os.PathLike[str] | None = None,
                 journal_flush_ms: float = 20.0, te_ports: tuple[int, int] | None = None, **controller: Any) -> None:
        """``tenants``: engine user -> (secret, (partition prefixes, may write)), as the
        service derives them from RLPLANE_TOKENS_FILE (in-process units only).
        ``te_ports``: the range the units' engines listen in (RLPLANE_TE_PORT_MIN/MAX).
        ``te_protocol``: each unit registers its slab with a transfer engine (``tcp``).
        ``journal_dir``: each unit keeps a journal in ``journal_dir/<unit>`` (RLPLANE_JOURNAL_DIR)."""
        self.secret = secret
        tenants = dict(tenants or {})
        users = {name: s for name, (s, _) in tenants.items()}
        control = self.seal_key = secrets.token_hex(16).encode()  # the controller's credential on the units
        hosts = list(hosts) if hosts is not None else ["127.0.0.1"] * units
        self._killed: set[int] = set()
        self.cores: list[UnitCore] = []
        self.units: list[Server] = []
        self.procs: list[subprocess.Popen] = []
        if processes:
            self.procs = [_spawn(f"u{i}", h, slab_bytes, secret, control, te_protocol, journal_dir, journal_flush_ms,
                                 te_ports) for i, h in enumerate(hosts)]
            started = [json.loads(p.stdout.readline() or "{}") for p in self.procs]  # type: ignore[union-attr]
            if not all("endpoint" in s for s in started):
                self.stop()
                raise RuntimeError(f"a storage unit process did not start: {started}")
            endpoints = [(s["endpoint"], s["control"]) for s in started]
        else:
            self.cores = [UnitCore(f"u{i}", slab_bytes, seal_key=control,
                                   te=TransferEngineConfig(h, te_protocol, ports=te_ports) if te_protocol else None,
                                   journal=_journal(journal_dir, f"u{i}", journal_flush_ms),
                                   readers=[u for u, (_, (_, write)) in tenants.items() if not write])
                          for i, h in zip(range(units), hosts)]
            self.units = [Server(c, host=h, secret=secret, name=f"u{i}", control_secret=control, users=users).start()
                          for i, (c, h) in enumerate(zip(self.cores, hosts))]
            endpoints = [(u.endpoint, u.control_endpoint) for u in self.units]
        self._make_core = lambda start: ControllerCore(
            [(f"u{i}", e) for i, (e, _) in enumerate(endpoints)], secret=secret, control=[c for _, c in endpoints],
            control_secret=control, is_dead=self._is_dead, scopes={u: scope for u, (_, scope) in tenants.items()},
            start=start, journal=journal_dir is not None, **controller)
        self._users = users
        self._restarts = 0
        self.core = self._make_core(True)
        self.server = Server(self.core, secret=secret, name="controller", users=users).start()
        self.info = {"controller": self.server.endpoint, "secret": secret.decode() if secret else None}

    def kill_controller(self) -> None:
        """Stop the controller (what a SIGKILL of its process is to clients: its index is gone)."""
        self.server.stop()
        self.core.stop()

    def restart_controller(self, *, rebuild: bool = True) -> dict[str, Any]:
        """Start a new controller on the old one's port, as the service's restarted actor
        does: it rebuilds its index from the units (``rebuild``), then serves. Returns the
        rebuild's report. The old controller must be stopped first (:meth:`kill_controller`)."""
        core = self._make_core(False)
        self._restarts += 1
        core.restarts = self._restarts
        report = core.rebuild() if rebuild else {}
        port = int(self.server.endpoint.rsplit(":", 1)[1])
        self.core = core
        self.server = Server(core, secret=self.secret, name="controller", users=self._users, port=port).start()
        core.start()
        return report

    def _is_dead(self, i: int) -> bool:
        return i in self._killed or (bool(self.procs) and self.procs[i].poll() is not None)

    def unit_pid(self, i: int) -> int:
        """The process id of unit ``i`` (``processes=True`` only)."""
        return self.procs[i].pid

    def kill_unit(self, i: int) -> None:
        """Stop unit ``i`` for good (what a killed process is to the controller)."""
        self._killed.add(i)
        if self.procs:
            self.procs[i].kill()
            self.procs[i].wait(timeout=10)
        else:
            self.units[i].stop()
            self.cores[i].stop()

    def stop(self) -> None:
        if hasattr(self, "server"):  # the controller first: none of its work then waits on a stopped unit
            self.server.stop()
            self.core.stop()
        for i, u in enumerate(self.units):  # every unit's loop told, then each waited for: they wind down together
            if i not in self._killed:
                u.stop(join=False)
        for i, (u, c) in enumerate(zip(self.units, self.cores)):
            if i not in self._killed:
                u.stop()
                c.stop()
            c.slab.close()  # its memory now: a test session makes many engines
        for p in self.procs:  # all told first, then each waited for
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # a test may have left it stopped
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _journal(root: str | os.PathLike[str] | None, name: str, flush_ms: float) -> JournalWriter | None:
    return JournalWriter(Path(root), name, flush_ms=flush_ms) if root is not None else None


def _spawn(name: str, host: str, slab_bytes: int, secret: bytes | None, control: bytes,
           te_protocol: str = "", journal_dir: str | os.PathLike[str] | None = None,
           journal_flush_ms: float = 20.0, te_ports: tuple[int, int] | None = None) -> subprocess.Popen:
    env = dict(os.environ, RLPLANE_LOCAL_SECRET=(secret or b"").decode(), RLPLANE_LOCAL_CONTROL=control.decode())
    journal = ["--journal-dir", str(journal_dir), "--journal-flush-ms", str(journal_flush_ms)] if journal_dir else []
    ports = ["--te-ports", f"{te_ports[0]}-{te_ports[1]}"] if te_ports else []
    return subprocess.Popen([sys.executable, "-m", "rlplane_service.native.local", "--name", name, "--host", host,
                             "--slab-bytes", str(slab_bytes), "--te-protocol", te_protocol, *journal, *ports],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve one storage unit until stdin closes or SIGTERM; print its endpoints as one JSON line.
    The secrets come from RLPLANE_LOCAL_SECRET and RLPLANE_LOCAL_CONTROL (not the command line)."""
    ap = argparse.ArgumentParser(prog="python -m rlplane_service.native.local",
                                 description="One native storage unit in this process (tests, experiments).")
    ap.add_argument("--name", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--slab-bytes", type=int, default=DEFAULT_SLAB_BYTES)
    ap.add_argument("--te-protocol", default="", choices=["", "tcp", "rdma"],
                    help="register the slab with Mooncake's transfer engine over this protocol ('' = no)")
    ap.add_argument("--te-ports", default="", help="MIN-MAX: the ports the transfer engine may listen on")
    ap.add_argument("--journal-dir", default=None, help="keep a write-ahead journal in JOURNAL_DIR/NAME")
    ap.add_argument("--journal-flush-ms", type=float, default=20.0, help="group fsync interval of the journal")
    args = ap.parse_args(argv)
    secret = os.environ.get("RLPLANE_LOCAL_SECRET", "").encode() or None
    control = os.environ.get("RLPLANE_LOCAL_CONTROL", "").encode() or None
    ports = tuple(int(x) for x in args.te_ports.split("-")) if args.te_ports else None
    te = TransferEngineConfig(args.host, args.te_protocol, ports=ports) if args.te_protocol else None  # type: ignore[arg-type]
    core = UnitCore(args.name, args.slab_bytes, seal_key=control, te=te,
                    journal=_journal(args.journal_dir, args.name, args.journal_flush_ms))
    server = Server(core, host=args.host, secret=secret, name=args.name, control_secret=control).start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print(json.dumps({"endpoint": server.endpoint, "control": server.control_endpoint, "pid": os.getpid()}), flush=True)
    done.wait()
    server.stop()
    core.stop()


if __name__ == "__main__":
    main()


__all__ = ["LocalEngine"]
