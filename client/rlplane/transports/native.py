"""NativeTransport: columns straight to rlplane's own storage engine over ZMQ.

The service's native store is a controller (the sample index) and storage units (the
bytes, as columnar blocks). This transport talks to both directly, with nothing but
the addresses and the data secret that ``GET /v1/transport`` hands out under the API
token: no Ray, no pickle. Messages per put or read: one to the controller, one per
storage unit involved, one more to the controller; never one per sample.

- ``put``: reserve the ids (atomic: concurrent puts of the same new ids, exactly one
  wins), send each block to its unit(s), commit. Anything failing in between aborts the
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

import socket
import time
from typing import Any, Mapping, Sequence

import numpy as np

from rlplane.channel import Channel, ChannelPool
from rlplane.codec import RESERVED_TAG_PREFIX, WIRE_TAG
from rlplane.column import Column
from rlplane.errors import MissingDataError, TransportError, WireFormatError
from rlplane.gather import gather
from rlplane.transports.base import PartitionInfo, Transport, check_put
from rlplane.wire import RawColumn, int_array, ints

#: Keys every reply header carries besides the operation's answer.
_ENVELOPE_KEYS = {"ok", "rid", "v", "c", "nbuf"}
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
        hello = self._ctrl().call({"op": "hello"}, timeout=min(timeout, 10.0))[0]
        self.units: list[tuple[str, str]] = [(str(n), str(e)) for n, e in hello["units"]]

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
        ids = list(sample_ids)
        deadline = time.monotonic() + self.timeout
        names = list(columns)
        # Split tags: geometry per field (kept in the controller's arrays), user tags per sample.
        geoms = {f: [t.get(WIRE_TAG, {}).get(f) for t in tags] for f in names}
        user = [{k: v for k, v in t.items() if not k.startswith(RESERVED_TAG_PREFIX)} for t in tags]
        for f, g in geoms.items():
            if any(x is None for x in g):
                raise WireFormatError("a row carries no wire geometry (encode it with rlplane's codec)", field=f)
        nbytes = sum(c.nbytes for c in columns.values())
        ctrl = self._ctrl()
        res = ctrl.call({"op": "reserve", "p": partition, "ids": ids, "create": create, "fields": names,
                         "nbytes": nbytes}, timeout=self._left(deadline))[0]
        try:
            if names:
                self._write_blocks(res["blocks"], columns, deadline)
            commit: dict[str, Any] = {"op": "commit", "res": res["res"], "g": geoms,
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

    # -- implementation --------------------------------------------------------------
    def _ctrl(self) -> Channel:
        return self._pool.get(self.controller, "controller")

    def _unit(self, u: int) -> Channel:
        if not 0 <= u < len(self.units):
            raise WireFormatError(f"the controller named storage unit {u} of {len(self.units)}")
        name, endpoint = self.units[u]
        return self._pool.get(endpoint, name)

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportError(f"the call ran past its deadline of {self.timeout:.0f} s (connect(timeout=...))")
        return left

    def _write_blocks(self, blocks: list[list[Any]], columns: Mapping[str, Column], deadline: float) -> None:
        sent = []
        for bid, units, a, z in blocks:
            part = {f: _rows(c, a, z) for f, c in columns.items()}
            for u in units:
                ch = self._unit(u)
                sent.append((ch, ch.send({"op": "write", "b": bid}, part)))
        for ch, rid in sent:
            ch.receive(rid, deadline)

    def _get(self, partition: str, ids: list[str], fields: list[str]) -> tuple[dict[str, Column], list[dict[str, Any]]]:
        deadline = time.monotonic() + self.timeout
        loc = self._ctrl().call({"op": "locate", "p": partition, "ids": ids, "fields": fields},
                                timeout=self._left(deadline))[0]
        sent = []
        for u, entries in loc["units"]:
            ch = self._unit(u)
            sent.append((entries, ch, ch.send({"op": "read", "p": partition, "f": [e[:3] for e in entries]})))
        parts: dict[str, list[tuple[RawColumn, np.ndarray]]] = {f: [] for f in fields}
        for entries, ch, rid in sent:
            cols = ch.receive(rid, deadline)[1]
            for name, _, _, pos in entries:
                if name not in cols:
                    raise WireFormatError("a storage unit did not return a requested field", field=name)
                parts[name].append((cols[name], int_array(pos, "positions")))
        n = len(ids)
        columns = {f: _assemble(f, parts[f], n) for f in fields}
        geoms, user = loc["g"], loc["user"]
        tags = [{**user[i], WIRE_TAG: {f: geoms[f][i] for f in fields}} for i in range(n)]
        return columns, tags


def _rows(col: Column, a: int, z: int) -> Column:
    """Rows ``a:z`` of ``col`` (values as a view; offsets rebased)."""
    if a == 0 and z == col.num_rows:
        return col
    off = col.offsets[a : z + 1]
    return Column(col.values[int(off[0]) : int(off[-1])], off - off[0])


def _assemble(name: str, parts: list[tuple[RawColumn, np.ndarray]], n: int) -> Column:
    """One field's rows from each unit's share, in request order, in writable memory."""
    if not parts:
        return Column.empty(torch_uint8())
    dtypes = {p.dtype for p, _ in parts}
    if len(dtypes) > 1:
        from rlplane.errors import ShapeError

        raise ShapeError(f"the requested samples were written with different dtypes {sorted(dtypes)}", field=name)
    for col, pos in parts:
        if col.num_rows != pos.size:
            raise WireFormatError(f"a storage unit returned {col.num_rows} rows for {pos.size}", field=name)
    if len(parts) == 1 and parts[0][1].size == n and bool((parts[0][1] == np.arange(n)).all()):
        return parts[0][0].to_column(copy=True)
    which = np.empty(n, np.int64)
    rows = np.empty(n, np.int64)
    for k, (_, pos) in enumerate(parts):
        which[pos] = k
        rows[pos] = np.arange(pos.size)
    values, offsets = gather([(c.values, c.offsets) for c, _ in parts], which, rows)
    return RawColumn(parts[0][0].dtype, values, offsets).to_column(copy=not values.flags.writeable)


def torch_uint8() -> Any:
    import torch

    return torch.uint8


__all__ = ["NativeTransport", "reachable"]
