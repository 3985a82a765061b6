"""Tenants (issue 23): tokens scoped to partition-name prefixes, read or read-write. The
rules, the tokens file, and the native engine enforcing a tenant's engine credential."""

from __future__ import annotations

import pytest
import torch

from rlplane import Client, default_registry
from rlplane import errors as E
from rlplane.transports.native import NativeTransport
from rlplane_service.native.local import LocalEngine
from rlplane_service.tenants import FULL, Tenants

FILE = """
tokens:
  - {name: job-a, token: "token-of-job-a-0123", prefixes: ["job-a:"]}
  - {name: eval, token: "token-of-eval-45678", prefixes: ["job-a:eval", "shared."], access: read}
"""


@pytest.fixture
def tenants(tmp_path):
    path = tmp_path / "tokens.yaml"
    path.write_text(FILE)
    return Tenants.load("admin-token-xyz", str(path))


def test_a_token_stands_for_its_tenant_and_scope(tenants):
    a = tenants.lookup("token-of-job-a-0123")
    assert a.tenant == "job-a" and a.write
    a.check("job-a:step-0", write=True)
    with pytest.raises(E.ForbiddenError, match="job-a"):
        a.check("job-b:step-0", write=False)
    ev = tenants.lookup("token-of-eval-45678")
    ev.check("shared.prompts", write=False)
    with pytest.raises(E.ForbiddenError, match="read-only"):
        ev.check("job-a:eval-1", write=True)
    assert tenants.lookup("admin-token-xyz") is FULL
    assert tenants.lookup("nope") is None and tenants.lookup(None) is None
    assert tenants.lookup_header("Bearer token-of-job-a-0123").tenant == "job-a"
    assert tenants.lookup_header("token-of-job-a-0123") is None
    assert tenants.lookup_header("bearer token-of-job-a-0123").tenant == "job-a"  # a scheme is case-insensitive
    assert tenants.lookup_header("Basic token-of-job-a-0123") is None
    assert Tenants.load(None, None).lookup(None) is FULL  # no tokens at all: open, as without RLPLANE_API_TOKEN


