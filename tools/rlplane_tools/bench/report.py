"""What ``rlplane bench`` prints and writes: rich tables, the JSON file, machine facts.

Example::

    print_report(results, console)
    write_json(results, Path("out/bench.json"))
"""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from rlplane.opstats import ENGINE, PARTS

#: Short names of the rows a title names (the tables' rows carry their own labels).
PATH_LABELS = {"rlplane-native": "native", "rlplane-native-apart": "native, a put per sample,"}


def machine_facts() -> dict:
    """The host and library versions a result was measured with."""
    versions = {}
    for dist in ("ray", "transferqueue", "rlplane"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", "0"),
        "memory_gb": _memory_gb(),
        **versions,
    }


def write_json(results: dict, path: Path) -> None:
    """``results`` as indented JSON at ``path`` (parent folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))


def print_report(results: dict, console: Console) -> None:
    """Every table of a run: per workload, latency, sweeps, targets."""
    for w in results["workloads"]:
        console.print(workload_table(w))
    if results.get("latency"):
        console.print(latency_table(results["latency"]))
    if results.get("dp_shard"):
        console.print(dp_shard_table(results["dp_shard"]))
    sweeps = results.get("sweeps", {})
    if sweeps.get("batch"):
        console.print(batch_sweep_table(sweeps["batch"]))
    if sweeps.get("scale"):
        console.print(scale_table(sweeps["scale"]))
    if sweeps.get("writers"):
        console.print(writers_table(sweeps["writers"]))
    if results.get("claim"):
        console.print(claim_table(results["claim"]))
    if results.get("controller"):
        console.print(controller_table(results["controller"]))
    parts = parts_table(results)
    if parts is not None:
        console.print(parts)
    for section in [*results["workloads"], results.get("latency"), results.get("dp_shard"), *sweeps.get("batch", []),
                    *sweeps.get("scale", [])]:
        for path, why in ((section or {}).get("wrong") or {}).items():
            console.print(f"[red]{path} left out of {section['workload']} B={section['batch']}[/]: {why}")
    console.print(targets_table(results["targets"]))


def workload_table(w: dict) -> Table:
    """One row per (path, op): median ms, min..max, GB/s, ratio to raw TransferQueue."""
    reps = w["paths"][0]["ops"]["put"]["reps"] if w["paths"] else 0
    held = "".join(f"; {PATH_LABELS.get(p, p)} stored {b / 1e6:.1f} MB" for p, b in (w.get("held_bytes") or {}).items())
    unique = f" ({w['unique_bytes'] / 1e6:.1f} MB unique{held})" if w.get("unique_bytes") is not None else ""
    t = Table(title=f"{w['workload']} B={w['batch']} S={w['seqlen']}: {w['bytes_stored'] / 1e6:.1f} MB written{unique}, "
                    f"writer -> reader, median of {reps}")
    for col in ("path", "op", "ms", "min..max ms", "GB/s", "x raw TQ"):
        t.add_column(col, justify="left" if col in ("path", "op") else "right")
    for r in w["paths"]:
        for op, d in r["ops"].items():
            ratio = (r.get("ratio_to_raw_tq") or {}).get(op)
            t.add_row(r["label"], op, f"{d['median_ms']:.1f}", f"{d['min_ms']:.1f}..{d['max_ms']:.1f}",
                      f"{d['gb_per_s']:.2f}", "" if ratio is None else f"{ratio:.2f}")
    for d in w["bounds"]:
        t.add_row(d["op"], "copy", f"{d['median_ms']:.1f}", f"{d['min_ms']:.1f}..{d['max_ms']:.1f}", f"{d['gb_per_s']:.2f}", "")
    if w.get("checksum_ms") is not None:
        t.add_row("row checksums (xxh3)", "each way", f"{w['checksum_ms']:.1f}", "", "", "")
    return t


def parts_table(results: dict) -> Table | None:
    """Where each rlplane op's time went, per section and path (median ms of each part,
    :data:`rlplane.opstats.PARTS`): waiting on the store's answers, encoding or decoding
    in the client, and the rest of the client's work. None when no row told."""
    t = Table(title="where rlplane's time went: median ms of each part (the engine's: of the wait, what its "
                    "servers said they took)")
    for col in ("section", "path", "op", "ms", "waited on store", "of it, engine", "codec", "client"):
        t.add_column(col, justify="left" if col in ("section", "path", "op") else "right")
    sweeps = results.get("sweeps", {})
    for section in [*results["workloads"], results.get("latency"), results.get("dp_shard"), *sweeps.get("scale", [])]:
        for r in (section or {}).get("paths", []):
            for op in ("put", "get"):
                d = (r.get("ops") or r).get(op) or {}
                if d.get("parts_ms"):
                    ms = d.get("median_ms", d.get("p50_ms"))
                    parts = d["parts_ms"]
                    t.add_row(f"{section['workload']} B={section['batch']}", r["label"], op, _num(ms),
                              _num(parts["wait"]), _num(parts.get(ENGINE)), _num(parts["codec"]), _num(parts["client"]))
    return t if t.row_count else None


