"""The bench's targets: what rlplane promises against the engine beneath it and the
alternatives, each reported met or missed (never asserted in a test).

Example::

    for t in evaluate(results):
        print(t["name"], "met" if t["met"] else "missed")
"""

from __future__ import annotations

from typing import Any

from rlplane_tools.bench.paths import REFERENCE

#: rlplane's put and read keep at least this share of raw TransferQueue's GB/s on vlm-step.
TQ_SHARE_OF_RAW = 0.9
#: The HTTP transport moves at least this many GB/s each way on vlm-step.
HTTP_MIN_GBPS = 0.5
#: A small-batch put or read may cost at most this much more than the Ray object store's (p50).
SMALL_OVERHEAD_MS = 0.0
#: text-scale: µs per sample at the biggest B at most this multiple of the one at B=256.
SCALE_FLAT = 1.2
#: text-scale B=4096: the round trip at most this multiple of a memcpy of its bytes.
MEMCPY_MULTIPLE = 10.0
#: text-step: the round trip at most this multiple of the Ray object store's.
TEXT_VS_RAY = 1.0
#: vlm-step over the slabs: round trip and get as a share of raw TransferQueue's time, round trip of DataProto's.
SLAB_TRIP_VS_TQ, SLAB_GET_VS_TQ, SLAB_TRIP_VS_DATAPROTO = 0.4, 0.3, 0.6
#: vlm-step sweep: native get GB/s at the biggest batch at least this share of the smallest's.
SWEEP_HOLDS = 0.9
#: claim section: p50 of a claim whose batch is ready, of a blocked claim's wake-up, and N claimers' rate.
CLAIM_P50_MS, WAKE_P50_MS, CLAIMERS_MIN_RATE = 2.0, 20.0, 1000.0
#: extend: p50 of appending EXTEND_TOKENS to a batch's partial rollouts (ms), and the last extends'
#: p50 as a multiple of the first ones' (the cost must not grow with the extends before).
EXTEND_P50_MS, EXTEND_FLAT = 2.0, 1.5
#: vlm-step: what the row checksums add (once on put, once on read) as a share of the native round trip.
CHECKSUM_SHARE = 0.05
#: The transfer engine: small put/get p50 at most this (ms); text-scale at most this multiple of shm's µs/sample.
TE_SMALL_MS, TE_SCALE_VS_SHM = 1.0, 1.5
#: vlm-grpo (groups sharing their images): what the native engine stores as a multiple of the
#: batch's unique bytes, and its round trip as a share of raw TransferQueue's (which stores every copy).
GRPO_STORED_VS_UNIQUE, GRPO_TRIP_VS_TQ = 1.05, 0.15
GRPO_WORKLOAD = "vlm-grpo"
TARGET_WORKLOAD = "vlm-step"
NATIVE = "rlplane-native"
APART = "rlplane-native-apart"  # vlm-grpo written one put per sample: its rows shared across puts
TE, ZMQ = "rlplane-native-te", "rlplane-native-zmq"
RAY = "ray-object-store"
DATAPROTO = "mooncake-dataproto"


