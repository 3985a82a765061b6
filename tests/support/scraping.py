"""Reading /metrics in tests: the one place that knows a body is reused for SCRAPE_TTL_S
(the cache that keeps a flood of scrapes off the store)."""

import time
from typing import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rlplane_service.metrics import SCRAPE_TTL_S

Samples = dict[tuple[str, tuple], float]


def scrape_text(url: str) -> str:
    """A body of ``url``/metrics made after this call began: the cached one has lapsed."""
    time.sleep(SCRAPE_TTL_S)
    return httpx.get(f"{url}/metrics", timeout=30).text


def parse(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str, until: Callable[[Samples], bool] | None = None, within: float = 10.0) -> Samples:
    """Every sample of ``url``/metrics as {(name, sorted labels): value}. Without ``until``:
    one body that shows every op before the call. With it: scrapes until the samples
    satisfy ``until`` or ``within`` seconds pass (the last answer)."""
    if until is None:
        return parse(scrape_text(url))
    deadline = time.monotonic() + within
    while True:
        samples = parse(httpx.get(f"{url}/metrics", timeout=30).text)
        if until(samples) or time.monotonic() >= deadline:
            return samples
        time.sleep(0.2)


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
