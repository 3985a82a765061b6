"""The metric names the dashboard and the alert rules query, checked against what the
service exports at GET /metrics.

``dashboard_metric_names(path)`` is what a live test compares with a real scrape::

    names = dashboard_metric_names("deploy/grafana/rlplane.json")
    assert names <= set(scraped_metric_families)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

# Every metric family GET /metrics exports (histograms by their base name).
METRICS = frozenset({
    "rlplane_ops_total",
    "rlplane_transferred_bytes_total",
    "rlplane_op_duration_seconds",
    "rlplane_errors_total",
    "rlplane_partitions",
    "rlplane_partition_samples",
    "rlplane_partition_bytes",
    "rlplane_storage_unit_samples",
    "rlplane_storage_unit_bytes",
    "rlplane_storage_unit_up",
    "rlplane_component_up",
    "rlplane_storage_unit_slab_bytes",
    "rlplane_storage_unit_slab_fragmentation",
    "rlplane_stored_samples",
    "rlplane_stored_bytes",
    "rlplane_shared_bytes",
    "rlplane_capacity_samples",
    "rlplane_mooncake_master_up",
    "rlplane_mooncake_allocated_bytes",
    "rlplane_mooncake_capacity_bytes",
    "rlplane_mooncake_keys",
    "rlplane_mooncake_clients",
    "rlplane_build_info",
    "rlplane_consumption_samples",
    "rlplane_claim_redelivered_total",
    "rlplane_claim_wait_seconds",
    "rlplane_claim_leases",
    "rlplane_lost_samples",
    "rlplane_under_replicated_samples",
    "rlplane_controller_restarts_total",
    "rlplane_controller_rebuild_seconds",
    "rlplane_commit_log_records",
    "rlplane_last_snapshot_time",
    "rlplane_last_snapshot_bytes",
    "rlplane_last_snapshot_seconds",
    "rlplane_last_snapshot_samples",
    "rlplane_snapshot_age_seconds",
    "rlplane_snapshot_interval_seconds",
    "rlplane_journal_lag_seconds",
    "rlplane_journal_lag_bytes",
})
HISTOGRAMS = frozenset({"rlplane_op_duration_seconds", "rlplane_claim_wait_seconds"})

FUNCTIONS = frozenset(
    # aggregation operators
    "sum min max avg count stddev stdvar topk bottomk quantile count_values group "
    # functions
    "rate irate increase delta idelta deriv predict_linear histogram_quantile histogram_count "
    "histogram_sum histogram_fraction abs absent absent_over_time ceil floor round clamp clamp_min "
    "clamp_max exp ln log2 log10 sqrt sgn changes resets label_replace label_join sort sort_desc "
    "time timestamp vector scalar avg_over_time min_over_time max_over_time sum_over_time "
    "count_over_time last_over_time quantile_over_time stddev_over_time present_over_time "
    "day_of_month day_of_week days_in_month hour minute month year".split()
)
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"})

_NAME = re.compile(r"rlplane_[a-z_]+")
_HIST_SUFFIX = re.compile(r"_(bucket|sum|count)$")


def base_name(name: str) -> str:
    """``rlplane_op_duration_seconds_bucket`` -> ``rlplane_op_duration_seconds``."""
    stripped = _HIST_SUFFIX.sub("", name)
    return stripped if stripped in HISTOGRAMS else name


def metric_names(expr: str) -> set[str]:
    """The rlplane metric families an expression mentions (histogram suffixes stripped)."""
    return {base_name(m) for m in _NAME.findall(expr)}


def unknown_identifiers(expr: str) -> set[str]:
    """Identifiers in a PromQL expression that are neither a known rlplane metric nor a
    standard PromQL function, aggregation or keyword (empty when the expression is clean)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)               # string literals
    text = re.sub(r"\{[^}]*\}", "", text)                            # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)                           # range / subquery windows
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\b(group_left|group_right)\b", " ", text)
    bad = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = m.group(0)
        is_call = re.match(r"\s*\(", text[m.end():]) is not None
        if word.lower() in KEYWORDS or (word in FUNCTIONS if is_call else base_name(word) in METRICS):
            continue
        bad.add(word)
    return bad


def _panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(_panels(p.get("panels", [])))  # panels inside collapsed rows
    return out


def dashboard_panels(path: str | Path) -> list[dict]:
    """Every panel of a Grafana dashboard JSON, rows and their nested panels included."""
    return _panels(json.loads(Path(path).read_text())["panels"])


def dashboard_exprs(path: str | Path) -> list[str]:
    """Every PromQL query of the dashboard: panel targets and templating variable queries."""
    dash = json.loads(Path(path).read_text())
    exprs = [t["expr"] for p in _panels(dash["panels"]) for t in p.get("targets", []) if "expr" in t]
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if var.get("type") == "query" and query:
            exprs.append(query)
    return exprs


def dashboard_metric_names(path: str | Path) -> set[str]:
    """The rlplane metric families the dashboard queries (histogram suffixes stripped)."""
    return set().union(*(metric_names(e) for e in dashboard_exprs(path)))


def rule_exprs(path: str | Path) -> dict[str, str]:
    """alert (or record) name -> expression, for every rule of a Prometheus rules file."""
    groups = yaml.safe_load(Path(path).read_text())["groups"]
    return {r.get("alert") or r["record"]: r["expr"] for g in groups for r in g["rules"]}
