"""Sample tags: the user's scalars plus rlplane's reserved entries (wire geometry).

Torch-free, so the store's index processes (controller, ledger) can read them.

Example::

    merge_tags({"_rlplane_wire": {"a": [3]}}, {"_rlplane_wire": {"b": [2]}})
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
import math
from typing import Any, Callable, Mapping

import numpy as np

from rlplane.wire import MAX_ITEMS, MAX_STR_LEN

#: Reserved key in each sample's tags: ``{field: geometry}`` for every field written.
#: Geometry is a shape list for dense and object fields and
#: ``{"d": dim_to_pack, "p": pad_to_max_shape, "s": [segment shapes]}`` for packed ones.
WIRE_TAG = "_rlplane_wire"

#: Tag keys starting with this prefix belong to rlplane (wire geometry, transport
#: bookkeeping); user tags may not use them. Their values merge key by key over writes.
RESERVED_TAG_PREFIX = "_rlplane"


def merge_tags(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """One sample's tags after a write: ``new`` wins; rlplane's reserved entries (wire
    geometry, transport bookkeeping) merge field by field.

    Example: ``merge_tags(stored, enc.tags[i])``.
    """
    out = dict(old)
    for key, value in new.items():
        if isinstance(key, str) and key.startswith(RESERVED_TAG_PREFIX) and isinstance(out.get(key), Mapping) and isinstance(value, Mapping):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


#: A user tag rlplane reads: a sample whose ``finished`` tag is False is a partial rollout
#: still being written (``put_samples(..., finished=False)``, then ``Client.extend``); claims
#: and a stage's readiness skip it until a write sets it True. Absent means finished.
FINISHED_TAG = "finished"


def unfinished(tags: Mapping[str, Any] | None) -> bool:
    """Whether a sample with these tags is still being written (its ``finished`` tag is False).

    Example: ``unfinished({"finished": False})`` is True; ``unfinished({})`` is False.
    """
    return (tags or {}).get(FINISHED_TAG) is False


#: Reserved key in each sample's tags: ``{field: xxh3-64 of the row's stored bytes}``.
SUM_TAG = "_rlplane_sum"

#: Reserved key in each sample's tags: which incarnation of the sample id the meta names
#: (a number the store draws when a put creates the sample; a sample cleared and put
#: again under the same id is another incarnation). A store that keeps it refuses a
#: write or a read of a meta naming an incarnation that is gone (stale meta). 0 or absent:
#: not known (a meta built by hand, or from a store that does not keep it): not checked.
BORN_TAG = "_rlplane_born"


#: How deep a user tag's lists and maps may nest.
MAX_TAG_DEPTH = 16


def tag_problem(value: Any, depth: int = 0, *, strict: bool = True) -> str | None:
    """What keeps ``value`` from being a user tag's value, or None: tags are JSON-like, so
    every store keeps them and every transport hands them back (msgpack to the engine, JSON
    over HTTP): None, bool, an int of 64 bits, a finite float, a str of valid Unicode, and
    lists and maps (str keys) of those, nested at most :data:`MAX_TAG_DEPTH` deep.
    ``strict=False`` (the engine, which also takes back what an earlier release stored:
    snapshots, journals) lets bytes and non-finite floats by; the nesting is what it cannot.

    Example: ``tag_problem({"k": {1: 2}})`` -> ``"a map key 1 that is not a str"``.
    """
    if isinstance(value, str):
        try:
            nbytes = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            return "a str that is not valid Unicode (a lone surrogate)"
        return None if nbytes <= MAX_STR_LEN else \
            f"a str of {nbytes} bytes (a tag's str is at most {MAX_STR_LEN}: store big values as a field)"
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return None if -(1 << 63) <= value < 1 << 64 else f"an int of more than 64 bits ({str(value)[:40]})"
    if isinstance(value, float):
        return None if math.isfinite(value) or not strict else \
            f"a float that is not finite ({value}): JSON has no such number"
    if isinstance(value, bytes) and not strict:
        return None
    if isinstance(value, (list, tuple, dict)):  # (dicts only: msgpack packs no other mapping)
        if depth >= MAX_TAG_DEPTH:
            return f"lists and maps nested more than {MAX_TAG_DEPTH} deep"
        if len(value) > MAX_ITEMS:
            return f"a list or map of {len(value)} items (at most {MAX_ITEMS}: store big values as a field)"
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    return f"a map key {k!r:.40} that is not a str"
                problem = tag_problem(k, strict=strict) or tag_problem(v, depth + 1, strict=strict)
                if problem:
                    return problem
            return None
        for v in value:
            problem = tag_problem(v, depth + 1, strict=strict)
            if problem:
                return problem
        return None
    return (f"a {type(value).__name__} (tags hold None, bool, int, finite float, str, and lists and maps with str "
            "keys of those)")


def check_user_tags(tag: Any, *, sample: Any = None, strict: bool = True) -> dict[str, Any]:
    """One sample's user tags checked (ShapeError naming the sample and the key otherwise):
    a map with str keys, none of them reserved for rlplane (:data:`RESERVED_TAG_PREFIX`),
    each value as :func:`tag_problem` allows (``strict``); returns them as a dict.

    Example: ``check_user_tags({"group_id": 3, "reward": 0.5}, sample="s0")``.
    """
    from rlplane.errors import ShapeError

    if not isinstance(tag, Mapping):
        raise ShapeError(f"tags must be dicts, got {type(tag).__name__}", sample=sample)
    for key, value in tag.items():
        if not isinstance(key, str):
            raise ShapeError(f"tag keys must be strings, got {key!r:.40}", sample=sample)
        if key.startswith(RESERVED_TAG_PREFIX):
            raise ShapeError(f"tag keys starting with {RESERVED_TAG_PREFIX!r} are reserved for rlplane: {key!r:.80}",
                             sample=sample)
        problem = tag_problem(key) or tag_problem(value, 1, strict=strict)
        if problem:
            raise ShapeError(f"tag {key!r:.80} holds {problem}", sample=sample)
    return dict(tag)


def check_written_tags(tags: Sequence[Any], sample_ids: Sequence[Any], columns: Any) -> None:
    """The tags a write sends a store (what a service takes from a client): user tags as
    :func:`check_user_tags` allows, and of rlplane's keys only the wire geometry and digests
    (:data:`WIRE_TAG`, :data:`SUM_TAG`), each a map over the written ``columns`` (names):
    ShapeError naming the sample otherwise, before anything is stored.

    Example: ``check_written_tags(enc.tags, ids, enc.columns)``.
    """
    from rlplane.errors import ShapeError

    written = set(columns)
    for tag, sid in zip(tags, sample_ids):  # (~1 µs a sample of rlplane's own keys only)
        if not isinstance(tag, Mapping):
            raise ShapeError(f"tags must be dicts, got {type(tag).__name__}", sample=sid)
        user = None
        for key, value in tag.items():
            if key == WIRE_TAG or key == SUM_TAG:
                if not isinstance(value, dict) or not value.keys() <= written:
                    raise ShapeError(f"tag {key!r} must map the written fields only ({sorted(written)[:8]}), got "
                                     f"{str(value)[:80]}", sample=sid)
            elif user is None:
                user = {key: value}
            else:
                user[key] = value
        if user:
            check_user_tags(user, sample=sid)


def incarnation(rid: str) -> int:
    """The incarnation number (:data:`BORN_TAG`) of the samples a put with reservation
    ``rid`` creates: 52 bits of its hash, never 0, the same wherever the put's record is
    replayed (a rebuilt controller, a journal). 52 bits: exact in JSON.

    Example: ``incarnation("3.9f2c...")``."""
    import hashlib

    h = int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little") & ((1 << 52) - 1)
    return h or 1


def born_of(tags: Sequence[Any]) -> Any:
    """Each sample's incarnation (:data:`BORN_TAG`) as an int64 numpy array, 0 where a tag
    has none; None when no sample has one (nothing to check).

    Example: ``born_of(meta.tags)``."""
    import numpy as np  # (this module stays importable without numpy until a meta is checked)

    maps: Any = tags
    if isinstance(tags, RowTags) and tags.born is not None:
        return tags.born
    if isinstance(tags, RowTags) and not tags._built:  # built maps handed on (take) keep theirs as user maps
        if tags.user is None:
            return None
        maps = tags.user
    try:  # plain dicts (a meta after msgpack/JSON or concat): one step a sample; put and claim metas keep an array
        got = [t.get(BORN_TAG) or 0 for t in maps]
        if not set(map(type, got)) <= {int}:  # a float or a bool is no incarnation (never rounded into one)
            raise TypeError
        born = np.array(got, np.int64) if got else np.zeros(0, np.int64)
    except (AttributeError, TypeError, ValueError, OverflowError):  # odd tag maps: one by one
        got = [t.get(BORN_TAG) if isinstance(t, Mapping) else None for t in maps]
        born = np.array([b if type(b) is int and 0 < b < 1 << 62 else 0 for b in got], np.int64)
    born[(born < 0) | (born >= 1 << 62)] = 0
    return born if born.any() else None


def stale(named: Any, now: Any) -> Any:
    """Positions where a meta naming incarnations ``named`` does not name the samples as
    they are now (``now``; both int64 arrays, 0: not known): both known and different.

    Example: ``stale(np.array([5, 0, 7]), np.array([5, 9, 8]))`` -> ``array([2])``."""
    import numpy as np

    return np.flatnonzero((named > 0) & (now > 0) & (named != now))


_UNDONE = {"write": "stored", "read": "read", "extend": "appended"}  # what a refused request did not do
_STALE = "'s meta is stale: "


def stale_meta(partition: str, ids: Sequence[str], bad: Any, what: str) -> Any:
    """The MissingDataError for a request whose meta names incarnations of samples that
    are gone (``bad``: positions in ``ids``, from :func:`stale`): the samples were cleared
    and put again under the same ids since the meta was made. ``what``: "write", "read"
    or "extend".

    Example: ``raise stale_meta("step-0", ids, stale(meta_born, stored_born), "read")``."""
    from rlplane.errors import MissingDataError

    names = [ids[i] for i in bad.tolist()]  # every one (a caller may retry without them); the text names the first
    return MissingDataError(
        partition, {s: [] for s in names},
        hint=f"The {what}{_STALE}{len(names)} of its {len(ids)} samples (first {names[0]!r}) were cleared "
             f"and put again under the same id since it was made, so it names samples that are gone. Nothing was "
             f"{_UNDONE[what]}: use the meta the new samples' put (or a claim) returned")


def stale_as(err: Any, ids: Sequence[str], what: str) -> Any:
    """``err`` told as a stale ``what`` ("write", "read", "extend") where it is a stale-meta
    MissingDataError of another request made for it (an extend reads first), else ``err``.

    Example: ``raise stale_as(err, meta.sample_ids, "extend") from None``."""
    import numpy as np

    if _STALE not in str(err):
        return err
    gone = {str(s) for s in err.missing}
    return stale_meta(err.partition, ids, np.flatnonzero([str(s) in gone for s in ids]), what)


def older_meta(field: str, new: int, have: int, ref: str, differ: int, n: int, sample: Any) -> Any:
    """The ShapeError for a write of stored samples whose token rows are not as long as the
    sample holds (``have`` tokens of ``ref``; ``differ`` of the write's ``n`` samples, the
    first ``sample``): its meta is older than the sample (extended, or put again since)."""
    from rlplane.errors import ShapeError

    return ShapeError(
        f"{new} tokens where the sample holds {have} ({ref}); {differ} of the write's {n} samples differ. The meta it "
        "was written with is older than the sample (extended, or cleared and put again since); nothing of the write "
        "was stored: write with the sample's current meta (the one extend or put_samples returned, or a claim's)",
        field=field, sample=sample)


def check_lengths(ids: Sequence[str], stored: Sequence[Mapping[str, Any]], written: Mapping[str, Any],
                  aligned: Sequence[str]) -> None:
    """For a store that keeps each sample's tags: a write of stored samples (``stored``:
    their tags) whose token rows (``written``: per field written, each row's length) are
    not as long as the sample's first token field (of ``aligned``) it holds is
    :func:`older_meta`. One step a sample (such a store reads every tag map anyway).

    Example: ``check_lengths(["a"], [{WIRE_TAG: {"input_ids": [16]}}], {"prev_logprobs": [8]}, ["input_ids"])``
    raises ShapeError."""
    import numpy as np

    fields = [f for f in aligned if f in written]
    if not fields or not stored:
        return
    have, ref = np.full(len(ids), -1, np.int64), [""] * len(ids)
    for i, tag in enumerate(stored):
        have[i], ref[i] = _length((tag or {}).get(WIRE_TAG) or {}, aligned)
    for f in fields:
        new = np.asarray(written[f], np.int64)
        bad = np.flatnonzero((have >= 0) & (new != have))
        if bad.size:
            i = int(bad[0])
            raise older_meta(f, int(new[i]), int(have[i]), ref[i], int(bad.size), len(ids), ids[i])


def left_out(field: str, sample: Any) -> Any:
    """The ShapeError for an extend that does not carry a token field the sample holds
    (a stage wrote it after the put whose meta the extend was given)."""
    from rlplane.errors import ShapeError

    return ShapeError(
        "the sample holds this token field and an extend grows every token field together (their rows stay as long "
        "as the sample); nothing of the extend was stored: extend it too, with a meta that names it (the one the "
        "stage's write_columns returned, or a claim's)", field=field, sample=sample)


def extended_since(field: str, have: int, read: int, sample: Any) -> Any:
    """The ShapeError for an extend of a sample another extend grew after this one read it
    (it holds ``have`` tokens of ``field``; this one read ``read``): of two extends of one
    sample at once, the later is refused whole instead of undoing the earlier."""
    from rlplane.errors import ShapeError

    return ShapeError(
        f"the sample holds {have} tokens where this extend read {read}: another extend grew it since (one writer "
        "extends a sample at a time); nothing of this extend was stored: read the sample again and extend from there",
        field=field, sample=sample)


def grown_evenly(written: Mapping[str, Any], read: Any, sample: Callable[[int], Any]) -> None:
    """An extend's token rows (``written``: per token field it writes, each row's length as
    int64) grow every field of a sample to one length, no shorter than it read (``read``;
    None: not known): a ShapeError naming the field and the first sample otherwise (a
    crafted write; the client's extend builds them so).

    Example: ``grown_evenly({"input_ids": np.array([6]), "prev_logprobs": np.array([5])}, None, str)`` raises."""
    from rlplane.errors import ShapeError

    names = list(written)
    if not names:
        return
    first = np.asarray(written[names[0]])
    for f in names[1:]:
        bad = np.flatnonzero(np.asarray(written[f]) != first)
        if bad.size:
            i = int(bad[0])
            raise ShapeError(f"an extend grows every token field of a sample to one length: {int(written[f][i])} "
                             f"tokens here, {int(first[i])} in {names[0]}; nothing of it was stored", field=f,
                             sample=sample(i))
    if read is not None:
        short = np.flatnonzero(first < np.asarray(read))
        if short.size:
            i = int(short[0])
            raise ShapeError(f"an extend appends: {int(first[i])} tokens where the sample held {int(read[i])}; "
                             "nothing of it was stored", field=names[0], sample=sample(i))


def check_grown(ids: Sequence[str], stored: Sequence[Mapping[str, Any]], written: Collection[str],
                aligned: Sequence[str], read: Any = None) -> None:
    """For a store that keeps each sample's tags: an extend (``written``: the fields it
    writes) of stored samples (``stored``: their tags) that leaves out a token field (of
    ``aligned``) a sample holds is :func:`left_out`, and one of a sample whose length is no
    longer ``read[i]`` (what the extend read) is :func:`extended_since`; each names the
    first such field and sample.

    Example: ``check_grown(["a"], [{WIRE_TAG: {"input_ids": [4], "prev_logprobs": [4]}}], {"input_ids"},
    ["input_ids", "prev_logprobs"])`` raises ShapeError."""
    others = [f for f in aligned if f not in written]
    for i, tag in enumerate(stored):
        rows = (tag or {}).get(WIRE_TAG) or {}
        for f in others:
            if rows.get(f) is not None:
                raise left_out(f, ids[i])
        if read is not None:
            have, f = _length(rows, aligned)
            if have >= 0 and have != int(read[i]):
                raise extended_since(f, have, int(read[i]), ids[i])


def _length(rows: Mapping[str, Any], aligned: Sequence[str]) -> tuple[int, str]:
    """A sample's length from its tags' wire geometry (``rows``): the rows of the first token
    field (of ``aligned``) it holds, and that field; ``(-1, "")`` for none."""
    for f in aligned:
        row = rows.get(f)
        if isinstance(row, list) and row and type(row[0]) is int:
            return row[0], f
    return -1, ""


class RowTags(Sequence[dict[str, Any]]):
    """Each sample's tags, built only when asked for: the user's tags (``user``, one
    map or None per sample; None: no user tags) plus the rows' wire geometry and
    digests per field (sequences indexed by sample, e.g. a Geometry and a uint64 array).
    What encode returns and the native transport reads back: the hot path takes the
    geometry and digests from the columns and never builds these. A built tag map is
    kept, so editing ``tags[i]`` sticks.

    Example::

        tags = RowTags(None, {"input_ids": [[3], [5]]}, {"input_ids": [7, 9]})
        tags[1]   # {'_rlplane_wire': {'input_ids': [5]}, '_rlplane_sum': {'input_ids': 9}}
    """

    __slots__ = ("user", "geoms", "sums", "born", "_n", "_built")

    def __init__(self, user: Sequence[Any] | None, geoms: Mapping[str, Sequence[Any]],
                 sums: Mapping[str, Sequence[Any]], n: int | None = None, born: Any = None) -> None:
        """``born``: each sample's incarnation (int64 array; :data:`BORN_TAG`), or None."""
        self.user, self.geoms, self.sums, self.born = user, dict(geoms), dict(sums), born
        if n is None:
            n = len(user) if user is not None else len(next(iter(self.geoms.values()), ()))
        self._n = n
        self._built: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._n))]
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        tag = self._built.get(i)
        if tag is None:
            user = self.user[i] if self.user is not None else None
            tag = dict(user) if isinstance(user, Mapping) else {}
            # a built tag map handed on (take) keeps its own geometry and digests
            if self.geoms or WIRE_TAG not in tag:  # (maps handed on whole keep their own as they are)
                tag[WIRE_TAG] = {**(tag.get(WIRE_TAG) or {}), **{f: g[i] for f, g in self.geoms.items()}}
            if self.sums:
                tag[SUM_TAG] = {**(tag.get(SUM_TAG) or {}), **{f: int(s[i]) for f, s in self.sums.items()}}
            if self.born is not None and self.born[i] > 0:
                tag[BORN_TAG] = int(self.born[i])
            self._built[i] = tag
        return tag

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (RowTags, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def concat(cls, parts: Sequence[RowTags]) -> RowTags:
        """The tags of ``parts`` one after another (every part naming the same fields).

        Example: ``len(RowTags.concat([a, b])) == len(a) + len(b)``."""
        import numpy as np  # (this module stays importable without numpy until tags are put together)

        from rlplane.geometry import Geometry

        n = sum(len(p) for p in parts)
        fields = set(parts[0].geoms) if parts else set()
        if any(p._built for p in parts) or any(set(p.geoms) != fields or set(p.sums) != set(parts[0].sums)
                                               for p in parts):
            return cls([t for p in parts for t in p], {}, {}, n)  # the maps as built (edited ones included)
        user = None if all(p.user is None for p in parts) else \
            [u for p in parts for u in (p.user if p.user is not None else [None] * len(p))]
        geoms = {f: Geometry.concat([Geometry.coerce(p.geoms[f]) for p in parts]) for f in fields}
        sums = {f: np.concatenate([np.asarray(p.sums[f], np.uint64) for p in parts]) for f in parts[0].sums} \
            if parts else {}
        born = None if all(p.born is None for p in parts) else \
            np.concatenate([p.born if p.born is not None else np.zeros(len(p), np.int64) for p in parts])
        return cls(user, geoms, sums, n, born)

    def take(self, index: Sequence[int]) -> RowTags:
        """The tags of the samples at ``index``, in that order (still built when asked for)."""
        if self._built:  # edited tag maps must come along
            return RowTags([self[i] for i in index], {}, {}, len(index),
                           None if self.born is None else _take(self.born, list(index)))
        pick = list(index)
        return RowTags(None if self.user is None else [self.user[i] for i in pick],
                       {f: _take(g, pick) for f, g in self.geoms.items()},
                       {f: _take(v, pick) for f, v in self.sums.items()}, len(pick),
                       None if self.born is None else _take(self.born, pick))

    def merged(self, new: Sequence[Mapping[str, Any]]) -> Sequence[dict[str, Any]]:
        """Each sample's tags after a write whose tags are ``new`` (:func:`merge_tags`)."""
        if isinstance(new, RowTags) and not self._built and not new._built and len(new) == self._n:
            user = self.user
            if new.has_user_tags():  # the new user tags win, key by key (they hold no reserved key)
                old = self.user if self.user is not None else [None] * self._n
                user = [{**(a or {}), **(b or {})} or None for a, b in zip(old, new.user)]  # type: ignore[arg-type]
            return RowTags(user, {**self.geoms, **new.geoms}, {**self.sums, **new.sums}, self._n,
                           self.born if self.born is not None else new.born)
        return [merge_tags(a, b) for a, b in zip(self, new, strict=True)]

    def with_user(self, user: Sequence[Mapping[str, Any] | None]) -> RowTags:
        """These rows' geometry and digests with ``user`` as the user tags (one map or None
        per sample, no reserved keys): what a write with user tags sends, built lazily."""
        if len(user) != self._n:
            raise ValueError(f"{len(user)} user tag maps for {self._n} samples")
        if self._built:  # edited tag maps come along
            return RowTags([merge_tags(t, u or {}) for t, u in zip(self, user)], {}, {}, self._n)
        return RowTags(list(user), self.geoms, self.sums, self._n, self.born)

    def with_born(self, born: Any) -> RowTags:
        """These tags naming incarnation ``born`` of each sample (an int64 array, or one int for all)."""
        import numpy as np

        arr = np.broadcast_to(np.asarray(born, np.int64), (self._n,)).copy()
        if self._built:
            return RowTags([{**t, BORN_TAG: int(b)} if b > 0 else t for t, b in zip(self, arr.tolist())], {}, {},
                           self._n, arr)
        return RowTags(self.user, self.geoms, self.sums, self._n, arr)

    def user_tags(self) -> list[Any]:
        """Each sample's own tags (a map or None, rlplane's reserved keys left out), without
        building the whole tag maps unless some were built (and so may have been edited)."""
        maps = self.user if not self._built and self.user is not None else \
            [None] * self._n if not self._built else [self[i] for i in range(self._n)]
        return [{k: v for k, v in t.items() if not k.startswith(RESERVED_TAG_PREFIX)} or None
                if isinstance(t, Mapping) else None for t in maps]

    def has_user_tags(self) -> bool:
        """Whether any sample carries a tag of its own (not rlplane's)."""
        return self.user is not None and any(self.user)


def _take(rows: Any, pick: list[int]) -> Any:
    take = getattr(rows, "take", None)
    if take is not None:  # a Geometry or a numpy array: one gather
        import numpy as np

        return take(np.asarray(pick, dtype=np.int64))
    return [rows[i] for i in pick]


__all__ = ["WIRE_TAG", "SUM_TAG", "BORN_TAG", "RESERVED_TAG_PREFIX", "MAX_TAG_DEPTH", "tag_problem", "check_user_tags",
           "check_written_tags", "RowTags", "born_of", "incarnation", "merge_tags",
           "stale", "stale_meta", "stale_as", "older_meta", "check_lengths", "left_out", "extended_since",
           "check_grown"]
