"""/metrics stays small whatever clients report or create (issue 23): error labels come
from a fixed set, and only the biggest partitions and tasks get labels of their own."""

from rlplane_service.metrics import TOP_LABELLED, Ledger, StoreView, render


def _lines(body: bytes, metric: str) -> list[str]:
    return [ln for ln in body.decode().splitlines() if ln.startswith(metric + "{")]


def test_two_thousand_invented_error_names_add_one_label():
    ledger = Ledger()
    counted = ledger.record([{"op": "put_samples", "transport": "native", "seconds": 0.1, "error": f"Bogus{i}"}
                             for i in range(2000)])
    ledger.record([{"op": "put_samples", "transport": "native", "seconds": 0.1, "error": "StorageFullError"}])
    assert counted == 2000
    body = render(ledger.snapshot(), StoreView("native", {}, {}, {}, None))
    errors = _lines(body, "rlplane_errors_total")
    kinds = sorted(ln.split('type="')[1].split('"')[0] for ln in errors)
    assert kinds == ["Other", "StorageFullError"], errors
    assert any(ln.endswith(" 2000.0") for ln in errors)


def test_many_partitions_and_tasks_are_summed_beyond_the_biggest():
    parts = {f"p{i}": (i + 1, 1000 * (i + 1)) for i in range(499)}
    parts["other"] = (500, 500_000)  # the biggest, named like the sum was (a third review: it was overwritten)
    tasks = [{"partition": f"p{i}", "task": "train", "pending": i, "claimed": 0, "acked": 0, "expired": 0,
              "redelivered": 1} for i in range(300)]
    view = StoreView("native", parts, {}, {}, None, streams={"tasks": tasks, "wait_buckets": [], "wait_counts": []})
    body = render({"ops": {}, "nbytes": {}, "errors": {}, "latency": {}}, view)
    samples = _lines(body, "rlplane_partition_samples")
    assert len(samples) == TOP_LABELLED + 1
    assert 'partition="other"} 500.0' in "".join(samples) and 'partition="p0"' not in "".join(samples)
    other = next(ln for ln in samples if 'partition="(other)"' in ln)
    assert float(other.rsplit(" ", 1)[1]) == sum(range(1, 451))  # the 450 smallest, summed
    total = next(ln for ln in body.decode().splitlines() if ln.startswith("rlplane_stored_samples "))
    assert float(total.rsplit(" ", 1)[1]) == sum(range(1, 501))  # totals still count every partition
    pending = [ln for ln in _lines(body, "rlplane_consumption_samples") if 'state="pending"' in ln]
    assert len(pending) == TOP_LABELLED + 1
    assert float(next(ln for ln in pending if 'task="(other)"' in ln).rsplit(" ", 1)[1]) == sum(range(250))


def test_a_dead_loop_of_a_component_shows_as_down():
    view = StoreView("native", {}, {}, {}, None, components={"controller": True, "controller rlplane-watch": False})
    body = render({"ops": {}, "nbytes": {}, "errors": {}, "latency": {}}, view).decode()
    assert 'rlplane_component_up{component="controller"} 1.0' in body
    assert 'rlplane_component_up{component="controller rlplane-watch"} 0.0' in body
