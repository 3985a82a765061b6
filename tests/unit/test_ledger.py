"""The consumption ledger's semantics, on its own index (no service)."""

from __future__ import annotations

import gc
import time
import weakref
from dataclasses import replace

import numpy as np
import pytest

from rlplane import errors as E
from rlplane.claims import ClaimRequest
from rlplane_service.ledger import Ledger, SimpleIndexes


def _ledger(lease_s: float = 60.0) -> tuple[Ledger, SimpleIndexes]:
    idx = SimpleIndexes()
    return Ledger(idx.get, lease_s=lease_s), idx


def _put(idx: SimpleIndexes, p: str, ids: list[str], fields=("input_ids",), tags=None) -> None:
    idx.record(p, ids, list(fields), tags or [{} for _ in ids], create=True)


def _req(task: str = "train", n: int = 4, fields=("input_ids",), **kw) -> ClaimRequest:
    args = dict(min_batch=kw.pop("min_batch", n), wait_s=kw.pop("wait_s", 0.0))
    return ClaimRequest("p", task, n, tuple(fields), args["wait_s"], args["min_batch"], **kw)


def test_claims_are_oldest_first_and_once_per_task():
    led, idx = _ledger()
    _put(idx, "p", [f"s{i}" for i in range(10)])
    a = led.claim(_req(n=4), final=True)
    b = led.claim(_req(n=4), final=True)
    assert a["ids"] == ["s0", "s1", "s2", "s3"] and b["ids"] == ["s4", "s5", "s6", "s7"]
    other = led.claim(_req(task="logprob", n=10), final=True)
    assert other["ids"] == [f"s{i}" for i in range(10)]  # tasks are independent
    with pytest.raises(E.NotReadyError, match="2 of 4 samples"):
        led.claim(_req(n=4), final=True)
    assert led.claim(_req(n=4), final=False) is None  # would wait
    short = led.claim(_req(n=4, min_batch=2), final=True)
    assert short["ids"] == ["s8", "s9"]


def test_a_sample_is_ready_only_when_every_asked_field_is_written():
    led, idx = _ledger()
    _put(idx, "p", ["a", "b"])
    assert led.claim(_req(n=2, fields=("input_ids", "prev_logprobs")), final=False) is None
    idx.record("p", ["b"], ["prev_logprobs"], [{}], create=False)
    got = led.claim(_req(n=2, fields=("input_ids", "prev_logprobs"), min_batch=1), final=True)
    assert got["ids"] == ["b"] and set(got["fields"]) == {"input_ids", "prev_logprobs"}


def test_unknown_partition_waits_like_an_empty_one():
    led, _ = _ledger()
    assert led.claim(_req(), final=False) is None
    with pytest.raises(E.NotReadyError):
        led.claim(_req(), final=True)


def test_groups_are_handed_out_whole_and_only_when_complete():
    led, idx = _ledger()
    tags = lambda g, k: [{"group_id": g, "group_size": 3} for _ in range(k)]  # noqa: E731
    _put(idx, "p", ["g0a", "g0b"], tags=tags("g0", 2))
    _put(idx, "p", ["g1a", "g1b", "g1c"], tags=tags("g1", 3))
    got = led.claim(_req(n=4, group_key="group_id", min_batch=1), final=True)
    assert got["ids"] == ["g1a", "g1b", "g1c"]  # g0 is incomplete; g1 whole though the batch has room for 4
    _put(idx, "p", ["g0c"], tags=tags("g0", 1))
    assert led.claim(_req(n=3, group_key="group_id"), final=True)["ids"] == ["g0a", "g0b", "g0c"]
    _put(idx, "p", ["x1", "x2"], tags=tags("big", 2) and [{"group_id": "big", "group_size": 2}] * 2)
    with pytest.raises(E.InvalidArgumentError, match="does not fit"):
        led.claim(_req(n=1, group_key="group_id"), final=True)


def test_a_group_is_stale_as_a_whole_even_for_members_that_come_later():
    """Members of one group may carry different policy versions (a partial rollout resumed
    after a weight update). One stale member expires the whole group for the task, and
    so are members that arrive later (before: the fresh half waited for ever, pending)."""
    led, idx = _ledger()
    tag = lambda g, v: {"group_id": g, "group_size": 3, "policy_version": v}  # noqa: E731
    _put(idx, "p", ["a0", "a1", "b0", "b1", "b2"], tags=[tag("a", 1), tag("a", 5), tag("b", 5), tag("b", 5), tag("b", 5)])
    stale = dict(group_key="group_id", current_version=5, max_staleness=1, min_batch=1)
    assert led.claim(_req(n=6, **stale), final=True)["ids"] == ["b0", "b1", "b2"]
    _put(idx, "p", ["a2"], tags=[tag("a", 5)])  # the group's last member, fresh
    with pytest.raises(E.NotReadyError):
        led.claim(_req(n=6, **stale), final=True)
    assert led.consumption("p", "train")["expired"] == 3 and led.consumption("p", "train")["pending"] == 0


def test_a_grouped_claim_over_members_without_a_group_size_is_refused_naming_one():
    """(Before: a missing group_size read as 1, so a group went out in pieces.)"""
    led, idx = _ledger()
    _put(idx, "p", ["x0", "x1"], tags=[{"group_id": "x"}, {"group_id": "x", "group_size": 2}])
    with pytest.raises(E.InvalidArgumentError, match="'x0' .*group_size"):
        led.claim(_req(n=2, group_key="group_id", min_batch=1), final=True)
    assert led.consumption("p", "train")["claimed"] == 0


def test_an_ack_naming_a_sample_twice_counts_it_once():
    led, idx = _ledger()
    _put(idx, "p", ["a", "b"])
    got = led.claim(_req(n=2), final=True)
    assert led.ack("p", "train", got["lease"], ["a", "a", "b", "b"]) == 2


