"""The bench's targets: what rlplane promises against the engine beneath it and the
alternatives, each reported met or missed (never asserted in a test).

Example::

    for t in evaluate(results):
        print(t["name"], "met" if t["met"] else "missed")
"""

from __future__ import annotations

from typing import Any

from rlplane_service.bench.paths import REFERENCE

#: rlplane's tq put and read keep at least this share of raw TransferQueue's GB/s on vlm-step.
TQ_SHARE_OF_RAW = 0.9
#: The HTTP transport moves at least this many GB/s each way on vlm-step.
HTTP_MIN_GBPS = 0.5
#: A small-batch put may cost at most this much more than raw TransferQueue's (p50).
SMALL_PUT_OVERHEAD_MS = 1.0
TARGET_WORKLOAD = "vlm-step"


def evaluate(results: dict) -> list[dict]:
    """One entry per target: ``name``, ``met`` (None when its rows did not run), ``value``,
    ``threshold``, ``detail``."""
    out: list[dict] = []
    vlm = next((w for w in results.get("workloads", []) if w["workload"] == TARGET_WORKLOAD), None)
    gbps = _gbps(vlm) if vlm else {}

    def ratio_target(name: str, op: str) -> None:
        ours, ref = gbps.get(("rlplane-tq", op)), gbps.get((REFERENCE, op))
        value = ours / ref if ours is not None and ref else None
        out.append(_target(name, value, TQ_SHARE_OF_RAW, value is not None and value >= TQ_SHARE_OF_RAW,
                           f"rlplane tq {op} / raw TransferQueue {op}, GB/s ratio"))

    ratio_target(f"{TARGET_WORKLOAD}: rlplane tq put >= {TQ_SHARE_OF_RAW}x raw TQ", "put")
    ratio_target(f"{TARGET_WORKLOAD}: rlplane tq read >= {TQ_SHARE_OF_RAW}x raw TQ", "get")

    ours, ray = _median(vlm, "rlplane-tq", "round trip"), _median(vlm, "ray-object-store", "round trip")
    out.append(_target(
        f"{TARGET_WORKLOAD}: rlplane round trip faster than the Ray object store",
        ours, ray, ours is not None and ray is not None and ours < ray,
        "rlplane tq put+get ms vs ray.put+ray.get ms (median)",
    ))
    for op in ("put", "get"):
        v = gbps.get(("rlplane-http", op))
        out.append(_target(f"{TARGET_WORKLOAD}: http transport {op} >= {HTTP_MIN_GBPS} GB/s", v, HTTP_MIN_GBPS,
                           v is not None and v >= HTTP_MIN_GBPS, "GB/s through the Serve HTTP proxy"))

    lat = {r["path"]: r for r in (results.get("latency") or {}).get("paths", [])}
    ours_p50 = lat.get("rlplane-tq", {}).get("put", {}).get("p50_ms")
    ref_p50 = lat.get(REFERENCE, {}).get("put", {}).get("p50_ms")
    limit = ref_p50 + SMALL_PUT_OVERHEAD_MS if ref_p50 is not None else None
    out.append(_target(f"small: rlplane tq put p50 <= raw TQ p50 + {SMALL_PUT_OVERHEAD_MS:g} ms", ours_p50, limit,
                       ours_p50 is not None and limit is not None and ours_p50 <= limit, "ms, p50 of put"))

    by_n = {w["writers"]: w["put"]["gb_per_s"] for w in results.get("sweeps", {}).get("writers", [])}
    one, most = by_n.get(1), by_n.get(max(by_n)) if by_n else None
    out.append(_target(f"{max(by_n) if by_n else 'N'} writers aggregate >= 1 writer", most, one,
                       most is not None and one is not None and most >= one, "aggregate put GB/s"))
    return out


def _target(name: str, value: float | None, threshold: float | None, met: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "met": met if value is not None and threshold is not None else None,
            "value": value, "threshold": threshold, "detail": detail}


def _gbps(workload: dict) -> dict[tuple[str, str], float]:
    return {(r["path"], op): d["gb_per_s"] for r in workload["paths"] for op, d in r["ops"].items()}


def _median(workload: dict | None, path: str, op: str) -> float | None:
    row = next((r for r in (workload or {}).get("paths", []) if r["path"] == path), None)
    return row["ops"][op]["median_ms"] if row else None
