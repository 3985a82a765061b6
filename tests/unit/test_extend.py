"""Partial rollouts on the native engine (in one process plus storage units, no Ray):
what an extend leaves survives a controller restart and a snapshot restore (lengths,
bytes, and which samples are still being written); a claim by tokens counts the grown
lengths; the two pure steps of an extend (which fields, the rows it writes) on their own.
The same behaviour over every transport is in tests/service/test_conformance.py."""

from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from rlplane import Client, default_registry, snapshot
from rlplane import errors as E
from rlplane import extension
from rlplane.extension import Appending, token_fields
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine

SECRET = b"extend-test-secret"


def appended(stored, stored_lengths, new, new_lengths, **kw):
    """One field's grown rows and the new lengths (what Client.extend does per field)."""
    plan = Appending(stored_lengths, new_lengths)
    return plan.rows(stored, new, **kw), plan.lengths


def connect(eng: LocalEngine) -> Client:
    info = {"controller": eng.server.endpoint, "secret": SECRET.decode()}
    return Client(default_registry(), NativeTransport(info, timeout=30, data_path="shm"))


def tokens(lens: list[int], start: int) -> dict:
    width = max(max(lens), 1)
    ids = torch.arange(start, start + len(lens) * width, dtype=torch.int64).reshape(len(lens), width)
    return {"input_ids": ids, "input_lengths": torch.tensor(lens)}


def test_appended_puts_each_samples_new_tokens_after_its_own_and_casts_to_the_stored_dtype():
    stored = torch.tensor([1, 2, 3], dtype=torch.int32)  # packed: [1, 2], [3], []
    rows, lengths = appended(stored, torch.tensor([2, 1, 0]), torch.tensor([[9, 9], [8, 0], [7, 6]]), torch.tensor([2, 0, 2]))
    assert lengths.tolist() == [4, 1, 2] and rows.dtype == torch.int32
    assert rows.tolist() == [1, 2, 9, 9, 3, 7, 6]
    with pytest.raises(E.ShapeError):  # trailing dims must agree
        appended(torch.zeros(1, 3), torch.tensor([1]), torch.zeros(1, 1, 4), torch.tensor([1]))
    with pytest.raises(E.ShapeError) as err:  # more tokens to append than the tensor holds
        appended(stored, torch.tensor([2, 1, 0]), torch.tensor([[9], [8], [7]]), torch.tensor([1, 2, 0]), field="x")
    assert err.value.field == "x" and "sample #1" in str(err.value)
    jagged = torch.nested.nested_tensor([torch.tensor([9, 9]), torch.tensor([8])], layout=torch.jagged)
    with pytest.raises(E.ShapeError) as err:  # jagged rows of other counts than input_lengths says
        appended(stored[:3], torch.tensor([2, 1]), jagged, torch.tensor([2, 2]), field="x")
    assert err.value.field == "x" and "sample #1" in str(err.value)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("old,add", [([3, 3, 3], [2, 2, 2]), ([3, 0, 5], [2, 4, 0]), ([0, 0], [1, 3])],
                         ids=["alike", "mixed", "empty-rows"])