def test_a_partial_group_ack_the_journal_refused_changes_nothing():
    """(A diff review's: the marks were kept though the journal write raised, so another
    rank's ack consumed the refused member and its retry was told the lease was gone.)"""
    led, idx = _ledger()
    _put(idx, "p", ["a", "b"], tags=[{"gid": 0, "group_size": 2}] * 2)
    lid = led.claim(_req(n=2, group_key="gid"), final=True)["lease"]
    assert led.ack("p", "train", lid, ["a"]) == 1

    def journal_down(ids):
        raise E.UnavailableError("journal: no unit kept the ack")

    with pytest.raises(E.UnavailableError):
        led.ack("p", "train", lid, ["b"], before=journal_down)
    journalled = []
    assert led.ack("p", "train", lid, ["a"], before=journalled.extend) == 1 and journalled == []  # b is not acked
    assert led.ack("p", "train", lid, ["b"], before=journalled.extend) == 1 and sorted(journalled) == ["a", "b"]
    assert led.consumption("p", "train")["acked"] == 2


def test_a_partition_keeps_at_most_max_tasks_consuming_tasks(monkeypatch):
    """Each task holds state per slot, and /metrics walks them all: a claim under a new
    name per step grew the controller without bound (300 names: 515 MB on 200k slots)."""
    from rlplane_service import ledger as L

    monkeypatch.setattr(L, "MAX_TASKS", 3)
    led, idx = _ledger()
    _put(idx, "p", ["a", "b"])
    for t in ("logprob", "ref", "train"):
        assert led.claim(_req(task=t, n=2), final=True)["ids"] == ["a", "b"]
    with pytest.raises(E.InvalidArgumentError, match="'p' has 3 consuming tasks.*'step-7' was not made"):
        led.claim(_req(task="step-7", n=1), final=True)
    assert sorted(led._parts["p"].tasks) == ["logprob", "ref", "train"]
    assert led.consumption("p", "train")["claimed"] == 2


def test_stale_samples_are_expired_and_counted_never_handed_out():
    led, idx = _ledger()
    _put(idx, "p", ["old0", "old1", "new0", "new1"],
         tags=[{"policy_version": 0}, {"policy_version": 0}, {"policy_version": 2}, {"policy_version": 2}])
    got = led.claim(_req(n=4, min_batch=1, current_version=2, max_staleness=1), final=True)
    assert got["ids"] == ["new0", "new1"]
    c = led.consumption("p", "train")
    assert c["expired"] == 2 and c["claimed"] == 2 and c["pending"] == 0


def test_leases_ack_nack_and_expiry():
    led, idx = _ledger()
    _put(idx, "p", ["a", "b", "c", "d"])
    t = time.monotonic()
    first = led.claim(_req(n=2, lease_s=30.0), final=True, now=t)
    assert led.nack("p", "train", first["lease"], None) == 2  # back at once
    again = led.claim(_req(n=2, lease_s=30.0), final=True, now=t)
    assert again["ids"] == ["a", "b"]
    assert led.expire(now=t + 31) == 1  # the consumer died: lease lapsed
    with pytest.raises(E.LeaseError, match="expired or was never granted"):
        led.ack("p", "train", again["lease"], None)
    third = led.claim(_req(n=4), final=True)
    assert third["ids"] == ["a", "b", "c", "d"]  # redelivered to the same task
    assert led.ack("p", "train", third["lease"], ["a", "b"]) == 2
    assert led.ack("p", "train", third["lease"], ["c", "d"]) == 2
    with pytest.raises(E.LeaseError):
        led.ack("p", "train", third["lease"], None)  # settled
    c = led.consumption("p", "train")
    assert (c["acked"], c["claimed"], c["pending"], c["redelivered"]) == (4, 0, 0, 2)


def test_a_cleared_and_remade_partition_starts_fresh():
    led, idx = _ledger()
    _put(idx, "p", ["a"])
    led.claim(_req(n=1), final=True)
    idx.drop("p", None)
    _put(idx, "p", ["a"])
    assert led.claim(_req(n=1), final=True)["ids"] == ["a"]


@pytest.mark.parametrize("kw, match", [
    (dict(n=0), "batch_size"), (dict(n=2, min_batch=3), "min_batch"), (dict(fields=()), "fields"),
    (dict(current_version=3), "go together"), (dict(lease_s=-1.0), "lease_s"),
])
def test_bad_claims_fail_at_once(kw, match):
    with pytest.raises(E.InvalidArgumentError, match=match):
        _req(**kw).check()


def test_acked_claims_move_the_cursor_past_every_consumed_sample():
    """A claim starts at the task's cursor, so its cost does not grow with what was consumed."""
    led, idx = _ledger()
    _put(idx, "p", [f"s{i}" for i in range(20000)])
    for _ in range(300):
        led.ack("p", "train", led.claim(_req(n=64), final=True)["lease"], None)
    ts = led._parts["p"].tasks["train"]
    assert ts.cursor == 300 * 64 and np.all(ts.state[: ts.cursor] == 2)


def test_tags_of_a_put_in_flight_are_read_once_it_commits():
    led, idx = _ledger()
    _put(idx, "p", ["a", "b"], tags=[{"group_id": "g", "group_size": 4, "policy_version": 5}] * 2)
    part = idx["p"]
    _put(idx, "p", ["c", "d"], tags=[{}, {}])  # reserved: slots taken, tags and liveness not yet
    part.alive[2:4] = False
    part.tags[2:4] = None
    assert led.claim(_req(n=4, group_key="group_id"), final=False) is None
    part.tags[2:4] = [{"group_id": "g", "group_size": 4, "policy_version": 5}] * 2  # the commit
    part.alive[2:4] = True
    got = led.claim(_req(n=4, group_key="group_id", current_version=6, max_staleness=1), final=True)
    assert got["ids"] == ["a", "b", "c", "d"]


