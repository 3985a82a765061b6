"""The rlplane command line, run as a user runs it (a separate process)."""

import json
import subprocess
import sys

import pytest


def rlplane(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "rlplane_service", *args], capture_output=True, text=True,
                          timeout=timeout, env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"})


def live(service):
    return ["--url", service.url, "--token", service.settings.token()]


@pytest.mark.parametrize("extra", [[], ["--layout", "jagged", "--dp", "3", "--transport", "http"]])
def test_demo_runs_a_verified_vlm_step_through_the_live_service(service, extra):
    res = rlplane("demo", *live(service), "--batch", "12", "--seqlen", "256", "--no-embedded", *extra)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK: every rank read exactly what was written" in res.stdout
    for phase in ("rollout put_samples", "logprob read", "ref_logprob write", "driver write advantages", "train read"):
        assert phase in res.stdout
    assert "pixel_values" in res.stdout
    assert f"transport {'http' if 'http' in extra else 'tq'}" in res.stdout


def test_demo_text_only_requests_no_multimodal_field(service):
    res = rlplane("demo", *live(service), "--batch", "8", "--seqlen", "128", "--text-only", "--no-embedded")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "pixel_values" not in res.stdout and "mm_token_type_ids" not in res.stdout


def test_demo_without_a_service_and_without_embedded_says_what_to_do():
    res = rlplane("demo", "--url", "http://127.0.0.1:9", "--no-embedded", "--batch", "2", "--seqlen", "16")
    assert res.returncode == 1 and "rlplane serve" in res.stdout


def test_status_shows_the_store_and_partitions(service):
    import torch

    from rlplane import connect

    with connect(service.url, token=service.settings.token()) as client:
        client.put_samples("status-check", {"input_ids": torch.ones(2, 3, dtype=torch.int64), "input_lengths": torch.tensor([3, 1])})
        res = rlplane("status", *live(service))
        client.clear("status-check")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 storage units" in res.stdout and "status-check" in res.stdout
    bad = rlplane("status", "--url", service.url)
    assert bad.returncode == 1 and "token" in bad.stdout


def test_bench_quick_writes_valid_json(tmp_path):
    out = tmp_path / "bench.json"
    res = rlplane("bench", "--codec", "--quick", "--batch", "4", "--seqlen", "64", "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    ops = {p["op"] for p in data["phases"]}
    assert {"encode", "decode", "round trip", "memcpy (warm dst)", "encode + decode"} <= ops
    assert all(p["reps"] == 3 and p["median_ms"] > 0 for p in data["phases"])
    assert data["bytes_stored"] > 0 and data["machine"]["cpus"] >= 1


def test_help_explains_each_command():
    res = rlplane("--help")
    assert res.returncode == 0 and all(c in res.stdout for c in ("serve", "status", "demo", "bench"))
    assert "Ctrl-C" in rlplane("serve", "--help").stdout
    assert "bit for bit" in rlplane("demo", "--help").stdout


def test_bad_option_is_a_clear_usage_error():
    res = rlplane("demo", "--batch", "0")
    assert res.returncode == 2 and "batch" in (res.stdout + res.stderr)


def test_import_rlplane_does_not_import_ray():
    code = "import rlplane, rlplane.client, rlplane.transports, sys; assert not any(m == 'ray' or m.startswith('ray.') for m in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