def evaluate(results: dict) -> list[dict]:
    """One entry per target: ``name``, ``met`` (None when its rows did not run), ``value``,
    ``threshold``, ``detail``."""
    out: list[dict] = []
    work = {w["workload"]: w for w in results.get("workloads", [])}
    vlm, text = work.get(TARGET_WORKLOAD), work.get("text-step")
    gbps = _gbps(vlm) if vlm else {}
    lat = {r["path"]: r for r in (results.get("latency") or {}).get("paths", [])}
    scale = {w["batch"]: w for w in results.get("sweeps", {}).get("scale", [])}

    # -- the native engine (the default backend) ------------------------------------------
    if scale:
        from rlplane_tools.bench.report import per_sample_us

        small_b = 256 if 256 in scale else min(scale)
        big_b = 8192 if 8192 in scale else max(scale)
        trip = {b: per_sample_us(w, NATIVE, "round trip") for b, w in scale.items()}
        lo, hi = trip.get(small_b), trip.get(big_b)
        out.append(_target(f"text-scale: native µs/sample at B={big_b} <= {SCALE_FLAT}x at B={small_b}",
                           None if lo is None or hi is None else hi / lo, SCALE_FLAT,
                           lo is not None and hi is not None and hi / lo <= SCALE_FLAT, "round trip µs/sample ratio"))
        b4k = 4096 if 4096 in scale else big_b
        w = scale[b4k]
        ours, copy = _median(w, NATIVE, "round trip"), w["bounds"][0]["median_ms"]
        out.append(_target(f"text-scale B={b4k}: native round trip <= {MEMCPY_MULTIPLE}x memcpy",
                           None if ours is None else ours / copy, MEMCPY_MULTIPLE,
                           ours is not None and ours / copy <= MEMCPY_MULTIPLE, "round trip ms / memcpy ms of its bytes",
                           _where(w, NATIVE)))
    ours, ray = _median(text, NATIVE, "round trip"), _median(text, RAY, "round trip")
    out.append(_target(f"text-step: native round trip <= {TEXT_VS_RAY}x the Ray object store's",
                       None if ours is None or not ray else ours / ray, TEXT_VS_RAY,
                       ours is not None and bool(ray) and ours / ray <= TEXT_VS_RAY, "put+get ms ratio (median)",
                       _where(text, NATIVE)))
    for op in ("put", "get"):
        ours_p50 = lat.get(NATIVE, {}).get(op, {}).get("p50_ms")
        ray_p50 = lat.get(RAY, {}).get(op, {}).get("p50_ms")
        limit = ray_p50 + SMALL_OVERHEAD_MS if ray_p50 is not None else None
        out.append(_target(f"small: native {op} p50 <= Ray object store p50 + {SMALL_OVERHEAD_MS:g} ms", ours_p50, limit,
                           ours_p50 is not None and limit is not None and ours_p50 <= limit, f"ms, p50 of {op}",
                           _where(results.get("latency"), NATIVE, (op,))))
    ours, ref = _median(vlm, NATIVE, "round trip"), _median(vlm, REFERENCE, "round trip")
    out.append(_target(f"{TARGET_WORKLOAD}: native round trip <= raw TransferQueue's", ours, ref,
                       ours is not None and ref is not None and ours <= ref, "put+get ms (median)", _where(vlm, NATIVE)))
    for op in ("put", "get"):
        mine, theirs = gbps.get((NATIVE, op)), gbps.get((REFERENCE, op))
        value = mine / theirs if mine is not None and theirs else None
        out.append(_target(f"{TARGET_WORKLOAD}: native {op} >= {TQ_SHARE_OF_RAW}x raw TQ", value, TQ_SHARE_OF_RAW,
                           value is not None and value >= TQ_SHARE_OF_RAW, f"GB/s ratio of {op}", _where(vlm, NATIVE, (op,))))

    out.extend(_versus_dataproto(results, vlm, lat, scale))
    out.extend(_slab_targets(results, vlm))
    out.extend(_te_targets(vlm, lat, scale, results.get("latency")))
    out.extend(_grpo_targets(work.get(GRPO_WORKLOAD)))
    ours, sums = _median(vlm, NATIVE, "round trip"), (vlm or {}).get("checksum_ms")
    value = 2 * sums / ours if ours and sums is not None else None
    out.append(_target(f"{TARGET_WORKLOAD}: row checksums (computed on put, checked on read) <= {CHECKSUM_SHARE:.0%} of "
                       "the native round trip", value, CHECKSUM_SHARE, value is not None and value <= CHECKSUM_SHARE,
                       "2 x digest ms / round trip ms"))

    # -- rlplane on TransferQueue and over HTTP ---------------------------------------------
    def ratio_target(name: str, op: str) -> None:
        ours, ref = gbps.get(("rlplane-tq", op)), gbps.get((REFERENCE, op))
        value = ours / ref if ours is not None and ref else None
        out.append(_target(name, value, TQ_SHARE_OF_RAW, value is not None and value >= TQ_SHARE_OF_RAW,
                           f"rlplane tq {op} / raw TransferQueue {op}, GB/s ratio"))

    ratio_target(f"{TARGET_WORKLOAD}: rlplane tq put >= {TQ_SHARE_OF_RAW}x raw TQ", "put")
    ratio_target(f"{TARGET_WORKLOAD}: rlplane tq read >= {TQ_SHARE_OF_RAW}x raw TQ", "get")
    for op in ("put", "get"):
        v = gbps.get(("rlplane-http", op))
        out.append(_target(f"{TARGET_WORKLOAD}: http transport {op} >= {HTTP_MIN_GBPS} GB/s", v, HTTP_MIN_GBPS,
                           v is not None and v >= HTTP_MIN_GBPS, "GB/s through the Serve HTTP proxy"))

    claim = results.get("claim")
    if claim:
        v = claim["claim"]["p50_ms"]
        out.append(_target(f"claim: p50 <= {CLAIM_P50_MS:g} ms with the batch ready (batch {claim['batch']})", v,
                           CLAIM_P50_MS, v <= CLAIM_P50_MS, "ms, p50 of claim"))
        tok = claim.get("claim_tokens")
        if tok:
            v = tok["p50_ms"]
            out.append(_target(f"claim: max_tokens p50 <= {CLAIM_P50_MS:g} ms with the batch ready (groups of "
                               f"{tok['group']})", v, CLAIM_P50_MS, v <= CLAIM_P50_MS, "ms, p50 of claim"))
        ext = claim.get("extend")
        if ext:
            v = ext["first"]["p50_ms"]
            out.append(_target(f"extend: {ext['tokens']} tokens to {ext['batch']} samples p50 <= {EXTEND_P50_MS:g} ms", v,
                               EXTEND_P50_MS, v <= EXTEND_P50_MS, "ms, p50 of the first tenth of the extends",
                               _parts_of(ext, ("first",))))
            v = ext["last"]["p50_ms"] / ext["first"]["p50_ms"]
            out.append(_target(f"extend: p50 after {ext['extends']} extends <= {EXTEND_FLAT}x the first ones'", v,
                               EXTEND_FLAT, v <= EXTEND_FLAT, "p50 ratio, last tenth / first tenth",
                               _parts_of(ext, ("first", "last"))))
        v = (claim.get("wake") or {}).get("p50_ms")
        out.append(_target(f"claim: wake-up p50 <= {WAKE_P50_MS:g} ms after the commit", v, WAKE_P50_MS,
                           v is not None and v <= WAKE_P50_MS and not claim["wake_missed"], "ms from put's return"))
        d = claim["drain"]
        v = d["samples_per_s"]
        out.append(_target(f"claim: {d['claimers']} claimers >= {CLAIMERS_MIN_RATE:g} samples/s claimed+read+acked", v,
                           CLAIMERS_MIN_RATE, v is not None and v >= CLAIMERS_MIN_RATE and d["exactly_once"],
                           "samples/s (text-step shapes), exactly once"))

    by_n = {w["writers"]: w["put"]["gb_per_s"] for w in results.get("sweeps", {}).get("writers", [])}
    one, most = by_n.get(1), by_n.get(max(by_n)) if by_n else None
    out.append(_target(f"{max(by_n) if by_n else 'N'} writers aggregate >= 1 writer (native)", most, one,
                       most is not None and one is not None and most >= one, "aggregate put GB/s"))
    return out