# -- claims by token budget ----------------------------------------------------------
def _put_lens(idx: SimpleIndexes, p: str, lens: list[int], prefix: str = "s", groups: list | None = None,
              size: int | None = None) -> list[str]:
    """Samples with token rows of ``lens`` (their wire geometry, as a put records it)."""
    ids = [f"{prefix}{i}" for i in range(len(lens))]
    tags = [{"_rlplane_wire": {"input_ids": [n]}} for n in lens]
    if groups is not None:
        for t, g in zip(tags, groups):
            t.update(group_id=g, group_size=size)
    idx.record(p, ids, ["input_ids"], tags, create=True)
    return ids


def _tok(max_tokens: int, n: int = 1 << 16, min_tokens: int | None = None, min_batch: int = 1, **kw) -> ClaimRequest:
    return ClaimRequest("p", kw.pop("task", "train"), n, ("input_ids",), 0.0, min_batch, max_tokens=max_tokens,
                        min_tokens=max_tokens if min_tokens is None else min_tokens, tokens_field="input_ids", **kw)


def test_a_token_claim_takes_samples_oldest_first_while_their_lengths_fit():
    led, idx = _ledger()
    _put_lens(idx, "p", [100, 300, 200, 50, 400])
    got = led.claim(_tok(600), final=False)  # 100 + 300 + 200 = 600: exactly full
    assert got["ids"] == ["s0", "s1", "s2"] and got["tokens"] == 600 and got["over_budget"] is False
    got = led.claim(_tok(400), final=False)  # 50 fits, 50 + 400 does not: full, nothing skipped
    assert got["ids"] == ["s3"] and got["tokens"] == 50
    assert led.claim(_tok(1000), final=False) is None  # 400 of 1000: waits for more
    with pytest.raises(E.NotReadyError, match="400 tokens, min_tokens=1000"):
        led.claim(_tok(1000), final=True)
    assert led.claim(_tok(1000, min_tokens=300), final=True)["ids"] == ["s4"]


def test_a_token_claim_also_stops_at_its_batch_size():
    led, idx = _ledger()
    _put_lens(idx, "p", [10] * 6)
    assert led.claim(_tok(1000, n=4), final=False)["ids"] == ["s0", "s1", "s2", "s3"]


def test_a_sample_larger_than_the_budget_comes_alone_and_says_so():
    led, idx = _ledger()
    _put_lens(idx, "p", [5000, 10, 10])
    got = led.claim(_tok(1000), final=False)
    assert got["ids"] == ["s0"] and got["over_budget"] is True and got["tokens"] == 5000
    assert led.claim(_tok(1000, min_tokens=1), final=True)["over_budget"] is False


def test_a_token_claim_hands_out_whole_complete_groups():
    led, idx = _ledger()
    _put_lens(idx, "p", [100, 100, 100, 50, 50, 50, 10, 10], groups=["a", "a", "a", "b", "b", "b", "c", "c"], size=3)
    got = led.claim(_tok(400, group_key="group_id"), final=False)  # a = 300; a + b = 450 > 400: full with a
    assert got["ids"] == ["s0", "s1", "s2"] and got["tokens"] == 300
    # b is complete (150); c (2 of 3) is not: a claim at its deadline takes b alone.
    assert led.claim(_tok(400, group_key="group_id"), final=False) is None
    got = led.claim(_tok(400, group_key="group_id", min_tokens=100), final=True)
    assert got["ids"] == ["s3", "s4", "s5"]
    idx.record("p", ["c2"], ["input_ids"], [{"_rlplane_wire": {"input_ids": [700]}, "group_id": "c", "group_size": 3}],
               create=True)
    got = led.claim(_tok(400, group_key="group_id"), final=False)  # c = 720 alone: over budget, whole
    assert got["ids"] == ["s6", "s7", "c2"] and got["over_budget"] is True


def test_a_token_claim_expires_stale_samples_and_its_lease_nacks_and_lapses_like_any_claim():
    """Staleness, nack and lease expiry with a token budget: stale samples expire (never
    counted in the budget, never handed out), a nacked token claim comes back at once, a
    lapsed one is redelivered, and an ack of the lapsed lease is a LeaseError."""
    led, idx = _ledger()
    ids = [f"s{i}" for i in range(6)]
    lens, versions = [100, 200, 300, 100, 200, 300], [0, 2, 2, 0, 2, 2]
    tags = [{"_rlplane_wire": {"input_ids": [n]}, "policy_version": v} for n, v in zip(lens, versions)]
    idx.record("p", ids, ["input_ids"], tags, create=True)
    t = time.monotonic()
    fresh = dict(current_version=2, max_staleness=1, lease_s=30.0)
    got = led.claim(_tok(500, **fresh), final=False, now=t)  # the stale s0, s3 expire: 200 + 300 = 500, full
    assert got["ids"] == ["s1", "s2"] and got["tokens"] == 500
    assert led.consumption("p", "train")["expired"] == 2
    assert led.nack("p", "train", got["lease"], None) == 2  # given back: the same samples, at once
    again = led.claim(_tok(500, **fresh), final=False, now=t)
    assert again["ids"] == ["s1", "s2"]
    assert led.expire(now=t + 31) == 1  # the claimer died: its lease lapsed
    with pytest.raises(E.LeaseError):
        led.ack("p", "train", again["lease"], None)
    third = led.claim(_tok(900, **fresh), final=False, now=t + 31)  # the lapsed ones first, never the stale
    assert third["ids"] == ["s1", "s2", "s4"] and third["tokens"] == 700  # (+ s5's 300 would pass 900)
    assert led.ack("p", "train", third["lease"], None) == 3
    c = led.consumption("p", "train")
    assert (c["expired"], c["acked"], c["pending"], c["redelivered"]) == (2, 3, 1, 2)