def parts_text(parts: dict[str, float] | None) -> str | None:
    """Where one op's time went, in words (a missed target's): ``waited on the store 2.10
    (the engine took 1.60) + codec 0.70 + client 0.80 ms``; None where not told."""
    if not parts:
        return None
    words = [f"{_PART_WORDS[k]} {parts[k]:.2f}" for k in PARTS]
    if ENGINE in parts:
        words[0] += f" (the engine took {parts[ENGINE]:.2f})"
    return " + ".join(words) + " ms"


_PART_WORDS = {"wait": "waited on the store", "codec": "codec", "client": "client"}


def latency_table(lat: dict) -> Table:
    t = Table(title=f"{lat['workload']} B={lat['batch']} S={lat['seqlen']} ({lat['bytes_stored'] / 1e3:.0f} kB): "
                    f"latency per op over {lat['ops']} ops")
    for col in ("path", "put p50 ms", "put p99 ms", "get p50 ms", "get p99 ms"):
        t.add_column(col, justify="left" if col == "path" else "right")
    for r in lat["paths"]:
        t.add_row(r["label"], *(f"{r[op][q]:.2f}" for op in ("put", "get") for q in ("p50_ms", "p99_ms")))
    return t


def dp_shard_table(d: dict) -> Table:
    """A DP rank's read (every other sample, two fields) per path that can select rows."""
    t = Table(title=f"DP shard read: {d['rows']} of {d['batch']} {d['workload']} samples, "
                    f"{' + '.join(d['fields'])}, p50 of {d['paths'][0]['get']['ops'] if d['paths'] else 0}")
    for col in ("path", "p50 ms", "p99 ms", "min ms"):
        t.add_column(col, justify="left" if col == "path" else "right")
    for r in d["paths"]:
        t.add_row(r["label"], *(f"{r['get'][q]:.1f}" for q in ("p50_ms", "p99_ms", "min_ms")))
    return t


def batch_sweep_table(sweep: list[dict]) -> Table:
    t = Table(title=f"{sweep[0]['workload']} batch sweep: GB/s put / get (median)")
    t.add_column("path")
    for w in sweep:
        t.add_column(f"B={w['batch']} ({w['bytes_stored'] / 1e6:.0f} MB)", justify="right")
    for path, label in sweep_paths(sweep):
        cells = []
        for w in sweep:
            row = next((r for r in w["paths"] if r["path"] == path), None)
            cells.append("wrong bytes" if row is None else
                         f"{row['ops']['put']['gb_per_s']:.2f} / {row['ops']['get']['gb_per_s']:.2f}")
        t.add_row(label, *cells)
    return t


def sweep_paths(sweep: list[dict]) -> list[tuple[str, str]]:
    """(path, label) of every row in any size of a sweep, first-seen order (a peer whose
    bytes came back wrong at one size is missing there)."""
    seen: dict[str, str] = {}
    for w in sweep:
        for r in w["paths"]:
            seen.setdefault(r["path"], r["label"])
    return list(seen.items())


def per_sample_us(w: dict, path: str, op: str) -> float | None:
    """Median µs per sample of ``op`` through ``path`` in one throughput result."""
    row = next((r for r in w["paths"] if r["path"] == path), None)
    return None if row is None else row["ops"][op]["median_ms"] * 1e3 / w["batch"]


def scale_table(sweep: list[dict]) -> Table:
    t = Table(title=f"{sweep[0]['workload']} S={sweep[0]['seqlen']}: µs per sample, put / get (median); "
                    "flat across a row is the goal")
    t.add_column("path")
    for w in sweep:
        t.add_column(f"B={w['batch']} ({w['bytes_stored'] / 1e6:.0f} MB)", justify="right")
    for path, label in sweep_paths(sweep):
        cells = ["wrong bytes" if per_sample_us(w, path, "put") is None else
                 f"{per_sample_us(w, path, 'put'):.1f} / {per_sample_us(w, path, 'get'):.1f}" for w in sweep]
        t.add_row(label, *cells)
    t.add_row("memcpy", *[f"{w['bounds'][0]['median_ms'] * 1e3 / w['batch']:.2f}" for w in sweep])
    return t


