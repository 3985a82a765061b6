"""NativeTransport: columns straight to rlplane's own storage engine.

The service's native store is a controller (the sample index) and storage units (the
bytes, as columnar blocks in each unit's slab). This transport talks to both directly,
with nothing but the addresses and the data secret that ``GET /v1/transport`` hands out
under the API token: no Ray, no pickle. ZMQ carries control; bulk bytes take one of two
*data paths* per unit (``data_path``, ``RLPLANE_DATA_PATH``):

- ``shm``: the unit is on this host and its slab is mapped here (:mod:`rlplane.shm`):
  a put copies each field's values straight into extents the unit allocated, a read
  copies rows out at the addresses the controller located (or, ``copy=False``, returns
  views of the slab). One memcpy each way, no socket.
- ``te``: the unit is on another host and registered its slab with Mooncake's transfer
  engine (the service's RLPLANE_TE_PROTOCOL): a put writes each block copy's values
  into the extents the unit allocated with one batched one-sided transfer, a read fetches
  a unit's rows (every field) with one batched one-sided read, both through this
  process's registered staging buffer (:mod:`rlplane.te`).
- ``zmq``: the values travel as frames to and from the unit, which copies them into
  (or gathers them out of) its slab.

``auto`` (default) maps every unit it can, reaches the others over their transfer
engines where they run one, and uses ``zmq`` for the rest; ``shm`` fails unless every
unit can be mapped; ``te`` uses the transfer engine for every unit (even one on this
host) and fails unless each runs one; ``zmq`` uses neither. Messages per put or read: one to
the controller, one per storage unit involved, one more to the controller; never one
per sample.

- ``put``: reserve the ids (atomic: concurrent puts of the same new ids, exactly one
  wins) while the blocks travel to (or are allocated on) their units, then commit.
  Anything failing in between aborts the reservation; nothing is visible until the
  commit. With a local unit a put is one block whose first copy is local, and its big
  fields are encoded straight into extents that unit staged (:meth:`put_buffers`): the
  pixels' cast to bfloat16 writes the slab, with no buffer and no copy after.
- ``get``: locate the rows (the controller pins their blocks), read each unit's share
  (one column per field, or one vectorized copy out of the mapped slab), put the rows
  back in the order asked, unpin. Every (sample, field) or MissingDataError. Rows land
  in buffers of a :class:`~rlplane.readpool.ReadPool`: memory the caller owns, reused
  once the caller drops it. A read too big for one locate goes in pieces (see :meth:`get`).

Every call has a deadline (``timeout``); a unit that died raises UnavailableError within
seconds (see :mod:`rlplane.channel`).

Example::

    t = NativeTransport(api.json("GET", "/v1/transport")["native"], timeout=60)
    t.put("step-0", ids, enc.columns, enc.tags, create=True)
"""

from __future__ import annotations

import collections
import logging
import math
import os
import secrets
import socket
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Collection, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from rlplane.channel import PLAIN_USER, Channel, SharedChannels, peer_down, ride
from rlplane.placement import spread
from rlplane.column import Column
from rlplane.dtypes import dtype_from_name, dtype_name
from rlplane.geometry import Geometry
from rlplane.errors import (ForbiddenError, InvalidArgumentError, LeaseError, MissingDataError, PayloadTooLargeError,
                            RlplaneError, ShapeError, StorageFullError, TransportError, UnavailableError,
                            WireFormatError)
from rlplane.readpool import ReadPool
from rlplane.scratch import Alloc
from rlplane.shm import SlabView, privatize, shared_slab
from rlplane.te import DEFAULT_STAGING_BYTES, PoolSpec, RemoteSlab, local_address
from rlplane.transports.base import PartitionInfo, Transport, check_put, sharing_of
from rlplane.streams import DirectStreams
from rlplane.tags import RESERVED_TAG_PREFIX, SUM_TAG, WIRE_TAG, RowTags
from rlplane.copies import copy as _copy
from rlplane.copies import copy_ranges
from rlplane.gather import BIG_RUN as _BIG_RUN
from rlplane.gather import MAX_RUNS as _MAX_RUNS
from rlplane.integrity import check_rows, copied_sums
from rlplane.wire import RawColumn, check_same, int_array, ints, numpy_dtype, raw

log = logging.getLogger(__name__)

#: Keys every reply header carries besides the operation's answer.
_ENVELOPE_KEYS = {"ok", "rid", "v", "c", "nbuf"}
#: Rows of one put go to one unit until the put is this big; then they are split over units.
CHUNK_BYTES = 8 << 20
#: How long an abort of a failed put may take before the reservation is left to lapse.
_ABORT_TIMEOUT_S = 5.0
#: Most row keys one ``held`` lookup asks the controller about (its MAX_HELD_KEYS).
_HELD_KEYS = 1 << 16
#: How often a client that places around down or suspect units asks which they are now.
_DOWN_REFRESH_S = 5.0
#: How often the pins of live zero-copy views are renewed at most (at a third of the lease
#: when that is shorter). A restarted controller frees nothing for three of these
#: (rlplane_service.native.pins.RESTART_HOLD_S), for the renewals to take the pins up again.
RENEW_EVERY_S = 5.0
#: Most bytes of block ids one renewal that names them carries (well under the 16 MiB message limit).
_TAKE_UP_BYTES = 4 << 20
#: The data paths a client may ask for (see the module docstring).
DATA_PATHS = ("auto", "shm", "te", "zmq")
#: A put of at most this many bytes of rows goes in one message to the controller, which hands
#: the rows to their units with the put's commit-log record (one round trip where a bigger put
#: makes two: the units' extents, then the commit). The controller takes up to 1 MiB.
ONE_MESSAGE_BYTES = 256 << 10
#: A field at least this big is encoded straight into an extent staged in a mapped slab
#: (for a smaller one the staging round trip costs more than the copy it saves).
STAGE_MIN_BYTES = 1 << 20
#: Most (sample, field) pairs one locate answers (~55 bytes each in its answer: ~14 MiB, under
#: the engine's 16 MiB message limit); a bigger read goes in pieces (and one whose samples' tags
#: make its answer too big anyway, in halves).
#: Of its reservation's lease, how much a put may take before copying its rows into the
#: units' extents; past it the put fails (LeaseError) rather than copy into blocks the
#: controller may have given up on and another put been given (a process stalled).
COPY_WITHIN = 0.8
READ_CELLS = 1 << 18
#: Most bytes of sample ids one locate names (its request stays under the message limit).
READ_ID_BYTES = 8 << 20
#: A field lent to a read that copies it out itself (``get(lend=...)``) is lent from this size
#: on: below it, holding the views' pin costs about what the copy saves.
LEND_MIN_BYTES = 1 << 20
#: Most runs :meth:`NativeTransport.slab_runs` hands out (each is one write of its user): rows
#: scattered wider than this are copied out by :meth:`NativeTransport.fetch`, vectorized.
MAX_SLAB_RUNS = 4096
_ALIGN = 64  # each field's rows start on a cache line in a small read's one buffer