@pytest.mark.parametrize("kw, match", [
    (dict(max_tokens=0, min_tokens=0, tokens_field="input_ids"), "max_tokens must be at least 1"),
    (dict(max_tokens=10, min_tokens=11, tokens_field="input_ids"), "min_tokens between"),
    (dict(max_tokens=10, min_tokens=5, tokens_field="prev_logprobs"), "must be one the claim waits for"),
    (dict(max_tokens=10, min_tokens=None, tokens_field="input_ids"), "go together"),
])
def test_bad_token_claims_fail_at_once(kw, match):
    with pytest.raises(E.InvalidArgumentError, match=match):
        ClaimRequest("p", "train", 4, ("input_ids",), 0.0, 1, **kw).check()


def test_a_token_claim_crosses_the_wire_unchanged():
    req = _tok(4096, n=64, min_tokens=1024, group_key="group_id")
    assert ClaimRequest.parse({"op": "claim", **req.to_header()}) == req


def test_build_picks_the_token_field_and_refuses_a_budget_without_one():
    from rlplane import default_registry

    reg = default_registry()
    req = ClaimRequest.build(reg, "p", "train", None, stage="train", max_tokens=8192)
    assert req.tokens_field == "input_ids" and req.min_tokens == 8192 and req.min_batch == 1
    with pytest.raises(E.InvalidArgumentError, match="none of"):
        ClaimRequest.build(reg, "p", "train", None, fields=["input_lengths"], max_tokens=10)
    with pytest.raises(E.InvalidArgumentError, match="batch_size, max_tokens"):
        ClaimRequest.build(reg, "p", "train", None, fields=["input_ids"])


@pytest.mark.parametrize("kw", [dict(batch_size=2**70), dict(batch_size=2.0), dict(min_batch=1.5),
                                dict(min_batch=float("nan")), dict(min_batch=float("inf")), dict(min_batch="x"),
                                dict(timeout="abc"), dict(timeout=[1]), dict(lease_s="5"), dict(lease_s=True),
                                dict(max_tokens=2**70), dict(current_version="a", max_staleness=0),
                                dict(current_version=0, max_staleness=float("nan")), dict(group_key=123)])
def test_build_refuses_arguments_of_the_wrong_kind_with_a_typed_error(kw):
    """(Before: ValueError, TypeError, OverflowError from float()/int()/msgpack, or 1.5 taken as 1.)"""
    from rlplane import default_registry

    with pytest.raises(E.InvalidArgumentError):
        ClaimRequest.build(default_registry(), "p", "train", kw.pop("batch_size", 2), fields=["input_ids"], **kw)


def test_token_claims_never_split_a_group_never_exceed_the_budget_and_hand_out_each_sample_once():
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 300)), min_size=1, max_size=25),
           st.lists(st.integers(1, 900), min_size=1, max_size=40))
    def run(groups, budgets):
        led, idx = _ledger()
        lens, names = [], []
        for g, (size, n) in enumerate(groups):
            lens += [n + k for k in range(size)]
            names += [f"g{g}"] * size
        size_of = {f"g{g}": s for g, (s, _) in enumerate(groups)}
        ids = [f"s{i}" for i in range(len(lens))]
        idx.record("p", ids, ["input_ids"], [{"_rlplane_wire": {"input_ids": [n]}, "group_id": g,
                                              "group_size": size_of[g]} for n, g in zip(lens, names)], create=True)
        length, group = dict(zip(ids, lens)), dict(zip(ids, names))
        seen: list[str] = []
        for b in budgets:
            got = led.claim(_tok(b, min_tokens=1, group_key="group_id"), final=True) if len(seen) < len(ids) else None
            if got is None:
                break
            took = got["ids"]
            assert sum(length[s] for s in took) == got["tokens"]
            assert got["tokens"] <= b or (got["over_budget"] and len({group[s] for s in took}) == 1)
            for g in {group[s] for s in took}:  # whole groups only
                assert sorted(s for s in took if group[s] == g) == sorted(s for s in ids if group[s] == g)
            seen += took
        assert len(seen) == len(set(seen))

    run()


def test_grouped_claims_over_a_small_window_hand_out_what_a_look_at_every_candidate_would(monkeypatch):
    """A grouped claim looks at the oldest candidates first and further only when it must:
    with a window of 2 (of a default 1024), its answers are those of a claim that sorts the
    whole backlog, for interleaved groups written out of order, by count and by tokens."""
    from hypothesis import given, settings, strategies as st

    def reference(ready: list[str], group: dict, size: dict, length: dict, n: int, budget: int | None) -> list[str]:
        order = list(dict.fromkeys(group[s] for s in ready))  # groups by their first ready sample
        complete = [g for g in order if sum(group[s] == g for s in ready) >= size[g]]
        took, count, tokens = [], 0, 0
        for g in complete:
            members = [s for s in ready if group[s] == g]
            t = sum(length[s] for s in members)
            if count + len(members) > n or (budget is not None and tokens + t > budget):
                if not took and budget is not None and count + len(members) <= n:
                    took.append(g)  # a lone group over the budget
                break
            took.append(g)
            count, tokens = count + len(members), tokens + t
        return [s for s in ready if group[s] in took]

    @settings(max_examples=80, deadline=None)
    @given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 3), st.integers(1, 50)), min_size=1, max_size=30),
           st.integers(3, 9), st.one_of(st.none(), st.integers(1, 200)))
    def run(rows, n, budget):
        monkeypatch.setattr(Ledger, "GROUP_WINDOW", 2)
        kept, per = [], {}  # no group has more samples than a batch holds (that is an error of its own)
        for r in rows:
            if per.get(r[0], 0) < n:
                per[r[0]] = per.get(r[0], 0) + 1
                kept.append(r)
        rows = kept
        led, idx = _ledger()
        size = {f"g{g}": 0 for g, _, _ in rows}
        for g, s, _ in rows:
            size[f"g{g}"] = max(size[f"g{g}"], s)
        ids = [f"s{i}" for i in range(len(rows))]
        group = {i: f"g{g}" for i, (g, _, _) in zip(ids, rows)}
        length = {i: t for i, (_, _, t) in zip(ids, rows)}
        idx.record("p", ids, ["input_ids"], [{"_rlplane_wire": {"input_ids": [length[i]]}, "group_id": group[i],
                                              "group_size": min(size[group[i]], n)} for i in ids], create=True)
        size = {g: min(s, n) for g, s in size.items()}
        if budget is None:
            req = _req(n=n, min_batch=1, group_key="group_id")
        else:
            req = _tok(budget, n=n, min_tokens=1, group_key="group_id")
        want = reference(ids, group, size, length, n, budget)
        try:
            got = led.claim(req, final=True)["ids"]
        except E.NotReadyError:
            got = []
        assert got == want

    run()


