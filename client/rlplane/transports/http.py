"""HttpTransport: columns through the service's HTTP data endpoints.

The fallback data path when the storage units are out of reach (another network, no
``transfer_queue`` installed). Bytes travel as rlplane envelopes (msgpack header + raw
buffers, see ``rlplane.envelope``) and the service checks them against its registry
before storing anything. Slower than ``tq``: every byte crosses the Serve HTTP proxy.

Example::

    t = HttpTransport(ServiceAPI("http://127.0.0.1:8000"))
    t.put("step-0", ids, enc.columns, enc.tags, create=True)
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence
from urllib.parse import quote

import numpy as np

from rlplane.column import Column
from rlplane.envelope import CONTENT_TYPE, chunked, pack_parts, unpack
from rlplane.errors import MissingDataError, WireFormatError
from rlplane.http_api import ServiceAPI
from rlplane.claims import ClaimRequest
from rlplane.tags import BORN_TAG
from rlplane.transports.base import PartitionInfo, Transport, check_put


#: Body pieces handed to the HTTP client at most this big. httpx sends a ``bytes`` body by
#: re-slicing what is left after every socket send (a copy each time: quadratic in the
#: body size; a 168 MB put spent >50% of its 1.3 s there); views of 1 MiB keep that small.
_CHUNK = 1 << 20


def _p(partition: str) -> str:
    return quote(partition, safe="")


class HttpTransport(Transport):
    """Moves columns over the service's ``/v1/data`` endpoints (see the module docstring)."""

    name = "http"
    counts_waits = True  # (rlplane.http_api counts them)
    durable_puts = True  # the service decides (InvalidArgumentError without a journal)
    checks_lengths = True  # the service checks a write's token rows when its store does (native)
    checks_born = True  # the service refuses a stale meta when its store keeps incarnations (native)
    checks_rewrites = True  # an extend sends the digests it read; the service's store checks them where it can (native)
    probes_fields = True  # the service looks for the fields a stale meta does not list (its store: every built-in one)
    shares_rows = True  # a row several samples of a put share crosses once, each way (the service's store
    #                     keeps it once where it shares rows: native; else it stores every copy)

    def __init__(self, api: ServiceAPI) -> None:
        self.api = api
        self.streams = HttpStreams(api)

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
        born: Any = None,
        grows: Any = None,
        read_sums: Mapping[str, Any] | None = None,
    ) -> int | None:
        """``durable``: the service answers once the put is in its journal on disk.
        ``aligned`` (a write of stored samples): the service checks the token rows' lengths
        against the samples' (with its own registry's token fields) where its store can;
        with ``grows`` (an extend: the lengths it read) that no token field a sample holds
        is left out and no sample was grown by another extend since; with ``read_sums`` (the
        digests of the token rows it read, per field) that no write replaced one since.
        ``born``: each sample's incarnation as the caller's meta names it (the service's
        store refuses a stale meta where it keeps them). Returns the incarnation a create
        gave its samples (None where the store keeps none)."""
        check_put(sample_ids, columns, tags, shares_rows=True)
        if any(c.held is not None and c.held.rows.size for c in columns.values()):
            raise WireFormatError("rows the store holds from earlier puts do not travel over HTTP: send their bytes")
        head: dict[str, Any] = {"sample_ids": list(sample_ids), "tags": [dict(t) for t in tags]}
        if born is not None:
            head["born"] = np.asarray(born, np.int64).tolist()
        if grows is not None and aligned and not create:
            head["grown_from"] = np.asarray(grows, np.int64).tolist()
            if read_sums:
                head["read_sums"] = {f: np.asarray(v, "<u8").tobytes() for f, v in read_sums.items()}
        parts = pack_parts(head, columns)
        params = {"create": "true" if create else "false", **({"durable": "true"} if durable else {}),
                  **({"aligned": "true"} if aligned and not create else {})}
        answer = self.api.request(
            "POST",
            f"/v1/data/{_p(partition)}/put",
            params=params,
            content=chunked(parts, _CHUNK),
            headers={"Content-Type": CONTENT_TYPE, "Content-Length": str(sum(len(p) for p in parts))},
        )
        try:
            reply = answer.json()
        except ValueError:  # (not JSON: nothing to learn from it)
            reply = None
        got = reply.get("born") if isinstance(reply, dict) else None
        return got if create and born is None and type(got) is int and got > 0 else None

    def get(
        self, partition: str, sample_ids: Sequence[str], fields: Sequence[str], *, copy: bool = True,
        born: Any = None, shared: bool = False, probe: Sequence[str] = (),
    ) -> tuple[dict[str, Column], list[dict[str, Any]]]:
        """``born``: the incarnations the caller's meta names (MissingDataError, from a
        store that keeps them, for samples cleared and put again since). ``shared``: a row
        the store keeps once for several of the samples crosses once (Column.same).
        ``probe``: fields not read, looked for (FieldsHeldError naming those some of the
        samples hold; a service of an earlier release looks for none)."""
        return self._fetch(partition, sample_ids, fields, born, shared, probe)

    def _fetch(self, partition: str, sample_ids: Sequence[str], fields: Sequence[str], born: Any, shared: bool,
               probe: Sequence[str] = ()) -> tuple[dict[str, Column], list[dict[str, Any]]]:
        ask: dict[str, Any] = {"sample_ids": list(sample_ids), "fields": list(fields)}
        if shared:
            ask["shared"] = True
        if probe:
            ask["probe"] = list(probe)
        if born is not None:
            ask["born"] = np.asarray(born, np.int64).tolist()
        body = self.api.read_into("POST", f"/v1/data/{_p(partition)}/get", json=ask)
        header, columns = unpack(body)
        tags = header.get("tags")
        if not isinstance(tags, list) or len(tags) != len(sample_ids):
            raise WireFormatError(f"the service returned tags for {len(tags or [])} of {len(sample_ids)} samples")
        lacking = [f for f in fields if f not in columns]
        if lacking:
            # (the service answers every field or an error: an answer without one is not the store's word)
            raise WireFormatError(f"the service answered a read of {partition!r} without the column(s) {lacking}")
        return columns, tags

    def replaced(self, partition: str, sample_ids: Sequence[str], tags: Sequence[Mapping[str, Any]]) -> list[str]:
        """Those of the samples a read got (with ``tags``) that are gone or were put again
        since: the service is asked for their tags alone, naming the incarnations the read
        got ([] where the store keeps none)."""
        born = [(t or {}).get(BORN_TAG) for t in tags]
        if not born or not all(type(b) is int and b > 0 for b in born):
            return []
        try:
            self._fetch(partition, sample_ids, [], born, False)
        except MissingDataError as err:
            return [s for s, lacks in err.missing.items() if not lacks] or list(sample_ids)
        return []

    def clear(self, partition: str, sample_ids: Sequence[str] | None = None) -> int:
        if sample_ids is None:
            return int(self.api.json("DELETE", f"/v1/partitions/{_p(partition)}")["cleared"])
        body = {"sample_ids": list(sample_ids)}
        return int(self.api.json("POST", f"/v1/partitions/{_p(partition)}/clear", json=body)["cleared"])

    def partitions(self) -> list[str]:
        return [p["partition"] for p in self.api.json("GET", "/v1/partitions")["partitions"]]

    def describe(self, partition: str) -> PartitionInfo:
        d = self.api.json("GET", f"/v1/partitions/{_p(partition)}")
        return PartitionInfo(d["partition"], list(d["sample_ids"]), dict(d["fields"]), int(d["nbytes"]))

    def sharing(self) -> dict[str, int] | None:
        """See :meth:`Transport.sharing` (the service's status says, where its store shares rows)."""
        got = self.api.json("GET", "/v1/status").get("sharing")
        return {k: int(v) for k, v in got.items()} if isinstance(got, dict) else None

    def close(self) -> None:
        self.api.close()


