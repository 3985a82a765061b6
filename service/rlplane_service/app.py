"""The Ray Serve application: ``rlplane_service.app:app``.

One deployment with a FastAPI ingress (:func:`rlplane_service.api.build_api`). Its
replica attaches to (or creates) the store of the configured backend (:mod:`rlplane_service.backends`)
and serves the registry, the control plane and the HTTP data path; clients that can
reach the store move bulk bytes there directly (``GET /v1/transport``).

Configure with ``RLPLANE_*`` environment variables or the app's args::

    serve run rlplane_service.app:app                       # defaults + RLPLANE_* env
    serve run rlplane_service.app:build_app storage_units=4 # args override env
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve

from rlplane import errors as E
from rlplane_service.api import MAX_WAITING_CLAIMS, ServiceState, build_api
from rlplane_service.backends import open_store
from rlplane_service.settings import ServiceSettings, load_registry, unknown_variables
from rlplane_service.snapshotter import start_snapshotter

log = logging.getLogger(__name__)


#: A replica told to stop checks for requests still in flight every quarter second (Serve's
#: default waits 2 s before its first look, even when nothing is in flight); it still waits
#: for every one of them, up to Serve's graceful_shutdown_timeout_s.
DRAIN_POLL_S = 0.25


#: Requests one replica serves at once: waiting claims take up to MAX_WAITING_CLAIMS of them
#: (rlplane_service.api), the rest stay for puts, reads and the control plane.
MAX_ONGOING_REQUESTS = MAX_WAITING_CLAIMS + 64


@serve.deployment(name="rlplane", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=MAX_ONGOING_REQUESTS,
                  graceful_shutdown_wait_loop_s=DRAIN_POLL_S)
@serve.ingress()
class RlplaneService:
    """The service replica: settings -> registry -> store -> FastAPI app."""

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        settings = ServiceSettings(**(args or {}))
        for name in unknown_variables(os.environ):
            log.warning("%s is set but no rlplane setting has that name (ignored)", name)
        registry = load_registry(settings)
        store = open_store(settings)
        transport = store.service_transport()
        if settings.restore_from is not None or has_journal(settings.journal_dir):
            restore_once(store, transport, settings.restore_from, registry.names(), settings.journal_dir)
        self._watch = store.watch_units(transport)  # where the engine does not watch its own units
        self._snapshotter = start_snapshotter(settings, transport, store.ledger)
        self._state = ServiceState(
            settings, registry, transport, store.transport_info(), store.health, LedgerProxy(store.ledger),
            store.master_info, publish_key=store.publish_key, streams=store.streams,
            loss=store.loss, transport_for=store.transport_for, store=store,
        )
        log.info("rlplane replica up: %d fields (registry %s)", len(registry.names()), registry.version)

    def __serve_build_asgi_app__(self) -> Any:
        return build_api(self._state)

    def __del__(self) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.stop()
        snapshotter = getattr(self, "_snapshotter", None)
        if snapshotter is not None:
            snapshotter.stop()
        state = getattr(self, "_state", None)
        if state is not None:
            state.transport.close()


def has_journal(root: Any) -> bool:
    """Whether journal directory ``root`` holds a segment (a store died with it)."""
    from rlplane.journal import segments

    return root is not None and next(iter(segments(Path(root))), None) is not None


#: How often the replica restoring the store says it is alive (the store's ledger actor keeps
#: it), and how long the other replicas, and any replica started after it, wait without a
#: sign before they call it dead.
RESTORE_BEAT_S = 5.0
RESTORE_SILENT_S = 60.0


def restore_once(store: Any, transport: Any, path: Any, declared: list[str], journal: Any = None) -> None:
    """Load snapshot ``path`` (and/or replay ``journal``) into the new store, once: the
    first replica to ask does it (the store's ledger actor says who), before it serves;
    the others, and any replica started later, wait until it is done. SnapshotError when
    it failed, or when the replica restoring it stopped mid-way (no sign for
    RESTORE_SILENT_S: the store holds part of it, so no replica serves it);
    InvalidArgumentError on a backend without snapshots.

    Example: ``restore_once(store, transport, "/mnt/snap/run-7", registry.names())``
    """
    from rlplane import snapshot

    if store.name != "native":
        what = "RLPLANE_RESTORE_FROM" if path is not None else "RLPLANE_JOURNAL_DIR"
        raise E.InvalidArgumentError(f"{what} needs the native backend (this store is {store.name!r})")
    me, source = secrets.token_hex(8), path or journal
    if ray.get(store.ledger.remember.remote("restored-by", me), timeout=30) != me:
        _await_restore(store.ledger, source)
        return
    ray.get(store.ledger.keep.remote("restore", {"state": "running"}), timeout=30)
    done = threading.Event()

    def beat() -> None:
        while not done.wait(RESTORE_BEAT_S):
            try:
                store.ledger.keep.remote("restore", {"state": "running"})
            except Exception as err:  # noqa: BLE001 - the ledger gone: the waiters say so
                log.warning("restore: could not tell the other replicas it goes on: %s", err)

    beating = threading.Thread(target=beat, name="rlplane-restore-beat", daemon=True)
    beating.start()
    outcome: dict[str, Any] = {"state": "failed", "why": "the restore was interrupted"}
    try:
        info = snapshot.restore(transport, path, progress=log.info, declared=declared,
                                journal=journal if has_journal(journal) else None, newest=True)
        outcome = {"state": "done"}
    except Exception as err:
        outcome["why"] = f"{type(err).__name__}: {err}"
        raise
    finally:  # the beat stopped first: a late one must not follow the outcome
        done.set()
        beating.join()
        ray.get(store.ledger.keep.remote("restore", outcome), timeout=30)
    log.warning("restored %d samples in %d partitions from %s in %.1f s%s", info.samples, info.partitions,
                source, info.seconds, f" (journal: {info.journal})" if info.journal else "")


def _await_restore(ledger: Any, source: Any) -> None:
    """Wait until the replica restoring the store from ``source`` is done (SnapshotError
    when it failed or fell silent)."""
    t0 = said = time.monotonic()
    while True:
        state, age = ray.get(ledger.kept.remote("restore"), timeout=30)
        state = state or {}
        if state.get("state") == "done":
            return
        if state.get("state") == "failed":  # the replica that restored failed: this store must not serve
            raise E.SnapshotError(f"the restore from {source} failed: {state.get('why')}; start a new store",
                                  component=str(source))
        silent = age if age is not None else time.monotonic() - t0
        if silent > RESTORE_SILENT_S:
            raise E.SnapshotError(f"the replica restoring this store from {source} stopped mid-way (no sign of it "
                                  f"for {silent:.0f} s): the store holds part of it, so no replica serves it; "
                                  "start a new store", component=str(source))
        if time.monotonic() - said > 30:
            said = time.monotonic()
            log.info("waiting for the replica restoring the store from %s (%.0f s so far)", source, said - t0)
        time.sleep(0.25)


class LedgerProxy:
    """The store's shared op ledger (a Ray actor), as :class:`ServiceState` uses it:
    ``record`` returns the call's ObjectRef (the API awaits it), ``snapshot`` blocks."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def record(self, events: list[dict[str, Any]]) -> Any:
        return self._actor.record.remote(events)

    def snapshot(self) -> dict[str, Any]:
        return ray.get(self._actor.snapshot.remote(), timeout=10)


def build_app(args: dict[str, Any] | None = None) -> Any:
    """App builder for ``serve run rlplane_service.app:build_app key=value ...`` and ``rlplane serve``."""
    return RlplaneService.bind(dict(args or {}))


app = RlplaneService.bind()