def test_a_finished_tag_a_grown_length_and_a_group_key_named_like_a_tag_the_ledger_reads():
    """Tags and lengths written after a sample's commit are read again (a partial rollout
    finished, its rows extended); a group key named ``policy_version`` or ``finished`` has
    its own cache beside the ledger's."""
    from rlplane.tags import WIRE_TAG

    led, idx = _ledger()
    tags = [{"finished": False, "policy_version": 3, "group_size": 2, WIRE_TAG: {"input_ids": [10]}} for _ in range(2)]
    _put(idx, "p", ["a", "b"], tags=tags)
    assert led.claim(_req(n=2, min_batch=1), final=False) is None  # unfinished
    tok = ClaimRequest("p", "peek", 2, ("input_ids",), 0.0, 1, max_tokens=150, min_tokens=1, tokens_field="input_ids",
                       unfinished=True)
    assert led.claim(tok, final=True)["tokens"] == 20  # asked for: handed out, lengths read
    idx.record("p", ["a", "b"], ["input_ids"], [{"finished": True, WIRE_TAG: {"input_ids": [100]}}] * 2,
               create=False)
    got = led.claim(replace(tok, task="tok", unfinished=False), final=True)
    assert got["ids"] == ["a"] and got["tokens"] == 100  # the grown length counts: both would be 200
    for key in ("policy_version", "finished"):
        got = led.claim(_req(task=f"g-{key}", n=2, group_key=key, current_version=3, max_staleness=0), final=True)
        assert sorted(got["ids"]) == ["a", "b"]


def test_a_partition_the_store_dropped_leaves_no_consumption_state_or_index_behind():
    """A run that makes and clears a partition per step must not keep each step's index
    (every field's rows) and task states alive in the ledger (the native controller and the
    TQ backends' ledger both drop them when the partition goes)."""
    from rlplane_service.native.stream import LedgerCore

    core = LedgerCore()
    core.indexes.record("p", ["a", "b"], ["input_ids"], [{}, {}], create=True)
    lease = core.ledger.claim(_req(n=2), final=True)
    core.ledger.ack("p", "train", lease["lease"])
    gone = weakref.ref(core.indexes["p"])
    core.op_drop({"p": "p", "ids": ["a"]}, {}, [])
    assert gone() is not None and core.ledger.consumption("p", "train")["acked"] == 1
    core.op_drop({"p": "p", "ids": ["b"]}, {}, [])
    gc.collect()
    assert gone() is None
    core.indexes.record("p", ["a"], ["input_ids"], [{}], create=True)  # made again: it starts fresh
    assert core.ledger.claim(_req(n=1), final=True)["ids"] == ["a"]


def test_a_streamed_partition_renumbers_its_slots_and_every_task_lease_and_length_follows():
    """A TransferQueue-based store's partition cleared sample by sample (the ledger's own
    index): its slots are renumbered at the drop that leaves most of them cleared, and
    claims, leases taken before, cursors and token lengths go on as if nothing happened."""
    led, idx = _ledger()
    idx.REPACK_MIN_SLOTS = 64
    lens = {f"k{i}": 10 * (i + 1) for i in range(4)}
    _put_lens(idx, "p", [1] * 8, prefix="early", groups=[f"e{i // 4}" for i in range(8)], size=4)  # slots 0-7
    early = led.claim(_tok(100, min_tokens=1, group_key="group_id", task="peek"), final=True)  # peek's cursor: 8
    assert len(early["ids"]) == 8 and led.ack("p", "peek", early["lease"], None) == 8
    _put_lens(idx, "p", list(lens.values()), prefix="k")  # slots 8-11: the kept ones
    held = led.claim(_req(n=2), final=True)  # train leases early0, early1 across the renumbering
    idx.drop("p", [f"early{i}" for i in range(8) if i != 1], led)  # early0 too: its lease still names it
    for r in range(12):  # what streams through: put, claimed, acked, cleared (a field only it has)
        _put(idx, "p", [f"r{r}-{i}" for i in range(8)], fields=("x",))
        got = led.claim(_req(task="stream", n=8, fields=("x",)), final=True)
        assert led.ack("p", "stream", got["lease"], None) == 8
        idx.drop("p", got["ids"], led)
    index = idx["p"]
    assert index.used < 64 and sorted(index.slot) == ["early1", *lens]  # renumbered at least once
    _put(idx, "p", ["z"], fields=("x",))
    assert led.ack("p", "train", held["lease"], ["early0", "early1"]) == 1  # the lease names the samples it named
    idx.record("p", ["k3"], ["extra"], [{}], create=False)  # a sample's slot is found by its id
    assert led.claim(_req(task="t2", n=1, fields=("input_ids", "extra")), final=True)["ids"] == ["k3"]
    assert led.claim(_tok(1000, task="peek", min_tokens=1), final=True)["ids"] == list(lens)  # peek's cursor moved down
    got = led.claim(_tok(30, min_tokens=1), final=True)  # lengths read again: 10 + 20 fit, + 30 does not
    assert got["ids"] == ["k0", "k1"] and got["tokens"] == 30
    assert led.consumption("p", "train")["acked"] == 1


