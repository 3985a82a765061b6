"""NativeTransport: columns straight to rlplane's own storage engine over ZMQ.

The service's native store is a controller (the sample index) and storage units (the
bytes, as columnar blocks). This transport talks to both directly, with nothing but
the addresses and the data secret that ``GET /v1/transport`` hands out under the API
token: no Ray, no pickle. Messages per put or read: one to the controller, one per
storage unit involved, one more to the controller; never one per sample.

- ``put``: reserve the ids (atomic: concurrent puts of the same new ids, exactly one
  wins) while the blocks travel to their units, then commit. Anything failing in between aborts the
  reservation; nothing is visible until the commit.
- ``get``: locate the rows, read each unit's share (one column per field), put the rows
  back in the order asked. Every (sample, field) or MissingDataError.

Every call has a deadline (``timeout``); a unit that died raises UnavailableError within
seconds (see :mod:`rlplane.channel`).

Example::

    t = NativeTransport(api.json("GET", "/v1/transport")["native"], timeout=60)
    t.put("step-0", ids, enc.columns, enc.tags, create=True)
"""

from __future__ import annotations

import secrets
import socket
import time
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from rlplane.channel import Channel, ChannelPool
from rlplane.placement import spread
from rlplane.codec import RESERVED_TAG_PREFIX, WIRE_TAG
from rlplane.integrity import SUM_TAG
from rlplane.column import Column
from rlplane.dtypes import dtype_from_name
from rlplane.errors import MissingDataError, ShapeError, TransportError, UnavailableError, WireFormatError
from rlplane.transports.base import PartitionInfo, Transport, check_put
from rlplane.streams import DirectStreams
from rlplane.gather import BIG_RUN as _BIG_RUN
from rlplane.gather import MAX_RUNS as _MAX_RUNS
from rlplane.wire import RawColumn, int_array, ints, numpy_dtype

#: Keys every reply header carries besides the operation's answer.
_ENVELOPE_KEYS = {"ok", "rid", "v", "c", "nbuf"}
#: Rows of one put go to one unit until the put is this big; then they are split over units.
CHUNK_BYTES = 8 << 20
#: How long an abort of a failed put may take before the reservation is left to lapse.
_ABORT_TIMEOUT_S = 5.0


def reachable(info: Mapping[str, Any], timeout: float = 1.0) -> bool:
    """Whether the controller and every unit accept a TCP connection within ``timeout``."""
    try:
        endpoints = [info["controller"]] + [u[1] for u in info["units"]]
        for ep in endpoints:
            host, _, port = ep.removeprefix("tcp://").rpartition(":")
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                pass
        return True
    except (OSError, KeyError, TypeError, ValueError, AttributeError, IndexError):
        return False


