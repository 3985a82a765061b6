"""The Grafana dashboard and the Prometheus rules query only what GET /metrics exports,
and the alerts fire when (and only when) they should (promtool's rule unit tests)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from promql import METRICS, dashboard_exprs, dashboard_metric_names, dashboard_panels, rule_exprs, unknown_identifiers

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "rlplane.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "rules_test.yaml"


def promtool() -> str:
    """promtool from the venv (`make setup` puts it there) or PATH."""
    found = Path(sys.executable).with_name("promtool")
    path = str(found) if found.exists() else shutil.which("promtool")
    assert path, "promtool not found: `make setup` extracts it from Debian's prometheus package into .venv/bin"
    return path


def test_dashboard_panels_all_have_queries():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    panels = [p for p in dashboard_panels(DASHBOARD) if p["type"] != "row"]
    assert len(panels) >= 10
    assert len({p["id"] for p in dashboard_panels(DASHBOARD)}) == len(dashboard_panels(DASHBOARD))
    for p in panels:
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]


def test_dashboard_queries_only_exported_metrics_and_all_of_them():
    assert dashboard_metric_names(DASHBOARD) == METRICS
    panel_exprs = [t["expr"] for p in dashboard_panels(DASHBOARD) for t in p.get("targets", [])]
    for expr in panel_exprs:
        assert unknown_identifiers(expr) == set(), expr


def test_dashboard_latency_quantiles_come_from_the_histogram():
    exprs = dashboard_exprs(DASHBOARD)
    for q in ("0.5", "0.99"):
        (expr,) = [e for e in exprs if e.startswith(f"histogram_quantile({q},") and "op_duration" in e]
        assert "rlplane_op_duration_seconds_bucket" in expr and "by (op, le)" in expr
        (wait,) = [e for e in exprs if e.startswith(f"histogram_quantile({q},") and "claim_wait" in e]
        assert "rlplane_claim_wait_seconds_bucket" in wait and "by (le)" in wait


def test_metric_name_helpers_catch_strangers():
    assert unknown_identifiers('sum by (op) (rate(rlplane_ops_totl{status="error"}[5m])) / up') == {"rlplane_ops_totl", "up"}
    assert unknown_identifiers("histgram_quantile(0.5, rlplane_op_duration_seconds_bucket)") == {"histgram_quantile"}
    assert unknown_identifiers("rlplane_stored_bytes_sum") == {"rlplane_stored_bytes_sum"}  # not a histogram
    assert unknown_identifiers('max(rlplane_build_info{backend="mooncake"}) or vector(0) > bool 1e9') == set()


def test_rules_have_the_alerts_and_only_known_metrics():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert {r["alert"] for r in rules} == {
        "RlplaneCapacityHigh", "RlplaneErrorRatioHigh", "RlplaneStorageUnitDown",
        "RlplaneIdleWithData", "RlplaneMooncakeMasterDown", "RlplaneConsumerLagging", "RlplaneSamplesLost",
        "RlplaneUnderReplicated", "RlplaneControllerRestarting", "RlplaneSnapshotStale",
    }
    for r in rules:
        assert r["labels"]["severity"] in {"info", "warning", "critical"}, r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
    for name, expr in rule_exprs(RULES).items():
        assert unknown_identifiers(expr) == set(), name


def test_promtool_checks_rules_and_their_unit_tests():
    check = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 10 rules found" in check.stdout
    unit = subprocess.run([promtool(), "test", "rules", RULES_TEST.name], cwd=RULES_TEST.parent,
                          capture_output=True, text=True, timeout=120)
    assert unit.returncode == 0, unit.stdout + unit.stderr