def test_a_grouped_claim_nacks_whole_groups_and_consumes_a_group_acked_in_parts_once_its_last_part_is():
    """A group split between acked and given back is never whole again: its given-back
    members used to wait for ever (pending, never claimed). So a partial nack is a
    LeaseError naming a member left out, and nothing changes; a partial ack (each DP
    rank acks its shard of the meta, which cuts groups) is held until the group's last
    member is acked, and a lease that lapses first gives the group back whole."""
    led, idx = _ledger(lease_s=60)
    _put(idx, "p", [f"s{i}" for i in range(12)], tags=[{"gid": i // 4, "group_size": 4} for i in range(12)])
    got = led.claim(_req(n=12, group_key="gid"), final=True)
    lid = got["lease"]
    with pytest.raises(E.LeaseError, match=r"part of a group: .*group_key='gid'.* sample 's2' of the group of 's0'"):
        led.nack("p", "train", lid, ["s0", "s1", "s4", "s5", "s6", "s7"])
    assert led.consumption("p", "train")["acked"] == 0 and led.consumption("p", "train")["claimed"] == 12
    assert led.nack("p", "train", lid, ["s8", "s9", "s10", "s11"]) == 4  # a whole group: given back
    assert led.ack("p", "train", lid, ["s0", "s1", "s4"]) == 3  # rank 0's shard: nothing consumed yet
    assert led.consumption("p", "train")["acked"] == 0
    assert led.ack("p", "train", lid, ["s2", "s3", "s5"]) == 3  # rank 1's: group 0 is whole, group 1 is not
    assert led.consumption("p", "train")["acked"] == 4
    led.expire(time.monotonic() + 120)  # rank 2 died before acking s6, s7: group 1 comes back whole
    again = led.claim(_req(n=8, group_key="gid"), final=True)
    assert again["ids"] == ["s4", "s5", "s6", "s7", "s8", "s9", "s10", "s11"]
    assert led.ack("p", "train", again["lease"], None) == 8 and led.consumption("p", "train")["acked"] == 12
    plain = led.claim(_req(task="other", n=8), final=True)  # a claim without groups acks any part
    assert led.ack("p", "other", plain["lease"], ["s0", "s5"]) == 2


def test_writes_and_clears_of_the_same_samples_take_turns_at_the_ledger_and_a_dead_holder_lapses():
    """The TransferQueue-based stores' ledger keeps a write and a clear of the same samples
    apart (a clear freed storage slots a write still under way then filled). Waiting is
    parked, not refused; different samples never wait; a holder that died frees its samples
    after put_lease_s; a put waits for a clear of its partition."""
    import threading
    import time

    from rlplane import errors as E
    from rlplane.streams import DirectStreams
    from rlplane_service.native.server import Server
    from rlplane_service.native.stream import LedgerCore

    server = Server(LedgerCore(lease_s=60, put_lease_s=2.0), host="127.0.0.1", name="ledger").start()
    streams = DirectStreams({"endpoint": server.endpoint}, timeout=10)
    try:
        made = streams.reserve("p", ["a", "b"])
        streams.record("p", ["a", "b"], ["x"], [{}, {}], create=True, reservation=made)
        first = streams.hold("p", ["a", "b"], "write")
        streams.hold("p", ["c"], "clear")  # other samples: at once (and left to lapse)
        got: list[tuple[str, float]] = []

        def wait(kind: str, ids) -> None:
            t0 = time.monotonic()
            got.append((streams.hold("p", ids, kind), time.monotonic() - t0))

        waiter = threading.Thread(target=wait, args=("clear", ["b"]))
        waiter.start()
        time.sleep(0.5)
        assert not got  # parked while the write holds b
        streams.record("p", ["a", "b"], ["x"], [{}, {}], create=False, reservation=first)
        waiter.join(timeout=5)
        assert got and got[0][1] < 2.0  # given as the write ended, not at a lapse
        whole = threading.Thread(target=wait, args=("write", None))  # the partition: waits for every hold in it
        whole.start()
        with pytest.raises(E.DuplicateSampleError):
            streams.reserve("p", ["a"])  # (stored: the id check still comes first)
        whole.join(timeout=10)
        assert len(got) == 2 and 1.0 < got[1][1] < 5.0  # the clear's holder never ended it: it lapsed
        t0 = time.monotonic()
        streams.abort(got[1][0])
        streams.hold("q", None, "clear")  # a clear of q (left to lapse): a put there waits for it
        streams.reserve("q", ["n"])
        assert time.monotonic() - t0 > 1.0
    finally:
        streams.close()
        server.stop()


def test_a_writer_that_still_works_keeps_its_hold_past_the_lease_and_one_that_stopped_loses_it():
    """A put slower than put_lease_s lost its reservation: a second put of the same ids then
    cleared what the first was still writing, and the two mixed. A transport renews its
    hold while it works; only a writer that stopped (killed, hung) loses it."""
    import time
    from types import SimpleNamespace

    from rlplane import errors as E
    from rlplane.streams import DirectStreams
    from rlplane.transports.tq import TQTransport
    from rlplane_service.native.server import Server
    from rlplane_service.native.stream import LedgerCore

    server = Server(LedgerCore(lease_s=60, put_lease_s=0.6), host="127.0.0.1", name="ledger").start()
    streams, other = (DirectStreams({"endpoint": server.endpoint}, timeout=10) for _ in range(2))
    try:
        working = streams.reserve("p", ["a"])
        assert streams.hold_lease_s == 0.6
        with TQTransport._holding(SimpleNamespace(streams=streams), working):
            time.sleep(1.5)  # the writer's put, slower than the lease: renewed meanwhile
            with pytest.raises(E.DuplicateSampleError, match="being written"):
                other.reserve("p", ["a"])
        streams.record("p", ["a"], ["x"], [{}], create=True, reservation=working)
        stopped = streams.reserve("p", ["b"])  # its writer never comes back
        time.sleep(1.0)
        assert not streams.renew(stopped)
        other.record("p", ["b"], ["x"], [{}], create=True, reservation=other.reserve("p", ["b"]))
    finally:
        streams.close()
        other.close()
        server.stop()


def test_a_clear_of_a_partition_puts_keep_arriving_in_comes_first_and_a_slow_reserve_waits_for_it():
    """A waiting clear of a partition starved while rollouts kept putting into it (each
    re-check found some put under way): it now waits only for what was under way when it
    came; puts arriving meanwhile wait for it. A put's reserve waits for it as long as a
    hold would, not only the client's own timeout (it left a reservation nobody owned)."""
    import threading
    import time

    from rlplane.streams import DirectStreams
    from rlplane_service.native.server import Server
    from rlplane_service.native.stream import LedgerCore

    server = Server(LedgerCore(lease_s=60, put_lease_s=3.0), host="127.0.0.1", name="ledger").start()
    stop, puts, errors = threading.Event(), [0], []

    def writer(k: int) -> None:
        streams = DirectStreams({"endpoint": server.endpoint}, timeout=1.0)  # below the 1.5 s a reserve waits
        try:
            for i in range(200):
                if stop.is_set():
                    return
                ids = [f"w{k}-{i}"]
                held = streams.reserve("stream", ids)
                time.sleep(0.2)
                streams.record("stream", ids, ["x"], [{}], create=True, reservation=held)
                puts[0] += 1
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)
        finally:
            streams.close()

    writers = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for w in writers:
        w.start()
    clearer = DirectStreams({"endpoint": server.endpoint}, timeout=1.0)  # (a short client timeout)
    try:
        deadline = time.monotonic() + 10
        while puts[0] < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        t0 = time.monotonic()
        hold = clearer.hold("stream", None, "clear")
        assert time.monotonic() - t0 < 1.5  # the puts under way when it came, not a stream of them
        before = puts[0]
        time.sleep(1.5)  # while it holds, the writers' puts wait (longer than their client's timeout)
        assert puts[0] <= before + 4
        clearer.drop("stream", None, hold)
        deadline = time.monotonic() + 10
        while puts[0] < before + 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert puts[0] >= before + 8 and not errors  # and then they went on
    finally:
        stop.set()
        for w in writers:
            w.join(timeout=10)
        clearer.close()
        server.stop()


def test_a_clear_that_gives_up_lets_the_puts_waiting_behind_it_go_on_at_once():
    """A put that came while a clear waited waits behind it; when the clear gave up (a put
    under way outlasted its wait) the put still waited out its own deadline."""
    import threading
    import time

    from rlplane import errors as E
    from rlplane.streams import DirectStreams
    from rlplane_service.native.server import Server
    from rlplane_service.native.stream import LedgerCore

    server = Server(LedgerCore(lease_s=60, put_lease_s=2.0), host="127.0.0.1", name="ledger").start()
    slow, clearer, late = (DirectStreams({"endpoint": server.endpoint}, timeout=10) for _ in range(3))
    stop, out = threading.Event(), {}
    try:
        working = slow.reserve("p", ["a"])  # a put under way that outlasts the clear's wait (it renews)

        def renew() -> None:
            while not stop.wait(0.4):
                slow.renew(working)

        renewer = threading.Thread(target=renew)
        renewer.start()
        t0 = time.monotonic()

        def clear() -> None:
            with pytest.raises(E.UnavailableError, match="waited"):
                clearer.hold("p", None, "clear")
            out["clear"] = time.monotonic() - t0

        def put() -> None:
            late.reserve("p", ["b"])
            out["put"] = time.monotonic() - t0

        threads = [threading.Thread(target=clear), threading.Thread(target=put)]
        threads[0].start()
        time.sleep(1.0)
        threads[1].start()
        for t in threads:
            t.join(timeout=20)
        assert out["clear"] < out["put"] < out["clear"] + 0.5  # it went on as the clear gave up (~2 s), not at ~3 s
    finally:
        stop.set()
        renewer.join(timeout=20)
        for s in (slow, clearer, late):
            s.close()
        server.stop()


@pytest.mark.parametrize("op", ["renew", "abort", "record", "drop"])
def test_a_ledger_request_naming_its_hold_by_anything_but_a_string_is_a_wire_format_error(op):
    """A ``res`` that is not a string (a list) failed inside the server as an untyped
    error counted as a failure of the server; it is refused as malformed, and the hold it
    did not name stays."""
    from rlplane.streams import DirectStreams
    from rlplane_service.native.server import Server
    from rlplane_service.native.stream import LedgerCore

    server = Server(LedgerCore(lease_s=60, put_lease_s=60), host="127.0.0.1", name="ledger").start()
    streams = DirectStreams({"endpoint": server.endpoint}, timeout=10)
    try:
        made = streams.reserve("p", ["a"])
        header = {"op": op, "res": [made], "p": "p", "ids": ["a"], "fields": ["x"], "tags": [{}], "create": True}
        with pytest.raises(E.WireFormatError, match="'res'"):
            streams._call(header)
        assert server.failures == 0 and streams.renew(made)  # the reservation is still there
        streams.record("p", ["a"], ["x"], [{}], create=True, reservation=made)
    finally:
        streams.close()
        server.stop()


def test_a_lease_whose_samples_were_cleared_or_leased_again_is_settled_and_counts_no_redelivery():
    """A lease was kept while any slot it named was leased: a cleared sample kept a fully
    acked lease for its whole term and was then counted redelivered; a sample given back
    and claimed under another lease kept the first one too."""
    led, idx = _ledger(lease_s=60)
    _put(idx, "p", [f"s{i}" for i in range(5)])
    a = led.claim(_req(n=4), final=True)
    idx.drop("p", ["s3"])
    assert led.ack("p", "train", a["lease"], a["ids"]) == 3 and led.snapshot()["leases"] == 0
    led.expire(now=time.monotonic() + 61)
    assert led.consumption("p", "train")["redelivered"] == 0
    b = led.claim(_req(n=1), final=True)  # (s4: lapses with one sample cleared, one not)
    _put(idx, "p", ["s5"])
    c = led.claim(_req(n=1), final=True)
    idx.drop("p", ["s5"])
    led.expire(now=time.monotonic() + 61)
    assert b["ids"] == ["s4"] and c["ids"] == ["s5"] and led.consumption("p", "train")["redelivered"] == 1
    led2, idx2 = _ledger()
    _put(idx2, "p", [f"s{i}" for i in range(4)])
    first = led2.claim(_req(n=4), final=True)
    led2.nack("p", "train", first["lease"], ["s0"])
    again = led2.claim(_req(n=1), final=True)
    led2.ack("p", "train", first["lease"], ["s1", "s2", "s3"])
    led2.ack("p", "train", again["lease"], None)
    assert led2.snapshot()["leases"] == 0 and led2.leased("p", idx2["p"]).size == 0
    with pytest.raises(E.LeaseError, match="not held by lease"):  # (acked already: named, as before)
        led2.ack("p", "train", first["lease"], ["s1"])


def test_a_ranks_ack_of_its_shard_cleared_after_another_ranks_ack_settled_the_lease_acks_nothing():
    led, idx = _ledger()
    _put(idx, "p", [f"s{i}" for i in range(4)])
    lease = led.claim(_req(n=4), final=True)["lease"]
    idx.drop("p", ["s2", "s3"])
    assert led.ack("p", "train", lease, ["s0", "s1"]) == 2 and led.snapshot()["leases"] == 0
    assert led.ack("p", "train", lease, ["s2", "s3"]) == 0
    with pytest.raises(E.LeaseError):
        led.ack("p", "train", lease + 1, ["s2"])


def test_a_stale_group_cleared_and_put_again_fresh_is_handed_out():
    """Expired members counted after they were cleared: the group's id stayed stale for the
    partition's life, and its fresh members were expired on arrival."""
    led, idx = _ledger()
    group = [{"group_id": "g", "group_size": 2, "policy_version": v} for v in (0, 0)]
    _put(idx, "p", ["a", "b"], tags=group)
    _put(idx, "p", ["keep"], tags=[{"group_id": "k", "group_size": 1, "policy_version": 5}])
    fresh = dict(n=2, group_key="group_id", current_version=5, max_staleness=1, min_batch=1)
    assert led.claim(_req(**fresh), final=True)["ids"] == ["keep"]
    idx.drop("p", ["a", "b"])
    _put(idx, "p", ["a", "b"], tags=[{**t, "policy_version": 5} for t in group])
    assert led.claim(_req(**fresh), final=True)["ids"] == ["a", "b"]


def test_a_partial_rollout_is_judged_stale_once_finished_not_while_written():
    """A rollout begun under an old policy and finished under the current one was expired
    while still being written, and never handed out."""
    led, idx = _ledger()
    _put(idx, "p", ["r0"], tags=[{"policy_version": 1, "finished": False}])
    _put(idx, "p", ["x"], tags=[{"policy_version": 5}])
    fresh = dict(n=1, current_version=5, max_staleness=1)
    assert led.claim(_req(**fresh), final=True)["ids"] == ["x"]
    assert led.consumption("p", "train")["expired"] == 0
    idx.record("p", ["r0"], ["input_ids"], [{"policy_version": 5, "finished": True}], create=False)
    assert led.claim(_req(**fresh), final=True)["ids"] == ["r0"]


def test_a_record_with_geometry_that_is_no_length_never_breaks_a_token_claim():
    """(TransferQueue's ledger) A writer's record whose wire tag was not a map failed every
    later token claim of its partition untyped; a negative length let a claim pass its budget."""
    from rlplane_service.native.stream import LedgerCore

    core = LedgerCore(lease_s=60)
    res = core.op_reserve({"p": "p", "ids": ["a"]}, {}, [])[0]["res"]
    with pytest.raises(E.WireFormatError, match="geometry"):
        core.op_record({"p": "p", "ids": ["a"], "fields": ["input_ids"], "create": True, "res": res,
                        "tags": [{"_rlplane_wire": [3, 4]}]}, {}, [])
    ids = ["b", "c", "d", "e"]
    res = core.op_reserve({"p": "p", "ids": ids}, {}, [])[0]["res"]
    core.op_record({"p": "p", "ids": ids, "fields": ["input_ids"], "create": True, "res": res,
                    "tags": [{"_rlplane_wire": {"input_ids": [n]}} for n in (5, -50, 2**70, 60)]}, {}, [])
    claim = {"p": "p", "task": "t", "n": 8, "fields": ["input_ids"], "min": 1, "tok": 20, "mintok": 1,
             "tokf": "input_ids", "_final": True}
    out = core.op_claim(claim, {}, [])[0]
    assert out["ids"] == ["b", "c", "d"] and out["tokens"] == 5 and not out["over_budget"]
