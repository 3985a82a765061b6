"""The HTTP API: JSON control plane under ``/v1``, binary data endpoints, health.

``build_api(state)`` returns a plain FastAPI app over a :class:`ServiceState` (registry,
a Transport to the store, settings). The Ray Serve deployment (``rlplane_service.app``)
wraps it; nothing here knows about Ray.

Errors: every rlplane error becomes JSON ``{"error": class, "message", "field",
"sample", ...}`` with a 4xx status (422 invalid field, 404 missing data or unknown stage,
409 duplicate sample, 413 body too large, 401 bad token), which the HTTP client turns back
into the same typed error.

Example::

    api = build_api(ServiceState(settings, registry, MemoryTransport()))
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
import inspect
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, AsyncIterator, Callable, Mapping, Optional

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
import numpy as np
from pydantic import AfterValidator, BaseModel, Field

import rlplane
from rlplane import errors as E
from rlplane import snapshot
from rlplane.names import MAX_ID_LEN, MAX_NAME_LEN, check_partition
from rlplane.codec import check_columns
from rlplane.column import Column
from rlplane.envelope import CONTENT_TYPE, chunked, pack_parts, unpack
from rlplane.fields import Registry
from rlplane.tags import check_written_tags
from rlplane.readpool import ReadPool
from rlplane.claims import MAX_WAIT_S, ClaimRequest
from rlplane.opstats import failure
from rlplane.streams import DirectStreams
from rlplane.transports.base import PartitionInfo, Transport, length_check, sharing_of
from rlplane_service.backends.base import StoreBackend, described_sizes
from rlplane_service.metrics import Ledger, OpsReport, ScrapeCache, render, store_view
from rlplane_service.settings import ServiceSettings
from rlplane_service.tenants import Access, Tenants

log = logging.getLogger(__name__)

#: How long one /readyz probe of the store is reused.
READY_TTL_S = 1.0

_STATUS: list[tuple[type[E.RlplaneError], int]] = [
    (E.ForbiddenError, 403),
    (E.AuthenticationError, 401),
    (E.PayloadTooLargeError, 413),
    (E.FieldValidationError, 422),
    (E.WireFormatError, 422),
    (E.MissingDataError, 404),
    (E.UnknownStageError, 404),
    (E.FieldsHeldError, 409),
    (E.DuplicateSampleError, 409),
    (E.LeaseError, 409),
    (E.SnapshotError, 422),
    (E.IntegrityError, 502),
    (E.NotReadyError, 408),
    (E.InvalidArgumentError, 400),
    (E.RegistryError, 400),
    (E.StorageFullError, 507),
    (E.TransportError, 503),
]


def status_of(err: E.RlplaneError) -> int:
    for cls, code in _STATUS:
        if isinstance(err, cls):
            return code
    return 500


@dataclass
class ServiceState:
    """What the API serves: the registry, a transport to the store, and the settings."""

    settings: ServiceSettings
    registry: Registry
    transport: Transport
    transport_info: dict[str, Any] = field(default_factory=dict)
    health: Callable[[], dict[str, bool]] = dict  # component -> answers (StoreBackend.health)
    ledger: Any = field(default_factory=Ledger)  # .record(events) / .snapshot(): op counters for /metrics
    mooncake: Optional[dict[str, Any]] = None  # the store's mooncake_master (MasterInfo) when backend is mooncake
    started: float = field(default_factory=time.time)
    publish_key: str = "tq"  # /v1/transport publishes transport_info under this key (the backend's data path)
    streams: Optional[Callable[[], dict[str, Any]]] = None  # every task's consumption, for /metrics (StoreBackend.streams)
    loss: Optional[Callable[[], dict[str, Any]]] = None  # lost_samples / lost_units where the service counts them (StoreBackend.loss)
    # What /v1/transport publishes to a tenant (None: the HTTP data path only); full access gets transport_info.
    transport_for: Optional[Callable[[Access], Optional[dict[str, Any]]]] = None
    tenants: Optional[Tenants] = None  # the tokens accepted (default: RLPLANE_API_TOKEN and RLPLANE_TOKENS_FILE)
    store: Optional[StoreBackend] = None  # what the service asks of the store; None: an in-process transport only
    last_snapshot: Optional[dict[str, Any]] = None  # the last snapshot this replica took (SnapshotInfo.to_dict)

    def recovering(self) -> Optional[dict[str, Any]]:
        """A restarted component's rebuild progress (native: the controller's), or None (blocking)."""
        return self.store.recovering() if self.store is not None else None

    def engine_stats(self) -> Optional[dict[str, Any]]:
        """The store engine's own account (native: the controller's), or None (blocking)."""
        return self.store.engine_stats(self.transport) if self.store is not None else None

    def sizes(self, unit_names: list[str]) -> Any:
        """Samples and bytes per partition and per unit (blocking)."""
        if self.store is None:
            return described_sizes(self.transport, unit_names)
        return self.store.sizes(self.transport, unit_names)


def _unicode(text: str) -> str:
    """A name as every store keeps it: valid Unicode (JSON lets a lone surrogate through,
    which msgpack and the answer's JSON then cannot carry: a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (not a lone surrogate)") from None
    return text


def _distinct(names: list[str]) -> list[str]:
    if len(set(names)) != len(names):
        twice = sorted(n for n, k in collections.Counter(names).items() if k > 1)[:3]
        raise ValueError(f"names {twice} more than once (a read of one sample many times answered many copies)")
    return names


_Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LEN), AfterValidator(_unicode)]
_Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_LEN), AfterValidator(_unicode)]