def _versus_dataproto(results: dict, vlm: dict | None, lat: dict, scale: dict) -> list[dict]:
    """The native engine against Mooncake's DataProto store, in the same run: text-scale
    B=4096 put and get µs/sample, vlm-step round trip, the DP-shard read, small p50s."""
    from rlplane_tools.bench.report import per_sample_us

    out = []

    def faster(name: str, ours: float | None, theirs: float | None, detail: str, where: str | None) -> None:
        out.append(_target(name, ours, theirs, ours is not None and theirs is not None and ours < theirs, detail, where))

    if scale:
        b = 4096 if 4096 in scale else max(scale)
        for op in ("put", "get"):
            faster(f"text-scale B={b}: native {op} µs/sample < Mooncake DataProto's",
                   per_sample_us(scale[b], NATIVE, op), per_sample_us(scale[b], DATAPROTO, op), f"µs/sample of {op}",
                   _where(scale[b], NATIVE, (op,)))
    faster(f"{TARGET_WORKLOAD}: native round trip < Mooncake DataProto's",
           _median(vlm, NATIVE, "round trip"), _median(vlm, DATAPROTO, "round trip"), "put+get ms (median)",
           _where(vlm, NATIVE))
    shard = {r["path"]: r["get"]["p50_ms"] for r in (results.get("dp_shard") or {}).get("paths", [])}
    faster("DP shard read: native p50 < Mooncake DataProto's", shard.get(NATIVE), shard.get(DATAPROTO), "ms, p50",
           _where(results.get("dp_shard"), NATIVE, ("get",)))
    for op in ("put", "get"):
        faster(f"small: native {op} p50 < Mooncake DataProto's", lat.get(NATIVE, {}).get(op, {}).get("p50_ms"),
               lat.get(DATAPROTO, {}).get(op, {}).get("p50_ms"), f"ms, p50 of {op}",
               _where(results.get("latency"), NATIVE, (op,)))
    return out