def writers_table(sweep: list[dict]) -> Table:
    t = Table(title=f"concurrent writers, one batch split between them ({sweep[0]['path']}, B={sweep[0]['batch']})")
    for col in ("writers", "aggregate put ms", "GB/s", "samples verified"):
        t.add_column(col, justify="right")
    for w in sweep:
        t.add_row(str(w["writers"]), f"{w['put']['median_ms']:.1f}", f"{w['put']['gb_per_s']:.2f}", str(w["verified_samples"]))
    return t


def targets_table(targets: list[dict]) -> Table:
    t = Table(title="targets")
    for col in ("target", "value", "threshold", "", "measured as"):
        t.add_column(col, justify="right" if col in ("value", "threshold") else "left")
    for g in targets:
        verdict = {True: "[green]met[/]", False: "[red]missed[/]", None: "[dim]not run[/]"}[g["met"]]
        where = f"\n[dim]where the time went: {g['where']}[/]" if g.get("where") else ""
        t.add_row(g["name"], _num(g["value"]), _num(g["threshold"]), verdict, g["detail"] + where)
    return t


def claim_table(c: dict) -> Table:
    """The streaming section: claim and ack latency, wake-up, N claimers' throughput."""
    t = Table(title=f"claim: batch {c['batch']}, S={c['seqlen']}, transport {c['transport']}")
    for col in ("measure", "p50 ms", "p99 ms", "other"):
        t.add_column(col, justify="left" if col == "measure" else "right")
    t.add_row("claim (batch ready)", _num(c["claim"]["p50_ms"]), _num(c["claim"]["p99_ms"]), f"{c['claim']['ops']} claims")
    if c.get("claim_tokens"):
        tok = c["claim_tokens"]
        t.add_row(f"claim by tokens (groups of {tok['group']}, max_tokens {tok['max_tokens']})", _num(tok["p50_ms"]),
                  _num(tok["p99_ms"]), f"{tok['ops']} claims")
    t.add_row("ack", _num(c["ack"]["p50_ms"]), _num(c["ack"]["p99_ms"]), "")
    if c.get("extend"):
        e = c["extend"]
        for which in ("first", "last"):
            split = parts_text(e[which].get("parts_ms"))
            t.add_row(f"extend {e['tokens']} tokens ({which} {e[which]['ops']} of {e['extends']})", _num(e[which]["p50_ms"]),
                      _num(e[which]["p99_ms"]), f"{e['batch']} samples, {len(e['fields'])} token fields, to {e['length']} tokens"
                      + (f"; {split}" if split else ""))
    if c.get("stream"):
        s = c["stream"]
        for which in ("first", "last"):
            t.add_row(f"long stream: claim ({which} {s[which]['ops']} of {s['rounds']} rounds)", _num(s[which]["p50_ms"]),
                      _num(s[which]["p99_ms"]), f"{s['samples']} samples put, claimed, cleared; slots renumbered "
                      f"{'n/a' if s['repacked'] is None else s['repacked']}x" if which == "last" else "")
    if c.get("wake"):
        t.add_row("wake-up after the put", _num(c["wake"]["p50_ms"]), _num(c["wake"]["p99_ms"]),
                  f"{c['wake']['ops']} wake-ups, {c['wake_missed']} missed")
    d = c["drain"]
    t.add_row(f"{d['claimers']} claimers: claim+read+ack", "", "",
              f"{_num(d['samples_per_s'])} samples/s ({d['samples']} samples, "
              f"{'exactly once' if d['exactly_once'] else 'NOT exactly once'})")
    return t


def controller_table(c: dict) -> Table:
    """Small ops per second through one store index, from N processes at once."""
    t = Table(title=f"controller: {c['processes']} client processes at once, {c['seconds']:g} s per op, "
                    f"transport {c['transport']}")
    for col in ("op (1 sample)", "ops/s", "p50 ms", "p99 ms"):
        t.add_column(col, justify="left" if col.startswith("op") else "right")
    for r in c["rows"]:
        lat = r["latency"] or {}
        t.add_row(r["op"], _num(r["ops_per_s"]), _num(lat.get("p50_ms")), _num(lat.get("p99_ms")))
    return t


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _memory_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        return None