def reachable(info: Mapping[str, Any], timeout: float = 1.0) -> bool:
    """Whether the controller and a storage unit accept a TCP connection within ``timeout``
    (a unit the store lost does not make the store unreachable: the transport learns from
    the controller which units are down and reads their blocks' other copies)."""

    def accepts(endpoint: str) -> bool:
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                return True
        except OSError:
            return False

    try:
        return accepts(info["controller"]) and any(accepts(u[1]) for u in info["units"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        return False


class NativeTransport(Transport):
    """Direct data path to the native engine (see the module docstring)."""

    name = "native"
    counts_waits = True  # (rlplane.channel counts them)
    direct = True
    durable_puts = True  # the controller answers InvalidArgumentError without a journal
    shares_rows = True  # a row several samples share is stored once and read once (Column.same)
    checks_lengths = True  # a write's token rows are checked against the sample's length (put(aligned=))
    checks_rewrites = True  # an extend's commit checks the digests of the rows it read (put(read_sums=))
    checks_born = True  # a meta naming samples cleared and put again since is refused (put/get(born=))
    lends_views = True  # a padded read's token rows are padded out of the slab, not copied first (get(lend=))
    verifies_reads = True  # rows copied out of a slab are digested as they are copied (get(verified=))
    probes_fields = True  # the locate looks for fields a stale meta does not list (get(probe=))

    def __init__(self, info: Mapping[str, Any], *, timeout: float = 60.0, data_path: str = "auto",
                 pool: ReadPool | None = None, te: TeOptions | None = None) -> None:
        if data_path not in DATA_PATHS:
            raise InvalidArgumentError(f"data_path must be one of {DATA_PATHS}, got {data_path!r}")
        try:
            self.controller = str(info["controller"])
            secret = info.get("secret")
            user = str(info.get("user") or PLAIN_USER.decode())  # a tenant's own engine credential
        except (KeyError, TypeError) as err:
            raise TransportError(f"the service's native-engine address is malformed ({err})") from None
        self.info = dict(info)
        self.timeout = timeout
        self._pool = SharedChannels(secret.encode() if secret else None, user.encode())
        self.streams = DirectStreams({"endpoint": self.controller, "secret": secret, "user": user}, timeout=timeout,
                                     name="controller")
        hello = self._ask({"op": "hello"}, min(timeout, 10.0))
        self.units: list[tuple[str, str]] = [(str(n), str(e)) for n, e in hello["units"]]
        self.replicas = max(1, min(int(hello.get("replicas", 1)), len(self.units)))
        lease = hello.get("lease_s")  # a put's reservation lapses then: its copies must be in before
        self.put_lease_s = float(lease) if isinstance(lease, (int, float)) and not isinstance(lease, bool) \
            and 0 < lease < math.inf else 60.0
        self._finds_held = hello.get("held") is not False  # a journalling store finds none: no lookups
        # Units the controller declared lost, or suspects (it does not answer): puts go around them.
        self.down: set[int] = set()
        self._gone: set[int] = set()  # (of them, the lost ones)
        self._heard(hello)
        self._cursor = secrets.randbelow(max(1, len(self.units)))
        self.data_path = data_path
        self.pool = pool if pool is not None else ReadPool.shared()
        self._slab_map: dict[int, SlabView] = {}  # unit -> its slab, mapped (same host): see _slabs
        self._slab_pid = os.getpid()
        self._remote: dict[int, RemoteSlab] = {}  # unit -> its slab over the transfer engine
        self._stage = threading.local()  # the put this thread is encoding into staged extents, if any
        self._views = _ViewPins(self.controller, secret.encode() if secret else None, user.encode())
        if data_path in ("auto", "shm"):
            self._map_slabs(required=data_path == "shm")
        if data_path in ("auto", "te"):
            self._reach_engines(te or TeOptions(), required=data_path == "te")

    @property
    def _slabs(self) -> dict[int, SlabView]:
        """The units' slabs mapped in this process: a forked child maps its own at first use
        (the inherited read-only mappings hold the views it made its own, see
        :meth:`_ViewPins.forked`, which a new read must not land in)."""
        if self._slab_pid != os.getpid():
            self._slab_pid, self._slab_map = os.getpid(), {}
            if self.data_path in ("auto", "shm"):
                self._map_slabs(required=False)
        return self._slab_map

    @_slabs.setter
    def _slabs(self, value: dict[int, SlabView]) -> None:
        self._slab_map = value

    def on_device(self, device: Any, *, write: bool = False) -> bool:
        """On CUDA: every slab mapped here page-locked for reads (or, ``write``, for puts;
        once per process, see :meth:`SlabView.register_cuda`); True when they all are, so
        reads onto the GPU take views of the slabs and copy them by DMA.
        Example: ``transport.on_device(torch.device("cuda"))``."""
        if getattr(device, "type", None) != "cuda" or not self._slabs:
            return False
        return all([view.register_cuda(write=write) for view in list(self._slabs.values())])

    def paths(self) -> dict[str, str]:
        """The data path to each storage unit: ``shm`` (its slab is mapped here), ``te``
        (one-sided over the transfer engine) or ``zmq``; ``down`` for a unit the store lost
        or suspects (as this client last heard from the controller).

        Example: ``client.transport.paths()  # {"rlplane-native-unit-0": "shm", ...}``
        """
        return {name: "down" if u in self.down else "shm" if u in self._slabs else "te" if u in self._remote else "zmq"
                for u, (name, _) in enumerate(self.units)}

    def _reach_engines(self, opts: TeOptions, *, required: bool) -> None:
        """The units not mapped here, through their transfer engines (where they run one)."""
        for u, (name, endpoint) in enumerate(self.units):
            if u in self.down or u in self._slabs:
                continue
            try:
                te = self._unit(u).call({"op": "te"}, timeout=min(self.timeout, 5.0))[0]
                peer, base, nbytes, protocol = str(te["peer"]), int(te["base"]), int(te["bytes"]), str(te["protocol"])
                host = opts.hostname or local_address(peer.rpartition(":")[0])
                slab = RemoteSlab(name, peer, base, nbytes, PoolSpec(protocol, host, opts.devices, opts.staging_bytes))
                slab.reach()  # (its handshake now, bounded: a unit that stalls since is named within REACH_S)
                self._remote[u] = slab
            except (TransportError, InvalidArgumentError, ForbiddenError, KeyError, TypeError, ValueError) as err:
                if required:
                    self.close()
                    raise TransportError(f"data_path='te' needs every storage unit on the transfer engine, but {name} "
                                         f"cannot be reached that way ({err}); use data_path='auto' "
                                         "(RLPLANE_DATA_PATH=auto)") from None
                log.debug("storage unit %s: no transfer engine path (%s)", name, err)

    def _map_slabs(self, *, required: bool) -> None:
        for u, (name, _) in enumerate(self.units):
            if u in self.down:
                continue
            try:
                share = self._unit(u).call({"op": "slab"}, timeout=min(self.timeout, 5.0))[0]
                self._slabs[u] = shared_slab(str(share["sock"]), str(share["ticket"]), int(share["bytes"]), unit=name,
                                             timeout=min(self.timeout, 5.0))
            except (TransportError, ForbiddenError, KeyError, TypeError, ValueError) as err:
                if required:
                    self.close()
                    raise TransportError(f"data_path='shm' needs every storage unit on this host, but {name} cannot "
                                         f"be mapped ({err}); use data_path='auto' (RLPLANE_DATA_PATH=auto)") from None
                log.debug("storage unit %s: zmq data path (%s)", name, err)

    # -- the Transport verbs ---------------------------------------------------------
    def put(
        self,
        partition: str,
        sample_ids: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]],
        *,
        create: bool,
        durable: bool = False,
        aligned: Sequence[str] = (),
        born: np.ndarray | None = None,
        grows: np.ndarray | None = None,
        read_sums: Mapping[str, np.ndarray] | None = None,
    ) -> int | None:
        """``durable``: answered once the commit is in the units' journals on disk
        (InvalidArgumentError from a store without a journal). ``aligned``: the token-aligned
        field names (a write of existing samples: ShapeError, nothing stored, when a token
        row's length is not the one the sample's other token fields hold; with ``grows``, an
        extend's lengths as it read them, when it leaves out one of them that a sample holds
        or another extend grew a sample since; ``read_sums``, the digests of the token rows
        it read, per field: ShapeError when a write replaced one since). ``born``: each
        sample's incarnation as the caller's meta names it (a write: MissingDataError,
        nothing stored, for samples cleared and put again since; a create: what they become,
        as a snapshot kept it). Returns the incarnation a create gave its samples."""
        check_put(sample_ids, columns, tags, shares_rows=True)
        aligned = [] if create else list(aligned)
        if born is not None and len(born) != len(sample_ids):
            raise ShapeError(f"{len(born)} incarnations for {len(sample_ids)} samples")
        ids, full = list(sample_ids), set()
        while True:
            try:
                try:
                    return self._put(partition, ids, columns, tags, create, durable, aligned, born, grows, read_sums,
                                     avoid=full)
                except UnavailableError as err:  # a unit died: once it is declared lost, place the put on the others
                    if not self._lost(err):
                        raise
                    columns = self._restaged(columns)
                    return self._put(partition, ids, columns, tags, create, durable, aligned, born, grows, read_sums,
                                     avoid=full)
            except StorageFullError as err:  # a unit is full: the put is placed again, on the others
                unit = next((u for u, (name, _) in enumerate(self.units)
                             if getattr(err, "component", None) == f"storage unit {name}"), None)
                if unit is None or unit in full or len(self.units) - len(self.down | full | {unit}) < self.replicas:
                    raise
                full.add(unit)
                columns = self._restaged(columns)

    def _restaged(self, columns: Mapping[str, Column]) -> Mapping[str, Column]:
        """``columns`` for a put placed again: the fields its failed try encoded into extents
        it staged (freed now) as they were copied before."""
        stage = getattr(self._stage, "put", None)
        if stage is None or not stage.kept:
            return columns
        return {f: replace(c, values=stage.kept[f]) if f in stage.kept else c for f, c in columns.items()}

    @contextmanager
    def put_buffers(self, batch: int, fallback: Alloc | None,
                    sizes: Mapping[str, tuple[int, torch.dtype]] | None = None) -> Iterator[Alloc | None]:
        """Where the next put of ``batch`` samples in this thread encodes its fields: with
        a unit mapped here, each field of at least STAGE_MIN_BYTES into an extent that
        unit stages for the put's block (``fallback`` for the rest). ``sizes``: the
        ``(numel, dtype)`` the caller will ask for, per field, where it knows them: the
        first big ask stages them all in one round trip. Extents the put did not take (it
        failed, or was placed elsewhere on a retry) are freed on the way out; the block
        frees the staged ones the encode did not use.

        Example::

            with transport.put_buffers(len(ids), None) as alloc:
                enc = encode(registry, fields, lengths, alloc=alloc)
                transport.put("p", ids, enc.columns, enc.tags, create=True)
        """
        blocks = self._place(batch, 0) if self._slabs and batch > 0 else []
        if len(blocks) != 1 or blocks[0][1][0] not in self._slabs:
            yield fallback
            return
        stage = _Stage(blocks, batch)
        bid, unit = blocks[0][0], blocks[0][1][0]
        told = {f: (numel * dtype.itemsize, dtype) for f, (numel, dtype) in (sizes or {}).items()}

        def elsewhere(field: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
            return fallback(field, numel, dtype) if fallback is not None else torch.empty(numel, dtype=dtype)

        def alloc(field: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
            nbytes = numel * dtype.itemsize
            if nbytes < STAGE_MIN_BYTES or field in stage.fields or stage.failed:
                return elsewhere(field, numel, dtype)
            if field not in stage.ready:  # staged with every other big field the caller said it will ask for
                want = {field: (nbytes, dtype), **{f: w for f, w in told.items() if w[0] >= STAGE_MIN_BYTES
                                                   and f != field and f not in stage.ready}}
                try:
                    self._stage_extents(unit, bid, want, stage)
                except UnavailableError as err:  # the unit died: encode as usual; the put places around it
                    stage.failed = True
                    try:
                        self._lost(err)
                    except RlplaneError:  # the controller is unreachable too: the put will say so
                        pass
                    return elsewhere(field, numel, dtype)
            at, staged_bytes, staged_dtype = stage.ready[field]
            if (staged_bytes, staged_dtype) != (nbytes, dtype):  # not what the caller said: the block frees it
                return elsewhere(field, numel, dtype)
            view = self._slabs[unit]
            view.prefault(at, at + nbytes)  # the encode writes there next
            out = torch.from_numpy(view.u8[at : at + nbytes]).view(dtype)
            stage.fields[field] = (at, nbytes, out.data_ptr())
            return out

        self._stage.put = stage
        try:
            yield alloc
        finally:
            self._stage.put = None
            if stage.ready and not stage.committed:
                self._drop_blocks(stage.blocks)

    def _stage_extents(self, unit: int, bid: int, want: Mapping[str, tuple[int, torch.dtype]], stage: _Stage) -> None:
        """One round trip: unit ``unit`` stages an extent of block ``bid`` for each field of
        ``want`` (``{field: (bytes, dtype)}``); they go into ``stage.ready``."""
        names = list(want)
        reply = self._unit(unit).call({"op": "stage", "b": bid, "fs": [[f, dtype_name(want[f][1]), want[f][0]]
                                                                        for f in names]},
                                      timeout=min(self.timeout, 10.0))[0]
        starts = reply.get("xs")
        view = self._slabs[unit]
        if not isinstance(starts, list) or len(starts) != len(names):
            raise WireFormatError(f"storage unit {view.unit} answered a stage of {len(names)} fields with {starts!r:.80}")
        for f, at in zip(names, starts):
            nbytes = want[f][0]
            if not isinstance(at, int) or at < 0 or at + nbytes > view.nbytes:
                raise WireFormatError(f"storage unit {view.unit} staged an extent outside its slab", field=f)
            stage.ready[f] = (at, nbytes, want[f][1])

    @staticmethod
    def _keep_staged(stage: _Stage | None, columns: Mapping[str, Column]) -> None:
        """Before a failed put lets go of its blocks (the store frees, then reuses, their
        extents): copy the fields encoded into staged extents, for a retry to write."""
        if stage is not None and not stage.kept:
            stage.kept = {f: columns[f].values.clone() for f in stage.fields if f in columns}

    def _staged(self, n: int, columns: Mapping[str, Column]) -> _Stage | None:
        """This thread's staged put, if ``columns`` are what was encoded into it (taken
        once: a retry places its blocks afresh and copies)."""
        stage = getattr(self._stage, "put", None)
        if stage is None or stage.taken or stage.failed or stage.n != n:
            return None
        stage.taken = True
        for f, (at, nbytes, ptr) in list(stage.fields.items()):
            c = columns.get(f)
            if c is None or c.nbytes != nbytes or c.values.data_ptr() != ptr:
                return None  # not encoded where it was staged: the ordinary path, which copies
        return stage

    def _put(self, partition: str, ids: list[str], columns: Mapping[str, Column], tags: Sequence[Mapping[str, Any]],
             create: bool, durable: bool = False, aligned: list[str] | None = None,
             born: np.ndarray | None = None, grows: np.ndarray | None = None,
             read_sums: Mapping[str, np.ndarray] | None = None, avoid: Collection[int] = ()) -> int | None:
        deadline = time.monotonic() + self.timeout
        names = list(columns)
        # Split tags: geometry and digests per field (kept in the controller's arrays; the
        # codec's columns carry them as arrays already), user tags per sample.
        geoms = {f: c.geom if c.geom is not None else Geometry.of_rows([t.get(WIRE_TAG, {}).get(f) for t in tags])
                 for f, c in columns.items()}
        sums = {f: c.sums.astype("<u8").tobytes() if c.sums is not None
                else _u64([(t.get(SUM_TAG) or {}).get(f, 0) for t in tags], f) for f, c in columns.items()}
        if isinstance(tags, RowTags) and not tags.has_user_tags():
            user = None
        elif isinstance(tags, RowTags):  # its user tags apart: no tag map built per sample
            user = tags.user_tags()
        else:
            user = [{k: v for k, v in t.items() if not k.startswith(RESERVED_TAG_PREFIX)} or None for t in tags]
        for f, g in geoms.items():
            if not g.dense and any(x is None for x in g.tolist()):
                raise WireFormatError("a row carries no wire geometry (encode it with rlplane's codec)", field=f)
        stage = self._staged(len(ids), columns) if names else None
        nbytes = sum(c.nbytes for c in columns.values())
        blocks = stage.blocks if stage is not None else self._place(len(ids), nbytes, avoid) if names else []
        described = _described(columns, geoms, sums, user, aligned, born, durable, grows, read_sums)
        if len(blocks) == 1 and nbytes <= ONE_MESSAGE_BYTES and (stage is None or not stage.ready):
            # One round trip: the controller reserves, hands the rows to the block's units with
            # the put's record, and commits (sent again after a restart of the controller:
            # answered as done when it was).
            done = self._ask({"op": "put", "put": secrets.token_hex(16), "p": partition, "ids": ids, "create": create,
                              "fields": names, "blocks": blocks, **described}, self._left(deadline), dict(columns))
            if stage is not None:
                stage.committed = True
            given = done.get("bn")
            return given if create and born is None and type(given) is int and given > 0 else None
        ctrl = self._ctrl()
        # The reservation and the blocks travel at once; the commit waits for both.
        reserve = {"op": "reserve", "p": partition, "ids": ids, "create": create, "fields": names, "blocks": blocks}
        try:
            ctrl.raise_if_dropped()  # (idle across a controller restart: reserved anew below)
            rid: int | None = ctrl.send(reserve)
        except UnavailableError:  # (only ever the channel's own: nothing answered yet)
            rid = None  # the controller is restarting: reserved again below, once it answers
        copy_by = time.monotonic() + COPY_WITHIN * self.put_lease_s  # (the reservation was asked for just now)
        writes = self._send_blocks(blocks, columns, stage)
        failed: BaseException | None = None
        late: list[list[int]] = []  # [block, unit] copies whose one-sided write failed
        try:
            where, seals = self._land_blocks(writes, deadline, late, copy_by)  # shm: the copies into the slabs
        except BaseException as err:  # noqa: BLE001 - raised below, once the reservation is settled
            failed, where, seals = err, {}, []
        try:
            try:
                if rid is None:
                    raise peer_down("the controller did not take the reservation", "controller")
                res = ctrl.receive(rid, deadline)[0]
            except UnavailableError as err:  # its process died with the reservation: a restarted one takes it
                if not getattr(err, "peer_down", False):
                    raise
                res = self._ask(reserve, self._left(deadline))
        except BaseException:
            self._keep_staged(stage, columns)
            self._drop_blocks(blocks, late)
            raise
        try:
            if failed is not None:
                raise failed
            commit: dict[str, Any] = {"op": "commit", "res": res["res"], **described,
                                      "x": [[b, {f: dtype_name(c.dtype) for f, c in columns.items()},
                                             [[u, x] for u, x in copies.items()]] for b, copies in where.items()],
                                      "xs": seals}
            done = self._ask(commit, self._left(deadline))  # sent again after a restart: answered as done if it was
            if stage is not None:
                stage.committed = True
        except BaseException:
            self._keep_staged(stage, columns)
            try:
                self._ctrl().call({"op": "abort", "res": res["res"], **({"late": late} if late else {})},
                                  timeout=_ABORT_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the reservation lapses on its own
                pass
            raise
        given = done.get("bn")
        return given if create and born is None and type(given) is int and given > 0 else None

    def get(
        self, partition: str, sample_ids: Sequence[str], fields: Sequence[str], *, copy: bool = True,
        shared: bool = False, born: np.ndarray | None = None, lend: Collection[str] = (),
        verified: set[str] | None = None, probe: Sequence[str] = (),
    ) -> tuple[dict[str, Column], list[dict[str, Any]]]:
        """``copy=False``: a field whose rows lie in order in one mapped slab comes back as
        a read-only view of it (zero copy), its blocks pinned until the last view is gone.
        ``lend``: fields the caller copies out of the columns itself (a padded read pads
        token rows into memory of its own): those of at least LEND_MIN_BYTES come back as
        such views too, for one copy where there would be two.
        ``shared=True``: a row stored once for several of the samples is read once, and its
        column says which rows repeat it (:attr:`Column.same`); else every row is its own.
        ``born``: the incarnations the caller's meta names (MissingDataError for samples
        cleared and put again since). A read of more than READ_CELLS (samples x fields) or
        READ_ID_BYTES of ids, or one whose locate answer is too big to send or which a unit
        refuses as too big (PayloadTooLargeError: it halves), goes in pieces, located and
        read in turn, then put together in pooled memory (owned, never views; one copy more;
        lent or zero-copy pieces keep their pins until then). Each piece is a moment of its
        own (a write of the same samples between two pieces shows in the later one), and a
        MissingDataError names the missing samples of the first piece that has any.
        ``verified`` (a set): rows copied out of a mapped slab are checked against their
        digests as they are copied (IntegrityError naming the sample and field), and the
        fields whose every row was checked so are added to it (a read in one piece only):
        the caller need not digest them again. ``probe``: fields not read, which the locate
        looks for (FieldsHeldError naming those some of the samples hold, nothing read)."""
        if born is not None and len(born) != len(sample_ids):
            raise ShapeError(f"{len(born)} incarnations for {len(sample_ids)} samples")
        ids, names, lend, probe = list(sample_ids), list(fields), frozenset(lend), tuple(probe)
        # Pieces of at most READ_CELLS pairs, whose ids fit a request (up to 512 characters each).
        step = max(1, min(READ_CELLS // max(1, len(names)),
                          len(ids) * READ_ID_BYTES // max(1, sum(map(len, ids))) if ids else 1))
        pieces = [p for a in range(0, max(len(ids), 1), step)  # (an empty read: one piece, as before)
                  for p in self._in_pieces(partition, ids, names, copy, shared, born, lend, a, min(a + step, len(ids)),
                                           verified, probe)]
        if len(pieces) == 1:
            return pieces[0]
        if verified is not None:  # each piece was checked, but what is handed out is a copy of them
            verified.clear()
        for f in names:  # (as one locate's read says it)
            if len(written := {str(cols[f].dtype) for cols, _ in pieces}) > 1:
                raise ShapeError(f"the requested samples were written with different dtypes {sorted(written)}", field=f)

        def pooled(numel: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(self.pool.take(numel * dtype.itemsize)).view(dtype)

        return ({f: Column.concat([cols[f] for cols, _ in pieces], into=pooled) for f in names},
                RowTags.concat([tags for _, tags in pieces]))

    def _in_pieces(self, partition: str, ids: list[str], fields: list[str], copy: bool, shared: bool,
                   born: np.ndarray | None, lend: frozenset[str], a: int, z: int, verified: set[str] | None = None,
                   probe: tuple[str, ...] = ()) -> list[tuple[dict[str, Column], RowTags]]:
        """The read of ``ids[a:z]`` as one locate's, or, when its answer is too big to send
        (the samples carry big tags), as two halves, each again if need be."""
        try:
            return [self._get_once(partition, ids[a:z], fields, copy, shared, None if born is None else born[a:z],
                                   lend, verified, probe)]
        except PayloadTooLargeError:
            if z - a < 2:
                raise
        m = (a + z) // 2
        return [p for x, y in ((a, m), (m, z)) for p in self._in_pieces(partition, ids, fields, copy, shared, born,
                                                                          lend, x, y, verified, probe)]

    def _get_once(self, partition: str, ids: list[str], fields: list[str], copy: bool, shared: bool,
                  born: np.ndarray | None, lend: frozenset[str], verified: set[str] | None = None,
                  probe: tuple[str, ...] = ()) -> tuple[dict[str, Column], RowTags]:
        """One locate's read (see :meth:`get`), again after a unit was lost or a block moved."""
        args = (partition, ids, fields, copy, shared, born, lend, verified, probe)
        try:
            try:
                return self._get(*args)
            except UnavailableError as err:  # a unit died: its rows are read from their other copy, or named lost
                if not self._lost(err):
                    raise
                return self._get(*args)
        except MissingDataError as err:
            if err.missing:
                raise
            # A block vanished between locate and read (a clear or an overwrite raced this
            # read): locate again, which names what is gone or finds the rows' new home.
            return self._get(*args)

    def held_rows(self, partition: str, field: str, keys: np.ndarray) -> np.ndarray:
        """Where the store keeps rows of ``field`` in ``partition`` under ``keys`` (``(n, 2)``
        uint64, from :func:`rlplane.dedup.row_keys`): ``(n, 5)`` int64 refs, block -1 for a
        key it has no row under (see :class:`~rlplane.column.HeldRows`). One message.

        Example: ``refs = transport.held_rows("step-0", "pixel_values", keys)``.
        """
        refs = np.full((keys.shape[0], 5), -1, np.int64)
        want = np.flatnonzero(keys.any(axis=1))
        if not want.size or not self._finds_held:
            return refs
        uniq, which = np.unique(keys[want], axis=0, return_inverse=True)
        found = []
        for a in range(0, uniq.shape[0], _HELD_KEYS):  # the controller answers at most _HELD_KEYS at a time
            part = uniq[a:a + _HELD_KEYS]
            got = self._ask({"op": "held", "p": partition, "f": field, "k": part.astype("<u8").tobytes()}).get("x")
            if not isinstance(got, bytes) or len(got) != part.shape[0] * 40:
                raise WireFormatError("the controller answered a malformed 'held'", field=field)
            found.append(np.frombuffer(got, "<i8").reshape(-1, 5))
        refs[want] = np.concatenate(found)[which.reshape(-1)]
        return refs

    def clear(self, partition: str, sample_ids: Sequence[str] | None = None) -> int:
        header: dict[str, Any] = {"op": "clear", "p": partition, "ids": None if sample_ids is None else list(sample_ids)}
        return int(self._ask(header)["cleared"])

    def partitions(self) -> list[str]:
        return [d["partition"] for d in self.list()]

    def list(self) -> list[dict[str, Any]]:
        """Every partition with samples: ``partition``, ``num_samples``, ``fields``, ``nbytes``."""
        return list(self._ask({"op": "list"})["partitions"])

    def describe(self, partition: str) -> PartitionInfo:
        d = self._ask({"op": "describe", "p": partition})
        return PartitionInfo(d["partition"], list(d["sample_ids"]), dict(d["fields"]), int(d["nbytes"]))

    def stats(self) -> dict[str, Any]:
        """The controller's view: samples, blocks, live and retained bytes, per unit."""
        reply = self._ask({"op": "stats"})
        return {k: v for k, v in reply.items() if k not in _ENVELOPE_KEYS}

    def sharing(self) -> dict[str, int]:
        """See :meth:`Transport.sharing` (the controller's account)."""
        return sharing_of(self.stats())

    def unit_usage(self) -> dict[str, tuple[int, int]]:
        """Per storage unit: (samples with a row there, live bytes there)."""
        return {name: (int(u["samples"]), int(u["live_bytes"])) for name, u in self.stats()["units"].items()}

    def close(self) -> None:
        self._pool.close()  # zero-copy views still alive stay pinned (their pin thread has channels of its own)
        self.streams.close()
        self._slabs = {}  # the mappings go with the last client of this process that holds them
        self._remote = {}  # the transfer pool stays for the process (see rlplane.te.transfer_pool)

    # -- implementation --------------------------------------------------------------
    def _ctrl(self) -> Channel:
        return self._pool.get(self.controller, "controller")

    def _ask(self, header: dict[str, Any], timeout: float | None = None,
             columns: Mapping[str, Column] | None = None) -> dict[str, Any]:
        """The controller's answer to ``header`` (and ``columns``), riding through a restart
        of the controller (it rebuilds its index and answers again; see :func:`rlplane.channel.ride`)."""
        return ride(self._ctrl, header, columns, timeout=self.timeout if timeout is None else timeout)[0]

    def _unit(self, u: int) -> Channel:
        if not 0 <= u < len(self.units):
            raise WireFormatError(f"the controller named storage unit {u} of {len(self.units)}")
        name, endpoint = self.units[u]
        return self._pool.get(endpoint, name)

    def _lost(self, err: UnavailableError) -> bool:
        """Tell the controller a unit did not answer; True once it is declared lost (so a
        retry goes around it), False when the failure was not a unit's or it still answers."""
        index = next((k for k, (name, _) in enumerate(self.units) if name == err.component), None)
        if index is None:
            return False
        self._heard(self._ask({"op": "unit_down", "u": index}, min(self.timeout, 30.0)))
        return index in self.down

    def _heard(self, reply: Mapping[str, Any]) -> None:
        """The units the controller's ``reply`` names lost (``down``) or suspect."""
        self._gone = {int(u) for u in reply.get("down") or []}
        self.down = self._gone | {int(u) for u in reply.get("suspect") or []}
        self._down_at = time.monotonic()

    def _none_live(self, full: Collection[int]) -> UnavailableError:
        """What a put that no unit takes is told: which units are lost, which do not answer
        now (suspect: they may again), which are full."""
        def named(units: Collection[int]) -> str:
            return ", ".join(self.units[u][0] for u in sorted(units))

        if self._gone >= set(range(len(self.units))):
            return UnavailableError(f"every storage unit of the store is lost ({named(self._gone)}); the service needs "
                                    "a restart", component="storage units")
        why = [f"{named(self._gone)} lost" if self._gone else "",
               f"{named(self.down - self._gone)} not answering (suspect: each may answer again, or is declared lost "
               "once its process is dead)" if self.down - self._gone else "",
               f"{named(set(full) - self.down)} full for this put" if set(full) - self.down else ""]
        return UnavailableError(f"no storage unit takes this put now: {'; '.join(w for w in why if w)}; retry, or see "
                                "the service's /readyz", component="storage units")

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportError(f"the call ran past its deadline of {self.timeout:.0f} s (connect(timeout=...))")
        return left

    def _place(self, n: int, nbytes: int, avoid: Collection[int] = ()) -> list[list[Any]]:
        """Blocks for ``n`` rows: one unit per block, split over units when the put is big
        (so the shares move in parallel); fresh random ids; units taken in turn, but those
        of ``avoid`` (full for this put). With a unit mapped here, one block whose first
        copy is local (a put is then a memcpy)."""
        if self.down and time.monotonic() - self._down_at > _DOWN_REFRESH_S:  # a suspect unit may answer again
            self._down_at = time.monotonic()
            self._heard(self._ask({"op": "hello"}, min(self.timeout, 10.0)))
        live = [u for u in range(len(self.units)) if u not in self.down and u not in avoid]
        if not live:
            raise self._none_live(avoid)
        local = [u for u in live if u in self._slabs]
        if local:
            first = local[self._cursor % len(local)]
            self._cursor = (self._cursor + 1) % max(len(live), 1)
            rest = [u for u in live if u != first]
            turn = [first] + sorted(rest, key=lambda u: (u not in self._slabs, (u - first) % len(live)))
            units = spread(turn, [self.units[u][1] for u in turn], min(self.replicas, len(live)))
            if units[0] != first:
                units = [first] + [u for u in units if u != first][: len(units) - 1]
            return [[secrets.randbits(62) + 1, units, 0, n]]
        chunks = max(1, min(len(live), n, -(-nbytes // CHUNK_BYTES) if nbytes else 1))
        bounds = np.linspace(0, n, chunks + 1).astype(np.int64).tolist()
        copies = min(self.replicas, len(live))
        out = []
        for k in range(chunks):
            turn = [live[(self._cursor + r) % len(live)] for r in range(len(live))]
            units = spread(turn, [self.units[u][1] for u in turn], copies)
            self._cursor = (self._cursor + 1) % len(live)
            out.append([secrets.randbits(62) + 1, units, bounds[k], bounds[k + 1]])
        return out

    def _send_blocks(self, blocks: list[list[Any]], columns: Mapping[str, Column], stage: _Stage | None = None
                     ) -> list[_Sent]:
        """Per block and copy: an ``alloc`` to a unit mapped here (the values follow by
        memcpy; fields encoded into extents staged there (``stage``) are named, not copied),
        else a ``write`` carrying the values."""
        sent = []
        for k, (bid, units, a, z) in enumerate(blocks):
            part = {f: _rows(c, a, z) for f, c in columns.items()}
            for r, u in enumerate(units):
                ch = self._unit(u)
                staged = stage.fields if stage is not None and k == 0 and r == 0 else {}
                if u in self._slabs or u in self._remote:  # extents first; the values follow one-sided
                    layout = [[f, dtype_name(c.dtype), c.nbytes] + ([staged[f][0]] if f in staged else [])
                              for f, c in part.items()]
                    rid = ch.send({"op": "alloc", "b": bid, "f": layout}, None, [raw(c.offsets) for c in part.values()])
                else:
                    rid = ch.send({"op": "write", "b": bid}, part)
                sent.append(_Sent(bid, u, part, ch, rid, frozenset(staged)))
        return sent

    def _land_blocks(self, sent: list[_Sent], deadline: float, late: list[list[int]], copy_by: float = math.inf
                     ) -> tuple[dict[int, dict[int, dict[str, int]]], list[list[Any]]]:
        """Wait for every unit's answer; copy the values into each allocated extent, unless
        ``copy_by`` has passed (LeaseError: the reservation may have lapsed, and its blocks
        been freed and given to another put, whose rows the copy would overwrite).
        Returns per block, per unit, each field's slab offset, and the units' seals of
        them (``[block, unit, {field: [dtype, nbytes, rows, seal]}]``, relayed to the
        controller at commit). Raises the first failure once every answer is in (so no
        unit still works on this put). ``late`` gets the ``[block, unit]`` of each
        one-sided write that failed: the engine may still deliver its bytes there, so
        the abort has the unit keep those extents out of use a while."""
        where: dict[int, dict[int, dict[str, int]]] = {}
        seals: list[list[Any]] = []
        failed: BaseException | None = None
        for w in sent:
            try:
                reply = w.channel.receive(w.rid, deadline if failed is None else
                                          min(deadline, time.monotonic() + _ABORT_TIMEOUT_S))[0]
                got = _offsets(reply.get("x"), w.part, self.units[w.unit][0])
                if failed is None and (w.unit in self._slabs or w.unit in self._remote) and time.monotonic() > copy_by:
                    raise LeaseError(f"this put took longer than {COPY_WITHIN * self.put_lease_s:.0f} s to copy its "
                                     f"rows (the service's reservation lease is {self.put_lease_s:.0f} s, "
                                     "RLPLANE_PUT_LEASE_S; was this process stalled?): nothing was stored; retry it")
                if failed is None and w.unit in self._slabs:
                    self._copy_in(self._slabs[w.unit], got, w.part, w.staged)
                elif failed is None and w.unit in self._remote:
                    try:
                        self._remote[w.unit].write([(np.frombuffer(raw(c.values), np.uint8), got[f])
                                                    for f, c in w.part.items()])
                    except UnavailableError:  # (the engine failed the transfer; a refusal before it moved nothing)
                        late.append([w.bid, w.unit])
                        raise
                where.setdefault(w.bid, {})[w.unit] = got
                seals.append([w.bid, w.unit, reply.get("xs") or {}])
            except BaseException as err:  # noqa: BLE001 - the first failure is raised below
                failed = failed or err
        if failed is not None:
            raise failed
        return where, seals

    @staticmethod
    def _copy_in(view: SlabView, where: dict[str, int], part: Mapping[str, Column], staged: frozenset[str]) -> None:
        for f, c in part.items():
            n = c.nbytes
            if not n or f in staged:  # a staged field was encoded where it is stored
                continue
            start = where[f]
            if start < 0 or start + n > view.nbytes:
                raise WireFormatError(f"storage unit {view.unit} allocated an extent outside its slab", field=f)
            view.prefault(start, start + n)
            _copy(view.u8[start : start + n], np.frombuffer(raw(c.values), np.uint8))

    def _drop_blocks(self, blocks: list[list[Any]], late: list[list[int]] | None = None) -> None:
        """After a refused reservation (the writes have landed): the controller frees what
        they stored (only it may free blocks on a unit); ``late``: see :meth:`_land_blocks`."""
        if not blocks:
            return
        try:
            self._ctrl().call({"op": "discard", "blocks": [[bid, units] for bid, units, _, _ in blocks],
                               **({"late": late} if late else {})}, timeout=_ABORT_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - best effort; the store may be going away
            pass

    def _get(self, partition: str, ids: list[str], fields: list[str], copy: bool, shared: bool = False,
             born: np.ndarray | None = None, lend: frozenset[str] = frozenset(), verified: set[str] | None = None,
             probe: tuple[str, ...] = ()) -> tuple[dict[str, Column], list[dict[str, Any]]]:
        deadline = time.monotonic() + self.timeout
        if verified is not None:  # (what an attempt before this one checked is not what this one hands out)
            verified.clear()
        ask = {"op": "locate", "p": partition, "ids": ids, "fields": fields,
               "shm": sorted(self._slabs.keys() | self._remote.keys())}  # the units read at addresses
        if shared:
            ask["share"] = True
        if born is not None:
            ask["bn"] = np.asarray(born, "<i8").tobytes()
        if probe:
            ask["opt"] = list(probe)
        if not copy or lend:  # views may outlive this call: their pin is never dropped to make room for others
            ask["keep"] = True
        loc = self._ask(ask, self._left(deadline))
        pin = loc.get("pin")
        kept = False
        try:
            columns, tags, views = self.fetch(loc, partition, ids, fields, copy=copy, deadline=deadline, lend=lend,
                                              verified=verified)
            if views and isinstance(pin, str):
                blocks = loc.get("pb")
                self._views.hold(pin, views, float(loc.get("pin_lease_s") or 60.0),
                                 blocks if isinstance(blocks, bytes) else None)
                kept = True
        finally:
            if isinstance(pin, str) and not kept:
                self.unpin(pin)
        return columns, tags

    def fetch(self, loc: dict[str, Any], partition: str, ids: list[str], fields: list[str], *, copy: bool = True,
              deadline: float | None = None, lend: frozenset[str] = frozenset(), verified: set[str] | None = None
              ) -> tuple[dict[str, Column], RowTags, list[np.ndarray]]:
        """The rows a locate (or a snapshot's cut) answered: the columns, the tags and any
        zero-copy views (``copy=False``, or the ``lend`` fields; see :meth:`get`). The caller
        holds and releases the pin. ``verified``: see :meth:`get`."""
        deadline = deadline if deadline is not None else time.monotonic() + self.timeout
        copied: dict[str, np.ndarray] | None = {} if verified is not None else None
        columns, views = self._gather(loc, partition, len(ids), fields, copy, deadline, lend, copied)
        user = loc["user"]
        geoms = {f: Geometry.from_wire(loc["g"][f], f) for f in fields}
        sums = {f: np.frombuffer(loc["h"][f], "<u8") for f in fields}
        for f, got in (copied or {}).items():  # rows digested as they were copied out of the slabs
            check_rows(partition, ids, f, got, sums[f])
            verified.add(f)  # type: ignore[union-attr]
        if user is not None and (not isinstance(user, list) or len(user) != len(ids)):
            raise WireFormatError("the controller answered tags for other samples than asked")
        columns = {f: c.with_meta(sums[f], geoms[f]) for f, c in columns.items()}
        for f, same in (loc.get("s") or {}).items():  # rows read once for the samples sharing them
            if f in columns:
                columns[f] = columns[f].sharing(_same(same, len(ids), f))
        return columns, RowTags(user, geoms, sums, len(ids)), views

    def unpin(self, pin: str) -> None:
        """Release a pin (one-way; a failed channel lets it lapse on its own)."""
        try:
            self._ctrl().post({"op": "unpin", "pin": pin})
        except TransportError:
            pass

    def renew(self, pins: list[str]) -> list[str]:
        """Extend pins by their lease; answers the ones that are gone."""
        return list(self._ask({"op": "renew", "pins": pins}).get("gone") or [])

    def cut(self) -> dict[str, Any]:
        """A consistent cut of the whole store for a snapshot (see :mod:`rlplane.snapshot`):
        per partition the samples, where each field's rows are, the tasks' consumption; one pin."""
        return self._ask({"op": "cut", "shm": sorted(self._slabs.keys() | self._remote.keys())})

    def snapshotted(self, nbytes: int, seconds: float, samples: int, seq: int | None = None, path: str = "") -> None:
        """Tell the controller a snapshot was written (for its stats and /metrics); ``seq``:
        its cut's, below which the units' journals are truncated."""
        header: dict[str, Any] = {"op": "snapshotted", "bytes": nbytes, "seconds": seconds, "samples": samples}
        if seq is not None:
            header.update(seq=seq, path=path)
        self._ask(header)

    def journal(self, *, floor: int | None = None, pause: bool | None = None,
                base: tuple[int, str] | None = None) -> dict[str, Any]:
        """The store's journal: ``journal`` (whether it has one), ``seq`` (the next change's
        number), ``paused``. A restore pauses it and sets the ``floor`` (the next number);
        ``base`` (a snapshot's cut and path): the units record that their journals continue
        that snapshot, as a snapshot's truncation does (a restore from the journal alone
        then loads it first)."""
        header: dict[str, Any] = {"op": "journal"}
        if floor is not None:
            header["floor"] = floor
        if pause is not None:
            header["pause"] = pause
        if base is not None:
            header["base"] = [int(base[0]), str(base[1])]
        return dict(self._ask(header))

    def set_consumption(self, partition: str, task: str, ids: list[str], states: bytes) -> None:
        """Set ``task``'s consumption of ``ids`` (int8 per sample: 0 pending, 2 acked, 3 expired)."""
        self._ask({"op": "consumed", "p": partition, "task": task, "ids": ids, "states": states})

    def _gather(self, loc: dict[str, Any], partition: str, n: int, fields: list[str], copy: bool, deadline: float,
                lend: frozenset[str] = frozenset(), copied: dict[str, np.ndarray] | None = None
                ) -> tuple[dict[str, Column], list[np.ndarray]]:
        """Every requested field's rows in request order: out of the mapped slabs, and from
        the other units over ZMQ (their shares received straight into place when they are
        contiguous rows of the request). Returns the columns and any zero-copy views.
        ``copied`` (a dict): each field whose every row was copied out of a mapped slab
        gets its rows' digests of the bytes as copied (a field of rows read once for
        several samples is not digested here)."""
        row_bytes = {f: int_array(loc["nb"][f], "row bytes") for f in fields}
        starts = {f: np.concatenate([[0], np.cumsum(row_bytes[f])]) for f in fields}
        entries_of: dict[str, list[tuple[int, list[Any]]]] = {f: [] for f in fields}
        caps = {int(u): c for u, c in loc.get("caps") or []}  # the controller's read capabilities, per unit
        for u, entries in loc["units"]:
            for e in entries:
                if not (isinstance(e, list) and len(e) >= 4 and e[0] in entries_of):
                    raise WireFormatError("the controller answered a malformed location")
                entries_of[e[0]].append((u, e))
        columns: dict[str, Column] = {}
        views: list[np.ndarray] = []
        # Zero copy: a field whose rows lie in order, back to back, in one mapped slab.
        for f in fields:
            if copy and (f not in lend or int(starts[f][-1]) < LEND_MIN_BYTES):
                continue
            view = self._view(entries_of[f], n, row_bytes[f])
            if view is not None:
                columns[f], array = view
                views.append(array)
        # A field one zmq unit holds whole is used as it arrives (the received frame, no copy).
        shared = loc.get("s") or {}  # fields with rows read once for several samples: not every row is asked
        whole = {f for f in fields if f not in columns and f not in shared and len(entries_of[f]) == 1
                 and not self._mapped(*entries_of[f][0])}
        out, base = self._outputs({f: int(starts[f][-1]) for f in fields if f not in columns and f not in whole})
        dtypes: dict[str, set[str]] = {f: set() for f in out}
        got = {f: np.zeros(n, np.uint64) for f in out if f not in shared} if copied is not None else {}
        mapped_rows = dict.fromkeys(got, 0)  # rows of each field copied out of a mapped slab here
        sent = []
        for u, entries in loc["units"]:
            direct = [e for e in entries if e[0] not in columns and self._mapped(u, e)]
            if u in self._remote and direct:  # one batched one-sided read of every field's rows there
                self._read_remote(self._remote[u], direct, out, starts, row_bytes)
            if u in self._slabs and direct:  # rows in a mapped slab: copied out here, no message
                # a small read: every field's rows there in one pass; else field by field
                passes = [(direct, *base)] if base is not None else [([e], out[e[0]], {e[0]: 0}) for e in direct]
                for share, buf, at in passes:
                    for f, rows in self._copy_out(self._slabs[u], share, buf, at, starts, row_bytes, got):
                        if f in mapped_rows:
                            mapped_rows[f] += rows
            for e in direct:
                dtypes[e[0]].add(str(e[5]))
            mine = [e for e in entries if e[0] not in columns and not self._mapped(u, e)]
            if not mine:
                continue
            ch = self._unit(u)
            sinks = {}
            for name, _, _, pos, *_ in mine:
                p = int_array(pos, "positions")
                if name in out and p.size and p[-1] - p[0] + 1 == p.size:  # contiguous rows of the request
                    sinks[name] = memoryview(out[name])[int(starts[name][p[0]]) : int(starts[name][p[-1] + 1])]
            sent.append((mine, ch, ch.send({"op": "read", "p": partition, "f": [e[:3] for e in mine],
                                             "caps": caps.get(u, [])}), sinks))
        parts: dict[str, list[tuple[RawColumn, np.ndarray, bool]]] = {f: [] for f in fields}
        for entries, ch, rid, sinks in sent:
            cols = ch.receive(rid, deadline, _sink(sinks))[1]
            for name, _, _, pos, *_ in entries:
                if name not in cols:
                    raise WireFormatError("a storage unit did not return a requested field", field=name)
                parts[name].append((cols[name], int_array(pos, "positions"), name in sinks))
                if name in dtypes:
                    dtypes[name].add(cols[name].dtype)
        for f in fields:
            if f in columns:
                continue
            if f in whole:
                columns[f] = _whole(f, parts[f], n, row_bytes[f])
            else:
                columns[f] = _assemble(f, parts[f], n, out[f], row_bytes[f], dtypes[f])
        if copied is not None:
            copied.update((f, got[f]) for f, rows in mapped_rows.items() if rows == n)
        return columns, views

    def _mapped(self, u: int, entry: list[Any]) -> bool:
        """Whether ``entry``'s rows are read at their addresses in unit ``u``'s slab (mapped
        here, or over the transfer engine; the controller sent the addresses); else over ZMQ."""
        return (u in self._slabs or u in self._remote) and len(entry) >= 6

    def _view(self, entries: list[tuple[int, list[Any]]], n: int, row_bytes: np.ndarray
              ) -> tuple[Column, np.ndarray] | None:
        """The field as a read-only view of one mapped slab, if its rows lie there in order
        (and the array the view's tensor holds: the pin goes when it is collected)."""
        if len(entries) != 1:
            return None
        u, e = entries[0]
        if u not in self._slabs or len(e) < 6:
            return None
        pos, at = int_array(e[3], "positions"), int_array(e[4], "addresses")
        if pos.size != n or (n and not bool((pos == np.arange(n)).all())):
            return None
        if n > 1 and not bool((at[1:] == at[:-1] + row_bytes[:-1]).all()):
            return None
        view = self._slabs[u]
        total = int(row_bytes.sum())
        first = int(at[0]) if n else 0
        if first < 0 or first + total > view.nbytes:
            raise WireFormatError("the controller located rows outside a storage unit's slab")
        dtype = dtype_from_name(str(e[5]))
        np_dtype = np.dtype(numpy_dtype(dtype))
        if total % np_dtype.itemsize or bool((row_bytes % np_dtype.itemsize).any()):
            raise WireFormatError(f"row sizes are not whole {e[5]} elements")
        values = np.frombuffer(view.ro, np_dtype, count=total // np_dtype.itemsize, offset=first)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(row_bytes // np_dtype.itemsize, out=offsets[1:])
        import warnings

        with warnings.catch_warnings():  # torch warns that the array is read-only: that is the point
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(values)
        return Column(tensor.view(dtype), torch.from_numpy(offsets)), values

    def slab_runs(self, loc: dict[str, Any], n: int, field: str) -> SlabRuns | None:
        """Where a locate (or a snapshot's cut) says ``field``'s rows of ``n`` samples are,
        as views of the slabs mapped here (:class:`SlabRuns`: the runs of bytes, rows one
        after another in one slab as one put wrote them, whose concatenation is the field's
        values in request order). None where a row is elsewhere (a unit read over ZMQ or the
        transfer engine) or the rows break into more than :data:`MAX_SLAB_RUNS` runs: read
        them with :meth:`fetch`. The views are valid while the locate's pin holds.

        Example: ``runs = transport.slab_runs(cut_loc, len(ids), "pixel_values")``.
        """
        row_bytes = int_array(loc["nb"][field], "row bytes")
        pos, at, unit, dtypes = [], [], [], set()
        for u, entries in loc["units"]:
            for e in entries:
                if not (isinstance(e, list) and len(e) >= 4) or e[0] != field:
                    continue
                if u not in self._slabs or len(e) < 6:
                    return None
                p, a = int_array(e[3], "positions"), int_array(e[4], "addresses")
                if p.size != a.size:
                    raise WireFormatError("the controller located rows it was not asked for", field=field)
                pos.append(p)
                at.append(a)
                unit.append(np.full(p.size, u, np.int64))
                dtypes.add(str(e[5]))
        if len(dtypes) != 1 or row_bytes.size != n:
            return None  # no row located (nothing to map), or rows of several dtypes: fetch says which
        p, a, u = np.concatenate(pos), np.concatenate(at), np.concatenate(unit)
        order = np.argsort(p, kind="stable")
        p, a, u = p[order], a[order], u[order]
        if p.size and (int(p[0]) < 0 or int(p[-1]) >= n or bool((p[1:] == p[:-1]).any())):
            raise WireFormatError("the controller located rows it was not asked for", field=field)
        covered = np.zeros(n, bool)
        covered[p] = True
        if bool(row_bytes[~covered].any()):  # (a row read once for several samples is stored empty for its twins)
            raise WireFormatError("the controller located fewer rows than it has bytes for", field=field)
        same = (loc.get("s") or {}).get(field)
        torch_dtype = dtype_from_name(str(dtypes.pop()))
        dtype, itemsize = dtype_name(torch_dtype), torch_dtype.itemsize
        if bool((row_bytes % itemsize).any()):
            raise WireFormatError(f"row sizes are not whole {dtype} elements", field=field)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(row_bytes // itemsize, out=offsets[1:])
        lens = row_bytes[p]
        keep = lens > 0
        a, u, lens = a[keep], u[keep], lens[keep]
        starts = np.flatnonzero(np.concatenate([[True], (u[1:] != u[:-1]) | (a[1:] != a[:-1] + lens[:-1])]))
        if starts.size > MAX_SLAB_RUNS:
            return None
        runs = []
        if a.size:
            for k, start, size in zip(u[starts].tolist(), a[starts].tolist(), np.add.reduceat(lens, starts).tolist()):
                view = self._slabs[k]
                if start < 0 or start + size > view.nbytes:
                    raise WireFormatError("the controller located rows outside a storage unit's slab", field=field)
                view.prefault(start, start + size)
                runs.append(memoryview(view.u8).toreadonly()[start : start + size])  # (the mapping prefault maps)
        return SlabRuns(dtype, runs, offsets, _same(same, n, field) if same is not None else None)

    @staticmethod
    def _read_remote(slab: RemoteSlab, entries: list[list[Any]], out: dict[str, np.ndarray],
                     starts: dict[str, np.ndarray], row_bytes: dict[str, np.ndarray]) -> None:
        """Rows of one unit's share (every field) over the transfer engine into their places."""
        names = [e[0] for e in entries]
        at, lens, which, dst_at = [], [], [], []
        for k, e in enumerate(entries):
            pos, addr = int_array(e[3], "positions"), int_array(e[4], "addresses")
            rb = row_bytes[e[0]]
            if pos.size != addr.size or (pos.size and (int(pos.min()) < 0 or int(pos.max()) >= rb.size)):
                raise WireFormatError("the controller located rows it was not asked for", field=e[0])
            at.append(addr)
            lens.append(rb[pos])
            which.append(np.full(pos.size, k, np.int64))
            dst_at.append(starts[e[0]][pos])
        slab.read(np.concatenate(at), np.concatenate(lens), [out[f] for f in names], np.concatenate(which),
                  np.concatenate(dst_at))

    def _outputs(self, sizes: dict[str, int]) -> tuple[dict[str, np.ndarray], tuple[np.ndarray, dict[str, int]] | None]:
        """Where each field's rows are read to. A read smaller than the pool's smallest buffer
        gets one buffer for every field (each field a 64-byte-aligned slice of it), so rows
        of all fields in one slab move in one pass (returned as ``(buffer, each field's
        offset in it)``); a bigger read a pooled buffer per field (None)."""
        at, total = {}, 0
        for f, size in sizes.items():
            at[f] = total
            total += -(-size // _ALIGN) * _ALIGN
        if total >= self.pool.min_bytes:
            return {f: self.pool.take(size) for f, size in sizes.items()}, None
        buf = np.empty(total, np.uint8)
        return {f: buf[at[f] : at[f] + size] for f, size in sizes.items()}, (buf, at)

    @staticmethod
    def _copy_out(view: SlabView, entries: list[list[Any]], buf: np.ndarray, at_of: dict[str, int],
                  starts: dict[str, np.ndarray], row_bytes: dict[str, np.ndarray], sums: dict[str, np.ndarray]
                  ) -> list[tuple[str, int]]:
        """Rows of ``entries`` (of one unit's share: one field's, or a small read's every
        field, see :meth:`_outputs`) out of its mapped slab in one pass, each field's rows
        at ``at_of[field]`` in ``buf`` onwards; per entry its field and how many rows. A field
        in ``sums`` gets each row's digest of its bytes as copied, at its place there."""
        pos = [int_array(e[3], "positions") for e in entries]
        src = [int_array(e[4], "addresses") for e in entries]
        for e, p, a in zip(entries, pos, src):
            if p.size != a.size:
                raise WireFormatError("the controller located rows it was not asked for", field=e[0])
        all_pos = np.concatenate(pos)
        rows = min(row_bytes[e[0]].size for e in entries)
        if all_pos.size and (int(all_pos.min()) < 0 or int(all_pos.max()) >= rows):
            raise WireFormatError("the controller located rows it was not asked for", field=entries[0][0])
        all_at = np.concatenate(src)
        lens = np.concatenate([row_bytes[e[0]][p] for e, p in zip(entries, pos)])
        if all_at.size and (int(all_at.min()) < 0 or int(lens.min()) < 0 or bool((all_at > view.nbytes - lens).any())):
            raise WireFormatError("the controller located rows outside a storage unit's slab", field=entries[0][0])
        if all_at.size:
            lo, hi = int(all_at.min()), int((all_at + lens).max())
            if hi - lo <= 2 * int(lens.sum()):  # rows close together (one put's): their span mapped at once
                view.prefault(lo, hi)
        dst = np.concatenate([at_of[e[0]] + starts[e[0]][p] for e, p in zip(entries, pos)])
        if any(e[0] in sums for e in entries):
            got = copied_sums(buf, dst, view.u8, all_at, lens)
            k = 0
            for e, p in zip(entries, pos):
                if e[0] in sums:
                    sums[e[0]][p] = got[k : k + p.size]
                k += p.size
        else:
            copy_ranges(buf, dst, view.u8, all_at, lens)
        return [(e[0], int(p.size)) for e, p in zip(entries, pos)]

def _described(columns: Mapping[str, Column], geoms: Mapping[str, Geometry], sums: Mapping[str, bytes],
               user: list[Any] | None, aligned: list[str] | None, born: np.ndarray | None, durable: bool,
               grows: np.ndarray | None = None, read_sums: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
    """What a commit (or a put in one message) says of its rows: each field's geometry,
    digests and row bytes, and what the put carries besides (user tags, the token fields a
    write must keep aligned, or, growing them, must carry all of; incarnations, rows stored
    once, durability)."""
    out: dict[str, Any] = {"g": {f: g.to_wire() for f, g in geoms.items()}, "h": dict(sums),
                           "nb": {f: ints(c.logical_numels() * c.values.element_size()) for f, c in columns.items()}}
    if user is not None and any(user):
        out["user"] = user
    if aligned:
        out["t"] = aligned
        if grows is not None:  # an extend: the lengths it read (the controller checks both)
            out["gr"] = np.asarray(grows, "<i8").tobytes()
            if read_sums:  # ...and the digests of the rows it read (a write may have replaced them since)
                out["gs"] = {f: np.asarray(v, "<u8").tobytes() for f, v in read_sums.items()}
    if born is not None:
        out["bn"] = np.asarray(born, "<i8").tobytes()
    shared = {f: c.same.astype("<i8").tobytes() for f, c in columns.items() if c.same is not None}
    if shared:  # rows stored empty whose bytes are an earlier row's (rlplane.dedup)
        out["s"] = shared
    held = {f: c.held for f, c in columns.items() if c.held is not None}
    if held:  # the rows' keys, and the rows stored empty whose bytes an earlier put stored
        out["k"] = {f: h.keys.astype("<u8").tobytes() for f, h in held.items()}
        out["hx"] = {f: h.refs.astype("<i8").tobytes() for f, h in held.items() if h.rows.size}
    if durable:
        out["durable"] = True
    return out


def _u64(values: list[Any], field: str) -> bytes:
    """Row digests as little-endian uint64 bytes (0: none recorded)."""
    try:
        return np.asarray(values, dtype="<u8").tobytes()
    except (OverflowError, TypeError, ValueError):
        raise WireFormatError("a row's checksum is not a 64-bit unsigned int", field=field) from None


def _sink(sinks: dict[str, memoryview]) -> Any:
    """Where a read reply's frames go: each named column's values into its slot of the output."""
    if not sinks:
        return None

    def where(header: dict[str, Any], k: int) -> memoryview | None:
        layout = header.get("c")
        if k % 2 or not isinstance(layout, list) or k // 2 >= len(layout):
            return None
        entry = layout[k // 2]
        return sinks.get(entry[0]) if isinstance(entry, list) and entry else None

    return where


class SlabRuns(NamedTuple):
    """A field's rows as views of mapped slabs (:meth:`NativeTransport.slab_runs`): its
    dtype's name, the runs of bytes in request order, the rows' element offsets (int64,
    one more than rows), and for rows stored once for several samples, each row's
    earlier twin (-1: none; None: no row is shared)."""

    dtype: str
    runs: list[memoryview]
    offsets: np.ndarray
    same: np.ndarray | None


def _same(given: Any, n: int, field: str) -> np.ndarray:
    """A locate's ``same`` of a field (int64 per requested sample), checked."""
    if not isinstance(given, bytes) or len(given) != 8 * n:
        raise WireFormatError("the controller answered a malformed 'same'", field=field)
    same = np.frombuffer(given, "<i8").astype(np.int64)
    check_same(same, n, field)
    return same


def _rows(col: Column, a: int, z: int) -> Column:
    """Rows ``a:z`` of ``col`` as stored (values as a view; offsets rebased; a shared row
    travels empty: the commit says whose bytes it has)."""
    if a == 0 and z == col.num_rows:
        return col if col.same is None else Column(col.values, col.offsets)
    off = col.offsets[a : z + 1]
    return Column(col.values[int(off[0]) : int(off[-1])], off - off[0])


def _whole(name: str, parts: list[tuple[RawColumn, np.ndarray, bool]], n: int, row_bytes: np.ndarray) -> Column:
    """A field one unit sent whole: its frame is the column (rows put in request order)."""
    col, pos, _ = parts[0]
    itemsize = col.values.dtype.itemsize
    if bool((row_bytes % itemsize).any()) or col.num_rows != pos.size or pos.size != n:
        raise WireFormatError(f"a storage unit returned {col.num_rows} rows for {n}", field=name)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(row_bytes // itemsize, out=offsets[1:])
    dtype = dtype_from_name(col.dtype)
    if bool((pos == np.arange(n)).all()):
        if not np.array_equal(col.offsets, offsets):
            raise WireFormatError("a storage unit returned rows of other sizes than the controller recorded", field=name)
        values = col.values if col.values.flags.writeable else col.values.copy()
        return Column(torch.from_numpy(values).view(dtype), torch.from_numpy(offsets))
    values = np.empty(int(offsets[-1]), col.values.dtype)
    if not np.array_equal(np.diff(col.offsets), offsets[pos + 1] - offsets[pos]):
        raise WireFormatError("a storage unit returned rows of other sizes than the controller recorded", field=name)
    _scatter(values, offsets, pos, col.values, col.offsets)
    return Column(torch.from_numpy(values).view(dtype), torch.from_numpy(offsets))


def _assemble(name: str, parts: list[tuple[RawColumn, np.ndarray, bool]], n: int, out: np.ndarray,
              row_bytes: np.ndarray, dtypes: set[str]) -> Column:
    """One field's rows in request order, in ``out`` (rows copied out of a slab and shares
    received in place are there already; any other share is copied in)."""
    if len(dtypes) > 1:
        raise ShapeError(f"the requested samples were written with different dtypes {sorted(dtypes)}", field=name)
    if not dtypes:
        return Column.empty(torch.uint8)
    dtype = dtypes.pop()
    torch_dtype = dtype_from_name(dtype)
    np_dtype = np.dtype(numpy_dtype(torch_dtype))
    itemsize = np_dtype.itemsize
    if out.size % itemsize or (itemsize > 1 and bool((row_bytes % itemsize).any())):
        raise WireFormatError(f"row sizes are not whole {dtype} elements", field=name)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(row_bytes // itemsize if itemsize > 1 else row_bytes, out=offsets[1:])
    values = out.view(np_dtype)
    for col, pos, in_place in parts:
        if col.num_rows != pos.size:
            raise WireFormatError(f"a storage unit returned {col.num_rows} rows for {pos.size}", field=name)
        want = offsets[pos + 1] - offsets[pos]
        if not np.array_equal(np.diff(col.offsets), want):
            raise WireFormatError("a storage unit returned rows of other sizes than the controller recorded", field=name)
        if not in_place:
            _scatter(values, offsets, pos, col.values, col.offsets)
    return Column(torch.from_numpy(values).view(torch_dtype), torch.from_numpy(offsets))


def _offsets(x: Any, part: Mapping[str, Column], unit: str) -> dict[str, int]:
    """A unit's answer to alloc/write: the slab offset of each field's extent."""
    if not isinstance(x, dict) or set(x) != set(part) or not all(isinstance(v, int) for v in x.values()):
        raise WireFormatError(f"storage unit {unit} did not say where it stored the block's fields")
    return dict(x)


class _Sent:
    """One copy of one block on its way to a unit: the request's id on that unit's
    channel, and the fields already in their (staged) extents there."""

    __slots__ = ("bid", "unit", "part", "channel", "rid", "staged")

    def __init__(self, bid: int, unit: int, part: dict[str, Column], channel: Channel, rid: int,
                 staged: frozenset[str] = frozenset()) -> None:
        self.bid, self.unit, self.part, self.channel, self.rid = bid, unit, part, channel, rid
        self.staged = staged


class _Stage:
    """A put being encoded into staged extents: its blocks (placed before the encode), the
    extents its unit staged, per field encoded into one ``(start, bytes, address here)``,
    and how it ended."""

    __slots__ = ("blocks", "n", "ready", "fields", "taken", "committed", "failed", "kept")

    def __init__(self, blocks: list[list[Any]], n: int) -> None:
        self.blocks, self.n = blocks, n
        self.ready: dict[str, tuple[int, int, torch.dtype]] = {}  # staged on the unit: (start, bytes, dtype)
        self.fields: dict[str, tuple[int, int, int]] = {}  # of those, the ones encoded into
        self.taken = self.committed = self.failed = False
        self.kept: dict[str, torch.Tensor] = {}  # the staged fields' values, copied when the put failed


class _ViewPins:
    """The pins of zero-copy reads whose views are alive: renewed in the background while
    any view lives, unpinned when the last view of a read is garbage-collected. The
    finalizers only queue the pin (they may run in any thread, even one of ZMQ's); the pin
    thread sends the unpins and renewals over a hold of its own on the process's channels,
    so the views stay protected after their client is closed or dropped (their pins lapsed
    then, and the store reused the memory under them). The thread ends, and lets go of
    its channels, once no view is left. The pins a renewal finds gone (a restarted
    controller, which frees nothing for a few renewal intervals) are renewed again, each
    named with its blocks as the locate answered them, and the controller takes them up
    (see rlplane_service.native.pins)."""

    def __init__(self, controller: str, secret: bytes | None, user: bytes) -> None:
        self._controller, self._secret, self._user = controller, secret, user
        self._lease = 60.0
        self._views: list[weakref.ref] = []  # every view held (dead ones pruned as they pile up)
        self._start()
        _VIEW_PINS.add(self)

    def _start(self) -> None:
        self._live: dict[str, int] = {}  # pin -> views of it still alive
        self._blocks: dict[str, bytes] = {}  # pin -> its blocks (int64 bytes), named in each renewal
        self._gone: collections.deque[str] = collections.deque()  # one entry per view collected
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, pin: str, views: list[np.ndarray], lease_s: float, blocks: bytes | None = None) -> None:
        with self._lock:
            self._live[pin] = len(views)
            if blocks is not None:
                self._blocks[pin] = blocks
            self._lease = lease_s
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="rlplane-view-pins", daemon=True)
                self._thread.start()
            if len(self._views) > 2 * len(self._live) + 64:
                self._views = [r for r in self._views if r() is not None]
            self._views += [weakref.ref(v) for v in views]
        for v in views:
            weakref.finalize(v, self._dropped, pin)

    def forked(self) -> int:
        """In a forked child (a DataLoader worker): the views it inherited keep what they
        show, as copies of their own (their pins are the parent's, which lets go of them with
        its views, and the store then reuses their memory: the child would see a later put's
        bytes); the child pins its own reads afresh. Returns the views copied."""
        views = [v for v in (r() for r in self._views) if v is not None]
        self._start()
        self._views = []
        kept = 0
        for v in views:
            if privatize(v.ctypes.data, v.nbytes):
                kept += 1
            else:
                log.error("a zero-copy view inherited by this forked process could not be made its own: it may show "
                          "memory the store reuses (read with copy=True before forking)")
        return kept

    def _dropped(self, pin: str) -> None:
        self._gone.append(pin)
        self._wake.set()

    def _take_up(self, ctrl: Channel, unknown: list[Any], timeout: float) -> list[Any]:
        """Renew again the pins the controller did not know (it was restarted), each named
        with its blocks, in messages of at most _TAKE_UP_BYTES of them; the pins still gone."""
        gone: list[Any] = []
        while unknown:
            with self._lock:
                some, named, size = [], [], 0
                while unknown and (not some or size < _TAKE_UP_BYTES):
                    pin = unknown.pop()
                    some.append(pin)
                    named.append(self._blocks.get(pin, b""))
                    size += len(named[-1])
            gone += ctrl.call({"op": "renew", "pins": some, "pb": named}, timeout=timeout)[0].get("gone") or []
        return gone

    def _loop(self) -> None:
        channels = SharedChannels(self._secret, self._user)
        try:
            every = min(self._lease / 3, RENEW_EVERY_S)
            renew_at = time.monotonic() + every
            while True:
                self._wake.wait(max(0.05, min(1.0, renew_at - time.monotonic())))
                self._wake.clear()
                done = []
                with self._lock:
                    while self._gone:
                        pin = self._gone.popleft()
                        left = self._live.get(pin, 0) - 1
                        if left > 0:
                            self._live[pin] = left
                        elif self._live.pop(pin, None) is not None:
                            self._blocks.pop(pin, None)
                            done.append(pin)
                    pins = list(self._live)
                    if not pins and not done:
                        self._thread = None  # the next view held starts a new one
                        return
                try:
                    ctrl = channels.get(self._controller, "controller")
                    for pin in done:
                        ctrl.post({"op": "unpin", "pin": pin})
                    if pins and time.monotonic() >= renew_at:
                        unknown = ctrl.call({"op": "renew", "pins": pins}, timeout=min(10.0, every))[0].get("gone")
                        gone = self._take_up(ctrl, unknown or [], min(10.0, every))
                        if gone:
                            log.error("%d zero-copy read pin(s) lapsed while their views were alive (the controller "
                                      "was unreachable for a lease, or restarted and freed their blocks before this "
                                      "process renewed them): those views may show reused memory", len(gone))
                    if time.monotonic() >= renew_at:
                        renew_at = time.monotonic() + every
                except Exception as err:  # noqa: BLE001 - retried within a second; a lapsed pin is logged above
                    log.warning("could not unpin or renew zero-copy read pins: %s", err)
                    renew_at = min(renew_at, time.monotonic() + 1.0)
        finally:
            channels.close()


_VIEW_PINS: weakref.WeakSet[_ViewPins] = weakref.WeakSet()  # every transport's (see _ViewPins.forked)


def _after_fork_in_child() -> None:
    for pins in list(_VIEW_PINS):
        pins.forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _scatter(values: np.ndarray, offsets: np.ndarray, pos: np.ndarray, src: np.ndarray, src_offsets: np.ndarray) -> None:
    """Rows ``k`` of ``src`` into rows ``pos[k]`` of ``values``: run by run where rows follow
    one another (big rows, e.g. a seqlen-balanced DP shard's images), else one index copy."""
    lens = src_offsets[1:] - src_offsets[:-1]
    total = int(lens.sum())
    if not total:
        return
    breaks = np.ones(pos.size, dtype=bool)
    breaks[1:] = pos[1:] != pos[:-1] + 1
    run_at = np.flatnonzero(breaks)
    if run_at.size <= _MAX_RUNS or total >= _BIG_RUN * run_at.size:
        run_end = np.append(run_at[1:], pos.size)
        for k0, k1 in zip(run_at.tolist(), run_end.tolist()):
            s0, s1 = int(src_offsets[k0]), int(src_offsets[k1])
            d0 = int(offsets[pos[k0]])
            values[d0 : d0 + (s1 - s0)] = src[s0:s1]
        return
    within = np.arange(total, dtype=np.int64) - np.repeat(src_offsets[:-1], lens)
    values[np.repeat(offsets[pos], lens) + within] = src[:total]


@dataclass(frozen=True)
class TeOptions:
    """This client's side of the transfer engine: the staging buffer's size, the address
    it advertises (``""``: the interface that reaches the unit) and its RDMA NICs.
    ``rlplane.connect`` fills it from RLPLANE_TE_STAGING_BYTES, RLPLANE_TE_HOSTNAME and
    RLPLANE_TE_DEVICES."""

    staging_bytes: int = DEFAULT_STAGING_BYTES
    hostname: str = ""
    devices: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TeOptions:
        """Read RLPLANE_TE_STAGING_BYTES / _HOSTNAME / _DEVICES (InvalidArgumentError if malformed)."""
        env = os.environ if env is None else env
        raw_size = env.get("RLPLANE_TE_STAGING_BYTES") or str(DEFAULT_STAGING_BYTES)
        try:
            size = int(raw_size)
        except ValueError:
            size = -1
        if size < 1 << 16:
            raise InvalidArgumentError(f"RLPLANE_TE_STAGING_BYTES must be a number of bytes >= 65536, got {raw_size!r}")
        return cls(size, env.get("RLPLANE_TE_HOSTNAME") or "", env.get("RLPLANE_TE_DEVICES") or "")


def open_transport(info: Mapping[str, Any], *, timeout: float, data_path: str = "auto",
                   te: TeOptions | None = None) -> NativeTransport:
    """The transport ``rlplane.connect`` opens for the ``native`` entry of ``/v1/transport``
    (``te`` defaults to the RLPLANE_TE_* environment, :meth:`TeOptions.from_env`)."""
    return NativeTransport(info, timeout=timeout, data_path=data_path, te=te if te is not None else TeOptions.from_env())


__all__ = ["NativeTransport", "TeOptions", "open_transport", "reachable"]
