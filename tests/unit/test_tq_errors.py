"""How TQTransport names Mooncake's failures (the live ones are in tests/service/test_mooncake.py;
a lease running out mid-read cannot be provoked reliably on a loaded 2-core machine)."""

import pytest

from rlplane import errors as E
from rlplane.transports.tq import TQTransport, _mooncake_not_found


class _Failing:
    def __init__(self, message: str, error: type = RuntimeError) -> None:
        self.message, self.error = message, error

    def _run_coroutine(self, coro):
        coro.close()
        raise self.error(self.message)


async def _noop():
    return None


def transport(kv: bool, message: str) -> TQTransport:
    t = TQTransport.__new__(TQTransport)  # no store: only the error mapping is under test
    t._kv, t._client, t.streams = kv, _Failing(message), None
    t._watched = lambda coro: coro  # no TransferQueue processes to watch
    return t


@pytest.mark.parametrize(
    "message, error, says",
    [
        ("batch_upsert_from failed for keys ['7@x'] with error codes [-200, -200] after retrying 3 times.",
         E.StorageFullError, "RLPLANE_MOONCAKE_SEGMENT_BYTES"),
        ("batch_get_into failed for keys ['64@pixel_values'] with error codes [-707, -707] after retrying 3 times.",
         E.TransportError, "RLPLANE_MOONCAKE_LEASE_TTL_MS"),
        ("batch_get_into failed for keys ['1@x'] with error codes [-1] after retrying 3 times.",
         E.TransportError, "TransferQueue call failed"),
        ("batch_get_into failed for keys ['2@x', '3@x'] with error codes [-800, -800] after retrying 3 times.",
         E.UnavailableError, "storage unit this call needs does not answer"),
    ],
)
def test_mooncake_failures_become_errors_that_say_what_to_do(message, error, says):
    with pytest.raises(error) as err:
        transport(True, message)._run(_noop())
    assert says in str(err.value)


def test_the_simple_backend_never_reports_a_full_mooncake_pool():
    with pytest.raises(E.TransportError) as err:
        transport(False, "with error codes [-200] after retrying")._run(_noop())
    assert not isinstance(err.value, E.StorageFullError)


def test_transferqueues_bare_key_error_is_missing_data():
    """TransferQueue's StorageKeyNotFoundError is a KeyError (a clear racing a read); it
    must reach the caller as MissingDataError, not as an untyped KeyError (HTTP 500)."""
    t = transport(False, "")
    t._client = _Failing("7@input_ids", KeyError)
    with pytest.raises(E.MissingDataError) as err:
        t._run(_noop())
    assert "cleared while this call ran" in str(err.value)


def test_values_the_pool_lost_are_named_by_sample_and_field():
    """TransferQueue names Mooncake keys ``{global index}@{field}``; OBJECT_NOT_FOUND (-704)
    ones map back to the samples and fields a read asked for, other codes do not."""
    message = ("batch_get_into failed for keys ['4@input_ids', '5@input_ids', '4@pixel_values', '9@x'] "
               "with error codes [-704, -800, -704, -704] after retrying 3 times.")
    assert _mooncake_not_found(message, {4: "a", 5: "b"}) == {"a": ["input_ids", "pixel_values"]}
    assert _mooncake_not_found("something else went wrong", {4: "a"}) == {}
