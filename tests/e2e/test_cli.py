"""The rlplane command line, run as a user runs it (a separate process)."""

import json
import subprocess
import sys

import pytest


def rlplane(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "rlplane_service", *args], capture_output=True, text=True,
                          timeout=timeout, env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("extra", [[], ["--layout", "jagged", "--dp", "3"]])
def test_demo_runs_a_verified_vlm_step(extra):
    res = rlplane("demo", "--batch", "12", "--seqlen", "256", *extra)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK: every rank read exactly what was written" in res.stdout
    for phase in ("rollout put_samples", "logprob read", "ref_logprob write", "driver write advantages", "train read"):
        assert phase in res.stdout
    assert "pixel_values" in res.stdout


def test_demo_text_only_requests_no_multimodal_field():
    res = rlplane("demo", "--batch", "8", "--seqlen", "128", "--text-only")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "pixel_values" not in res.stdout and "mm_token_type_ids" not in res.stdout


def test_bench_quick_writes_valid_json(tmp_path):
    out = tmp_path / "bench.json"
    res = rlplane("bench", "--quick", "--batch", "4", "--seqlen", "64", "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    ops = {p["op"] for p in data["phases"]}
    assert {"encode", "decode", "round trip", "memcpy (warm dst)", "encode + decode"} <= ops
    assert all(p["reps"] == 3 and p["median_ms"] > 0 for p in data["phases"])
    assert data["bytes_stored"] > 0 and data["machine"]["cpus"] >= 1


def test_help_explains_each_command():
    res = rlplane("--help")
    assert res.returncode == 0 and "demo" in res.stdout and "bench" in res.stdout
    assert "bit for bit" in rlplane("demo", "--help").stdout


def test_bad_option_is_a_clear_usage_error():
    res = rlplane("demo", "--batch", "0")
    assert res.returncode == 2 and "batch" in (res.stdout + res.stderr)


def test_import_rlplane_does_not_import_ray():
    code = "import rlplane, rlplane.client, rlplane.transports, sys; assert not any(m == 'ray' or m.startswith('ray.') for m in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