class ClearRequest(BaseModel):
    sample_ids: list[_Id] = Field(..., description="Samples to drop from the partition.")


class GetRequest(BaseModel):
    sample_ids: Annotated[list[_Id], AfterValidator(_distinct)]
    fields: Annotated[list[_Name], Field(max_length=1024), AfterValidator(_distinct)]
    shared: bool = Field(False, description="A row the store keeps once for several of the samples (a GRPO group's "
                                            "image) comes once, with each column's shared rows named (native).")
    born: Optional[list[Annotated[int, Field(ge=0, lt=1 << 62)]]] = Field(
        None, description="Each sample's incarnation as the reader's meta names it (tag _rlplane_born; 0: not known): "
                          "a 404 MissingDataError for samples cleared and put again since (native stores).")
    probe: Annotated[list[_Name], Field(max_length=1024)] = Field(
        [], description="Fields not read, looked for: a 409 FieldsHeldError naming those some of the samples hold (a "
                        "reader's meta older than the write that added them; a read by stage then reads them too).")


class ClaimBody(BaseModel):
    """``POST /v1/partitions/{id}/claim``: what ``client.claim`` sends (see its docstring)."""

    task: _Name = Field(..., description="The consuming task; each task sees every sample once.")
    batch_size: Optional[int] = Field(None, ge=1, le=1_000_000, description="Most samples (needed without max_tokens).")
    stage: Optional[_Name] = Field(None, description="Ready = the stage's required fields are written.")
    fields: Optional[list[_Name]] = Field(None, max_length=1000, description="Ready = these fields are written.")
    timeout: float = Field(0.0, ge=0, le=MAX_WAIT_S, description=f"Seconds to wait for a full batch (at most {MAX_WAIT_S:.0f}; "
                           "wait longer by asking again).")
    min_batch: Optional[int] = Field(None, ge=1, le=1_000_000)
    group_key: Optional[_Name] = None
    current_version: Optional[int] = Field(None, ge=-(1 << 62), lt=1 << 62)
    max_staleness: Optional[int] = Field(None, ge=0, lt=1 << 62)
    lease_s: Optional[float] = Field(None, gt=0, le=86400)
    max_tokens: Optional[int] = Field(None, ge=1, le=1 << 40, description="Token budget: whole samples (or groups), "
                                      "oldest first, while their summed lengths fit.")
    min_tokens: Optional[int] = Field(None, ge=1, le=1 << 40, description="What a claim at its timeout needs at least "
                                      "(default max_tokens).")
    unfinished: bool = Field(False, description="Hand out partial rollouts too (samples whose 'finished' tag is false).")


class SnapshotBody(BaseModel):
    path: str = Field(..., min_length=1, max_length=4096, description="A new directory on the service's host.")


class LeaseBody(BaseModel):
    """``POST /v1/partitions/{id}/ack`` and ``/nack``."""

    task: _Name
    lease: int = Field(..., ge=0, lt=1 << 63)
    sample_ids: Optional[list[_Id]] = Field(None, description="The samples of the lease to settle (default: all).")


def _info(p: PartitionInfo) -> dict[str, Any]:
    return {"partition": p.partition, "num_samples": p.num_samples, "fields": p.fields, "nbytes": p.nbytes}


