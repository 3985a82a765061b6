"""The consumption ledger: which task has claimed, acked or expired which sample.

The service's claim engine (the client only builds requests: :mod:`rlplane.claims`).

Streaming consumers *claim* ready samples instead of being handed a meta. The ledger
decides what a claim gets; it runs wherever the store's index lives (the native
controller; a ledger actor beside TransferQueue-based stores) and serves one request
at a time, which is what makes a claim exactly-once per task across any number of
concurrent claimers.

It reads the partition through a small :class:`Index` view (slot order = commit
order, so "oldest first" is slot order) and keeps, per (partition, task), one int8
state per slot: unseen, leased, acked or expired. Everything a claim computes is
numpy over slots; the only per-sample Python work is done once per sample (its
``policy_version`` and group tags, cached on first use).

Example::

    ledger = Ledger(index.get, lease_s=60)
    reply = ledger.claim(ClaimRequest.parse({"p": "step-0", "task": "train", "n": 64, "fields": ["input_ids"]}),
                         final=True)
    ledger.ack("step-0", "train", reply["lease"], reply["ids"])
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from rlplane import errors as E
from rlplane.claims import MAX_WAIT_S, ClaimRequest
from rlplane.tags import WIRE_TAG, merge_tags, unfinished

UNSEEN, LEASED, ACKED, EXPIRED = 0, 1, 2, 3
#: Tags the ledger reads (besides the claim's ``group_key``).
VERSION_TAG, GROUP_SIZE_TAG = "policy_version", "group_size"
#: The tag caches' keys (a group key's cache is "group:" + its tag: no tag can collide with these).
FINISHED_KEY, VERSION_KEY = "@finished", "@policy_version"
#: ``policy_version`` of a sample without one: never stale.
NO_VERSION = np.iinfo(np.int64).max
#: Slots a claim of the oldest ``batch_size`` looks at first (at least 4 x its batch); then
#: twice as many, and so on, until it found them: a claim costs what it takes, not the backlog.
SCAN_WINDOW = 4096
#: The most consuming tasks a partition keeps state for (each: 9 bytes per slot of it).
MAX_TASKS = 256
#: Settled leases kept for late acks of their cleared samples (see Ledger._settled).
MAX_SETTLED = 4096
#: Upper bounds (seconds) of the claim-wait histogram's buckets.
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0)


class Index(Protocol):
    """What the ledger reads of one partition (the native controller's Partition, or
    :class:`SimpleIndex`)."""

    used: int  # slots handed out so far; slot order is commit order
    #: Whether every change that can make a slot claimable (new samples, rows, tags) reaches
    #: :meth:`Ledger.touch` with its slots: claims then skip the slots that did not change
    #: since they last found nothing there (:attr:`TaskState.clean`). False: claims look at
    #: every unseen slot each time.
    touches: bool

    def live(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Bool per slot in ``[start, stop)`` (``stop`` None: ``used``): the sample is stored and visible."""

    def has(self, field: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Bool per slot in ``[start, stop)`` (``stop`` None: ``used``): the sample holds ``field``."""

    def field_names(self) -> list[str]:
        """Every field some sample of the partition holds."""

    def ids_of(self, slots: np.ndarray) -> list[str]:
        """Sample ids of ``slots``."""

    def tags_of(self, slots: np.ndarray) -> list[dict[str, Any]]:
        """Each slot's tags as written (user tags and wire geometry)."""

    def user_tags(self, slots: np.ndarray) -> list[dict[str, Any] | None]:
        """Each slot's user tags (what the ledger's caches read: versions, groups,
        ``finished``), None where it has none; cheaper than :meth:`tags_of`."""

    def wire_columns(self, slots: np.ndarray) -> dict[str, Any] | None:
        """:meth:`tags_of`'s wire geometry as one column per field (``Geometry.to_wire``),
        for the fields every one of ``slots`` holds; None where some field is held by only
        some of them, or the index keeps no such columns."""

    def leads(self, field: str, slots: np.ndarray) -> np.ndarray:
        """Int64 per one of ``slots``: the leading dim of its row of ``field`` (a token
        field's: the sample's length), -1 where it has none."""

    def epochs(self) -> np.ndarray:
        """Int64 per slot < used: how many times its tags changed after its commit (a
        later write's tags: a partial rollout finished), so tag caches know to look again."""


@dataclass
class TaskState:
    """One task's view of one partition: a state per slot and where unseen slots start."""

    state: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    lease: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    cursor: int = 0  # every slot below it is not UNSEEN
    # Where the last claim of ``scan`` (its fields, whether it takes partial rollouts) found
    # the first slot it could take: none in [cursor, clean) could, and none changed since
    # (a commit or a release there lowers it: Ledger.touch), so the next such claim starts
    # there, on an index that reports its changes (Index.touches). A claim that waits for a
    # field the backlog lacks looks at new slots only.
    scan: tuple[Any, ...] = ()
    clean: int = 0
    fields: tuple[str, ...] = ()  # what this task's last claim asked for ("ready" in consumption())
    redelivered: int = 0

    def fit(self, n: int) -> None:
        if self.state.size < n:
            cap = max(n, 2 * self.state.size, 64)
            self.state = np.concatenate([self.state, np.zeros(cap - self.state.size, np.int8)])
            self.lease = np.concatenate([self.lease, np.zeros(cap - self.lease.size, np.int64)])


@dataclass
class PartState:
    """Consumption of one partition: its tasks, and per-slot tag caches."""

    index: Any
    tasks: dict[str, TaskState] = field(default_factory=dict)
    version: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    groups: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # key -> (code, size)
    codes: dict[str, dict[Any, int]] = field(default_factory=dict)
    filled: dict[str, np.ndarray] = field(default_factory=dict)  # per cache: the tag epoch it holds per slot (-1: none)
    open: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # a partial rollout, still being written

    def _todo(self, key: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Live slots in ``[start, stop)`` whose ``key`` cache does not hold their current
        tags (never read, or their tags changed since: :meth:`Index.epochs`), marked read.
        A reserved slot of a put in flight has no tags yet: it is read once it is live."""
        n = self.index.used
        z = n if stop is None else min(stop, n)
        seen = self.filled.get(key, np.zeros(0, np.int64))
        if seen.size < n:
            seen = self.filled[key] = np.concatenate([seen, np.full(max(n, 2 * seen.size, 64) - seen.size, -1,
                                                                    np.int64)])
        epoch = self.index.epochs()[start:z]
        todo = start + np.flatnonzero(self.index.live(start, z) & (seen[start:z] != epoch))
        seen[todo] = epoch[todo - start]
        return todo

    @staticmethod
    def _fit(a: np.ndarray, n: int, fill: int) -> np.ndarray:
        return a if a.size >= n else np.concatenate([a, np.full(max(n, 2 * a.size, 64) - a.size, fill, np.int64)])

    def versions(self) -> np.ndarray:
        """``policy_version`` per slot (NO_VERSION when absent), computed once per sample."""
        n = self.index.used
        self.version = self._fit(self.version, n, NO_VERSION)
        todo = self._todo(VERSION_KEY)
        if todo.size:
            self.version[todo] = [_version(t) for t in self.index.user_tags(todo)]
        return self.version[:n]

    def unfinished(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Per slot in ``[start, stop)``: its ``finished`` tag is False (a partial rollout:
        never claimed, not ready), read once per sample and again whenever its tags change."""
        n = self.index.used
        if self.open.size < n:
            self.open = np.concatenate([self.open, np.zeros(max(n, 2 * self.open.size, 64) - self.open.size, bool)])
        todo = self._todo(FINISHED_KEY, start, stop)
        if todo.size:
            self.open[todo] = [unfinished(t) for t in self.index.user_tags(todo)]
        return self.open[start : n if stop is None else min(stop, n)]

    def tokens(self, name: str, slots: np.ndarray) -> np.ndarray:
        """The length of each of ``slots`` in token field ``name`` (-1 without a row)."""
        return self.index.leads(name, slots)

    def group_of(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(group code, declared group size) per slot for tag ``key``; code -1 without one."""
        n = self.index.used
        code, size = self.groups.get(key, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        code, size = self._fit(code, n, -1), self._fit(size, n, 1)
        self.groups[key] = (code, size)
        todo = self._todo("group:" + key)
        if todo.size:
            ids = self.codes.setdefault(key, {})
            tags = [t or {} for t in self.index.user_tags(todo)]
            code[todo] = [ids.setdefault(_hashable(t.get(key)), len(ids)) if t.get(key) is not None else -1 for t in tags]
            size[todo] = [_int(t.get(GROUP_SIZE_TAG), 0) for t in tags]  # (0: none, or not a positive int)
        return code[:n], size[:n]


def _groups_of(ps: PartState, ts: TaskState, key: str, a: int, z: int, stale: np.ndarray) -> np.ndarray:
    """Of slots ``a..z``, the members of a group (tag ``key``) that has a ``stale`` member
    there or one the task expired before: a group is stale as a whole (one split by
    staleness is never whole again, so its fresh members would wait for ever)."""
    code = ps.group_of(key)[0]
    n = min(code.size, ts.state.size)
    expired = (ts.state[:n] == EXPIRED) & ps.index.live(0, n)  # (a cleared member is no longer the group's)
    gone = np.concatenate([code[a:z][stale], code[:n][expired]])
    gone = gone[gone >= 0]
    return np.isin(code[a:z], gone) if gone.size else np.zeros(z - a, bool)


def _members(cand: np.ndarray, code: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """The slots of ``cand`` (group ``code`` each) in one of ``groups``, in slot order."""
    if not groups.size:
        return cand[:0]
    chosen = np.zeros(int(code.max()) + 1, bool)
    chosen[groups] = True
    return cand[chosen[code]]


def _version(tags: Mapping[str, Any] | None) -> int:
    """A sample's ``policy_version`` (NO_VERSION without one, or with one outside int64,
    which the version arrays hold: such a tag counts as absent, it cannot stop a claim)."""
    v = (tags or {}).get(VERSION_TAG)
    ok = isinstance(v, (int, np.integer)) and not isinstance(v, bool) and -NO_VERSION <= v < NO_VERSION
    return int(v) if ok else int(NO_VERSION)


def _int(x: Any, default: int) -> int:
    """A positive int tag (``group_size``) that fits int64, else ``default``."""
    return int(x) if isinstance(x, (int, np.integer)) and not isinstance(x, bool) and 0 < x < NO_VERSION else default


def _hashable(x: Any) -> Any:
    return x if isinstance(x, (str, int, float, bool, bytes)) else repr(x)


@dataclass
class Lease:
    lid: int
    partition: str
    task: str
    state: TaskState
    slots: np.ndarray
    deadline: float
    ids: list[str]  # the samples of ``slots`` when claimed (a cleared slot's id is gone from the index)
    # A grouped claim's (``group_key``): the key, and each of ``slots``' group (lease-local codes).
    # Its nacks name whole groups: a group split between acked and given back would never be
    # whole again, and its given-back members would wait forever. Its acks may name part of a
    # group (each data-parallel rank acks its shard): ``marked`` (per slot) holds them until
    # the group's last member is acked, and the group is consumed then, all at once; a lease
    # that lapses first gives the group back whole.
    group_key: str | None = None
    groups: np.ndarray | None = None
    marked: np.ndarray | None = None


class Ledger:
    """Claims, leases and acks over partitions found through ``index_of`` (see the module docstring).

    Not thread-safe: its host serves one request at a time (or holds a lock)."""

    def __init__(self, index_of: Callable[[str], Any], *, lease_s: float = 300.0) -> None:
        self.index_of = index_of
        self.lease_s = lease_s
        self._parts: dict[str, PartState] = {}
        self._leases: dict[int, Lease] = {}
        # Leases that hold no stored sample any more, till their term (at most MAX_SETTLED): a
        # data-parallel rank's ack of its shard, whose samples were cleared after another
        # rank's ack settled the lease, acks nothing rather than fail.
        self._settled: dict[int, Lease] = {}
        self.wait_counts = [0] * (len(WAIT_BUCKETS) + 1)
        self.wait_sum = 0.0
        self._touched: set[str] = set()  # partitions where something a parked claim may wait for happened

    def _new_lease_id(self) -> int:
        """A lease id nobody can guess: 63 bits from the OS's CSPRNG (and bound to its
        partition and task, which an ack must name too)."""
        while True:
            lid = secrets.randbits(63)
            if lid and lid not in self._leases and lid not in self._settled:
                return lid

    # -- claiming --------------------------------------------------------------------
    def claim(self, req: ClaimRequest, *, final: bool, now: float | None = None,
              expired: Callable[[list[str]], None] | None = None) -> dict[str, Any] | None:
        """The claim's answer, or None when it should wait (never None when ``final``).
        ``expired``: told the ids of the samples this claim found stale and marked expired
        for the task (the native controller journals them), whatever the claim's outcome.

        Raises NotReadyError when ``final`` and fewer than ``min_batch`` are ready."""
        newly: list[np.ndarray] = []
        try:
            return self._claim(req, final, now, newly)
        finally:
            ps = self._part(req.partition) if newly and expired is not None else None
            if ps is not None:
                expired(ps.index.ids_of(np.concatenate(newly)))

    def _claim(self, req: ClaimRequest, final: bool, now: float | None, newly: list[np.ndarray]
               ) -> dict[str, Any] | None:
        """:meth:`claim`; the slots it marks expired are added to ``newly``."""
        now = time.monotonic() if now is None else now
        self.expire(now)
        ps = self._part(req.partition)
        if ps is None:
            return self._not_ready(req, 0, final)
        idx, n = ps.index, ps.index.used
        ts = self._task(ps, req.partition, req.task)
        ts.fit(n)
        ts.fields = req.fields
        lo = ts.cursor
        # (A claim that expires stale samples looks at every unseen one, as it marks them.)
        scan = (tuple(req.fields), req.unfinished) if req.max_staleness is None and idx.touches \
            else ()
        start = max(lo, min(ts.clean, n)) if scan and ts.scan == scan else lo

        def ready_in(a: int, z: int) -> np.ndarray:
            """The slots in [a, z) this claim may take, in order."""
            live = idx.live(a, z)
            st = ts.state[a:z]
            if req.max_staleness is not None:
                waiting = live & (st == UNSEEN)
                if not req.unfinished:  # (a partial rollout is judged once finished: its version may move on)
                    waiting &= ~ps.unfinished(a, z)
                oldest = req.current_version - req.max_staleness  # type: ignore[operator]
                stale = (ps.versions()[a:z] < oldest) & waiting
                if req.group_key is not None:
                    stale |= _groups_of(ps, ts, req.group_key, a, z, stale) & waiting
                st[stale] = EXPIRED
                if stale.any():
                    newly.append(np.flatnonzero(stale) + a)
            ready = live & (st == UNSEEN)
            if not req.unfinished:  # a partial rollout is claimed once it is finished
                ready &= ~ps.unfinished(a, z)
            for f in req.fields:
                ready &= idx.has(f, a, z)
            return np.flatnonzero(ready) + a

        if req.max_staleness is None and req.group_key is None and req.max_tokens is None:
            # The oldest batch_size: windows of growing size, as far as it takes to find them.
            found, z, step = [], start, max(4 * req.batch_size, SCAN_WINDOW)
            while z < n and sum(f.size for f in found) < req.batch_size:
                found.append(ready_in(z, min(n, z + step)))
                z, step = min(n, z + step), 2 * step
            cand = np.concatenate(found) if found else np.zeros(0, np.int64)
        else:
            cand = ready_in(start, n)
        ts.scan, ts.clean = scan, int(cand[0]) if cand.size else n
        over, tokens = False, 0
        if req.max_tokens is not None:
            take, full, over, tokens = self._within_budget(ps, req, cand)
            enough = take.size >= req.min_batch and tokens >= req.min_tokens  # type: ignore[operator]
        elif req.group_key is None:
            take = cand[: req.batch_size]
            full = take.size == req.batch_size
            enough = take.size >= req.min_batch
        else:
            take, full = self._whole_groups(ps, req, cand)
            enough = take.size >= req.min_batch
        answer = full or (final and enough)
        if answer:
            lid = self._new_lease_id()
            ts.state[take] = LEASED
            ts.lease[take] = lid
        if lo >= n or ts.state[lo] != UNSEEN:  # (else the cursor stays: its slot is still unseen)
            unseen = np.flatnonzero(ts.state[lo:n] == UNSEEN)
            ts.cursor = lo + (int(unseen[0]) if unseen.size else n - lo)
        if not answer:
            return self._not_ready(req, int(take.size), final, tokens)
        lease_s = req.lease_s or self.lease_s
        ids = idx.ids_of(take)
        groups = ps.group_of(req.group_key)[0][take].copy() if req.group_key is not None else None  # type: ignore[arg-type]
        self._leases[lid] = Lease(lid, req.partition, req.task, ts, take, now + lease_s, ids, req.group_key, groups)
        held = {f: _at(partial(idx.has, f), take) for f in idx.field_names()}
        out = {"lease": lid, "lease_s": lease_s, "ids": ids, **_tags(idx, take, req.columnar),
               "fields": [f for f, h in held.items() if bool(h.all())],  # every sample holds them
               "some_fields": [f for f, h in held.items() if bool(h.any()) and not bool(h.all())]}
        born = getattr(idx, "born", None)  # each sample's incarnation, where the index keeps them (native)
        if born is not None:
            out["born"] = born[take].tolist()
        if req.max_tokens is not None:
            out.update(tokens=tokens, over_budget=over)
        return out

    def _whole_groups(self, ps: PartState, req: ClaimRequest, cand: np.ndarray) -> tuple[np.ndarray, bool]:
        """Complete groups among ``cand``, oldest first, as many as fit in the batch."""
        limit = self.GROUP_WINDOW
        while True:
            code, groups, counts, seen_all = self._complete_groups(ps, req, cand, limit)
            fits = np.cumsum(counts) <= req.batch_size
            if seen_all or not bool(fits.all()):
                break
            limit *= 4
        take = _members(cand, code, groups[fits])
        full = take.size == req.batch_size or bool((~fits).any())
        return take, full

    #: How many candidates (oldest first) a grouped claim looks at for the groups it may hand
    #: out, before it looks further (x4 each time): a deep backlog costs a count over it,
    #: not a sort of it.
    GROUP_WINDOW = 1024

    def _complete_groups(self, ps: PartState, req: ClaimRequest, cand: np.ndarray, limit: int
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """The group code of each of ``cand``; the complete groups whose first sample is
        among the first ``limit`` of ``cand``, oldest first (a group that starts later is
        younger than all of them), and their sizes; and whether that was every group.
        InvalidArgumentError for a sample without the tag, or such a group larger than the batch."""
        code, size = ps.group_of(req.group_key)  # type: ignore[arg-type]
        c = code[cand]
        if (c < 0).any():
            sid = ps.index.ids_of(cand[c < 0][:1])[0]
            raise E.InvalidArgumentError(f"sample {sid!r} has no tag {req.group_key!r} (group_key); every sample of a "
                                         "grouped claim needs one")
        if not cand.size:
            return c, c, c, True
        if not bool(size[cand].all()):
            sid = ps.index.ids_of(cand[size[cand] == 0][:1])[0]
            raise E.InvalidArgumentError(f"sample {sid!r} has a {req.group_key!r} tag (group_key) but no "
                                         f"{GROUP_SIZE_TAG!r} tag of a positive int: a grouped claim hands a group "
                                         "out once all its group_size members are ready, so every member needs it")
        counts = np.bincount(c)  # ready samples per group, over all of cand (codes are small ints)
        head = c[:limit]
        _, first = np.unique(head, return_index=True)
        first.sort()  # the groups in the order their first sample came
        groups = head[first]
        complete = counts[groups] >= size[cand[first]]
        groups = groups[complete]
        n = counts[groups]
        too_big = n > req.batch_size
        if too_big.any():
            raise E.InvalidArgumentError(f"a group of {int(n[too_big][0])} samples does not fit in batch_size="
                                         f"{req.batch_size}; claim at least a whole group")
        return c, groups, n, limit >= cand.size

    def _within_budget(self, ps: PartState, req: ClaimRequest, cand: np.ndarray
                       ) -> tuple[np.ndarray, bool, bool, int]:
        """What a token-budget claim takes of ``cand``: samples (or complete groups), oldest
        first, while their summed lengths fit ``max_tokens`` and their count ``batch_size``;
        the first alone when it is larger than the budget by itself. Returns the slots,
        whether the claim is full (the next would not fit), whether it is over budget, and
        the tokens taken."""
        limit = 256 if req.group_key is None else self.GROUP_WINDOW
        tok = None
        while True:  # look at as few candidates as decide it
            if req.group_key is None:  # a prefix of the samples
                part = cand[:limit]
                units, code = part, None
                unit_n, unit_tok = np.ones(part.size, np.int64), ps.tokens(req.tokens_field, part)  # type: ignore[arg-type]
                seen_all = part.size == cand.size
            else:
                code, units, unit_n, seen_all = self._complete_groups(ps, req, cand, limit)
                if tok is None:
                    tok = np.bincount(code, weights=ps.tokens(req.tokens_field, cand))  # type: ignore[arg-type]
                unit_tok = tok[units].astype(np.int64)
            fits = (np.cumsum(unit_tok) <= req.max_tokens) & (np.cumsum(unit_n) <= req.batch_size)
            if seen_all or not bool(fits.all()):
                break
            limit *= 4
        if not units.size:
            return cand[:0], False, False, 0
        cum_tok, cum_n = np.cumsum(unit_tok), np.cumsum(unit_n)
        fits = (cum_tok <= req.max_tokens) & (cum_n <= req.batch_size)
        k = int(np.argmin(fits)) if not bool(fits.all()) else int(fits.size)  # a prefix: oldest first, none skipped
        over = k == 0
        k = max(k, 1)
        tokens, count = int(cum_tok[k - 1]), int(cum_n[k - 1])
        full = over or k < units.size or tokens == req.max_tokens or count == req.batch_size
        take = _members(cand, code, units[:k]) if code is not None else units[:k]
        return take, full, over, tokens

    def _not_ready(self, req: ClaimRequest, ready: int, final: bool, tokens: int = 0) -> None:
        if not final:
            return None
        if req.max_tokens is not None:
            raise E.NotReadyError(f"{ready} samples ({tokens} tokens, min_tokens={req.min_tokens}) of partition "
                                  f"{req.partition!r} were ready for task {req.task!r} when the claim's timeout passed; "
                                  "nothing was claimed")
        raise E.NotReadyError(f"{ready} of {req.batch_size} samples of partition {req.partition!r} were ready for task "
                              f"{req.task!r} (min_batch={req.min_batch}) when the claim's timeout passed; nothing was "
                              "claimed")

    def observe_wait(self, seconds: float) -> None:
        """Count one answered claim's wait in the histogram."""
        self.wait_counts[int(np.searchsorted(WAIT_BUCKETS, seconds))] += 1
        self.wait_sum += seconds

    # -- leases ----------------------------------------------------------------------
    def ack(self, partition: str, task: str, lease: int, ids: Sequence[str] | None = None, *,
            before: Callable[[list[str]], None] | None = None) -> int:
        """Mark the lease's samples (or those of ``ids``) consumed; LeaseError if it expired.
        ``before``: called with the sample ids first (a journal; if it raises, nothing changes)."""
        le, slots, held = self._lease(partition, task, lease, ids, "ack")
        named, marked = int(slots.size), None
        if le.groups is not None:
            slots, marked = self._whole_groups_acked(le, held, slots)
        if before is not None:
            ps = self._part(partition)
            before(list(ps.index.ids_of(slots)) if ps is not None and ps.index is not None and slots.size else [])
        if marked is not None:  # (only once the journal took the ack: if it raised, nothing changed)
            le.marked = marked
        le.state.state[slots] = ACKED
        self._settle(le, slots)
        return named

    @staticmethod
    def _whole_groups_acked(le: Lease, held: np.ndarray, named: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A grouped lease's ack of ``named``: the lease's marks with them added, and the
        slots of the groups every member of which the lease still holds (``held``) is marked
        then (see :class:`Lease`); the caller keeps the marks once the ack is journalled."""
        assert le.groups is not None
        marked = (le.marked if le.marked is not None else np.zeros(le.slots.size, bool)) | np.isin(le.slots, named)
        mine = np.isin(le.slots, held)
        done = mine & ~np.isin(le.groups, le.groups[mine & ~marked])
        return le.slots[done], marked

    def nack(self, partition: str, task: str, lease: int, ids: Sequence[str] | None = None) -> int:
        """Give the lease's samples (or those of ``ids``) back to the task at once."""
        le, slots, _ = self._lease(partition, task, lease, ids, "nack")
        self._release(le.state, slots, partition)
        self._settle(le, slots)
        return int(slots.size)

    def expire(self, now: float | None = None) -> int:
        """Return the samples of lapsed leases to their tasks; how many leases lapsed."""
        now = time.monotonic() if now is None else now
        gone = [le for le in self._leases.values() if le.deadline <= now]
        while self._settled and next(iter(self._settled.values())).deadline <= now:
            del self._settled[next(iter(self._settled))]
        for le in gone:
            del self._leases[le.lid]
            held = le.slots[(le.state.state[le.slots] == LEASED) & (le.state.lease[le.slots] == le.lid)]
            le.state.redelivered += int(self._held_by(le).sum())  # (cleared samples come back to nobody)
            self._release(le.state, held, le.partition)
        return len(gone)

    def leased(self, partition: str, index: Any) -> np.ndarray:
        """The slots of ``index`` (partition ``partition``'s) that live leases name."""
        ps = self._parts.get(partition)
        if ps is None or ps.index is not index:
            return np.zeros(0, np.int64)
        mine = [le.slots for le in self._leases_on(partition, ps)]
        return np.concatenate(mine) if mine else np.zeros(0, np.int64)

    def _leases_on(self, partition: str, ps: PartState) -> list[Lease]:
        tasks = {id(ts) for ts in ps.tasks.values()}
        return [le for le in self._leases.values() if le.partition == partition and id(le.state) in tasks]

    def renumber(self, partition: str, index: Any, keep: np.ndarray, remap: np.ndarray) -> None:
        """``index`` renumbered its slots (:meth:`Partition.repack`: ``keep`` became 0.., in
        order; ``remap`` old -> new): every task's states, cursor and leases follow; the tag
        caches start again (their group codes too, which otherwise grow by every group ever
        seen). Every slot a live lease names must be in ``keep`` (see :meth:`leased`)."""
        ps = self._parts.get(partition)
        if ps is None or ps.index is not index:
            return
        leases = self._leases_on(partition, ps)
        for ts in ps.tasks.values():
            ts.state, ts.lease = kept(ts.state, keep, UNSEEN), kept(ts.lease, keep)
            ts.cursor = int(np.searchsorted(keep, ts.cursor))  # the kept slots below it are not UNSEEN either
            ts.clean = 0
        fresh = PartState(index)  # the tag caches are read again, for the samples held only
        ps.version, ps.open, ps.groups, ps.codes, ps.filled = (fresh.version, fresh.open, fresh.groups, fresh.codes,
                                                                fresh.filled)
        for le in leases:
            le.slots = remap[le.slots]
        self._settled = {lid: le for lid, le in self._settled.items() if le.partition != partition}  # (old slots)

    def forget(self, partition: str) -> None:
        """``partition`` left the index (its last sample was cleared): drop its consumption
        state now. Kept until the next look at the partition, it held the old index's arrays
        (every field's rows) and each task's states, for every partition a run cleared.

        Example: ``ledger.forget("step-7")`` after the index dropped the partition."""
        self._parts.pop(partition, None)

    def touch(self, partition: str, slots: np.ndarray | None = None) -> None:
        """Something a parked claim on ``partition`` may wait for happened: a commit of
        ``slots`` (new samples, or new rows or tags of stored ones), samples given back to
        a task, or (``slots`` None) anything anywhere, e.g. a loss. Claims look at those
        slots again (:attr:`TaskState.clean`)."""
        self._touched.add(partition)
        ps = self._parts.get(partition)
        if ps is None or (slots is not None and not slots.size):
            return
        low = int(slots.min()) if slots is not None else 0
        for ts in ps.tasks.values():
            ts.clean = min(ts.clean, low)

    def touched(self) -> set[str]:
        """The partitions touched since the last call (and forget them)."""
        out, self._touched = self._touched, set()
        return out

    def next_deadline(self) -> float | None:
        return min((le.deadline for le in self._leases.values()), default=None)

    def _lease(self, partition: str, task: str, lid: int, ids: Sequence[str] | None, verb: str
               ) -> tuple[Lease, np.ndarray, np.ndarray]:
        """Lease ``lid`` and the slots of it ``ids`` name (all it holds when None), checked
        (LeaseError otherwise); and every slot it still holds."""
        self.expire()
        le = self._leases.get(lid)
        if le is None and ids is not None:  # (named samples of a settled lease: cleared ones are nothing to do)
            le = self._settled.get(lid)
        if le is None or le.partition != partition or le.task != task:
            raise E.LeaseError(f"cannot {verb}: lease {lid} of task {task!r} on partition {partition!r} expired or was "
                               "never granted (its samples went back to the task; they will be claimed again)")
        ps = self._part(partition)
        if ps is None or ps.tasks.get(task) is not le.state:  # its slots would name the new partition's samples
            self._leases.pop(lid, None)
            self._settled.pop(lid, None)
            raise E.LeaseError(f"cannot {verb}: lease {lid} of task {task!r} was on samples of partition {partition!r} "
                               "that were cleared since (the partition was dropped, and made again if it exists)")
        slots = le.slots[le.state.lease[le.slots] == lid]
        slots = slots[le.state.state[slots] == LEASED]
        if ps.index is not None and slots.size:  # samples cleared since the claim: nothing to ack (or journal)
            slots = slots[_at(ps.index.live, slots)]
        if ids is not None:
            held = dict(zip(le.ids, le.slots.tolist()))
            unknown = [s for s in ids if s not in held]
            if unknown:
                raise E.LeaseError(f"cannot {verb}: samples {unknown[:5]} are not held by lease {lid}")
            mine = set(slots.tolist())
            at = np.asarray([held[s] for s in ids], np.int64)
            live = _at(ps.index.live, at).tolist() if ps.index is not None else [False] * len(ids)
            settled = [s for s, alive in zip(ids, live) if held[s] not in mine and alive]
            if settled:  # acked or given back already (a sample cleared since the claim is left out instead)
                raise E.LeaseError(f"cannot {verb}: samples {settled[:5]} are not held by lease {lid} any more")
            named = np.unique(np.asarray([held[s] for s in ids if held[s] in mine], np.int64))  # (a repeat: once)
            if le.groups is not None and verb != "ack":
                self._whole_groups_only(le, slots, named, verb)
            return le, named, slots
        return le, slots, slots

    @staticmethod
    def _whole_groups_only(le: Lease, held: np.ndarray, named: np.ndarray, verb: str) -> None:
        """LeaseError unless ``named`` (slots of grouped lease ``le``) holds, for each group
        it touches, every member the lease still holds (``held``): nothing changes."""
        assert le.groups is not None
        on = np.isin(le.slots, named)
        left = np.isin(le.slots, held) & ~on & np.isin(le.groups, le.groups[on])
        if left.any():
            k = int(np.flatnonzero(left)[0])
            mate = le.ids[int(np.flatnonzero(on & (le.groups == le.groups[k]))[0])]
            raise E.LeaseError(
                f"cannot {verb} part of a group: lease {le.lid} was a grouped claim (group_key={le.group_key!r}) and "
                f"sample {le.ids[k]!r} of the group of {mate!r} is not named ({int(left.sum())} such). A group split "
                f"between acked and given back is never whole again, so its other members would never be claimed: "
                f"{verb} whole groups (or the lease's whole meta); nothing was {verb}ed")

    def _settle(self, le: Lease, slots: np.ndarray) -> None:
        """Forget ``le`` once it holds no stored sample (acked, given back, leased again
        under another lease, or cleared)."""
        if not bool(self._held_by(le).any()):
            self._leases.pop(le.lid, None)
            self._settled[le.lid] = le
            if len(self._settled) > MAX_SETTLED:
                del self._settled[next(iter(self._settled))]

    def _held_by(self, le: Lease) -> np.ndarray:
        """Per slot of ``le``: leased under it and still stored."""
        mine = (le.state.state[le.slots] == LEASED) & (le.state.lease[le.slots] == le.lid)
        ps = self._parts.get(le.partition)
        if ps is None or ps.index is not self.index_of(le.partition) or ps.tasks.get(le.task) is not le.state:
            # (its partition dropped, maybe made anew: nothing of the lease's is stored)
            return np.zeros(le.slots.size, bool)
        return mine & _at(ps.index.live, le.slots)

    def _release(self, ts: TaskState, slots: np.ndarray, partition: str) -> None:
        if slots.size:
            ts.state[slots] = UNSEEN
            ts.lease[slots] = 0
            ts.cursor = min(ts.cursor, int(slots.min()))
            self.touch(partition, slots)

    # -- reporting -------------------------------------------------------------------
    def consumption(self, partition: str, task: str) -> dict[str, int]:
        """``samples``, ``ready``, ``claimed``, ``acked``, ``expired``, ``pending``, ``redelivered``."""
        ps = self._part(partition)
        ts = ps.tasks.get(task) if ps is not None else None
        if ps is None:
            return dict.fromkeys(("samples", "ready", "claimed", "acked", "expired", "pending", "redelivered"), 0)
        idx, n = ps.index, ps.index.used
        live = idx.live()[:n]
        ready = live.copy()
        state = np.zeros(n, np.int8)
        if ts is not None:
            ts.fit(n)
            state = ts.state[:n]
            for f in ts.fields:
                ready &= idx.has(f)[:n]
        ready &= ~ps.unfinished()
        return {"samples": int(live.sum()), "ready": int(ready.sum()),
                "claimed": int((live & (state == LEASED)).sum()), "acked": int((live & (state == ACKED)).sum()),
                "expired": int((live & (state == EXPIRED)).sum()), "pending": int((ready & (state == UNSEEN)).sum()),
                "redelivered": ts.redelivered if ts is not None else 0}

    def snapshot(self) -> dict[str, Any]:
        """Every (partition, task)'s consumption and the claim-wait histogram (for /metrics)."""
        tasks = []
        for p in list(self._parts):
            ps = self._part(p)
            if ps is not None:
                tasks += [{"partition": p, "task": t, **self.consumption(p, t)} for t in ps.tasks]
        return {"tasks": tasks, "wait_buckets": list(WAIT_BUCKETS), "wait_counts": list(self.wait_counts),
                "wait_sum": self.wait_sum, "leases": len(self._leases)}

    def export(self, partition: str, slots: np.ndarray) -> dict[str, np.ndarray]:
        """Per task of ``partition``, the state of each of ``slots`` as a snapshot keeps it
        (int8: UNSEEN, ACKED or EXPIRED; a lease in flight comes back as UNSEEN)."""
        ps = self._part(partition)
        out = {}
        for task, ts in (ps.tasks.items() if ps is not None else ()):
            ts.fit(ps.index.used)  # type: ignore[union-attr]
            st = ts.state[slots].copy()
            st[st == LEASED] = UNSEEN
            out[task] = st
        return out

    @staticmethod
    def _task(ps: PartState, partition: str, task: str) -> TaskState:
        """Task ``task``'s state of a partition, made on its first claim: at most
        MAX_TASKS of them (each holds a byte or more per slot, and /metrics walks them all)."""
        ts = ps.tasks.get(task)
        if ts is None:
            if len(ps.tasks) >= MAX_TASKS:
                raise E.InvalidArgumentError(f"partition {partition!r} has {len(ps.tasks)} consuming tasks already, "
                                             "the most it keeps: a task is a stage that consumes each sample once "
                                             f"(logprob, ref, train), not a step; name it so (task {task!r} was not "
                                             "made)")
            ts = ps.tasks[task] = TaskState()
        return ts

    def load(self, partition: str, task: str, slots: np.ndarray, states: np.ndarray) -> None:
        """Set ``task``'s state of ``slots`` (what :meth:`export` gave; a restore)."""
        ps = self._part(partition)
        if ps is None:
            raise E.MissingDataError(partition, {}, hint="restore the samples before their consumption")
        if states.shape != slots.shape or not bool(np.isin(states, (UNSEEN, ACKED, EXPIRED)).all()):
            raise E.WireFormatError(f"bad consumption states for task {task!r} of {partition!r}")
        ts = self._task(ps, partition, task)
        ts.fit(ps.index.used)
        ts.state[slots] = states
        ts.lease[slots] = 0
        unseen = np.flatnonzero(ts.state[: ps.index.used] == UNSEEN)
        ts.cursor = int(unseen[0]) if unseen.size else ps.index.used
        self.touch(partition)

    def _part(self, partition: str) -> PartState | None:
        """The partition's consumption state; reset when the partition was dropped and made anew."""
        index = self.index_of(partition)
        ps = self._parts.get(partition)
        if index is None:
            self._parts.pop(partition, None)
            return None
        if ps is None or ps.index is not index:
            ps = self._parts[partition] = PartState(index)
        return ps


class SimpleIndex:
    """An :class:`Index` kept by the ledger itself, for stores that have no index of their
    own to share (TransferQueue-based ones): the store's writers ``record`` what they
    wrote and ``drop`` what they cleared.

    Example::

        parts = SimpleIndexes()
        parts.record("step-0", ["a", "b"], ["input_ids"], [{}, {}], create=True)
    """

    touches = False  # its writers record into it directly: claims look at every unseen slot

    def __init__(self) -> None:
        self.used = 0
        self.slot: dict[str, int] = {}
        self.names = np.empty(0, object)
        self.alive = np.zeros(0, bool)
        self.present: dict[str, np.ndarray] = {}
        self.tags = np.empty(0, object)
        self._leads: dict[str, np.ndarray] = {}  # field -> each slot's row length (_UNREAD until read)
        self.retagged = np.zeros(0, np.int64)  # per slot: tag changes after its first write (Index.epochs)

    def live(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self.alive[start : self.used if stop is None else min(stop, self.used)]

    def has(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        z = self.used if stop is None else min(stop, self.used)
        got = self.present.get(name)
        return got[start:z] if got is not None else np.zeros(max(0, z - start), bool)

    def field_names(self) -> list[str]:
        return list(self.present)

    def epochs(self) -> np.ndarray:
        return self.retagged[: self.used]

    def ids_of(self, slots: np.ndarray) -> list[str]:
        return self.names[slots].tolist()

    def tags_of(self, slots: np.ndarray) -> list[dict[str, Any]]:
        return [dict(t or {}) for t in self.tags[slots].tolist()]

    def user_tags(self, slots: np.ndarray) -> list[dict[str, Any] | None]:
        return self.tags[slots].tolist()  # (as written: the ledger only looks keys up)

    def wire_columns(self, slots: np.ndarray) -> dict[str, Any] | None:
        return None  # (the geometry lives in each sample's tags here)

    def leads(self, name: str, slots: np.ndarray) -> np.ndarray:
        """From the rows' wire geometry in the tags, read once per sample (then cached)."""
        n = self.used
        has = _at(partial(self.has, name), slots)
        lead = self._leads.get(name, np.zeros(0, np.int64))
        if lead.size < n:
            lead = self._leads[name] = np.concatenate([lead, np.full(max(n, 2 * lead.size, 64) - lead.size, _UNREAD,
                                                                     np.int64)])
        todo = slots[has & (lead[slots] == _UNREAD)]
        if todo.size:
            lead[todo] = [_lead(_wire(t).get(name)) for t in self.tags[todo].tolist()]
        return np.where(has, np.maximum(lead[slots], 0), -1)  # (held, its geometry unreadable: no tokens)

    def record(self, ids: Sequence[str], fields: Sequence[str], tags: Sequence[Mapping[str, Any]], *, create: bool) -> None:
        if create:
            n = len(ids)
            need = self.used + n
            if need > self.alive.size:
                cap = max(need, 2 * self.alive.size, 64)
                self.names = grown(self.names, cap)
                self.alive = grown(self.alive, cap)
                self.tags = grown(self.tags, cap)
                self.retagged = grown(self.retagged, cap)
                self.present = {f: grown(a, cap) for f, a in self.present.items()}
            slots = np.arange(self.used, need)
            for i, s in enumerate(ids):
                self.names[self.used + i] = s
                self.tags[self.used + i] = dict(tags[i]) if i < len(tags) else {}
            self.slot.update(zip(ids, range(self.used, need)))
            self.alive[slots] = True
            self.used = need
        else:
            got = [self.slot.get(s, -1) for s in ids]
            keep = [i for i, s in enumerate(got) if s >= 0]
            slots = np.asarray([got[i] for i in keep], np.int64)
            for i in keep:
                if i < len(tags) and tags[i]:
                    self.tags[got[i]] = merge_tags(self.tags[got[i]] or {}, tags[i])
                    self.retagged[got[i]] += 1
            for f in fields:  # rows written again (an extend): their lengths are read again
                lead = self._leads.get(f)
                if lead is not None and slots.size:
                    lead[slots] = _UNREAD
        for f in fields:
            if f not in self.present:
                self.present[f] = np.zeros(self.alive.size, bool)
            self.present[f][slots] = True

    def repack(self, keep: np.ndarray) -> np.ndarray:
        """Renumber the slots: ``keep`` (sorted; every live slot among them) become 0.. in
        order, every other slot goes; returns the old -> new map (-1: gone). Without it a
        partition cleared sample by sample keeps a slot per sample it ever held."""
        remap = np.full(self.used, -1, np.int64)
        remap[keep] = np.arange(keep.size, dtype=np.int64)
        self.names, self.alive, self.tags, self.retagged = (kept(self.names, keep), kept(self.alive, keep),
                                                            kept(self.tags, keep), kept(self.retagged, keep))
        self.present = {f: kept(a, keep) for f, a in self.present.items()}
        self._leads = {}  # read again from the tags, for the samples held
        self.slot = {s: int(remap[i]) for s, i in self.slot.items()}
        self.used = int(keep.size)
        return remap

    def drop(self, ids: Sequence[str] | None) -> None:
        slots = np.flatnonzero(self.alive[: self.used]) if ids is None else np.asarray(
            [s for s in (self.slot.pop(i, -1) for i in ids) if s >= 0], np.int64)
        if ids is None:
            self.slot.clear()
        self.alive[slots] = False
        self.tags[slots] = None


_UNREAD = -2


def _lead(row: Any) -> int:
    """The leading dim of a row's wire geometry (a token row's ``[length, ...]``), -1 if none
    (or not a length: negative, a bool, past int64)."""
    ok = isinstance(row, list) and row and type(row[0]) is int and 0 <= row[0] < 1 << 62
    return int(row[0]) if ok else -1


def _wire(tags: Any) -> Mapping[str, Any]:
    """A sample's wire geometry per field ({} where its tags hold none, or not as a map)."""
    got = tags.get(WIRE_TAG) if isinstance(tags, dict) else None
    return got if isinstance(got, dict) else {}


def kept(a: np.ndarray, keep: np.ndarray, fill: Any = 0) -> np.ndarray:
    """``a[keep]`` (``keep`` sorted; a slot at or past ``a``'s end reads ``fill``) at the
    front of a new array with room to grow, the rest ``fill`` (None in object arrays): what
    a renumbering of slots (``repack``) keeps of each per-slot array.

    Example: ``kept(np.array([5, 6, 7]), np.array([0, 2]))[:2]`` is ``array([5, 7])``."""
    out = np.empty(max(64, keep.size + keep.size // 2), a.dtype)
    out[:] = None if a.dtype == object else fill
    inside = keep[: int(np.searchsorted(keep, a.size))]
    out[: inside.size] = a[inside]
    return out


def grown(a: np.ndarray, cap: int) -> np.ndarray:
    """``a`` in a new array of ``cap`` entries (the rest zero, or None for objects)."""
    new = np.zeros(cap, dtype=a.dtype) if a.dtype != object else np.empty(cap, dtype=object)
    new[: a.size] = a
    return new


class SimpleIndexes(dict):
    """Partition name -> :class:`SimpleIndex`; ``record``/``drop`` keep them current."""

    def record(self, partition: str, ids: Sequence[str], fields: Sequence[str], tags: Sequence[Mapping[str, Any]], *,
               create: bool) -> None:
        if create:
            self.setdefault(partition, SimpleIndex()).record(ids, fields, tags, create=True)
        elif partition in self:
            self[partition].record(ids, fields, tags, create=False)

    #: A partition renumbers its slots (:meth:`SimpleIndex.repack`) at a drop that leaves it
    #: this many slots, at most half of them live.
    REPACK_MIN_SLOTS = 1 << 14

    def drop(self, partition: str, ids: Sequence[str] | None, ledger: Ledger | None = None) -> None:
        """``ids`` (None: all) of ``partition`` were cleared. With ``ledger`` (whose index this
        is), a partition left mostly cleared slots renumbers them and the ledger follows:
        the slots its live leases name stay."""
        index = self.get(partition)
        if index is None:
            return
        index.drop(ids)
        if not index.slot:
            del self[partition]
        elif ledger is not None and index.used >= self.REPACK_MIN_SLOTS and 2 * len(index.slot) <= index.used:
            keep = index.alive[: index.used].copy()
            keep[ledger.leased(partition, index)] = True
            keep = np.flatnonzero(keep)
            ledger.renumber(partition, index, keep, index.repack(keep))


def _at(look: Callable[[int, int], np.ndarray], slots: np.ndarray) -> np.ndarray:
    """``look(start, stop)`` (a bool per slot of the range, e.g. ``Index.live``) at ``slots``,
    looking at their span only: a request's cost follows the slots it names, not how many
    the partition has.

    Example: ``_at(index.live, np.array([7, 3]))`` asks ``live(3, 8)``."""
    a = int(slots.min()) if slots.size else 0
    return look(a, int(slots.max()) + 1 if slots.size else 0)[slots - a]


def _tags(idx: Index, take: np.ndarray, columnar: bool) -> dict[str, Any]:
    """A claim's tags of the samples ``take``: asked for as columns (``columnar``) and where
    the index keeps them, each field's rows' wire geometry (``g``) and each sample's user
    tags (``user``), so neither side builds a map per sample; else a tag map per sample
    (``tags``: user tags and wire geometry)."""
    g = idx.wire_columns(take) if columnar else None
    return {"tags": idx.tags_of(take)} if g is None else {"g": g, "user": idx.user_tags(take)}


__all__ = ["Ledger", "ClaimRequest", "SimpleIndex", "SimpleIndexes", "Index", "UNSEEN", "LEASED", "ACKED", "EXPIRED",
           "MAX_WAIT_S", "WAIT_BUCKETS"]
