"""The controller's side of rows stored once across puts (rlplane_service.native.held),
driven with hostile and racing commits straight at a ControllerCore (no units, no Ray):
refs only on puts of new samples, refs that moved checked in one pass and accepted only
where a live row holds the bytes, empty rows never shared, lookups bounded, and a replayed
record whose shared bytes no unit holds leaves its sample lost and no block behind."""

import numpy as np
import pytest

from rlplane import errors as E
from rlplane.wire import ints
from rlplane_service.native import commitlog as clog
from rlplane_service.native.controller import ControllerCore
from rlplane_service.native.held import MAX_HELD_KEYS
from rlplane_service.native.index import FREE

NB = 4096
KEY = (5).to_bytes(8, "little") + (6).to_bytes(8, "little")
NONE = bytes(16)


@pytest.fixture
def core():
    c = ControllerCore([("u0", "tcp://127.0.0.1:1")], start=False)
    c._replaying = True  # no commit-log writes: there are no units to take them
    yield c
    c.stop()


def put(c, p, ids, block, *, keys=None, hx=None, create=True, nb=NB):
    n = len(ids)
    r = c.op_reserve({"op": "reserve", "p": p, "ids": ids, "create": create, "fields": ["f"],
                      "blocks": [[block, [0], 0, n]]}, {}, [])[0]
    head = {"op": "commit", "res": r["res"], "g": {"f": [[[nb // 2]]] * n}, "nb": {"f": ints([nb] * n)},
            "h": {"f": ints([7] * n)}}
    if keys is not None:
        head["k"] = {"f": b"".join(keys)}
    if hx is not None:
        head["hx"] = {"f": ints(np.asarray(hx, np.int64).reshape(-1))}
    try:
        out = c.op_commit(head, {}, [])
    except BaseException:
        c.op_abort({"op": "abort", "res": r["res"]}, {}, [])
        raise
    out[3]()  # what the server runs once the answer is sent
    return out[0]


def held(c, p, keys):
    return np.frombuffer(c.op_held({"op": "held", "p": p, "f": "f", "k": b"".join(keys)}, {}, [])[0]["x"],
                         "<i8").reshape(-1, 5)


def books(c):
    s = c.stats()
    return s["blocks"], s["live_bytes"], s["shared_bytes"], dict(c._block_refs)


def test_a_write_over_stored_samples_cannot_carry_keys_or_held_rows(core):
    put(core, "p", ["a"], 1, keys=[KEY])
    ref = held(core, "p", [KEY])[0]
    before = books(core)
    with pytest.raises(E.WireFormatError, match="new samples"):
        put(core, "p", ["a"], 2, keys=[KEY], hx=[ref], create=False)  # a's own bytes, which the write would drop
    assert books(core) == before and core._parts["p"].fields["f"].block[0] == 1
    assert held(core, "p", [KEY])[0].tolist() == ref.tolist()


def test_refs_that_moved_are_checked_in_one_pass_and_only_live_bytes_are_taken(core):
    ids = [f"a{i}" for i in range(5000)]
    put(core, "p", ids, 1, keys=[KEY] + [NONE] * 4999)
    ref = held(core, "p", [KEY])[0]
    # 2,000 rows name a's bytes under no key (every one looked up stale): all held by a live row
    put(core, "p", [f"c{i}" for i in range(2000)], 2, keys=[NONE] * 2000, hx=[ref] * 2000)
    assert core.stats()["shared_bytes"] == 2000 * NB
    forged = ref.copy()
    forged[2] += 8  # an offset no row holds
    with pytest.raises(E.LeaseError) as err:
        put(core, "p", ["d0", "d1"], 3, keys=[NONE, NONE], hx=[ref, forged])
    assert err.value.component == E.HELD_GONE and "d0" not in core._parts["p"].ids
    core.op_clear({"op": "clear", "p": "p"}, {}, [])
    assert books(core)[:3] == (0, 0, 0)


def test_an_empty_row_is_never_held_and_a_lookup_is_bounded(core):
    put(core, "p", ["a"], 1, nb=0)
    with pytest.raises(E.WireFormatError, match="empty row"):
        put(core, "p", ["b"], 2, keys=[NONE], hx=[[1, 0, 0, 0, 7]], nb=0)
    with pytest.raises(E.WireFormatError, match="at most"):
        held(core, "p", [KEY] * (MAX_HELD_KEYS + 1))
    assert held(core, "p", [KEY] * 3)[:, 0].tolist() == [-1, -1, -1]  # a's row has no key


def test_a_replayed_record_whose_shared_bytes_no_unit_holds_leaves_its_sample_lost_and_no_blocks(core):
    """A replay trusts the rows a record found stored (its commit checked them; the records of
    the rows that held them then may be forgotten from a compacted log). Where no unit holds
    their block, the rebuild's end counts the sample lost and keeps none of its blocks."""
    ref = [777, 0, 0, NB, 7]  # a block no unit lists
    body = {"rid": "1.x", "ids": ["b"], "create": True, "fields": ["f"], "blocks": [[9, [0], 0, 1]],
            "g": {"f": [[[NB // 2]]]}, "nb": {"f": ints([NB])}, "h": {"f": ints([7])}, "user": None, "x": None,
            "k": {"f": NONE}, "hx": {"f": ints(ref)}}
    entry = clog.Entry(5, clog.PUT, "p", clog.record(body), "")
    assert core._replay(entry, clog.parse(entry))
    assert core._locate_copies({}) == 1  # (what the units listed: nothing)
    part = core._parts.get("p")
    assert "b" in part.lost and "b" not in part.ids and (part.state[: part.used] == FREE).all()
    assert not {9, 777} & (set(core._block_units) | set(core._block_refs))
    put(core, "p", ["b"], 10)  # the id is free for a put