@pytest.mark.parametrize("text, what", [
    ("tokens: [{name: a, token: short, prefixes: [x]}]", "16 characters"),
    ("tokens: [{name: a, token: aaaaaaaaaaaaaaaaaa, prefixes: []}]", "prefixes"),
    ("tokens: [{name: a, token: aaaaaaaaaaaaaaaaaa, prefixes: [a/]}]", "no '/'"),
    ("tokens: [{name: a, token: aaaaaaaaaaaaaaaaaa, prefixes: [x]}, {name: a, token: bbbbbbbbbbbbbbbbbb, prefixes: [y]}]",
     "distinct"),
    ("tokens: [{name: a, token: aaaaaaaaaaaaaaaaaa, prefixes: [x]}, {name: b, token: aaaaaaaaaaaaaaaaaa, prefixes: [y]}]",
     "share a token"),
    ("tokens: [{name: a, token: aaaaaaaaaaaaaaaaaa, prefixes: [x], access: admin}]", "access"),
    ("tokens: {{{", "tokens.yaml"),
    ("tokens: [{name: a, token: \"t\u00f6ken-of-a-0123456\", prefixes: [x]}]", "printable ASCII"),
    ("tokens: [{name: a, token: \"token of a 0123456\", prefixes: [x]}]", "without spaces"),
    ("tokens: [{name: a, token: admin-token-xyz-0123, prefixes: [x]}]", "RLPLANE_API_TOKEN"),
])
def test_a_bad_tokens_file_is_refused_naming_the_file_and_the_fault(tmp_path, text, what):
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    with pytest.raises(E.InvalidArgumentError, match="tokens.yaml") as err:
        Tenants.load("admin-token-xyz-0123", str(path))
    assert what in str(err.value)
    with pytest.raises(E.InvalidArgumentError, match="cannot read"):
        Tenants.load(None, str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("text", [
    "tokens: [{name: a, token: 82319477192345123470, prefixes: [x]}]",
    "tokens: [{name: a, token: [82319477192345123470], prefixes: [x]}]",
    "tokens: [{name: a, token: \"8231947\", prefixes: [x]}]",
    "tokens:\n  - name: a\n    token: \"8231947719234512347-0\n    prefixes: [x]\n",
])
def test_an_error_about_a_tokens_file_never_quotes_a_token(tmp_path, text):
    """The error reaches Serve's deployment status and the logs."""
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    with pytest.raises(E.InvalidArgumentError, match="tokens.yaml") as err:
        Tenants.load(None, str(path))
    assert "8231947" not in str(err.value)


SECRET = b"tenant-engine-secret"


@pytest.fixture(scope="module")
def engine():
    tenants = {"job-a": (b"secret-a", (("job-a:",), True)), "reader": (b"secret-r", (("job-a:",), False)),
               "controller": (b"secret-c", (("ctl:",), True))}  # (a name the engine once trusted)
    with LocalEngine(2, secret=SECRET, slab_bytes=16 << 20, tenants=tenants) as eng:
        yield eng


def _client(engine, user: str | None, secret: bytes) -> Client:
    info = {**engine.info, "secret": secret.decode(), **({"user": user} if user else {})}
    return Client(default_registry(), NativeTransport(info, timeout=10))


FIELDS = {"input_ids": torch.arange(24).reshape(3, 8), "input_lengths": torch.tensor([8, 5, 2])}
#: What a read gives back: each row's tokens up to its length, zero padding after.
WANT = FIELDS["input_ids"] * (torch.arange(8) < FIELDS["input_lengths"][:, None])


def test_the_native_engine_holds_a_tenant_to_its_prefixes(engine):
    admin, a, reader = _client(engine, None, SECRET), _client(engine, "job-a", b"secret-a"), _client(engine, "reader", b"secret-r")
    try:
        assert set(a.transport.paths().values()) == {"zmq"}  # a tenant never maps a slab (every tenant's bytes)
        assert set(admin.transport.paths().values()) == {"shm"}
        other = admin.put_samples("job-b:step", FIELDS, sample_ids=["x", "y", "z"])
        mine = a.put_samples("job-a:step", FIELDS)
        assert torch.equal(a.read_columns(mine, ["input_ids"])["input_ids"], WANT)
        assert a.partitions() == ["job-a:step"] and sorted(admin.partitions()) == ["job-a:step", "job-b:step"]
        for attempt in (lambda c: c.put_samples("job-b:new", FIELDS),
                        lambda c: c.read_columns(other, ["input_ids"]),
                        lambda c: c.clear("job-b:step"),
                        lambda c: c.transport.describe("job-b:step"),
                        lambda c: c.claim("job-b:step", "train", batch_size=1, fields=["input_ids"], timeout=0)):
            with pytest.raises(E.ForbiddenError, match="job-b:"):
                attempt(a)
        got = reader.read_columns(mine, ["input_ids"])["input_ids"]  # read-only: reads and claims its prefix
        assert torch.equal(got, WANT)
        batch = reader.claim("job-a:step", "eval", batch_size=3, fields=["input_ids"], timeout=5)
        reader.ack(batch, "eval")
        with pytest.raises(E.ForbiddenError, match="read-only"):
            reader.put_samples("job-a:more", FIELDS)
        with pytest.raises(E.ForbiddenError, match="read-only"):
            reader.clear("job-a:step")
        assert torch.equal(admin.read_columns(other, ["input_ids"])["input_ids"], WANT)  # untouched
        assert a.clear("job-a:step") == 3 and admin.clear("job-b:step") == 3
    finally:
        for c in (admin, a, reader):
            c.close()


def test_a_tenant_credential_cannot_map_or_allocate_in_a_slab(engine):
    from rlplane.channel import Channel

    ch = Channel(engine.units[0].endpoint, "u0", secret=b"secret-a", user=b"job-a")
    try:
        with pytest.raises(E.ForbiddenError, match="slab"):
            ch.call({"op": "slab"}, timeout=5)
        with pytest.raises(E.ForbiddenError, match="allocate"):
            ch.call({"op": "alloc", "b": 99, "f": [["x", "int64", 8]]}, [], timeout=5)
        with pytest.raises(E.ForbiddenError):
            ch.call({"op": "free", "b": b""}, timeout=5)
    finally:
        ch.close()


def _stored_block(admin: Client, partition: str) -> tuple:
    """Put FIELDS into ``partition`` over the engine's sockets; the meta and where the first
    unit holds them: ``(unit, field, blocks, rows)`` as a locate names them."""
    admin.transport.data_path = "zmq"
    meta = admin.put_samples(partition, FIELDS)
    loc = admin.transport._ctrl().call({"op": "locate", "p": partition, "ids": meta.sample_ids,
                                        "fields": ["input_ids"]}, timeout=5)[0]
    u, entries = loc["units"][0]
    return meta, (u, *entries[0][:3])


@pytest.mark.parametrize("user, secret", [(b"job-a", b"secret-a"), (b"controller", b"secret-c")])
def test_no_tenant_name_stands_for_the_controller_on_a_unit(engine, user, secret):
    """The units trust the controller's own socket, not a user name: a tenant named
    ``controller`` can neither map a slab nor read a block without its capability."""
    from rlplane.channel import Channel

    admin = _client(engine, None, SECRET)
    try:
        meta, (u, field, blocks, rows) = _stored_block(admin, "job-b:private")
        ch = Channel(engine.units[u].endpoint, f"u{u}", secret=secret, user=user)
        try:
            with pytest.raises(E.ForbiddenError, match="slab"):
                ch.call({"op": "slab"}, timeout=5)
            with pytest.raises(E.ForbiddenError, match="capability"):
                ch.call({"op": "read", "f": [[field, blocks, rows]]}, timeout=5)
        finally:
            ch.close()
        assert torch.equal(admin.read_columns(meta, ["input_ids"])["input_ids"], WANT)
        admin.clear("job-b:private")
    finally:
        admin.close()


def test_a_read_only_tenant_cannot_write_blocks_into_a_unit(engine):
    """Not through the controller, and not straight to a unit's data socket either (that
    would fill the slab with bytes nobody can clear until the orphan sweep)."""
    import numpy as np

    from rlplane.channel import Channel
    from rlplane.wire import RawColumn

    before = engine.cores[0].alloc.free_bytes
    ch = Channel(engine.units[0].endpoint, "u0", secret=b"secret-r", user=b"reader")
    try:
        junk = RawColumn("uint8", np.zeros(1 << 20, np.uint8), np.asarray([0, 1 << 20], np.int64))
        with pytest.raises(E.ForbiddenError, match="read-only"):
            ch.call({"op": "write", "b": 12345}, {"junk": junk}, timeout=5)
    finally:
        ch.close()
    assert engine.cores[0].alloc.free_bytes == before


def test_a_tenant_cannot_read_another_tenants_block_even_knowing_its_id(engine):
    """Block ids travel only in locate answers (scope-checked), and a unit reads a block
    only for the holder of the controller's capability for it."""
    from rlplane.channel import Channel

    admin = _client(engine, None, SECRET)
    try:
        meta, (u, field, blocks, rows) = _stored_block(admin, "job-b:secret")
        ch = Channel(engine.units[u].endpoint, f"u{u}", secret=b"secret-a", user=b"job-a")
        try:
            with pytest.raises(E.ForbiddenError, match="capability"):
                ch.call({"op": "read", "f": [[field, blocks, rows]]}, timeout=5)
            forged = [[int.from_bytes(blocks[:8], "little"), "0" * 32]]  # the right block, a made-up capability
            with pytest.raises(E.ForbiddenError, match="capability"):
                ch.call({"op": "read", "f": [[field, blocks, rows]], "caps": forged}, timeout=5)
        finally:
            ch.close()
        admin.clear("job-b:secret")
    finally:
        admin.close()
