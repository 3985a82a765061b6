"""``rlplane soak`` in short (30 s of writing): 4 writer and 2 reader processes against an
embedded store with replicas=2; storage unit 1, the Serve replica and the controller are killed midway.
It must end with zero wrong bytes, zero lost acknowledged writes and only typed errors,
and say so (exit 0); its report has the numbers."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.soak  # out of CI (make test); make soak-test runs it
def test_a_short_soak_with_a_unit_and_the_replica_killed_loses_and_corrupts_nothing(tmp_path):
    out = tmp_path / "soak.json"
    env = {"COLUMNS": "160", "PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "RAY_AUTH_MODE": "disabled",
           "RLPLANE_LOG_DIR": str(tmp_path)}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    res = subprocess.run([sys.executable, "-m", "rlplane_tools", "soak", "--minutes", "0.5", "--writers", "4",
                          "--readers", "2", "--json", str(out)], capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["violations"] == []
    assert any("killed storage unit" in e for e in report["events"])
    assert any("killed the Serve replica" in e for e in report["events"])
    assert any("SIGKILLed the controller" in e for e in report["events"])  # it rebuilt: nothing was lost
    ops = report["ops"]
    assert ops["put_samples"]["count"] > 0 and ops["claim+read+ack"]["samples"] > 0
    assert report["read_back"]["checked"] == ops["put_samples"]["count"] * 8  # every acknowledged sample, read back
    assert report["read_back"]["lost"] == 0 and report["read_back"]["wrong"] == 0
    assert "OK" in res.stdout and "zero wrong bytes" in res.stdout
    memory = report["memory"]  # sampled, reported (the RSS target is the full soak's, not this test's)
    assert len(memory["unit_rss_peak_mb"]) == 3 and all(mb > 0 for mb in memory["unit_rss_peak_mb"].values())
    assert memory["limit_mb"] == memory["slab_mb"] + 150 and "peak RSS" in res.stdout