@pytest.mark.parametrize("inner", [(), (2,), (2, 3)], ids=["scalar", "per-token-vector", "per-token-matrix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int32])
@pytest.mark.parametrize("runs", [False, True], ids=["masked", "runs"])  # short rows / rows long enough to copy as runs
def test_appended_packed_equals_the_padded_concatenation(old, add, inner, dtype, runs, monkeypatch):
    if runs:
        monkeypatch.setattr(extension, "_RUN_TOKENS", 1)
    gen = torch.Generator().manual_seed(7)
    width = max(add)
    stored = [(torch.randn(n, *inner, generator=gen) * 9).to(dtype) for n in old]
    new = (torch.randn(len(add), width, *inner, generator=gen) * 9).to(dtype)
    given = new.to(torch.float64) if dtype.is_floating_point else new  # cast to the stored dtype on the way
    rows, lengths = appended(torch.cat(stored), torch.tensor(old), given, torch.tensor(add))
    want = torch.cat([torch.cat([s, new[i, :add[i]]]) for i, s in enumerate(stored)])
    assert lengths.tolist() == [a + b for a, b in zip(old, add)] and rows.dtype == dtype and rows.shape == want.shape
    assert torch.equal(_bits(rows), _bits(want))  # bit for bit (NaN payloads, -0.0 and all)
    jagged = torch.nested.nested_tensor([new[i, :a] for i, a in enumerate(add)], layout=torch.jagged)
    assert torch.equal(_bits(appended(torch.cat(stored), torch.tensor(old), jagged, torch.tensor(add))[0]), _bits(want))


def test_an_extend_grows_a_field_of_several_dims_per_token_bit_exactly():
    from rlplane import FieldSpec, Registry
    from rlplane.transports.memory import MemoryTransport

    reg = Registry([FieldSpec("input_ids", "token", "dense", {"train"}, dtype="int64"),
                    FieldSpec("input_lengths", "sample", "dense", {"train"}, dtype="int64"),
                    FieldSpec("topk", "token", "dense", {"train"}, dtype="bfloat16")])
    c = Client(reg, MemoryTransport())
    lens, add = torch.tensor([3, 0, 2]), torch.tensor([2, 1, 0])
    topk, more = torch.randn(3, 5, 2, 3).to(torch.bfloat16), torch.randn(3, 2, 2, 3).to(torch.bfloat16)
    meta = c.put_samples("p", {"input_ids": torch.arange(15).reshape(3, 5), "topk": topk, "input_lengths": lens},
                         finished=False)
    meta = c.extend(meta, {"input_ids": torch.arange(6).reshape(3, 2), "topk": more, "input_lengths": add})
    got = c.read_columns(meta, ["topk"], layout="jagged")["topk"]
    for i, row in enumerate(got.unbind()):
        assert torch.equal(_bits(row), _bits(torch.cat([topk[i, :lens[i]], more[i, :add[i]]])))
    holes = torch.nested.narrow(torch.arange(12).reshape(3, 4), 1, torch.tensor([0, 1, 0]), torch.tensor([1, 2, 0]),
                                layout=torch.jagged)  # a jagged tensor with holes (torch cannot pad it)
    meta = c.extend(meta, {"input_ids": holes, "topk": torch.zeros(3, 2, 2, 3, dtype=torch.bfloat16),
                               "input_lengths": torch.tensor([1, 2, 0])})
    assert meta.lengths == [6, 3, 2]
    ids = c.read_columns(meta, ["input_ids"], layout="jagged")["input_ids"]
    assert ids[0].tolist()[-1:] == [0] and ids[1].tolist()[-2:] == [5, 6]


def test_each_token_keeps_the_policy_version_that_generated_it_through_interrupted_rollouts():
    """What async RL's interruptible rollouts store (AReaL-style): a per-token
    ``token_policy_version`` field written with the tokens and extended with them, each
    stretch of a rollout under the weights of its time. Read back, every token carries the
    version that made it, on the native engine (shm) through four extends, 10 rollouts."""
    from rlplane import FieldSpec, Registry

    reg = Registry([FieldSpec("input_ids", "token", "dense", {"train"}, dtype="int64"),
                    FieldSpec("input_lengths", "sample", "dense", {"train"}, dtype="int64"),
                    FieldSpec("token_policy_version", "token", "dense", {"train"}, dtype="int32")])
    g = torch.Generator().manual_seed(4)
    with LocalEngine(2, secret=SECRET, lease_s=30) as eng:
        info = {"controller": eng.server.endpoint, "secret": SECRET.decode()}
        with Client(reg, NativeTransport(info, timeout=30, data_path="shm")) as c:
            want_ids: list[list[int]] = [[] for _ in range(10)]
            want_ver: list[list[int]] = [[] for _ in range(10)]
            meta = None
            for version in range(5):  # weights updated between the stretches: version 0, 1, ...
                lens = torch.randint(0, 7, (10,), generator=g)
                ids = torch.randint(0, 50_000, (10, 7), generator=g)
                step = {"input_ids": ids, "input_lengths": lens,
                        "token_policy_version": torch.full((10, 7), version, dtype=torch.int32)}
                meta = c.put_samples("rollouts", step, finished=False) if meta is None else \
                    c.extend(meta, step, finished=version == 4)
                for i in range(10):
                    want_ids[i] += ids[i, : int(lens[i])].tolist()
                    want_ver[i] += [version] * int(lens[i])
            got = c.read_columns(meta, ["input_ids", "token_policy_version", "input_lengths"], layout="jagged")
            assert [r.tolist() for r in got["input_ids"]] == want_ids
            assert [r.tolist() for r in got["token_policy_version"]] == want_ver
            assert got["token_policy_version"][0].dtype == torch.int32 and meta.lengths == [len(r) for r in want_ids]
            claimed = c.claim("rollouts", "train", batch_size=10, fields=["input_ids", "token_policy_version"],
                              timeout=5)
            assert sorted(claimed.sample_ids) == sorted(meta.sample_ids)


def test_token_fields_names_what_an_extension_must_carry():
    reg = default_registry()
    held = {"input_ids", "input_lengths", "generation_logprobs", "pixel_values"}
    two = {"input_ids": torch.zeros(1, 1), "generation_logprobs": torch.zeros(1, 1), "input_lengths": torch.tensor([1])}
    assert token_fields(reg, held, two) == ["generation_logprobs", "input_ids"]
    for given, field in (({"input_ids": torch.zeros(1, 1), "input_lengths": torch.tensor([1])}, "generation_logprobs"),
                         ({**two, "pixel_values": torch.zeros(1, 1)}, "pixel_values"),
                         ({**two, "advantages": torch.zeros(1, 1)}, "advantages"),
                         ({k: v for k, v in two.items() if k != "input_lengths"}, "input_lengths")):
        with pytest.raises(E.ShapeError) as err:
            token_fields(reg, held, given)
        assert err.value.field == field
    with pytest.raises(E.ShapeError, match="no token field"):
        token_fields(reg, {"input_lengths", "pixel_values"}, two)


def test_partial_rollouts_survive_a_controller_restart_and_a_snapshot_restore(tmp_path):
    with LocalEngine(2, secret=SECRET, lease_s=30) as a, LocalEngine(1, secret=SECRET, lease_s=30) as b, \
            connect(a) as ca, connect(b) as cb:
        meta = ca.put_samples("p", tokens([2, 3], 0), finished=False)
        meta = ca.extend(meta, tokens([4, 1], 100))
        done = ca.put_samples("p", tokens([5], 500))
        want = ca.read_columns(meta, ["input_ids"], layout="jagged")["input_ids"]
        a.kill_controller()
        a.restart_controller()
        assert ca.claim("p", "train", batch_size=3, min_batch=1, fields=["input_ids"], timeout=0).sample_ids == done.sample_ids
        snapshot.take(ca.transport, tmp_path / "snap")
        snapshot.restore(cb.transport, tmp_path / "snap")
        for c in (ca, cb):
            got = c.read_columns(meta, ["input_ids"], layout="jagged")["input_ids"]
            assert all(torch.equal(x, y) for x, y in zip(got, want)) and [len(x) for x in got] == [6, 4]
        with pytest.raises(E.NotReadyError):  # restored: still being written
            cb.claim("p", "train", batch_size=3, fields=["input_ids"], timeout=0)
        assert cb.claim("p", "train", batch_size=3, min_batch=1, fields=["input_ids"], timeout=0).sample_ids == done.sample_ids
        for c in (ca, cb):
            c.extend(meta, tokens([0, 2], 900), finished=True)
            got = c.claim("p", "train", batch_size=2, fields=["input_ids"], timeout=5)
            assert sorted(got.sample_ids) == sorted(meta.sample_ids) and sorted(got.lengths) == [6, 6]


def test_a_claim_by_tokens_counts_the_lengths_an_extend_grew():
    with LocalEngine(1, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        meta = c.put_samples("p", tokens([10, 10], 0), finished=False)
        c.extend(meta, tokens([90, 0], 100), finished=True)  # 100 and 10 tokens now
        got = c.claim("p", "train", max_tokens=50, fields=["input_ids"], timeout=5)
        assert got.sample_ids == meta.sample_ids[:1] and got.over_budget  # alone, larger than the budget
        got = c.claim("p", "train", max_tokens=50, min_tokens=1, fields=["input_ids"], timeout=0)
        assert got.sample_ids == meta.sample_ids[1:] and got.lengths == [10]


def test_an_extend_that_leaves_out_a_token_field_a_stage_wrote_is_refused_and_changes_nothing():
    """A stage wrote prev_logprobs with its own meta; the rollout extends with the put's meta,
    which does not list it. The store knows the sample holds it: the extend is a ShapeError
    naming the field and the sample, and nothing of it is stored (lengths, rows, readiness).
    With the stage's meta, which names it, the extend carries it too and grows both."""
    with LocalEngine(1, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        meta = c.put_samples("p", tokens([2, 3], 0), finished=False)
        staged = c.write_columns(meta.subset([1]), {"prev_logprobs": torch.zeros(1, 3)})
        with pytest.raises(E.ShapeError) as err:
            c.extend(meta, tokens([1, 1], 100), finished=True)
        assert err.value.field == "prev_logprobs" and err.value.sample == meta.sample_ids[1]
        after = c.read_columns(meta, ["input_ids", "input_lengths"], layout="jagged")
        assert [r.tolist() for r in after["input_ids"]] == [[0, 1], [3, 4, 5]]
        assert after["input_lengths"].tolist() == [2, 3] and c.consumption("p", "t")["ready"] == 0
        grown = c.extend(staged, {**tokens([2], 100), "prev_logprobs": torch.ones(1, 2)}, finished=True)
        got = c.read_columns(grown, ["input_ids", "prev_logprobs", "input_lengths"], layout="jagged")
        assert got["input_ids"][0].tolist() == [3, 4, 5, 100, 101]
        assert got["prev_logprobs"][0].tolist() == [0, 0, 0, 1, 1] and grown.lengths == [5]


def test_an_extend_takes_jagged_rows_as_a_put_does():
    from rlplane.transports.memory import MemoryTransport

    c = Client(default_registry(), MemoryTransport())
    meta = c.put_samples("p", tokens([2, 1], 0), finished=False)
    more = torch.nested.nested_tensor([torch.tensor([7, 8]), torch.tensor([9])], layout=torch.jagged)
    meta = c.extend(meta, {"input_ids": more, "input_lengths": torch.tensor([2, 1])}, finished=True)
    got = c.read_columns(meta, ["input_ids"], layout="jagged")["input_ids"]
    assert [r.tolist() for r in got] == [[0, 1, 7, 8], [2, 9]] and meta.lengths == [4, 2]


def test_an_extend_of_big_rows_writes_them_where_its_put_lands_them_bit_exactly():
    """Token fields of 1 MiB or more: the grown rows are written straight into the extent
    the unit staged for the put (no copy after), read back bit for bit, and the rows
    written before the extend are read from the store as views (nothing copied out)."""
    from rlplane.transports.native import STAGE_MIN_BYTES

    g = torch.Generator().manual_seed(3)
    lens, add = torch.randint(2000, 2300, (64,), generator=g), torch.randint(0, 300, (64,), generator=g)
    step = {"input_ids": torch.randint(0, 1 << 40, (64, 2300), generator=g), "input_lengths": lens,
            "generation_logprobs": torch.randn(64, 2300, generator=g)}
    more = {"input_ids": torch.randint(0, 1 << 40, (64, 300), generator=g), "input_lengths": add,
            "generation_logprobs": torch.randn(64, 300, generator=g)}
    with LocalEngine(2, secret=SECRET) as eng, connect(eng) as c:
        t = c.transport
        staged, copied = [], []
        take, gets = t._staged, t.get
        t._staged = lambda n, cols: staged.append(take(n, cols)) or staged[-1]
        t.get = lambda *a, **k: copied.append(k.get("copy", True)) or gets(*a, **k)
        meta = c.put_samples("big", step, finished=False)
        staged.clear()
        meta = c.extend(meta, more, finished=True)
        tokens = int((lens + add).sum())  # input_ids (8 bytes a token) is staged, the float32 logprobs are not
        assert tokens * 8 >= STAGE_MIN_BYTES > tokens * 4
        assert staged and staged[-1] is not None and set(staged[-1].fields) == {"input_ids"}
        assert copied == [False]
        got = c.read_columns(meta, ["input_ids", "generation_logprobs"], layout="jagged")
        for f in ("input_ids", "generation_logprobs"):
            want = [torch.cat([step[f][i, :lens[i]], more[f][i, :add[i]]]) for i in range(64)]
            assert all(torch.equal(a, b) for a, b in zip(got[f].unbind(), want)), f


@contextmanager
def writer(eng: LocalEngine, path: str) -> Iterator[Client]:
    """A client of ``eng``: straight to the engine, or through the HTTP API served over it."""
    if path == "direct":
        with connect(eng) as c:
            yield c
        return
    from fastapi.testclient import TestClient

    from rlplane.http_api import ServiceAPI
    from rlplane.transports.http import HttpTransport
    from rlplane_service.api import ServiceState, build_api
    from rlplane_service.settings import ServiceSettings

    info = {"controller": eng.server.endpoint, "secret": SECRET.decode(), "backend": "native"}
    store = NativeTransport({**info, "streams": dict(info)}, timeout=10)
    try:
        app = build_api(ServiceState(ServiceSettings(api_token="t"), default_registry(), store, transport_info=info))
        api = ServiceAPI("http://rlplane.test", token="t", http=TestClient(app, base_url="http://rlplane.test"))
        with Client(default_registry(), HttpTransport(api), service=api) as c:
            yield c
    finally:
        store.close()


@pytest.mark.parametrize("path", ["direct", "http"])
def test_an_extend_after_which_a_write_replaced_a_row_it_read_is_refused_and_the_write_stays(path):
    """A write_columns of a token field between an extend's read and its commit: the extend
    wrote back the rows it had read, and the write was lost without a word. The extend's
    commit names the digests of the rows it read (over HTTP too); a row replaced since
    refuses it."""
    with LocalEngine(1, secret=SECRET, lease_s=30) as eng, writer(eng, path) as roll, connect(eng) as stage:
        n, width = 2, 4
        meta = roll.put_samples("p", {"input_ids": torch.arange(n * width).reshape(n, width),
                                      "advantages": torch.zeros(n, width), "input_lengths": torch.full((n,), width)},
                                finished=False)
        real_get, fired = roll.transport.get, []

        def get_then_another_writer(*a, **kw):
            out = real_get(*a, **kw)
            if not fired:  # the other writer, between the extend's read and its commit
                fired.append(stage.write_columns(meta, {"advantages": torch.full((n, width), 7.0)}))
            return out

        roll.transport.get = get_then_another_writer
        more = {"input_ids": torch.full((n, 2), 99), "advantages": torch.full((n, 2), 1.0),
                "input_lengths": torch.full((n,), 2)}
        with pytest.raises(E.ShapeError, match="written since this extend read it") as err:
            roll.extend(meta, more, finished=True)
        assert err.value.field == "advantages" and fired
        roll.transport.get = real_get
        got = stage.read_columns(meta, ["advantages", "input_ids"], layout="jagged")
        assert got["advantages"][0].tolist() == [7.0] * width and got["input_ids"][0].numel() == width
        grown = roll.extend(meta, more, finished=True)  # read again: it goes through
        assert stage.read_columns(grown, ["advantages"], layout="jagged")["advantages"][0].tolist() == \
            [7.0] * width + [1.0, 1.0]


def test_a_meta_older_than_an_extend_neither_writes_old_lengths_back_nor_reads_more_tokens_than_it_says():
    """With the put's meta after an extend: a write_columns carrying input_lengths wrote the
    old lengths back, and every later read of the samples failed; a read (a token budget
    claim's, extended since) handed out 104 tokens a sample where the meta said 4."""
    with LocalEngine(1, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        meta = c.put_samples("p", tokens([4, 4], 0), finished=False)
        claimed = c.claim("p", "train", max_tokens=8, fields=["input_ids"], timeout=0, unfinished=True)
        grown = c.extend(meta, tokens([3, 3], 100), finished=True)
        c.write_columns(meta, {"input_lengths": torch.tensor([4, 4]), "sample_mask": torch.ones(2)})
        got = c.read_columns(grown, ["input_ids", "input_lengths", "sample_mask"], layout="jagged")
        assert got["input_lengths"].tolist() == [7, 7] and got["sample_mask"].tolist() == [1.0, 1.0]
        assert [r.tolist() for r in got["input_ids"]] == [[0, 1, 2, 3, 100, 101, 102], [4, 5, 6, 7, 103, 104, 105]]
        for old in (meta, claimed):
            with pytest.raises(E.ShapeError, match="extended since the meta was made") as err:
                c.read_columns(old, ["input_ids"], layout="jagged")
            assert err.value.field == "input_ids" and err.value.sample == meta.sample_ids[0]
        assert c.read_columns(old, ["sample_mask"])["sample_mask"].tolist() == [1.0, 1.0]  # (no token rows read)


def test_an_extend_never_casts_its_tokens_to_a_dtype_the_field_does_not_declare():
    """A field without a declared dtype keeps what its put gave; an extend of float tokens
    onto int32 ones cast 0.7 to 0 and 1e10 to -2147483648, silently."""
    with LocalEngine(1, secret=SECRET, lease_s=30) as eng, connect(eng) as c:
        meta = c.put_samples("p", {**tokens([2], 0), "token_mask": torch.ones(1, 2, dtype=torch.int32)}, finished=False)
        with pytest.raises(E.DtypeError) as err:
            c.extend(meta, {**tokens([2], 9), "token_mask": torch.tensor([[0.7, 1e10]])})
        assert err.value.field == "token_mask" and "int32" in str(err.value)
        grown = c.extend(meta, {**tokens([2], 9), "token_mask": torch.tensor([[0, 5]], dtype=torch.int32)})
        assert c.read_columns(grown, ["token_mask"])["token_mask"].tolist() == [[1, 1, 0, 5]]