def _slab_targets(results: dict, vlm: dict | None) -> list[dict]:
    """What the shared-memory slabs promise: vlm-step against raw TransferQueue and
    DataProto as time ratios, the DP-shard read against raw TransferQueue's, and a batch
    sweep whose get holds its GB/s as B grows and beats raw TransferQueue's at every B."""
    out = []

    def at_most(name: str, ours: float | None, theirs: float | None, share: float, detail: str, where: str | None) -> None:
        value = ours / theirs if ours is not None and theirs else None
        out.append(_target(name, value, share, value is not None and value <= share, detail, where))

    at_most(f"{TARGET_WORKLOAD}: native round trip <= {SLAB_TRIP_VS_TQ}x raw TransferQueue's",
            _median(vlm, NATIVE, "round trip"), _median(vlm, REFERENCE, "round trip"), SLAB_TRIP_VS_TQ, "time ratio (median)",
            _where(vlm, NATIVE))
    at_most(f"{TARGET_WORKLOAD}: native get <= {SLAB_GET_VS_TQ}x raw TransferQueue's",
            _median(vlm, NATIVE, "get"), _median(vlm, REFERENCE, "get"), SLAB_GET_VS_TQ, "time ratio (median)",
            _where(vlm, NATIVE, ("get",)))
    at_most(f"{TARGET_WORKLOAD}: native round trip < {SLAB_TRIP_VS_DATAPROTO}x Mooncake DataProto's",
            _median(vlm, NATIVE, "round trip"), _median(vlm, DATAPROTO, "round trip"), SLAB_TRIP_VS_DATAPROTO,
            "time ratio (median)", _where(vlm, NATIVE))
    shard = {r["path"]: r["get"]["p50_ms"] for r in (results.get("dp_shard") or {}).get("paths", [])}
    ours, ref = shard.get(NATIVE), shard.get(REFERENCE)
    out.append(_target("DP shard read: native p50 < raw TransferQueue's", ours, ref,
                       ours is not None and ref is not None and ours < ref, "ms, p50",
                       _where(results.get("dp_shard"), NATIVE, ("get",))))
    sweep = sorted(results.get("sweeps", {}).get("batch", []), key=lambda w: w["batch"])
    if sweep:
        gets = [_gbps(w) for w in sweep]
        lo, hi = gets[0].get((NATIVE, "get")), gets[-1].get((NATIVE, "get"))
        value = hi / lo if lo and hi is not None else None
        out.append(_target(f"sweep: native get GB/s at B={sweep[-1]['batch']} >= {SWEEP_HOLDS}x B={sweep[0]['batch']}",
                           value, SWEEP_HOLDS, value is not None and value >= SWEEP_HOLDS, "GB/s ratio"))
        worst = min((g[(NATIVE, "get")] / g[(REFERENCE, "get")] for g in gets
                     if g.get((NATIVE, "get")) and g.get((REFERENCE, "get"))), default=None)
        out.append(_target("sweep: native get GB/s >= raw TransferQueue's at every B", worst, 1.0,
                           worst is not None and worst >= 1.0, "lowest GB/s ratio over the sweep"))
    return out


