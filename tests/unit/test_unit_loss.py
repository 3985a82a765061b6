"""Declaring a dead storage unit lost on the TransferQueue-based backends, without Ray:
the ledger's record of what a unit took, and the service's watch deciding when to sweep."""

from __future__ import annotations

import pytest

from rlplane import errors as E
from rlplane.claims import ClaimRequest
from rlplane_service.native.stream import LedgerCore
from rlplane_service.unitloss import UnitLossWatch


def call(core: LedgerCore, op: str, **header) -> dict:
    return getattr(core, f"op_{op}")(header, {}, [])[0]


def put(core: LedgerCore, p: str, ids: list[str]) -> None:
    """A put as a TransferQueue-based store makes it: the ids reserved, then recorded."""
    res = call(core, "reserve", p=p, ids=ids)["res"]
    call(core, "record", p=p, ids=ids, fields=["input_ids"], tags=[{} for _ in ids], create=True, res=res)


def test_the_ledger_forgets_what_a_unit_took_and_says_which_unit():
    core = LedgerCore()
    put(core, "p", ["a", "b", "c"])
    call(core, "lose", unit="unit-1", p="p", ids=["b"])
    assert call(core, "lost", p="p", ids=["a", "b", "z"]) == {"lost": {"b": "unit-1"}}
    claim = ClaimRequest("p", "train", 3, ("input_ids",), 0.0, 1)
    assert core.ledger.claim(claim, final=True)["ids"] == ["a", "c"]  # claims skip what was lost
    assert core.loss() == {"lost_samples": 1, "lost_units": ["unit-1"]}
    put(core, "p", ["b"])  # written again
    assert call(core, "lost", p="p", ids=["b"]) == {"lost": {}}
    call(core, "lose", unit="unit-2")  # a unit that held nothing is still named
    assert core.loss() == {"lost_samples": 1, "lost_units": ["unit-1", "unit-2"]}  # counted since start
    call(core, "lose", unit="unit-2", p="q", ids=["x"])
    call(core, "drop", p="q", ids=None)  # the partition deleted: its loss record goes with it
    assert call(core, "lost", p="q", ids=["x"]) == {"lost": {}}


@pytest.mark.parametrize("header", [{}, {"unit": ""}, {"unit": "u", "ids": ["a"]}, {"unit": "u", "p": "p", "ids": [1]}])
def test_malformed_lose_is_a_wire_error(header):
    with pytest.raises(E.WireFormatError):
        LedgerCore().op_lose(header, {}, [])


class FakeStore:
    """What the watch asks of a store: which units Ray reports dead, and (through the
    service's transport) what a unit held and forgetting it."""

    unit_infos = {"u0": {}, "u1": {}}

    def __init__(self) -> None:
        self.dead: list[str] = []

    def dead_units(self) -> list[str]:
        return list(self.dead)

    def held_on(self, transport: "FakeTransport", partition: str, unit: int) -> list[str]:
        return transport.held[partition][unit]

    def forget(self, transport: "FakeTransport", partition: str, ids: list[str], unit: str) -> None:
        transport.forgotten.append((partition, list(ids), unit))
        for u, held in transport.held.get(partition, {}).items():
            transport.held[partition][u] = [s for s in held if s not in ids]


class FakeTransport:
    def __init__(self) -> None:
        self.held = {"p": {0: ["a"], 1: ["b", "c"]}, "q": {0: ["d"], 1: []}}
        self.forgotten: list[tuple[str, list[str], str]] = []

    def partitions(self) -> list[str]:
        return list(self.held)


def test_only_a_unit_ray_reports_dead_is_swept_and_it_is_looked_at_again_later():
    store, transport = FakeStore(), FakeTransport()
    watch = UnitLossWatch(store, transport, rescan_every=0.0)
    assert watch.check() == [] and transport.forgotten == []  # alive (or only slow): nothing happens
    store.dead = ["u1"]
    assert watch.check() == ["u1"]
    assert transport.forgotten == [("p", ["b", "c"], "u1"), ("", [], "u1")]  # its samples, then the unit itself
    transport.held["q"][1] = ["e"]  # a put under way when it died left a sample routed to it
    transport.forgotten.clear()
    assert watch.check() == ["u1"] and transport.forgotten == [("q", ["e"], "u1")]


def test_a_put_whose_reservation_lapsed_is_not_recorded_twice():
    """Writer A reserves and outlasts the put lease; writer B reserves the same ids and
    records them; A's record used to add the ids a second time (one claim then handed each
    out twice). Now A's record is a LeaseError and B's samples are claimed once."""
    core = LedgerCore(put_lease_s=0.0)
    late = call(core, "reserve", p="p", ids=["x0", "x1"])["res"]
    put(core, "p", ["x0", "x1"])  # B: A's reservation lapsed at once
    with pytest.raises(E.LeaseError, match="lapsed"):
        call(core, "record", p="p", ids=["x0", "x1"], fields=["input_ids"], tags=[{}, {}], create=True, res=late)
    claim = ClaimRequest("p", "train", 4, ("input_ids",), 0.0, 1)
    assert core.ledger.claim(claim, final=True)["ids"] == ["x0", "x1"]