def build_api(state: ServiceState) -> FastAPI:
    """The FastAPI app serving ``state`` (see the module docstring)."""
    api = FastAPI(
        title="rlplane",
        version=rlplane.__version__,
        description="The data plane for RL post-training: declared fields, bit-exact from rollout to trainer.",
    )
    tenants = state.tenants or Tenants.load(state.settings.token(), str(state.settings.tokens_file or ""))
    registry, transport = state.registry, state.transport
    waiting = [0]  # claims parked at the ledger from this replica now (MAX_WAITING_CLAIMS)

    async def offload(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # Store calls block on sockets and the codec on memory; keep the event loop free.
        return await asyncio.to_thread(fn, *args, **kwargs)

    @api.exception_handler(E.RlplaneError)
    async def _typed_error(_: Request, err: E.RlplaneError) -> JSONResponse:
        code = status_of(err)
        headers = {"WWW-Authenticate": "Bearer"} if code == 401 else None
        return JSONResponse(E.error_payload(err), status_code=code, headers=headers)

    @api.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, err: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes the offending input, which may not be JSON at all (a
        # float infinity): answer with where and what, never the value.
        detail = [{"loc": [str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
                  for e in err.errors()]
        where = "; ".join(f"{'.'.join(d['loc'])}: {d['msg']}" for d in detail[:5])
        return JSONResponse({"error": "InvalidArgumentError", "message": f"invalid request: {where}", "detail": detail},
                            status_code=422)

    async def caller(request: Request) -> Access:
        """Who the request comes from (its bearer token's scope); 401 without a known token."""
        who = tenants.lookup_header(request.headers.get("authorization", ""))
        if who is None:
            raise _unauthorized()
        return who

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(caller)])

    # -- health ----------------------------------------------------------------------
    @api.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """The process answers (liveness)."""
        return {"status": "ok"}

    def probe() -> tuple[int, dict[str, Any]]:
        """What /readyz answers: (status code, body). Blocking; see ``probes``."""
        body: dict[str, Any] = {}
        if state.mooncake is not None:
            body["mooncake_master"] = {k: state.mooncake[k] for k in ("master_address", "metrics_url") if k in state.mooncake}
        try:
            components = state.health()
            body["components"] = components
            if any(not ok and "rebuilding" in name for name, ok in components.items()):
                progress = state.recovering()
                return 503, {"status": "recovering", "reason": "the controller restarted and is rebuilding its index "
                             "from the storage units; calls wait for it (up to their timeout)",
                             "progress": progress or {}, **body}
            down = sorted(name for name, ok in components.items() if not ok)
            if not down:
                transport.partitions()
        except E.RlplaneError as err:
            return 503, {"status": "not ready", "reason": str(err) or type(err).__name__, **body}
        if down:
            loss = _loss(transport, down)
            if loss is not None:  # every sample still has a live copy: serving, with fewer copies
                return 200, {"status": "degraded", "reason": f"not answering: {', '.join(down)}; every sample still "
                             f"has a copy ({loss['under_replicated_samples']} under-replicated)", **body}
            return 503, {"status": "not ready", "reason": f"not answering: {', '.join(down)}", **body}
        return 200, {"status": "ready", **body}

    probes = ScrapeCache(probe, ttl=READY_TTL_S)  # a flood of probes costs one store round per READY_TTL_S

    @api.get("/readyz", tags=["health"])
    async def readyz() -> JSONResponse:
        """Ready only when the store answers: every component (controller, storage units,
        the Mooncake master's /health) responds and a listing round-trips. Probed at most
        once a second; concurrent probes share the answer."""
        try:
            code, body = await asyncio.wait_for(probes.get(), timeout=15.0)
        except asyncio.TimeoutError:
            return JSONResponse({"status": "not ready", "reason": "the store did not answer within 15 s"}, status_code=503)
        return JSONResponse(body, status_code=code)

    def _loss(transport: Any, down: list[str]) -> dict[str, Any] | None:
        """The engine's loss counts when only storage units are down and no sample was
        lost (the store serves on from the other copies); else None."""
        if "controller" in down:
            return None
        try:
            stats = state.engine_stats()
        except E.RlplaneError:
            return None
        if stats is None:
            return None
        declared = set(stats.get("lost_units", []))
        if stats.get("lost_samples", 1) or not set(down) <= declared or len(declared) >= len(stats.get("units", {})):
            return None  # samples were lost, the controller has not yet settled what a unit took, or none is left
        return stats

    def scrape() -> bytes:
        view = store_view(
            state.sizes,
            backend=str(state.transport_info.get("backend", transport.name)),
            unit_names=list(state.transport_info.get("storage_units", {})),
            health=state.health(),
            capacity=state.settings.capacity,
            engine_stats=state.engine_stats,
            mooncake_metrics_url=(state.mooncake or {}).get("metrics_url"),
            streams=state.streams,
            loss=state.loss,
        )
        view.snapshot_interval_s = float(state.settings.snapshot_interval_s)
        return render(state.ledger.snapshot(), view)

    scrapes = ScrapeCache(scrape)

    @api.get("/metrics", tags=["health"])
    async def metrics() -> Response:
        """Prometheus metrics (text format): ops, bytes, latencies and errors of every
        replica and tq client, and what the store holds now. Open like /healthz; read on
        a thread of its own, at most once per second (a scrape sees every op done >= 1 s
        before it)."""
        return Response(await scrapes.get(), media_type=CONTENT_TYPE_LATEST)

    @asynccontextmanager
    async def observed(op: str) -> AsyncIterator[dict[str, Any]]:
        """Count one HTTP data-path op in the ledger (set ``["nbytes"]`` on the yielded dict);
        the answer goes out once it is counted, so a scrape after it sees it."""
        event: dict[str, Any] = {"op": op, "transport": "http", "nbytes": 0, "error": None}
        start = time.perf_counter()
        try:
            yield event
        except BaseException as err:
            event["error"] = failure(op, err)
            raise
        finally:
            event["seconds"] = time.perf_counter() - start
            await _counted(state.ledger.record([event]))

    # -- registry --------------------------------------------------------------------
    @v1.get("/registry", tags=["registry"])
    async def get_registry() -> dict[str, Any]:
        """Every declared field and the registry's version (a content hash)."""
        return {"version": registry.version, **registry.to_dict()}

    @v1.get("/registry/stages/{stage}", tags=["registry"])
    async def stage_fields(stage: str, partition: Optional[str] = Query(None),
                           who: Access = Depends(caller)) -> dict[str, Any]:
        """The fields ``stage`` reads: its required fields, plus its optional fields present in ``partition``."""
        present = None
        if partition is not None:
            who.check(partition, write=False)
            present = set((await offload(transport.describe, partition)).fields)
        return {"stage": stage, "partition": partition, "fields": registry.fields_for_stage(stage, present)}

    # -- partitions ------------------------------------------------------------------
    @v1.get("/partitions", tags=["partitions"])
    async def list_partitions(who: Access = Depends(caller)) -> dict[str, Any]:
        """Every partition holding samples (of those the caller's token may see), with sample
        count, fields present and bytes."""
        names = [n for n in await offload(transport.partitions) if who.sees(n)]
        out = []
        for name in names:
            try:
                out.append(_info(await offload(transport.describe, name)))
            except E.MissingDataError:  # cleared between the two calls
                continue
        return {"partitions": out}

    @v1.get("/partitions/{partition}", tags=["partitions"])
    async def describe(partition: str, who: Access = Depends(caller)) -> dict[str, Any]:
        """One partition: its samples, how many hold each field, stored bytes."""
        who.check(partition, write=False)
        info = await offload(transport.describe, partition)
        return {**_info(info), "sample_ids": info.sample_ids}

    @v1.delete("/partitions/{partition}", tags=["partitions"])
    async def delete_partition(partition: str, who: Access = Depends(caller)) -> dict[str, Any]:
        """Drop every sample of the partition."""
        who.check(partition, write=True)
        async with observed("delete_partition"):
            return {"partition": partition, "cleared": await offload(transport.clear, partition, None)}

    @v1.post("/partitions/{partition}/clear", tags=["partitions"])
    async def clear_samples(partition: str, body: ClearRequest, who: Access = Depends(caller)) -> dict[str, Any]:
        """Drop the given samples of the partition."""
        who.check(partition, write=True)
        async with observed("clear"):
            return {"partition": partition, "cleared": await offload(transport.clear, partition, body.sample_ids)}

    # -- streaming -------------------------------------------------------------------
    def ledger() -> Any:
        streams = transport.streams
        if not isinstance(streams, DirectStreams):  # an in-process transport (MemoryTransport) keeps none
            raise E.TransportError("this store keeps no consumption ledger; claims need the native, simple or "
                                   "mooncake backend")
        return streams

    @v1.post("/partitions/{partition}/claim", tags=["streaming"])
    async def claim(partition: str, body: ClaimBody, who: Access = Depends(caller)) -> Response:
        """Claim up to ``batch_size`` ready samples for ``task`` (exactly once per task, oldest
        first), or with ``max_tokens`` whole samples (groups) while their lengths fit, waiting
        up to ``timeout`` s: the answer names the samples, their tags and the lease to ack
        (and with a budget ``tokens`` and ``over_budget``). 408 NotReadyError when fewer than ``min_batch`` were ready in time.
        A waiting claim holds no server thread."""
        async with observed("claim"):
            check_partition(partition)
            who.check(partition, write=False)
            req = ClaimRequest.build(registry, partition, body.task, body.batch_size, stage=body.stage,
                                     fields=body.fields, timeout=body.timeout, min_batch=body.min_batch,
                                     group_key=body.group_key, current_version=body.current_version,
                                     max_staleness=body.max_staleness, lease_s=body.lease_s,
                                     max_tokens=body.max_tokens, min_tokens=body.min_tokens,
                                     unfinished=body.unfinished)
            crowded = req.wait_s > 0 and waiting[0] >= MAX_WAITING_CLAIMS
            if crowded:  # it asks once, without waiting: the replica's request slots stay for puts and reads
                req = dataclasses.replace(req, wait_s=0.0)
            waiting[0] += req.wait_s > 0
            try:
                out = await _kept_if_abandoned(
                    ledger().acall({"op": "claim", **req.to_header()}, req.wait_s),
                    lambda got: ledger().acall({"op": "nack", "p": partition, "task": body.task,
                                                "lease": got["lease"], "ids": None}))
            except E.NotReadyError as err:
                if crowded:
                    raise E.NotReadyError(f"{err} ({MAX_WAITING_CLAIMS} claims wait at this replica already: this "
                                          "one did not wait; ask again)") from None
                raise
            finally:
                waiting[0] -= req.wait_s > 0
        answer = {"partition": partition, "task": body.task, "lease": out["lease"], "lease_s": out["lease_s"],
                  "sample_ids": out["ids"], "tags": out["tags"], "fields": out["fields"],
                  **{k: out[k] for k in ("tokens", "over_budget", "born", "some_fields") if k in out}}
        try:  # (the ledger leased the batch already: an answer that cannot be sent must give it back)
            return Response(json.dumps(answer, allow_nan=False).encode(), media_type="application/json")
        except (TypeError, ValueError) as err:  # tags an earlier release stored (NaN, bytes) that JSON cannot carry
            await ledger().acall({"op": "nack", "p": partition, "task": body.task, "lease": out["lease"], "ids": None})
            raise E.WireFormatError(f"a claimed sample's tags cannot travel as JSON ({err}); the batch was given back: "
                                    "claim it over a direct transport (transport='direct')") from None

    async def settle(verb: str, partition: str, body: LeaseBody) -> int:
        async with observed(verb):
            out = await ledger().acall({"op": verb, "p": partition, "task": body.task, "lease": body.lease,
                                        "ids": body.sample_ids})
        return int(out[f"{verb}ed"])

    @v1.post("/partitions/{partition}/ack", tags=["streaming"])
    async def ack(partition: str, body: LeaseBody, who: Access = Depends(caller)) -> dict[str, Any]:
        """Mark a lease's samples consumed by the task (409 LeaseError once the lease expired)."""
        who.check(partition, write=False)
        return {"acked": await settle("ack", partition, body)}

    @v1.post("/partitions/{partition}/nack", tags=["streaming"])
    async def nack(partition: str, body: LeaseBody, who: Access = Depends(caller)) -> dict[str, Any]:
        """Give a lease's samples back to the task at once."""
        who.check(partition, write=False)
        return {"nacked": await settle("nack", partition, body)}

    @v1.get("/partitions/{partition}/consumption", tags=["streaming"])
    async def consumption(partition: str, task: str = Query(..., min_length=1, max_length=200),
                          who: Access = Depends(caller)) -> dict[str, Any]:
        """How ``task`` stands: samples, ready, claimed, acked, expired, pending, redelivered."""
        who.check(partition, write=False)
        out = await ledger().acall({"op": "consumption", "p": partition, "task": task})
        return {k: out[k] for k in ("samples", "ready", "claimed", "acked", "expired", "pending", "redelivered")}

    # -- data path -------------------------------------------------------------------
    @v1.get("/transport", tags=["data"])
    async def transport_description(who: Access = Depends(caller)) -> dict[str, Any]:
        """How a client reaches the data path: the store's direct address (``native`` or ``tq``,
        by backend; ``native`` carries the data-path credential, a tenant's its own) and the
        HTTP fallback (a tenant's only path on the TransferQueue-based backends)."""
        if who.full:
            direct = state.transport_info or None
        else:
            direct = state.transport_for(who) if state.transport_for is not None else None
        return {
            "version": rlplane.__version__,  # a client of another release refuses to go on (VersionMismatchError)
            "registry_version": registry.version,
            "backend": state.transport_info.get("backend", transport.name),
            state.publish_key: direct,
            "http": {"put": "/v1/data/{partition}/put", "get": "/v1/data/{partition}/get",
                     "content_type": CONTENT_TYPE, "max_request_bytes": state.settings.max_request_bytes},
        }

    @v1.post("/data/{partition}/put", tags=["data"])
    async def put(partition: str, request: Request, create: bool = Query(True), durable: bool = Query(False),
                  aligned: bool = Query(False), who: Access = Depends(caller)) -> dict[str, Any]:
        """Store encoded columns (body: rlplane envelope with ``sample_ids`` and ``tags``).

        Checked against the registry first; a body that fails stores nothing. ``durable``:
        answered once the put is in the journal on disk (native with RLPLANE_JOURNAL_DIR).
        ``aligned`` (a write of stored samples): token rows of another length than their
        sample's are a 422 ShapeError naming the field and sample; with the header's
        ``grown_from`` (an extend: each sample's length as it read it) the rows grow
        instead, and leaving out a token field a sample holds, or growing a sample another
        extend grew since, is that 422.
        """
        async with observed("put_samples" if create else "write_columns") as event:
            check_partition(partition)
            who.check(partition, write=True)
            body = await _read_body(request, state.settings.max_request_bytes)
            (stored, event["nbytes"]), born = await offload(_check_and_store, registry, transport, partition, body,
                                                            create, durable, aligned and not create,
                                                            state.settings.max_request_bytes, event)
        return {"partition": partition, "stored": stored, "nbytes": len(body), **({"born": born} if born else {})}

    @v1.post("/data/{partition}/get", tags=["data"])
    async def get(partition: str, body: GetRequest, who: Access = Depends(caller)) -> Response:
        """Every requested (sample, field) as an rlplane envelope, or 404 naming what is missing."""
        who.check(partition, write=False)
        async with observed("read_columns") as event:
            for name in body.fields:
                registry.get(name)
            if body.born is not None and len(body.born) != len(body.sample_ids):
                raise E.ShapeError(f"{len(body.born)} incarnations for {len(body.sample_ids)} samples")
            more: dict[str, Any] = {"shared": True} if body.shared and transport.shares_rows else {}
            if body.born is not None and transport.checks_born:
                more["born"] = np.asarray(body.born, np.int64)
            if body.probe and transport.probes_fields:
                more["probe"] = body.probe
            columns, tags = await offload(transport.get, partition, body.sample_ids, body.fields, **more)
            parts = await offload(pack_parts, {"tags": list(tags)}, columns)
            event["nbytes"] = sum(col.nbytes for col in columns.values())
        # Streamed in pieces: no joined copy of the whole answer in fresh memory.
        size = sum(len(p) for p in parts)
        return StreamingResponse(_chunks(parts), media_type=CONTENT_TYPE, headers={"Content-Length": str(size)})

    @v1.post("/snapshot", tags=["data"])
    async def take_snapshot(body: SnapshotBody, who: Access = Depends(caller)) -> dict[str, Any]:
        """A consistent snapshot of the whole store into the new directory ``path`` on the
        service's host (a shared filesystem for another host to restore it): see
        :mod:`rlplane.snapshot`. Full access only; writes and claims go on meanwhile."""
        if not who.full:
            raise E.ForbiddenError("a tenant's token may not snapshot the whole store")
        async with observed("snapshot") as event:
            info = await offload(snapshot.take, transport, snapshot_path(state.settings.snapshot_dir, body.path))
            event["nbytes"] = info.nbytes
        state.last_snapshot = info.to_dict()
        return info.to_dict()

    @v1.post("/metrics/report", tags=["status"])
    async def report_ops(body: OpsReport) -> dict[str, Any]:
        """Ops a tq client did straight against the store, for ``/metrics`` (see ``Client.report_ops``)."""
        events = [e.model_dump() for e in body.events]
        await _counted(state.ledger.record(events))
        return {"received": len(events)}

    @v1.get("/status", tags=["status"])
    async def status(who: Access = Depends(caller)) -> dict[str, Any]:
        """Registry version, store layout, partitions and bytes (what ``rlplane status`` prints;
        a tenant sees its own partitions and tasks)."""
        parts = (await list_partitions(who))["partitions"]
        info = state.transport_info or {}
        streams = await offload(state.streams) if state.streams is not None else {"tasks": []}
        streams = {**streams, "tasks": [t for t in streams.get("tasks", []) if who.sees(str(t.get("partition")))]}
        return {
            "version": rlplane.__version__,
            "registry_version": registry.version,
            "fields": len(registry.names()),
            "store": {
                "backend": info.get("backend", transport.name),
                "storage_units": len(info.get("storage_units", {})),
                "capacity": state.settings.capacity,
                **({"mooncake_master": state.mooncake} if state.mooncake is not None else {}),
            },
            "partitions": parts,
            "samples": sum(p["num_samples"] for p in parts),
            "nbytes": sum(p["nbytes"] for p in parts),
            "consumption": streams.get("tasks", []),
            **({"loss": loss} if (loss := await loss_counts()) is not None else {}),
            **({"memory": memory} if (memory := await unit_memory()) else {}),
            **({"sharing": sharing} if (sharing := await rows_shared()) else {}),
            "uptime_s": round(time.time() - state.started, 1),
        }

    async def unit_memory() -> dict[str, Any]:
        """Each storage unit's slab (bytes total, used, free, largest hole, fragmentation),
        where the engine keeps slabs."""
        stats = await offload(state.engine_stats)
        if stats is None:
            return {}
        return {u: d["slab"] for u, d in stats.get("units", {}).items() if isinstance(d.get("slab"), dict)}

    async def rows_shared() -> dict[str, int] | None:
        """Bytes the samples hold as written, stored and shared, where the store keeps rows
        identical across samples once (native)."""
        stats = await offload(state.engine_stats)
        if stats is None or "written_bytes" not in stats:
            return None
        return sharing_of(stats)

    async def loss_counts() -> dict[str, Any] | None:
        """Samples lost with dead storage units, the units, and (native) samples short of
        their replicas; None where the service has no loss to report (an in-process API)."""
        if state.loss is not None:
            return await offload(state.loss)
        stats = await offload(state.engine_stats)
        if stats is None:
            return None
        return {k: stats.get(k) for k in ("lost_samples", "lost_units", "under_replicated_samples")}

    api.include_router(v1)
    api.add_middleware(Guard, tenants=tenants, limit=state.settings.max_request_bytes,
                       json_limit=min(state.settings.max_json_bytes, state.settings.max_request_bytes))
    return api


#: The most claims one replica lets wait at once. A waiting claim holds no thread but one of
#: the replica's request slots (Serve's max_ongoing_requests, 256 in rlplane_service.app):
#: past this many, a claim asks once without waiting, so puts and reads always find a slot
#: (trainer ranks waiting on claims must not queue the rollout's puts they wait for).
MAX_WAITING_CLAIMS = 192

_ABANDONED: set[asyncio.Task] = set()  # claims whose caller left while they waited: given back once they land


async def _kept_if_abandoned(call: Any, give_back: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """``await call``; if the awaiting request is cancelled first (its HTTP client went
    away: Serve cancels the handler), the call still runs to its answer, and what it
    leased is handed to ``give_back`` (a nack): a batch leased to nobody would wait out
    its lease (300 s by default) before another claim could have it."""
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        async def settle() -> None:
            try:
                got = await task
            except Exception:  # noqa: BLE001 - nothing leased, nothing to give back
                return
            try:
                await give_back(got)
            except Exception:  # noqa: BLE001 - the lease lapses on its own
                log.warning("could not give back a claim whose caller left; it lapses with its lease", exc_info=True)

        done = asyncio.ensure_future(settle())
        _ABANDONED.add(done)
        done.add_done_callback(_ABANDONED.discard)
        raise


class Guard:
    """Raw ASGI middleware: refuse a ``/v1`` request without the right token, and any body
    announced over the limit, *before* a byte of the body is read (FastAPI reads the body
    before its dependencies run). The route's own ``authorize`` check stays as a second line.
    ``limit``: a data put's body (the binary envelope); ``json_limit``: every other body
    (JSON, which takes tens of times its bytes once parsed)."""

    def __init__(self, app: Any, *, tenants: Tenants, limit: int, json_limit: int | None = None) -> None:
        self.app, self.data_limit, self.tenants = app, limit, tenants
        self.json_limit = limit if json_limit is None else json_limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if path.startswith("/v1") and self.tenants.lookup_header(headers.get(b"authorization", b"")) is None:
            return await _refuse(send, 401, _unauthorized(), {"WWW-Authenticate": "Bearer"})
        data = path.startswith("/v1/data/") and path.endswith("/put")
        limit = self.data_limit if data else self.json_limit
        declared = headers.get(b"content-length", b"")
        if declared.isdigit():  # (the server delivers no more than it says)
            if int(declared) > limit:
                return await _refuse(send, 413, _too_big(limit, data))
            return await self.app(scope, receive, send)
        # A body of unknown length (chunked): counted as it comes, and refused once over the
        # limit; the app then sees the client gone and answers nothing (FastAPI reads a JSON
        # body whole itself: 77 MiB chunked to /clear cost 0.5 GB against a 1 MiB limit).
        got, refused = 0, False

        async def counted() -> dict:
            nonlocal got, refused
            message = await receive()
            if message.get("type") == "http.request" and not refused:
                got += len(message.get("body", b""))
                if got > limit:
                    refused = True
                    await _refuse(send, 413, _too_big(limit, data))
                    return {"type": "http.disconnect"}
            return message

        async def answer(message: dict) -> None:
            if not refused:
                await send(message)

        return await self.app(scope, counted, answer)


def _unauthorized() -> E.AuthenticationError:
    return E.AuthenticationError(
        "this rlplane service needs 'Authorization: Bearer <token>'; "
        "pass token= to rlplane.connect (or set RLPLANE_API_TOKEN)"
    )


def _too_big(limit: int, data: bool = True) -> E.PayloadTooLargeError:
    if not data:
        return E.PayloadTooLargeError(
            f"request body is over this service's limit of {limit} bytes for JSON requests; name fewer samples per "
            "call (or raise RLPLANE_MAX_JSON_BYTES), or use a direct transport (transport='direct')"
        )
    return E.PayloadTooLargeError(
        f"request body is over this service's limit of {limit} bytes; put fewer samples per call "
        "(or raise RLPLANE_MAX_REQUEST_BYTES), or use a direct transport (transport='direct')"
    )


async def _refuse(send: Any, code: int, err: E.RlplaneError, headers: dict[str, str] | None = None) -> None:
    """Answer with the typed error's JSON without reading the request body."""
    body = json.dumps(E.error_payload(err)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"connection", b"close")] + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": code, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def snapshot_path(root: Optional[Path], given: str) -> Path | str:
    """Where a snapshot asked for over HTTP goes: inside ``root`` (RLPLANE_SNAPSHOT_DIR)
    when the service has one (InvalidArgumentError for a path outside it, or a URL), else
    ``given`` (a path, or an fsspec URL the service's credentials may write)."""
    from rlplane.snapplace import is_url

    if "\0" in given:
        raise E.InvalidArgumentError("a snapshot path cannot hold a NUL character")
    if is_url(given):
        if root is not None:
            raise E.InvalidArgumentError(f"{given!r} is a URL and this service writes snapshots only inside its "
                                         f"snapshot directory {root} (RLPLANE_SNAPSHOT_DIR): name a directory inside it")
        return given
    path = Path(given[len("file://"):] if given.startswith("file://") else given)
    if root is None:
        return path
    root = root.resolve()
    path = (root / path).resolve()
    if path != root and root not in path.parents:
        raise E.InvalidArgumentError(f"{given!r} is outside this service's snapshot directory {root} "
                                     "(RLPLANE_SNAPSHOT_DIR): name a directory inside it")
    return path


def births(born: Any, n: int, key: str = "born", what: str = "one incarnation") -> np.ndarray:
    """A put header's ``born`` (or ``key``): ``n`` ints in [0, 2**62) as int64, or WireFormatError."""
    try:
        arr = np.asarray(born, np.int64) if isinstance(born, list) else None
    except (TypeError, ValueError, OverflowError):
        arr = None
    if arr is None or arr.shape != (n,) or (n and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 62)):
        raise E.WireFormatError(f"put {key!r} must be {what} (an int in [0, 2**62)) per sample")
    return arr


def _check_and_store(
    registry: Registry, transport: Transport, partition: str, body: np.ndarray | bytearray, create: bool,
    durable: bool = False, check_lengths: bool = False, limit: int | None = None, event: dict | None = None,
) -> tuple[int, int]:
    """Parse, check and store one put body; returns ((samples, column bytes), the
    incarnation a create gave its samples or None). Parsing and checking touch every byte,
    so this runs off the event loop, with the store call. The header's ``born`` (a write:
    each sample's incarnation as the writer's meta names it) goes to a store that checks it.
    ``event``: the op being counted, named ``extend`` when the body is one."""
    header, columns = unpack(body)
    ids, tags = header.get("sample_ids"), header.get("tags")
    if (
        not isinstance(ids, list)
        or not isinstance(tags, list)
        or not all(isinstance(s, str) for s in ids)
        or not all(isinstance(t, dict) for t in tags)
    ):
        raise E.WireFormatError("put needs 'sample_ids' (list of str) and 'tags' (list of dicts) in the header")
    for name in columns:  # an unregistered column is named first (UnregisteredFieldError), then the tags
        registry.get(name)
    check_written_tags(tags, ids, columns)  # (what every store keeps and every transport hands back)
    check_columns(registry, columns, tags, sample_ids=ids)
    if not transport.shares_rows:  # a store that keeps every copy: the rows a client sent once, copied out
        _within(columns, limit)
        columns = {name: col.expanded() for name, col in columns.items()}
    if durable and not transport.durable_puts:
        raise E.InvalidArgumentError(f"durable=True needs the native backend with a journal "
                                     f"(RLPLANE_JOURNAL_DIR); this service stores on {transport.name!r}")
    extra = {"durable": True} if durable else {}
    if check_lengths:
        grown = header.get("grown_from")
        read = None if grown is None else births(grown, len(ids), "grown_from", "the length the extend read")
        if read is not None and event is not None:
            event["op"] = "extend"  # (as a direct client's extend counts itself)
        extra.update(length_check(registry, transport, grows=read, read_sums=_read_sums(header, columns, len(ids))))
    born = header.get("born")
    if born is not None:
        arr = births(born, len(ids))
        if transport.checks_born:
            extra["born"] = arr
    got = transport.put(partition, ids, columns, tags, create=create, **extra)
    return (len(ids), sum(col.nbytes for col in columns.values())), got if type(got) is int else None


def _read_sums(header: Mapping[str, Any], columns: Mapping[str, Column], n: int) -> dict[str, np.ndarray] | None:
    """An extend's ``read_sums``: per field it writes, the digests of the ``n`` rows it read
    (uint64 bytes), or WireFormatError."""
    raw = header.get("read_sums")
    if raw is None:
        return None
    if not isinstance(raw, dict) or not set(raw) <= set(columns) or \
            not all(isinstance(v, bytes) and len(v) == 8 * n for v in raw.values()):
        raise E.WireFormatError("an extend's 'read_sums' must map fields it writes to their rows' digests "
                                "(uint64 bytes, one per sample)")
    return {f: np.frombuffer(v, "<u8") for f, v in raw.items()}


def _within(columns: Mapping[str, Column], limit: int | None) -> None:
    """PayloadTooLargeError when the rows a put sent once for several samples would, copied
    out for each (a store that keeps every copy), come to more than ``limit`` bytes: a
    small body naming one row many times cannot make the service allocate any amount."""
    if limit is None:
        return
    total = 0
    for col in columns.values():
        if col.same is None:
            total += col.nbytes
            continue
        sizes = col.row_numels().numpy() * col.values.element_size()
        total += col.nbytes + int(sizes[col.same[col.same >= 0]].sum())
    if total > limit:
        raise E.PayloadTooLargeError(f"the put's rows come to {total} bytes once the rows it shares are copied out for "
                                     f"each sample, over this service's limit of {limit} (max_request_bytes; its store "
                                     "keeps every copy): send fewer samples per put")


async def _chunks(parts: list[Any], chunk: int = 4 << 20) -> AsyncIterator[bytes]:
    """The answer in pieces of at most ``chunk`` bytes. Bytes, not views: Ray Serve pickles
    each streamed piece on its way to the proxy, and a memoryview does not pickle."""
    for view in chunked(parts, chunk):
        yield bytes(view)


async def _counted(pending: Any) -> None:
    """Wait for a ledger record when it is asynchronous (the Ray actor's ObjectRef);
    metrics never fail a request."""
    if pending is None or not inspect.isawaitable(pending):
        return
    try:
        await asyncio.wait_for(pending, timeout=5.0)
    except Exception as err:  # noqa: BLE001 - a lost count must not fail the caller's op
        log.warning("an op was not counted in the metrics ledger: %s", err)


async def _read_body(request: Request, limit: int) -> np.ndarray | bytearray:
    """The request body as a writable buffer; 413 (PayloadTooLargeError) past ``limit`` bytes.

    A body that declares its length lands in memory of the process's read pool, each piece
    copied once into place: pages an earlier body faulted in, reused once nothing refers to
    that body. A growing ``bytearray`` (what a body without a length gets) copies what it
    holds at every regrowth, into fresh pages: a 168 MB vlm-step put through the service
    took 466-501 ms that way, 338-355 ms this way (``rlplane bench -p rlplane-http``).
    """
    declared = request.headers.get("content-length")
    size = int(declared) if declared is not None and declared.isdigit() else None
    if size is not None and size > limit:
        raise _too_big(limit)
    if size is None:
        grown = bytearray()
        async for chunk in request.stream():
            grown += chunk
            if len(grown) > limit:
                raise _too_big(limit)
        return grown
    body = ReadPool.shared().take(size)
    into, at = memoryview(body), 0
    async for chunk in request.stream():
        if at + len(chunk) > size:
            raise E.WireFormatError(f"the request body is longer than the {size} bytes its Content-Length declares")
        into[at : at + len(chunk)] = chunk
        at += len(chunk)
    if at != size:
        raise E.WireFormatError(f"the request body ended after {at} of the {size} bytes its Content-Length declares")
    return body
