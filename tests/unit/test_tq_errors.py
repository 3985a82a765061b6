"""How TransferQueue's and Mooncake's failures are named (the table in
rlplane.transports.tq_errors; the live ones are in tests/service/test_mooncake.py; a lease
running out mid-read cannot be provoked reliably on a loaded 2-core machine)."""

import pytest

from rlplane import errors as E
from rlplane.transports.tq_simple import SimpleTQTransport
from rlplane.transports.tq_errors import BACKENDS, RULES, mooncake_not_found, translate


@pytest.mark.parametrize(
    "backend, message, error, says",
    [
        ("mooncake", "batch_upsert_from failed for keys ['7@x'] with error codes [-200, -200] after retrying 3 times.",
         E.StorageFullError, "RLPLANE_MOONCAKE_SEGMENT_BYTES"),
        ("mooncake", "batch_get_into failed for keys ['64@pixel_values'] with error codes [-707, -707] after retrying.",
         E.TransportError, "RLPLANE_MOONCAKE_LEASE_TTL_MS"),
        ("mooncake", "batch_get_into failed for keys ['1@x'] with error codes [-1] after retrying 3 times.",
         E.TransportError, "TransferQueue call failed"),
        ("mooncake", "batch_get_into failed for keys ['2@x', '3@x'] with error codes [-800, -800] after retrying.",
         E.UnavailableError, "storage unit this call needs does not answer (its process died"),
        ("simple", "Storage capacity exceeded: 12 > 10", E.StorageFullError, "RLPLANE_CAPACITY"),
        ("simple", "with error codes [-200] after retrying", E.TransportError, "TransferQueue call failed"),
        ("mooncake", "Storage capacity exceeded", E.TransportError, "TransferQueue call failed"),
    ],
)
def test_each_failure_becomes_the_error_that_says_what_to_do(backend, message, error, says):
    err = translate(backend, RuntimeError(message))
    assert type(err) is error and says in str(err)


def test_a_transfer_failure_names_the_unit_the_service_declared_dead():
    err = translate("mooncake", RuntimeError("with error codes [-800]"), lambda: ["mc-unit-1"])
    assert isinstance(err, E.UnavailableError) and err.component == "mc-unit-1" and "mc-unit-1" in str(err)
    err = translate("mooncake", RuntimeError("with error codes [-800]"), lambda: ["mc-unit-1", "mc-unit-2"])
    assert err.component is None and "mc-unit-1, mc-unit-2" in str(err)


def test_a_master_that_does_not_answer_is_named():
    err = translate("mooncake", RuntimeError("batch_get_into failed for keys ['0@x'] with error codes [-900]"))
    assert isinstance(err, E.UnavailableError) and err.component == "mooncake_master" and "master" in str(err)


def test_every_rule_is_for_a_known_backend_and_recognises_only_its_own_code():
    assert {r.backend for r in RULES} <= set(BACKENDS)
    for rule in RULES:
        assert not rule.pattern.search("error codes [-1, -2]"), rule.name
        assert issubclass(rule.error, E.RlplaneError) and rule.hint


def test_a_negative_code_is_not_taken_for_a_longer_one():
    assert isinstance(translate("mooncake", RuntimeError("error codes [-2000]")), E.TransportError)
    assert not isinstance(translate("mooncake", RuntimeError("error codes [-2000]")), E.StorageFullError)


class _Failing:
    def __init__(self, message: str, error: type = RuntimeError) -> None:
        self.message, self.error = message, error

    def _run_coroutine(self, coro):
        coro.close()
        raise self.error(self.message)


async def _noop():
    return None


def test_transferqueues_bare_key_error_is_missing_data():
    """TransferQueue's StorageKeyNotFoundError is a KeyError (a clear racing a read); it
    must reach the caller as MissingDataError, not as an untyped KeyError (HTTP 500)."""
    t = SimpleTQTransport.__new__(SimpleTQTransport)  # no store: only how _run hands failures on is under test
    t._client, t.streams = _Failing("7@input_ids", KeyError), None
    t._watched = lambda coro: coro
    with pytest.raises(E.MissingDataError) as err:
        t._run(_noop())
    assert "cleared while this call ran" in str(err.value)
    t._client = _Failing("Storage capacity exceeded")
    with pytest.raises(E.StorageFullError):  # and the rest goes through the table
        t._run(_noop())


def test_values_the_pool_lost_are_named_by_sample_and_field():
    """TransferQueue names Mooncake keys ``{global index}@{field}``; OBJECT_NOT_FOUND (-704)
    ones map back to the samples and fields a read asked for, other codes do not."""
    message = ("batch_get_into failed for keys ['4@input_ids', '5@input_ids', '4@pixel_values', '9@x'] "
               "with error codes [-704, -800, -704, -704] after retrying 3 times.")
    assert mooncake_not_found(message, {4: "a", 5: "b"}) == {"a": ["input_ids", "pixel_values"]}
    assert mooncake_not_found("something else went wrong", {4: "a"}) == {}


def test_each_transferqueue_storage_is_its_own_transport_class():
    """connect and the service pick the class from the backend a store publishes; an
    unknown one is refused naming it, and the shared part is not a transport on its own."""
    from rlplane.transports.tq import STORAGES, TQTransport, transport_class
    from rlplane.transports.tq_mooncake import MooncakeTQTransport

    assert transport_class({"backend": "simple"}) is SimpleTQTransport
    assert transport_class({"backend": "mooncake"}) is MooncakeTQTransport
    assert set(STORAGES) == {"simple", "mooncake"}
    with pytest.raises(ValueError, match="'etcd'"):
        transport_class({"backend": "etcd"})
    with pytest.raises(TypeError):
        TQTransport({"backend": "simple"})