class NativeTransport(Transport):
    """Direct data path to the native engine (see the module docstring)."""

    name = "native"

    def __init__(self, info: Mapping[str, Any], *, timeout: float = 60.0) -> None:
        try:
            self.controller = str(info["controller"])
            secret = info.get("secret")
        except (KeyError, TypeError) as err:
            raise TransportError(f"the service's native-engine address is malformed ({err})") from None
        self.info = dict(info)
        self.timeout = timeout
        self._pool = ChannelPool(secret.encode() if secret else None)
        self.streams = DirectStreams({"endpoint": self.controller, "secret": secret}, timeout=timeout, name="controller")
        hello = self._ctrl().call({"op": "hello"}, timeout=min(timeout, 10.0))[0]
        self.units: list[tuple[str, str]] = [(str(n), str(e)) for n, e in hello["units"]]
        self.replicas = max(1, min(int(hello.get("replicas", 1)), len(self.units)))
        self.down: set[int] = {int(u) for u in hello.get("down", [])}  # units the controller declared lost
        self._cursor = secrets.randbelow(max(1, len(self.units)))

    # -- the Transport verbs ---------------------------------------------------------
    def put(
        self,
        partition: str,
        sample_ids: Sequence[str],
        columns: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]],
        *,
        create: bool,
    ) -> None:
        check_put(sample_ids, columns, tags)
        try:
            self._put(partition, list(sample_ids), columns, tags, create)
        except UnavailableError as err:  # a unit died: once it is declared lost, place the put on the others
            if not self._lost(err):
                raise
            self._put(partition, list(sample_ids), columns, tags, create)

    def _put(self, partition: str, ids: list[str], columns: Mapping[str, Column], tags: Sequence[Mapping[str, Any]],
             create: bool) -> None:
        deadline = time.monotonic() + self.timeout
        names = list(columns)
        # Split tags: geometry per field (kept in the controller's arrays), user tags per sample.
        geoms = {f: [t.get(WIRE_TAG, {}).get(f) for t in tags] for f in names}
        sums = {f: _u64([(t.get(SUM_TAG) or {}).get(f, 0) for t in tags], f) for f in names}
        user = [{k: v for k, v in t.items() if not k.startswith(RESERVED_TAG_PREFIX)} for t in tags]
        for f, g in geoms.items():
            if any(x is None for x in g):
                raise WireFormatError("a row carries no wire geometry (encode it with rlplane's codec)", field=f)
        blocks = self._place(len(ids), sum(c.nbytes for c in columns.values())) if names else []
        ctrl = self._ctrl()
        # The reservation and the blocks travel at once; the commit waits for both.
        rid = ctrl.send({"op": "reserve", "p": partition, "ids": ids, "create": create, "fields": names,
                         "blocks": blocks})
        writes = self._send_blocks(blocks, columns)
        try:
            res = ctrl.receive(rid, deadline)[0]
        except BaseException:
            self._drop_blocks(writes, blocks, deadline)
            raise
        try:
            self._wait_blocks(writes, deadline)
            commit: dict[str, Any] = {"op": "commit", "res": res["res"], "g": geoms, "h": sums,
                                      "nb": {f: ints(c.row_numels() * c.values.element_size()) for f, c in columns.items()}}
            if create or any(user):
                commit["user"] = user
            ctrl.call(commit, timeout=self._left(deadline))
        except BaseException:
            try:
                self._ctrl().call({"op": "abort", "res": res["res"]}, timeout=_ABORT_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the reservation lapses on its own
                pass
            raise

    def get(
        self, partition: str, sample_ids: Sequence[str], fields: Sequence[str]
    ) -> tuple[dict[str, Column], list[dict[str, Any]]]:
        try:
            try:
                return self._get(partition, list(sample_ids), list(fields))
            except UnavailableError as err:  # a unit died: its rows are read from their other copy, or named lost
                if not self._lost(err):
                    raise
                return self._get(partition, list(sample_ids), list(fields))
        except MissingDataError as err:
            if err.missing:
                raise
            # A block vanished between locate and read (a clear or an overwrite raced this
            # read): locate again, which names what is gone or finds the rows' new home.
            return self._get(partition, list(sample_ids), list(fields))

    def clear(self, partition: str, sample_ids: Sequence[str] | None = None) -> int:
        header: dict[str, Any] = {"op": "clear", "p": partition, "ids": None if sample_ids is None else list(sample_ids)}
        return int(self._ctrl().call(header, timeout=self.timeout)[0]["cleared"])

    def partitions(self) -> list[str]:
        return [d["partition"] for d in self.list()]

    def list(self) -> list[dict[str, Any]]:
        """Every partition with samples: ``partition``, ``num_samples``, ``fields``, ``nbytes``."""
        return list(self._ctrl().call({"op": "list"}, timeout=self.timeout)[0]["partitions"])

    def describe(self, partition: str) -> PartitionInfo:
        d = self._ctrl().call({"op": "describe", "p": partition}, timeout=self.timeout)[0]
        return PartitionInfo(d["partition"], list(d["sample_ids"]), dict(d["fields"]), int(d["nbytes"]))

    def stats(self) -> dict[str, Any]:
        """The controller's view: samples, blocks, live and retained bytes, per unit."""
        reply = self._ctrl().call({"op": "stats"}, timeout=self.timeout)[0]
        return {k: v for k, v in reply.items() if k not in _ENVELOPE_KEYS}

    def unit_usage(self) -> dict[str, tuple[int, int]]:
        """Per storage unit: (samples with a row there, live bytes there)."""
        return {name: (int(u["samples"]), int(u["live_bytes"])) for name, u in self.stats()["units"].items()}

    def close(self) -> None:
        self._pool.close()
        self.streams.close()

    # -- implementation --------------------------------------------------------------
    def _ctrl(self) -> Channel:
        return self._pool.get(self.controller, "controller")

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
        down = self._ctrl().call({"op": "unit_down", "u": index}, timeout=min(self.timeout, 30.0))[0]["down"]
        self.down = {int(u) for u in down}
        return index in self.down

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportError(f"the call ran past its deadline of {self.timeout:.0f} s (connect(timeout=...))")
        return left

    def _place(self, n: int, nbytes: int) -> list[list[Any]]:
        """Blocks for ``n`` rows: one unit per block, split over units when the put is big
        (so the shares move in parallel); fresh random ids; units taken in turn."""
        live = [u for u in range(len(self.units)) if u not in self.down]
        if not live:
            raise UnavailableError("every storage unit of the store is lost; the service needs a restart",
                                   component="storage units")
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

    def _send_blocks(self, blocks: list[list[Any]], columns: Mapping[str, Column]) -> list[tuple[Channel, int]]:
        sent = []
        for bid, units, a, z in blocks:
            part = {f: _rows(c, a, z) for f, c in columns.items()}
            for u in units:
                ch = self._unit(u)
                sent.append((ch, ch.send({"op": "write", "b": bid}, part)))
        return sent

    def _wait_blocks(self, sent: list[tuple[Channel, int]], deadline: float) -> None:
        for ch, rid in sent:
            ch.receive(rid, deadline)

    def _drop_blocks(self, sent: list[tuple[Channel, int]], blocks: list[list[Any]], deadline: float) -> None:
        """After a refused reservation: let the writes land, then free what they stored."""
        try:
            self._wait_blocks(sent, min(deadline, time.monotonic() + _ABORT_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - a write that failed stored nothing
            pass
        for bid, units, _, _ in blocks:
            for u in units:
                try:
                    self._unit(u).call({"op": "free", "b": ints([bid])}, timeout=_ABORT_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - best effort; the unit may be gone
                    pass

    def _get(self, partition: str, ids: list[str], fields: list[str]) -> tuple[dict[str, Column], list[dict[str, Any]]]:
        deadline = time.monotonic() + self.timeout
        loc = self._ctrl().call({"op": "locate", "p": partition, "ids": ids, "fields": fields},
                                timeout=self._left(deadline))[0]
        n = len(ids)
        # Each field's rows land in one buffer sized from the row bytes the controller
        # recorded; a unit's share of contiguous rows is received straight into its place.
        row_bytes = {f: int_array(loc["nb"][f], "row bytes") for f in fields}
        starts = {f: np.concatenate([[0], np.cumsum(row_bytes[f])]) for f in fields}
        shares: dict[str, int] = {}
        for _, entries in loc["units"]:
            for e in entries:
                shares[e[0]] = shares.get(e[0], 0) + 1
        # A field one unit holds whole is used as it arrives (the received frame, no copy).
        out = {f: np.empty(int(starts[f][-1]) if shares.get(f, 0) > 1 else 0, np.uint8) for f in fields}
        sent = []
        for u, entries in loc["units"]:
            ch = self._unit(u)
            sinks = {}
            for name, _, _, pos in entries:
                p = int_array(pos, "positions")
                if shares[name] > 1 and p.size and p[-1] - p[0] + 1 == p.size:  # contiguous rows of the request
                    sinks[name] = memoryview(out[name])[int(starts[name][p[0]]) : int(starts[name][p[-1] + 1])]
            sent.append((entries, ch, ch.send({"op": "read", "p": partition, "f": [e[:3] for e in entries]}), sinks))
        parts: dict[str, list[tuple[RawColumn, np.ndarray, bool]]] = {f: [] for f in fields}
        for entries, ch, rid, sinks in sent:
            cols = ch.receive(rid, deadline, _sink(sinks))[1]
            for name, _, _, pos in entries:
                if name not in cols:
                    raise WireFormatError("a storage unit did not return a requested field", field=name)
                parts[name].append((cols[name], int_array(pos, "positions"), name in sinks))
        columns = {f: _assemble(f, parts[f], n, out[f], row_bytes[f]) for f in fields}
        geoms, user = loc["g"], loc["user"]
        sums = {f: np.frombuffer(loc["h"][f], "<u8").tolist() for f in fields}
        tags = [{**user[i], WIRE_TAG: {f: geoms[f][i] for f in fields}, SUM_TAG: {f: sums[f][i] for f in fields}}
                for i in range(n)]
        return columns, tags


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


def _rows(col: Column, a: int, z: int) -> Column:
    """Rows ``a:z`` of ``col`` (values as a view; offsets rebased)."""
    if a == 0 and z == col.num_rows:
        return col
    off = col.offsets[a : z + 1]
    return Column(col.values[int(off[0]) : int(off[-1])], off - off[0])


def _assemble(name: str, parts: list[tuple[RawColumn, np.ndarray, bool]], n: int, out: np.ndarray,
              row_bytes: np.ndarray) -> Column:
    """One field's rows in request order, in ``out`` (the shares received in place are
    there already; any other is copied in)."""
    if not parts:
        return Column.empty(torch.uint8)
    dtypes = {p.dtype for p, _, _ in parts}
    if len(dtypes) > 1:
        raise ShapeError(f"the requested samples were written with different dtypes {sorted(dtypes)}", field=name)
    dtype = dtypes.pop()
    itemsize = np.dtype(numpy_dtype(dtype_from_name(dtype))).itemsize
    if out.size % itemsize or bool((row_bytes % itemsize).any()):
        raise WireFormatError(f"row sizes are not whole {dtype} elements", field=name)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(row_bytes // itemsize, out=offsets[1:])
    if len(parts) == 1 and parts[0][1].size == n and bool((parts[0][1] == np.arange(n)).all()):
        col = parts[0][0]  # one unit held every row, in order: its frame is the column
        if not np.array_equal(col.offsets, offsets):
            raise WireFormatError("a storage unit returned rows of other sizes than the controller recorded", field=name)
        values = col.values if col.values.flags.writeable else col.values.copy()
        return Column(torch.from_numpy(values).view(dtype_from_name(dtype)), torch.from_numpy(offsets))
    values = out.view(numpy_dtype(dtype_from_name(dtype)))
    covered = 0
    for col, pos, in_place in parts:
        if col.num_rows != pos.size:
            raise WireFormatError(f"a storage unit returned {col.num_rows} rows for {pos.size}", field=name)
        want = offsets[pos + 1] - offsets[pos]
        if not np.array_equal(np.diff(col.offsets), want):
            raise WireFormatError("a storage unit returned rows of other sizes than the controller recorded", field=name)
        covered += pos.size
        if in_place:
            continue
        _scatter(values, offsets, pos, col.values, col.offsets)
    if covered != n:
        raise WireFormatError(f"storage units returned {covered} of {n} rows", field=name)
    return Column(torch.from_numpy(values).view(dtype_from_name(dtype)), torch.from_numpy(offsets))


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


__all__ = ["NativeTransport", "reachable"]