def _grpo_targets(grpo: dict | None) -> list[dict]:
    """vlm-grpo: the native engine keeps each group's images once (bytes it stored against
    the batch's unique bytes) and moves them once (round trip against raw TransferQueue's)."""
    out = []
    for path, how in ((NATIVE, ""), (APART, ", a put per sample,")):
        held, unique = (grpo or {}).get("held_bytes", {}).get(path), (grpo or {}).get("unique_bytes")
        value = held / unique if held is not None and unique else None
        out.append(_target(f"{GRPO_WORKLOAD}: native{how} stores <= {GRPO_STORED_VS_UNIQUE}x the batch's unique bytes",
                           value, GRPO_STORED_VS_UNIQUE, value is not None and value <= GRPO_STORED_VS_UNIQUE,
                           "bytes stored / unique bytes"))
    ours, ref = _median(grpo, NATIVE, "round trip"), _median(grpo, REFERENCE, "round trip")
    value = ours / ref if ours is not None and ref else None
    out.append(_target(f"{GRPO_WORKLOAD}: native round trip <= {GRPO_TRIP_VS_TQ}x raw TransferQueue's", value,
                       GRPO_TRIP_VS_TQ, value is not None and value <= GRPO_TRIP_VS_TQ, "time ratio (median)",
                       _where(grpo, NATIVE)))
    return out


def _te_targets(vlm: dict | None, lat: dict, scale: dict, latency: dict | None) -> list[dict]:
    """The transfer-engine path: vlm-step round trip against the zmq path's and raw
    TransferQueue's, small p50s in absolute ms, text-scale B=4096 against the shm path."""
    from rlplane_tools.bench.report import per_sample_us

    ours = _median(vlm, TE, "round trip")
    out = []
    for other, label in ((ZMQ, "the zmq path's"), (REFERENCE, "raw TransferQueue's")):
        theirs = _median(vlm, other, "round trip")
        out.append(_target(f"{TARGET_WORKLOAD}: te round trip <= {label}", ours, theirs,
                           ours is not None and theirs is not None and ours <= theirs, "put+get ms (median)",
                           _where(vlm, TE)))
    for op in ("put", "get"):
        v = lat.get(TE, {}).get(op, {}).get("p50_ms")
        out.append(_target(f"small: te {op} p50 <= {TE_SMALL_MS:g} ms", v, TE_SMALL_MS,
                           v is not None and v <= TE_SMALL_MS, f"ms, p50 of {op}", _where(latency, TE, (op,))))
    if scale:
        b = 4096 if 4096 in scale else max(scale)
        te, shm = per_sample_us(scale[b], TE, "round trip"), per_sample_us(scale[b], NATIVE, "round trip")
        value = te / shm if te is not None and shm else None
        out.append(_target(f"text-scale B={b}: te µs/sample <= {TE_SCALE_VS_SHM}x the shm path's", value,
                           TE_SCALE_VS_SHM, value is not None and value <= TE_SCALE_VS_SHM, "round trip µs/sample ratio",
                           _where(scale[b], TE)))
    return out


def _target(name: str, value: float | None, threshold: float | None, met: bool, detail: str,
            where: str | None = None) -> dict[str, Any]:
    """One target's entry; a missed one says ``where`` the time of the rlplane ops it
    measures went, when the bench could tell (:func:`_where`)."""
    verdict = met if value is not None and threshold is not None else None
    out = {"name": name, "met": verdict, "value": value, "threshold": threshold, "detail": detail}
    if verdict is False and where:
        out["where"] = where
    return out


def _parts_of(section: dict, keys: tuple[str, ...]) -> str | None:
    """:func:`_where` for a section whose ``keys`` each hold one measure's ``parts_ms``."""
    from rlplane_tools.bench.report import parts_text

    said = [(k, parts_text(section.get(k, {}).get("parts_ms"))) for k in keys]
    return "; ".join(f"{k}: {text}" for k, text in said if text) or None


def _where(section: dict | None, path: str, ops: tuple[str, ...] = ("put", "get")) -> str | None:
    """Where ``path``'s ``ops`` spent their time in one section of the results (its rows'
    ``parts_ms``: waiting on the store, codec, client), in words; None where not told."""
    row = next((r for r in (section or {}).get("paths", []) if r["path"] == path), None) or {}
    return _parts_of(row.get("ops") or row, ops)


def _gbps(workload: dict) -> dict[tuple[str, str], float]:
    return {(r["path"], op): d["gb_per_s"] for r in workload["paths"] for op, d in r["ops"].items()}


def _median(workload: dict | None, path: str, op: str) -> float | None:
    row = next((r for r in (workload or {}).get("paths", []) if r["path"] == path), None)
    return row["ops"][op]["median_ms"] if row else None
