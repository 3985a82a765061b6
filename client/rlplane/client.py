"""Client: the verbs stages use — put samples, add columns, read what a stage needs.

The client speaks fields and metas; a :class:`~rlplane.transports.Transport` moves the
encoded columns. Validation happens here, before any byte moves: a call that fails
stores nothing.

Example::

    client = Client(default_registry(), MemoryTransport())
    meta = client.put_samples("step-0", batch)                 # rollout
    for shard in meta.shard(2):
        inputs = client.read_columns(shard, stage="logprob")   # logprob ranks
        client.write_columns(shard, {"prev_logprobs": lp})
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
import weakref
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from rlplane.codec import WIRE_TAG, Encoded, Prepared, alloc_sizes, decode, encode, prepare
from rlplane.errors import (DtypeError, FieldsHeldError, HELD_GONE, IntegrityError, InvalidArgumentError, LeaseError,
                            MissingDataError, NotReadyError, RlplaneError, ShapeError, TransportError, WireFormatError)
from rlplane.fields import LENGTHS_FIELD, Registry
from rlplane.geometry import Geometry
from rlplane.gcpause import gc_paused
from rlplane.claims import AWAIT_STEP_S, MAX_WAIT_S, ClaimRequest
from rlplane.extension import Appending, token_fields
from rlplane.meta import SampleMeta
from rlplane.names import check_partition
from rlplane.opstats import OpEvent, OpStats
from rlplane import rowkernels, snapshot
from rlplane.scratch import Scratch
from rlplane.snapshot import SnapshotInfo
from rlplane.tags import BORN_TAG, FINISHED_TAG, SUM_TAG, RowTags, check_user_tags, stale_as
from rlplane.transports.base import Transport, born_check, length_check

log = logging.getLogger(__name__)

#: How long a snapshot the service makes may take.
SNAPSHOT_TIMEOUT_S = 3600.0
#: How often (at most) a tq client hands its op counts to the service's /metrics.
REPORT_EVERY_S = 5.0
#: The longest a report of ops to the service waits for it, and the longest between two
#: reports while they fail (each failure doubles the wait from REPORT_EVERY_S).
REPORT_TIMEOUT_S, REPORT_BACKOFF_S = 2.0, 60.0


class Client:
    """Put and read declared fields through a transport (see the module docstring)."""

    def __init__(self, registry: Registry, transport: Transport, *, service: Any = None, reuse_buffers: bool = True) -> None:
        self.registry = registry
        self.transport = transport
        self._shares = bool(getattr(transport, "shares_rows", False))  # identical rows stored once (rlplane.dedup)
        # Encode buffers kept from one put to the next (see rlplane.scratch): the second and
        # later puts skip the page faults of fresh memory. reuse_buffers=False frees them.
        self._scratch = Scratch() if reuse_buffers else None
        self._service = service  # the ServiceAPI when made by rlplane.connect; closed with the client
        self.ops = OpStats(transport.name)
        self._last_report = time.monotonic()
        self._report_every = REPORT_EVERY_S  # (longer while reports fail)
        self._report_lock, self._reporter = threading.Lock(), None
        self.closed = False
        # A client dropped without close() still gives its connections back when it is
        # garbage (the finalizer holds the transport and the service, not the client).
        self._finalizer = weakref.finalize(self, _release, transport, service)
        rowkernels.load_soon()  # (the compiled row copies, ~0.4 s: loaded before the first big read needs them)

    # -- writing ---------------------------------------------------------------------
    def put_samples(
        self,
        partition: str,
        fields: Mapping[str, Any],
        *,
        sample_ids: Sequence[str] | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
        durable: bool = False,
        finished: bool = True,
    ) -> SampleMeta:
        """Store new samples; returns their meta.

        Lengths come from ``input_lengths`` (required when a token field is written).
        An invalid field raises a typed error naming field and sample; nothing is stored.
        ``durable=True``: returns once the put is in the store's journal on disk
        (RLPLANE_JOURNAL_DIR; native backend): it survives every engine process dying.
        ``finished=False`` starts partial rollouts (tag ``finished`` False): claims and a
        stage's readiness skip them until :meth:`extend` (or a write of the tag) finishes them.

        Example::

            meta = client.put_samples("step-0", {"input_ids": ids, "input_lengths": lens})
        """
        with self._op("put_samples") as op:
            check_partition(partition)
            prep = prepare(self.registry, fields, fields.get(LENGTHS_FIELD), sample_ids=sample_ids)
            batch, lengths = prep
            _ready_for(self.transport, fields)
            ids = [str(s) for s in sample_ids] if sample_ids is not None else _new_ids(batch)
            if len(ids) != batch:
                raise ShapeError(f"{len(ids)} sample ids for a batch of {batch} samples")
            user = _user_tags(tags, batch, ids)
            if not finished:
                user = [{**u, FINISHED_TAG: False} for u in user]
            if durable and not self.transport.durable_puts:
                raise InvalidArgumentError(f"put_samples(..., durable=True) needs the native backend with a "
                                           f"journal (RLPLANE_JOURNAL_DIR); this client's transport is "
                                           f"{getattr(self.transport, 'name', type(self.transport).__name__)!r}")
            if not batch:  # (a step whose samples were all filtered out: checked, nothing to store)
                return SampleMeta(partition, [], [], frozenset(f for f in fields if fields[f] is not None))
            # Rows the partition holds from earlier puts are not written again (rlplane.dedup);
            # if a clear takes them before the commit, the put writes them itself.
            lookup = getattr(self.transport, "held_rows", None) if self._shares and not durable else None
            try:
                enc, merged = self._put_once(op, partition, ids, fields, prep, user, tags is not None or not finished,
                                             durable, lookup)
            except LeaseError as err:
                if lookup is None or getattr(err, "component", "") != HELD_GONE:
                    raise
                enc, merged = self._put_once(op, partition, ids, fields, prep, user, tags is not None or not finished,
                                             durable, _none_held)
            op.nbytes = enc.nbytes
        stored_lengths = lengths.tolist() if lengths is not None else [0] * batch
        return SampleMeta(partition, ids, stored_lengths, frozenset(enc.columns), merged)

    def _put_once(self, op: OpEvent, partition: str, ids: list[str], fields: Mapping[str, Any], prep: Prepared,
                  user: list[dict[str, Any]], tagged: bool, durable: bool, lookup: Any) -> tuple[Encoded, Any]:
        held = (lambda name, keys: lookup(partition, name, keys)) if lookup is not None else None
        sizes = alloc_sizes(self.registry, fields, prep)  # (staged at once, where the store stages)
        with self._buffers() as mine, self.transport.put_buffers(len(ids), mine, sizes) as alloc:
            with op.part("codec"):
                enc = encode(self.registry, fields, sample_ids=ids, alloc=alloc, prepared=prep,
                             share_rows=self._shares, held=held)
            merged = enc.tags.with_user(user) if tagged else enc.tags
            if durable:
                born = self.transport.put(partition, ids, enc.columns, merged, create=True, durable=True)
            else:
                born = self.transport.put(partition, ids, enc.columns, merged, create=True)
        if type(born) is int and born > 0:  # the incarnation the store gave the samples: their meta names it
            merged = merged.with_born(born) if isinstance(merged, RowTags) else \
                [{**t, BORN_TAG: born} for t in merged]
        return enc, merged

    def write_columns(self, meta: SampleMeta, fields: Mapping[str, Any]) -> SampleMeta:
        """Add (or replace) fields of stored samples, e.g. a stage's outputs.

        Example::

            meta = client.write_columns(shard, {"prev_logprobs": logprobs})
        """
        with self._op("write_columns") as op:
            lengths = torch.tensor(meta.lengths, dtype=torch.int64)
            given = fields.get(LENGTHS_FIELD)
            if LENGTHS_FIELD not in meta.fields and not any(meta.lengths) and \
                    (token := [n for n in fields if n in self.registry and self.registry.get(n).alignment == "token"]):
                raise ShapeError("the meta names no lengths (the samples were put without input_lengths, or the meta "
                                 "was made by hand), so a token field's rows have none to be cut to (they would be "
                                 "stored empty); put input_lengths with the samples, and write with their meta",
                                 field=token[0], sample=meta.sample_ids[0] if len(meta) else None)
            prep = prepare(self.registry, fields, given if given is not None else lengths, sample_ids=meta.sample_ids)
            if given is not None and not torch.equal(prep.lengths, lengths):
                raise ShapeError("differs from the meta's lengths; lengths are fixed at put_samples", field=LENGTHS_FIELD)
            if given is not None and LENGTHS_FIELD in meta.fields:
                # (it checked the write; stored again, a meta older than an extend would put old lengths back)
                fields = {k: v for k, v in fields.items() if k != LENGTHS_FIELD}
            if not len(meta):  # (checked, nothing to store, as a put of no samples)
                return meta
            _ready_for(self.transport, fields)
            sizes = alloc_sizes(self.registry, fields, prep)
            with self._buffers() as mine, self.transport.put_buffers(len(meta), mine, sizes) as alloc:
                with op.part("codec"):
                    enc = encode(self.registry, fields, sample_ids=meta.sample_ids, alloc=alloc, prepared=prep,
                                 share_rows=self._shares)
                if not enc.columns:
                    return meta
                self.transport.put(meta.partition, meta.sample_ids, enc.columns, enc.tags, create=False,
                                   **length_check(self.registry, self.transport), **born_check(self.transport, meta.tags))
                op.nbytes = enc.nbytes
        return meta.with_fields(enc.columns, enc.tags)

    def extend(self, meta: SampleMeta, fields: Mapping[str, Any], *, finished: bool = False) -> SampleMeta:
        """Append tokens to stored samples (partial rollouts): ``fields`` holds, for every
        token field the samples hold (and only those), the new tokens ``[B, T, ...]``, and
        ``input_lengths`` how many each sample gets (0 for none). The samples' lengths grow;
        every other field stays as it is. ``finished=True`` marks them done: claims hand
        them out from then on. Returns the meta with the new lengths. A token field left
        out (the store says which the samples hold, whatever the meta lists), or one the
        samples do not hold, is a ShapeError naming it, and nothing changes; tokens a put
        would store as another dtype than the samples' are a DtypeError naming the field.
        One writer extends a sample at a time (the rollout that owns it): of two extends of
        the same sample at once, the later to commit is a ShapeError and stores nothing, and
        so is an extend after whose read a write replaced a token row it read (atomic on the
        native engine, direct or over HTTP; the TransferQueue-based stores narrow the window only).

        Example::

            meta = client.put_samples("step-0", {"input_ids": ids, "input_lengths": lens}, finished=False)
            meta = client.extend(meta, {"input_ids": more, "input_lengths": more_lens}, finished=True)
        """
        with self._op("extend") as op:
            names = token_fields(self.registry, meta.fields, fields)
            given = prepare(self.registry, fields, fields[LENGTHS_FIELD], sample_ids=meta.sample_ids)
            if given.batch != len(meta):
                raise ShapeError(f"{given.batch} samples of appended tokens for a meta of {len(meta)}")
            born = born_check(self.transport, meta.tags)  # a stale meta (samples put again since) is refused
            try:
                columns, tags = self.transport.get(meta.partition, meta.sample_ids, [*names, LENGTHS_FIELD], copy=False,
                                                   **born)  # (views, where the store has them: read once, then let go)
            except MissingDataError as err:  # a stale meta is the extend's, not the read's it starts with
                raise stale_as(err, meta.sample_ids, "extend") from None
            with op.part("codec"):
                stored = decode(self.registry, columns, tags, "packed", None, sample_ids=meta.sample_ids,
                                partition=meta.partition)  # (checks every token row against input_lengths)
            user = [{FINISHED_TAG: bool(finished)}] * len(meta)  # one map for all: nothing edits it
            plan, out = Appending(stored[LENGTHS_FIELD], given.lengths), {}
            sizes = {name: (plan.total * math.prod(stored[name].shape[1:]), stored[name].dtype) for name in names}
            with self._buffers() as mine, self.transport.put_buffers(len(meta), mine, sizes) as alloc:
                for name in names:
                    new = fields[name]
                    if new.device.type != "cpu":  # appended on the host, to the stored rows read there
                        new = new.cpu()
                    if (kept := self.registry.get(name).stored_dtype(new.dtype)) != stored[name].dtype:
                        raise DtypeError(f"appended tokens would be stored as {kept} after stored ones of "
                                         f"{stored[name].dtype}: extend with the dtype the samples were put with",
                                         field=name, sample=meta.sample_ids[0] if len(meta) else None)
                    into = (lambda numel, dtype, f=name: alloc(f, numel, dtype)) if alloc is not None else None
                    out[name] = plan.rows(stored[name], new, field=name, into=into)  # where the put lands them
                out[LENGTHS_FIELD] = lengths = plan.lengths
                prep = Prepared(len(meta), lengths)  # the stored rows and the given ones, both checked
                with op.part("codec"):
                    enc = encode(self.registry, out, sample_ids=meta.sample_ids, alloc=alloc, prepared=prep,
                                 packed=frozenset(names))
                written = enc.tags.with_user(user)
                read_sums = _read_sums(columns, tags, names)  # (a write since replaced one: refused)
                self.transport.put(meta.partition, meta.sample_ids, enc.columns, written, create=False, **born,
                                   **length_check(self.registry, self.transport, grows=stored[LENGTHS_FIELD],
                                                  read_sums=read_sums))
                op.nbytes = enc.nbytes
        grown = meta.with_fields(enc.columns, written)
        new = lengths.tolist()
        pad = meta.pad_to_seqlen if meta.pad_to_seqlen is None or meta.pad_to_seqlen >= max(new, default=0) else None
        return replace(grown, lengths=new, pad_to_seqlen=pad)

    # -- reading ---------------------------------------------------------------------
    def fields_for_stage(self, stage: str, meta_or_partition: SampleMeta | str) -> list[str]:
        """The fields ``stage`` reads for these samples (required + optional ones present,
        in every sample or in some: ``meta.some_fields``).

        Example: ``client.fields_for_stage("train", meta)``.
        """
        if isinstance(meta_or_partition, SampleMeta):
            present = meta_or_partition.fields | meta_or_partition.some_fields
        else:
            present = set(self.transport.describe(meta_or_partition).fields)
        return self.registry.fields_for_stage(stage, present)

    def read_columns(
        self,
        meta: SampleMeta,
        fields: Sequence[str] | None = None,
        *,
        stage: str | None = None,
        layout: str = "padded",
        pad_to_seqlen: int | None = None,
        copy: bool = True,
        device: torch.device | str | None = None,
    ) -> dict[str, Any]:
        """Every requested field of every sample in ``meta``, or MissingDataError.

        Name ``fields`` or a ``stage`` (its fields come from the registry). Token fields
        come back ``[B, pad_to_seqlen]`` (default: the meta's, else the longest sample),
        jagged (``layout="jagged"``) or packed (``layout="packed"``: the samples' tokens one
        after another, ``[sum(input_lengths), ...]``); packed fields as PackedTensor; object fields as lists. The caller owns
        what it gets; ``copy=False`` lets the native engine's shared-memory path hand out
        read-only views of the store's memory instead (zero copy: writing into one faults),
        whose blocks stay pinned, and so not reused, until the last view is gone.
        ``device`` (e.g. ``"cuda"``): tensors land there, each field's bytes copied once
        after their digests were checked on the host (default: host memory).

        A read by ``stage`` also asks for the stage's optional fields that only some of the
        samples hold (``meta.some_fields``: text-only samples put apart from image ones, as
        a claim or ``SampleMeta.concat`` over both says). The store decides which samples
        hold each: a media field comes back for all of them, empty (no images) for those
        without, as for a text-only sample put beside image ones, and is left out only
        when none of them holds it; an optional field of another kind that some lack is a
        MissingDataError naming them (nothing is ever left out for all of them silently).
        The store, not only the meta, says which optional fields the samples hold: one
        written after the meta was made (``write_columns`` adding images to some of them)
        is read too.

        Example::

            batch = client.read_columns(shard, stage="train", device="cuda")
        """
        with self._op("read_columns") as op:
            if fields is None and stage is None:
                raise InvalidArgumentError("read_columns needs fields=[...] or stage=...")
            if device is not None:
                device = _device(device)
                if device.type != "cpu" and self.transport.on_device(device):
                    copy = False  # views of the store's page-locked memory: the copy onto the device is the copy
            names = list(fields) if fields is not None else self.fields_for_stage(stage, meta)  # type: ignore[arg-type]
            for name in names:
                self.registry.get(name)
            if not len(meta):  # (no samples: no dtype or shape to give the fields' tensors)
                raise InvalidArgumentError(f"the meta names no samples of partition {meta.partition!r}: there is "
                                           "nothing to read (a step whose samples were all filtered out)")
            how = dict(layout=layout, pad=pad_to_seqlen if pad_to_seqlen is not None else meta.pad_to_seqlen,
                       copy=copy, device=device)
            # Optional fields only some samples may hold: the store's MissingDataError says
            # which samples lack each (a read in pieces: one piece's at a time, so each try
            # learns more, or the error is raised); the first try is the whole read.
            maybe = frozenset(f for f in meta.some_fields if self.registry.get(f).optional) if fields is None \
                else frozenset()
            # A meta older than a write that added one of the stage's optional fields to some
            # of its samples (images written after the put) does not list it: the read looks
            # for the stage's other optional fields, and reads the ones the store finds too.
            probe = [s.name for s in self.registry if stage in s.stages and s.optional and s.name not in names] \
                if fields is None else []
            lacking: dict[str, list[str]] = {}
            while True:
                try:
                    out = self._read(meta, [n for n in names if n not in lacking], op, probe=probe, **how)
                    out.update(self._read_held(meta, lacking, op, how))
                    break
                except FieldsHeldError as err:
                    found = [f for f in probe if f in (err.fields if isinstance(err.fields, list) else ())]
                    if not found:
                        raise
                    names = [s.name for s in self.registry if s.name in names or s.name in found]
                    maybe, probe = maybe | set(found), [f for f in probe if f not in found]
                except MissingDataError as err:
                    more = _lacking(err, maybe)
                    if more is None or all(set(who) <= set(lacking.get(f, ())) for f, who in more.items()):
                        raise
                    for f, who in more.items():
                        lacking[f] = sorted(set(lacking.get(f, ())) | set(who))
            some = sorted(f for f in lacking if f in out and self.registry.get(f).container != "packed")
            if some:  # (held by some, lacked by others: nothing to fill a token or sample row with)
                raise MissingDataError(meta.partition, {s: [f for f in some if s in lacking[f]] for s in
                                                        sorted({s for f in some for s in lacking[f]})},
                                       hint=f"stage {stage!r} reads the optional field(s) {some}, which only some of "
                                       "these samples hold (they were put apart): write them for the others too, or "
                                       "read those apart")
            return {n: out[n] for n in names if n in out}

    def _read_held(self, meta: SampleMeta, lacking: dict[str, list[str]], op: Any, how: dict[str, Any]
                   ) -> dict[str, Any]:
        """The fields of ``lacking`` (each with the samples of ``meta`` the store said lack
        it) read from the samples that hold them, left out where none does; a media field's
        rows placed among empty ones for the others (another field's are only read: the
        caller refuses it)."""
        out: dict[str, Any] = {}
        for group, holders in _holders(meta, lacking):  # (fields the same samples lack: one read)
            if holders.size:
                got = self._read(meta.subset(holders), group, op, **how)
                out.update({f: got[f].placed(holders.tolist(), len(meta))
                            if self.registry.get(f).container == "packed" else got[f] for f in group})
        return out

    def _read(self, meta: SampleMeta, names: list[str], op: Any, *, layout: str, pad: int | None, copy: bool,
              device: torch.device | None, probe: Sequence[str] = ()) -> dict[str, Any]:
        """One read of ``names`` for every sample of ``meta`` (see :meth:`read_columns`);
        FieldsHeldError when the samples hold fields of ``probe`` (where the store says)."""
        more: dict[str, Any] = born_check(self.transport, meta.tags)  # a stale meta (put again since) is refused
        if probe and self.transport.probes_fields:
            more["probe"] = list(probe)
        if copy and device is None and layout == "padded" and self.transport.lends_views:
            # Token rows are padded into memory of their own: out of the store's, not out of a copy of it.
            more["lend"] = [n for n in names if self.registry.get(n).alignment == "token"
                            and self.registry.get(n).container == "dense"]
        if self._shares:  # rows stored once for several samples come back as views of one copy
            more["shared"] = True
        verified: set[str] = set()
        if self.transport.verifies_reads:  # rows checked as they are copied: not digested again below
            more["verified"] = verified
        columns, tags = self.transport.get(meta.partition, meta.sample_ids, names, copy=copy, **more)
        op.nbytes += sum(col.nbytes for col in columns.values())
        with op.part("codec"):
            try:
                return decode(self.registry, columns, tags, layout, pad, sample_ids=meta.sample_ids,
                              partition=meta.partition, device=device, verified=verified, lengths=meta.lengths)
            except IntegrityError as err:  # damage, or a clear that raced this read (the rows were reused)
                gone = self.transport.replaced(meta.partition, meta.sample_ids, tags)
                if not gone:
                    raise
                raise MissingDataError(meta.partition, {s: [] for s in gone}, hint="they were cleared (and "
                                       "their storage given to another put) while this read ran") from err

    # -- streaming -------------------------------------------------------------------
    def claim(
        self,
        partition: str,
        task: str,
        *,
        batch_size: int | None = None,
        stage: str | None = None,
        fields: Sequence[str] | None = None,
        timeout: float | None = None,
        min_batch: int | None = None,
        group_key: str | None = None,
        current_version: int | None = None,
        max_staleness: int | None = None,
        lease_s: float | None = None,
        max_tokens: int | None = None,
        min_tokens: int | None = None,
        unfinished: bool = False,
    ) -> SampleMeta:
        """Up to ``batch_size`` samples of ``partition`` that are ready for ``stage`` (or hold
        ``fields``) and that ``task`` has not claimed, oldest first; exactly once per task
        across every claimer. Waits up to ``timeout`` seconds (None: for ever; 0: not at all)
        for a full batch, then returns at least ``min_batch`` or raises NotReadyError.
        ``group_key`` hands out whole groups (tag ``group_size`` says how big); with
        ``current_version``/``max_staleness`` samples whose ``policy_version`` tag is older
        are expired for this task. The samples are leased for ``lease_s``: ``ack`` them when
        done, ``nack`` to give them back; an unacked lease lapses and they come back.

        ``max_tokens`` (with or without ``batch_size``) claims by tokens: samples (whole
        groups with ``group_key``), oldest first, as long as their summed lengths fit
        ``max_tokens`` (and their count ``batch_size``). A first sample or group larger than
        the budget on its own comes alone, with ``meta.over_budget`` True. The claim
        waits until the next one would not fit; at its deadline it returns what is ready
        if that holds at least ``min_tokens`` (default ``max_tokens``) tokens.

        Partial rollouts (tag ``finished`` False: ``put_samples(..., finished=False)``) are
        not handed out until they are finished, unless ``unfinished=True``.

        Example::

            meta = client.claim("step-0", "train", batch_size=64, stage="train", timeout=30)
            batch = client.read_columns(meta, stage="train")
            client.ack(meta, "train")
            meta = client.claim("step-0", "train", max_tokens=16384, stage="train", group_key="group_id")
        """
        with self._op("claim"):
            want = ClaimRequest.build(self.registry, partition, task, batch_size, stage=stage, fields=fields,
                                      timeout=timeout, min_batch=min_batch, group_key=group_key,
                                      current_version=current_version, max_staleness=max_staleness, lease_s=lease_s,
                                      max_tokens=max_tokens, min_tokens=min_tokens, unfinished=unfinished)
            reply = self._claim(replace(want, columnar=True), timeout)
        return self._claimed_meta(partition, reply)

    def _claimed_meta(self, partition: str, reply: dict[str, Any]) -> SampleMeta:
        tags, lengths = self._claimed(reply)
        some = reply.get("some_fields") or []  # (a store of an earlier release sends none)
        if not isinstance(some, list) or not all(isinstance(f, str) for f in some):
            raise WireFormatError(f"a claim's some_fields must be a list of field names, got {some!r}")
        return SampleMeta(partition, reply["ids"], lengths, frozenset(reply["fields"]), tags,
                          pad_to_seqlen=max(lengths) if lengths and max(lengths) > 0 else None, lease=int(reply["lease"]),
                          over_budget=bool(reply.get("over_budget", False)), some_fields=frozenset(some))

    def _claim(self, want: ClaimRequest, timeout: float | None, stop: threading.Event | None = None) -> dict[str, Any]:
        """Ask the ledger in waits of at most MAX_WAIT_S; only the last may return a short batch.
        ``stop`` (an awaited claim's): waits of at most AWAIT_STEP_S, and once it is set no
        more of them."""
        streams, step = self._streams(), MAX_WAIT_S if stop is None else AWAIT_STEP_S
        deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
        while True:
            left = step if deadline is None else max(0.0, deadline - time.monotonic())
            last = deadline is not None and left <= step
            req = replace(want if last else want.filled(), wait_s=min(left, step))
            if stop is not None and stop.is_set():
                raise NotReadyError(f"the awaited claim on {want.partition!r} for {want.task!r} was cancelled")
            try:
                return streams.claim(req)
            except NotReadyError:
                if last:
                    raise

    def ack(self, meta: SampleMeta, task: str) -> int:
        """Mark the claimed samples of ``meta`` (a claim's meta, or a shard of it) consumed by
        ``task``; LeaseError when the lease expired (they went back to the task). Example:
        ``client.ack(meta, "train")``."""
        with self._op("ack"):
            return self._streams().ack(meta.partition, task, self._lease(meta), meta.sample_ids)

    def nack(self, meta: SampleMeta, task: str) -> int:
        """Give the claimed samples of ``meta`` back to ``task`` at once (another claimer gets
        them). Example: ``client.nack(meta, "train")``."""
        with self._op("nack"):
            return self._streams().nack(meta.partition, task, self._lease(meta), meta.sample_ids)

    def consumption(self, partition: str, task: str) -> dict[str, int]:
        """How ``task`` stands on ``partition``: ``samples``, ``ready``, ``claimed`` (leased,
        not acked), ``acked``, ``expired`` (stale), ``pending`` (ready, never claimed) and
        ``redelivered``; on the native engine also ``controller_restarts`` once its controller
        restarted (claims and acks before that are gone: every sample is pending again).
        Example: ``client.consumption("step-0", "train")["pending"]``."""
        check_partition(partition)
        return self._streams().consumption(partition, task)

    def _streams(self) -> Any:
        if self.transport.streams is None:
            raise TransportError(f"the {self.transport.name!r} transport cannot reach a consumption ledger; "
                                 "connect to an rlplane service (rlplane.connect) to claim samples")
        return self.transport.streams

    @staticmethod
    def _lease(meta: SampleMeta) -> int:
        if meta.lease is None:
            raise LeaseError("this meta holds no lease: only a meta from client.claim (or a shard of it) can be "
                             "acked or nacked")
        return meta.lease

    def _claimed(self, reply: Mapping[str, Any]) -> tuple[Sequence[Mapping[str, Any]], list[int]]:
        """A claim's tags and each sample's length (the leading dim of its first token field's
        row, 0 for none): from the columns a store answers with (``g``: each field's wire
        geometry, ``user``: each sample's user tags; no map built per sample), or from the
        tag map it sends per sample."""
        born = reply.get("born")  # each sample's incarnation (also in its tags): kept as one array for the checks
        n = len(reply["ids"])
        born = np.asarray(born, np.int64) if isinstance(born, list) and len(born) == n else None
        token = self.registry.token_fields()
        if "g" in reply:
            user = reply.get("user")
            if not isinstance(reply["g"], dict) or not (user is None or isinstance(user, list) and len(user) == n):
                raise WireFormatError("a claim's tag columns need 'g' (geometry per field) and one 'user' map per sample")
            geoms = {f: Geometry.from_wire(g, f, n) for f, g in reply["g"].items()}
            lengths = np.full(n, -1, np.int64)
            for f in (f for f in token if f in geoms):
                lengths = np.where(lengths < 0, geoms[f].leads(), lengths)
            return RowTags(user, geoms, {}, n, born), np.maximum(lengths, 0).tolist()
        tags = reply["tags"]
        out = []
        for tag in tags:
            wire = tag.get(WIRE_TAG) or {}
            g = next((wire[f] for f in token if isinstance(wire.get(f), list) and wire[f]), None)
            out.append(int(g[0]) if g is not None else 0)
        if born is not None and isinstance(tags, list) and len(tags) == n:
            tags = RowTags(tags, {}, {}, n, born)
        return tags, out

    # -- housekeeping ----------------------------------------------------------------
    def clear(self, partition: str, sample_ids: Sequence[str] | None = None) -> int:
        """Drop samples (the whole partition when ``sample_ids`` is None); returns how many."""
        with self._op("delete_partition" if sample_ids is None else "clear"):
            check_partition(partition)
            return self.transport.clear(partition, sample_ids)

    def partitions(self) -> list[str]:
        """Partitions that hold samples."""
        return self.transport.partitions()

    def stats(self) -> dict[str, Any]:
        """What the store holds (per partition: sample count, fields present, bytes; and,
        where it stores rows identical across samples once, ``sharing``: bytes written,
        stored and shared, :meth:`Transport.sharing`), how
        this client's bytes move (``paths``: per storage unit ``shm`` or ``zmq``) and
        what this client did (``ops``: per op count, errors, bytes, wall time p50/p90;
        see :meth:`rlplane.opstats.OpStats.summary`).

        Example: ``client.stats()["partitions"]["step-0"]["nbytes"]``,
        ``client.stats()["ops"]["read_columns"]["p90_s"]``.
        """
        parts = {}
        for name in self.transport.partitions():
            try:
                info = self.transport.describe(name)
            except MissingDataError:  # cleared meanwhile
                continue
            parts[name] = {"num_samples": info.num_samples, "fields": dict(info.fields), "nbytes": info.nbytes}
        return {
            "transport": self.transport.name,
            "paths": self.transport.paths(),
            "registry_version": self.registry.version,
            "partitions": parts,
            "samples": sum(p["num_samples"] for p in parts.values()),
            "nbytes": sum(p["nbytes"] for p in parts.values()),
            **({"sharing": sharing} if (sharing := self.transport.sharing()) is not None else {}),
            "ops": self.ops.summary(),
        }

    def snapshot(self, path: str) -> SnapshotInfo:
        """A consistent snapshot of the whole store (every partition, every task's
        consumption) in the new directory ``path`` (see :mod:`rlplane.snapshot`). Made by
        the service, on its host's disk, when this client has a service; else here, over
        this client's direct transport. Writes and claims go on while it runs.

        Example: ``client.snapshot("/mnt/shared/snaps/step-1200").samples``
        """
        with self._op("snapshot") as op:
            if self._service is not None:
                op.by_service = True
                return SnapshotInfo(**self._service.json("POST", "/v1/snapshot", json={"path": str(path)},
                                                          timeout=SNAPSHOT_TIMEOUT_S))
            return snapshot.take(self.transport, path)

    def report_ops(self) -> None:
        """Hand the ops done since the last report to the service's ``/metrics`` (direct
        transports only: the service counts http ops itself), waiting at most
        REPORT_TIMEOUT_S. Never raises; a failed report is retried with the next one, and
        reports back off while they fail. Runs every few seconds on a thread of its own
        (an op never waits for it), and on :meth:`close`."""
        self._last_report = time.monotonic()
        if self._service is None or not self.transport.direct:
            return
        events = [e for e in self.ops.drain() if not e.by_service]
        if not events:
            return
        try:
            self._service.json("POST", "/v1/metrics/report", json={"events": [e.to_dict() for e in events]},
                               timeout=REPORT_TIMEOUT_S)
            self._report_every = REPORT_EVERY_S
        except Exception as err:  # noqa: BLE001 - metrics must never fail the caller's work
            self.ops.requeue(events)
            self._report_every = min(self._report_every * 2, REPORT_BACKOFF_S)
            log.warning("could not report %d ops to the service (next try in %.0f s): %s", len(events),
                        self._report_every, err)

    def _report_soon(self) -> None:
        """:meth:`report_ops` on a thread of its own, unless one runs already."""
        self._last_report = time.monotonic()
        with self._report_lock:
            if self._reporter is not None and self._reporter.is_alive():
                return
            self._reporter = threading.Thread(target=self.report_ops, name="rlplane-report", daemon=True)
            self._reporter.start()

    def close(self) -> None:
        """Release the transport's connections (and the service connection, if any).
        Idempotent; a client used after it is a TransportError."""
        if self.closed:
            return
        if self._reporter is not None:
            self._reporter.join(timeout=REPORT_TIMEOUT_S)
        self.report_ops()
        self.closed = True
        self._finalizer()

    @contextmanager
    def _buffers(self) -> Iterator[Any]:
        if self._scratch is None:
            yield None
        else:
            with self._scratch.lease() as alloc:
                yield alloc

    @contextmanager
    def _op(self, name: str) -> Iterator[Any]:
        if self.closed:
            raise TransportError(f"{name} on a closed client; connect again (rlplane.connect)")
        with gc_paused(), self.ops.timed(name) as event:
            yield event
        if time.monotonic() - self._last_report >= self._report_every:
            self._report_soon()

    # -- async twins: the same verbs, awaitable; the work runs in a worker thread ----
    async def aput_samples(self, partition: str, fields: Mapping[str, Any], **kwargs: Any) -> SampleMeta:
        """Awaitable :meth:`put_samples`."""
        return await asyncio.to_thread(self.put_samples, partition, fields, **kwargs)

    async def awrite_columns(self, meta: SampleMeta, fields: Mapping[str, Any]) -> SampleMeta:
        """Awaitable :meth:`write_columns`."""
        return await asyncio.to_thread(self.write_columns, meta, fields)

    async def aread_columns(self, meta: SampleMeta, fields: Sequence[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        """Awaitable :meth:`read_columns`, e.g. ``await client.aread_columns(shard, stage="train")``."""
        return await asyncio.to_thread(self.read_columns, meta, fields, **kwargs)

    async def afields_for_stage(self, stage: str, meta_or_partition: SampleMeta | str) -> list[str]:
        """Awaitable :meth:`fields_for_stage`."""
        return await asyncio.to_thread(self.fields_for_stage, stage, meta_or_partition)

    async def aclear(self, partition: str, sample_ids: Sequence[str] | None = None) -> int:
        """Awaitable :meth:`clear`."""
        return await asyncio.to_thread(self.clear, partition, sample_ids)

    async def apartitions(self) -> list[str]:
        """Awaitable :meth:`partitions`."""
        return await asyncio.to_thread(self.partitions)

    async def astats(self) -> dict[str, Any]:
        """Awaitable :meth:`stats`."""
        return await asyncio.to_thread(self.stats)

    async def aclaim(self, partition: str, task: str, **kwargs: Any) -> SampleMeta:
        """Awaitable :meth:`claim` (the same arguments). Cancelled (``asyncio.wait_for``, a
        task's cancel), it stops waiting within AWAIT_STEP_S and gives back a batch that
        came meanwhile, so no sample waits out a lease nobody holds.

        Example: ``await client.aclaim("step-0", "train", batch_size=64, stage="train")``."""
        timeout = kwargs.get("timeout")
        want = ClaimRequest.build(self.registry, partition, task, kwargs.pop("batch_size", None), **kwargs)
        stop, lock, handed = threading.Event(), threading.Lock(), []

        def run() -> SampleMeta:
            with self._op("claim"):
                reply = self._claim(replace(want, columnar=True), timeout, stop)
            meta = self._claimed_meta(partition, reply)
            with lock:  # handed over, or given back: whichever of the answer and the cancel came first
                if not stop.is_set():
                    handed.append(meta)
                    return meta
            self._give_back(meta, task)
            raise NotReadyError(f"the awaited claim on {partition!r} for {task!r} was cancelled; the batch that came "
                                "meanwhile was given back")

        try:
            return await asyncio.to_thread(run)
        except asyncio.CancelledError:
            with lock:
                stop.set()
                late = list(handed)  # answered, but cancelled before the awaiting task took it
            if late:
                asyncio.get_running_loop().run_in_executor(None, self._give_back, late[0], task)
            raise

    def _give_back(self, meta: SampleMeta, task: str) -> None:
        """Nack the batch an awaited claim got after it was cancelled (logged if that fails:
        its lease then runs out)."""
        try:
            self.nack(meta, task)
        except RlplaneError as err:
            log.warning("could not give back the %d samples a cancelled aclaim got: %s", len(meta), err)

    async def aack(self, meta: SampleMeta, task: str) -> int:
        """Awaitable :meth:`ack`."""
        return await asyncio.to_thread(self.ack, meta, task)

    async def anack(self, meta: SampleMeta, task: str) -> int:
        """Awaitable :meth:`nack`."""
        return await asyncio.to_thread(self.nack, meta, task)

    async def aconsumption(self, partition: str, task: str) -> dict[str, int]:
        """Awaitable :meth:`consumption`."""
        return await asyncio.to_thread(self.consumption, partition, task)

    async def aclose(self) -> None:
        """Awaitable :meth:`close`."""
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ready_for(transport: Transport, fields: Mapping[str, Any]) -> None:
    """Before a put of tensors on a GPU: the transport's memory readied for copies from it.
    InvalidArgumentError for a tensor on the meta device (a shape, no data to store)."""
    ready = False
    for name, value in fields.items():
        device = getattr(value, "device", None)
        if isinstance(device, torch.device) and device.type == "meta":
            raise InvalidArgumentError(f"field {name!r} is a tensor on the meta device (a shape with no data): "
                                       "materialize it first")
        if isinstance(device, torch.device) and device.type != "cpu" and not ready:
            transport.on_device(device, write=True)
            ready = True



def _lacking(err: MissingDataError, some: frozenset[str]) -> dict[str, list[str]] | None:
    """The samples lacking each field, from the store's answer ``err``, when every sample it
    names is known and lacks only fields of ``some``; else None."""
    lacking: dict[str, list[str]] = {}
    missing = err.missing if isinstance(getattr(err, "missing", None), dict) else {}
    for sample, names in missing.items():
        if not names or not set(names) <= some:
            return None
        for name in names:
            lacking.setdefault(name, []).append(sample)
    return lacking or None


def _holders(meta: SampleMeta, lacking: Mapping[str, list[str]]) -> list[tuple[list[str], np.ndarray]]:
    """Fields lacked by the same samples, each group with the positions in ``meta`` of the
    samples that hold them."""
    groups: dict[frozenset[str], list[str]] = {}
    for name, who in lacking.items():
        groups.setdefault(frozenset(who), []).append(name)
    ids = np.asarray(meta.sample_ids)
    return [(names, np.flatnonzero(~np.isin(ids, list(who)))) for who, names in groups.items()]


def _device(device: torch.device | str) -> torch.device:
    """``device`` as a torch.device this process can allocate on, or InvalidArgumentError."""
    try:
        dev = torch.device(device)
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"read_columns(device={device!r}): this process cannot place tensors there "
                                   f"({exc}); pass a device it has, e.g. 'cpu' or 'cuda:0'") from None
    return dev


def _none_held(partition: str, field: str, keys: Any) -> Any:
    """A lookup that finds nothing: the put stores every row itself (and keys them for later puts)."""
    return np.full((len(keys), 5), -1, np.int64)


def _release(transport: Transport, service: Any) -> None:
    """Close a client's transport and service connection (its finalizer, and close())."""
    try:
        transport.close()
    finally:
        if service is not None:
            service.close()


def _read_sums(columns: Mapping[str, Any], tags: Sequence[Mapping[str, Any]], names: Sequence[str]
               ) -> dict[str, np.ndarray]:
    """The digests of the rows a read returned, per field of ``names``: the columns' own
    (the native engine's), else the samples' ``_rlplane_sum`` tags (over HTTP); a field
    with neither is left out."""
    out = {}
    for f in names:
        sums = getattr(columns[f], "sums", None)
        if sums is None:
            got = [(t.get(SUM_TAG) or {}).get(f) if isinstance(t, Mapping) else None for t in tags]
            if not got or not all(type(x) is int and 0 <= x < 1 << 64 for x in got):
                continue
            sums = np.array(got, np.uint64)
        out[f] = sums
    return out


def _new_ids(n: int) -> list[str]:
    base = uuid.uuid4().hex[:12]
    return [f"{base}-{i}" for i in range(n)]


def _user_tags(tags: Sequence[Mapping[str, Any]] | None, batch: int, ids: list[str]) -> list[dict[str, Any]]:
    if tags is None:
        return [{} for _ in range(batch)]
    if len(tags) != batch:
        raise ShapeError(f"{len(tags)} tag dicts for {batch} samples")
    return [check_user_tags(tag, sample=sid) for sid, tag in zip(ids, tags)]  # (JSON-like: every transport's)