class HttpStreams:
    """Claims, acks and consumption through ``/v1/partitions/{id}/...`` (the same methods
    as :class:`rlplane.streams.DirectStreams`). A waiting claim is one HTTP request per
    ``wait_s``; the service parks it without holding a thread."""

    def __init__(self, api: ServiceAPI, *, timeout: float = 60.0) -> None:
        self.api, self.timeout = api, timeout

    def claim(self, req: ClaimRequest) -> dict[str, Any]:
        out = self.api.json("POST", f"/v1/partitions/{_p(req.partition)}/claim", json=_claim_body(req),
                            timeout=req.wait_s + self.timeout)
        return {**out, "ids": out["sample_ids"]}

    def ack(self, partition: str, task: str, lease: int, ids: Sequence[str] | None) -> int:
        body = {"task": task, "lease": lease, "sample_ids": None if ids is None else list(ids)}
        return int(self.api.json("POST", f"/v1/partitions/{_p(partition)}/ack", json=body)["acked"])

    def nack(self, partition: str, task: str, lease: int, ids: Sequence[str] | None) -> int:
        body = {"task": task, "lease": lease, "sample_ids": None if ids is None else list(ids)}
        return int(self.api.json("POST", f"/v1/partitions/{_p(partition)}/nack", json=body)["nacked"])

    def consumption(self, partition: str, task: str) -> dict[str, int]:
        return dict(self.api.json("GET", f"/v1/partitions/{_p(partition)}/consumption", params={"task": task}))

    def close(self) -> None:
        """Nothing of its own: the transport closes the API."""


def _claim_body(req: ClaimRequest) -> dict[str, Any]:
    return {"task": req.task, "batch_size": req.batch_size, "fields": list(req.fields), "timeout": req.wait_s,
            "min_batch": req.min_batch, "group_key": req.group_key, "current_version": req.current_version,
            "max_staleness": req.max_staleness, "lease_s": req.lease_s, "max_tokens": req.max_tokens,
            "min_tokens": req.min_tokens, "unfinished": req.unfinished}


__all__ = ["HttpTransport", "HttpStreams"]
