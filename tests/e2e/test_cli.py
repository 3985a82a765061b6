"""The rlplane command line, run as a user runs it (a separate process)."""

import json
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest


def rlplane(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "rlplane_tools", *args], capture_output=True, text=True,
                          timeout=timeout, env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"})


def live_args(service):
    return ["--url", service.url, "--token", service.settings.token()]


@pytest.mark.parametrize("live", ["native", "mooncake"], indirect=True)  # (simple's ranks run as mooncake's do)
def test_demo_runs_a_verified_vlm_step_through_the_live_service(live):
    """Its two DP ranks per stage are plain processes of their own, each its own client of the
    backend's engine (on mooncake, a Mooncake client each)."""
    demo_runs(live, [])


def test_demo_with_jagged_rows_and_three_ranks_over_http(service):
    """The demo's other options, on the native backend (the TransferQueue backends' DP ranks
    run in the test above, and every backend's HTTP path in tests/service)."""
    demo_runs(SimpleNamespace(url=service.url, token=service.settings.token(), direct="native"),
              ["--layout", "jagged", "--dp", "3", "--transport", "http"])


def demo_runs(live, extra: list[str]) -> None:
    res = rlplane("demo", "--url", live.url, "--token", live.token, "--batch", "12", "--seqlen", "256", "--no-embedded", *extra)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK: every rank read exactly what was written" in res.stdout
    for phase in ("rollout put_samples", "logprob read", "ref_logprob write", "driver write advantages", "train read"):
        assert phase in res.stdout
    assert "pixel_values" in res.stdout
    assert f"transport {'http' if 'http' in extra else live.direct}" in res.stdout


def test_demo_text_only_requests_no_multimodal_field(service):
    res = rlplane("demo", *live_args(service), "--batch", "8", "--seqlen", "128", "--text-only", "--no-embedded")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "pixel_values" not in res.stdout and "mm_token_type_ids" not in res.stdout


def test_demo_without_a_service_and_without_embedded_says_what_to_do():
    res = rlplane("demo", "--url", "http://127.0.0.1:9", "--no-embedded", "--batch", "2", "--seqlen", "16")
    assert res.returncode == 1 and "rlplane serve" in res.stdout


def test_soak_against_a_service_that_does_not_answer_or_takes_no_such_token_says_so_in_one_line(service):
    """It ended after ~30 s with a traceback of a worker process that could not start."""
    for args, says in ((["--url", "http://127.0.0.1:9"], "rlplane serve"),
                       (["--url", service.url, "--token", "not-the-token"], "token")):
        res = rlplane("soak", *args, "--minutes", "0.1", "--no-kill", timeout=60)
        assert res.returncode == 1 and says in res.stdout and "Traceback" not in res.stdout + res.stderr, res.stdout


def test_a_soak_in_which_nothing_was_written_or_read_is_a_violation_not_ok():
    """A run whose every put failed with a typed error (a full store, a read-only token)
    printed OK and exited 0: nothing had been tested."""
    from rlplane_tools.soak import Outcome, SoakConfig, _summary

    out = Outcome(reports=[{"role": "writer", "ms": [], "errors": {"StorageFullError": 30}, "untyped": []},
                           {"role": "reader", "ms": [], "errors": {}, "untyped": [], "wrong": [], "samples": 0}],
                  final={"checked": 0, "lost": [], "wrong": []})
    violations = _summary(SoakConfig(minutes=0.1, writers=1, readers=1), out, 6.0)["violations"]
    assert len(violations) == 2 and "no put succeeded (StorageFullError x30)" in violations[0]


def test_status_shows_the_store_and_partitions(service):
    import torch

    from rlplane import connect

    with connect(service.url, token=service.settings.token()) as client:
        client.put_samples("status-check", {"input_ids": torch.ones(2, 3, dtype=torch.int64), "input_lengths": torch.tensor([3, 1])})
        client.claim("status-check", "rank-task", batch_size=1, fields=["input_ids"], timeout=5)
        res = rlplane("status", *live_args(service))
        client.clear("status-check")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 storage units" in res.stdout and "status-check" in res.stdout
    (row,) = [line for line in res.stdout.splitlines() if "rank-task" in line]
    assert [c.strip() for c in row.split("│")[1:-1]] == ["status-check", "rank-task", "2", "1", "1", "0", "0", "0"]
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


def test_help_lists_every_command_and_each_has_help_of_its_own():
    res = rlplane("--help")
    commands = ("serve", "status", "demo", "bench", "soak", "two-node")
    assert res.returncode == 0 and all(c in res.stdout for c in commands)
    says = {"serve": "Ctrl-C", "status": "consumption", "demo": "bit for bit", "bench": "--json", "soak": "--minutes",
            "two-node": "127.0.0.2"}
    for command in commands:
        own = rlplane(command, "--help")
        assert own.returncode == 0, (command, own.stderr)
        assert f"{command} [OPTIONS]" in own.stdout and "--help" in own.stdout, command
        assert says[command] in own.stdout, (command, says[command])


def test_help_shows_each_paragraph_of_a_commands_docstring_whole_for_the_terminal_to_wrap():
    """Typer keeps a docstring's line breaks: unjoined, they wrapped raggedly in every width."""
    from rlplane_service.cli import prose
    from rlplane_tools.cli import app

    docs = {c.name or c.callback.__name__.replace("_", "-"): prose(c.callback.__doc__) for c in app.registered_commands}
    assert docs and all("\n" not in p for doc in docs.values() for p in doc.split("\n\n"))
    code = ("import sys; from rlplane_tools.cli import main\n"
            f"for argv in ([], *[[c] for c in {sorted(docs)!r}]):\n"
            "    sys.argv = ['rlplane', *argv, '--help']\n"
            "    print('=====' + ' '.join(argv))\n"
            "    try:\n"
            "        main()\n"
            "    except SystemExit:\n"
            "        pass\n")
    res = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "2000"})
    assert res.returncode == 0, res.stderr[-2000:]
    shown = {block.split("\n", 1)[0].strip(): block for block in res.stdout.split("=====")[1:]}
    for name, doc in docs.items():
        first, *rest = doc.split("\n\n")
        assert first in shown[""], (name, first)  # the command list
        for paragraph in (first, *rest):
            assert paragraph in shown[name], (name, paragraph)


def test_help_answers_without_loading_torch():
    """--help is what a user runs first: it needs typer and the settings, not the ~1.5 s of torch."""
    code = ("import sys; from rlplane_tools.cli import main\n"
            "for argv in (['rlplane', '--help'], ['rlplane', 'serve', '--help'], ['rlplane', 'bench', '--help']):\n"
            "    sys.argv = argv\n"
            "    try:\n"
            "        main()\n"
            "    except SystemExit:\n"
            "        pass\n"
            "assert 'torch' not in sys.modules, 'torch'")
    res = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
    assert res.returncode == 0 and "Usage:" in res.stdout, res.stderr[-2000:]


def test_bad_option_is_a_clear_usage_error():
    res = rlplane("demo", "--batch", "0")
    assert res.returncode == 2 and "batch" in (res.stdout + res.stderr)


@pytest.mark.parametrize("args, says", [
    (["demo", "--async", "--dp", "4"], "--dp set the synchronous demo's step"),  # (ignored before)
    (["demo", "--async", "--text-only"], "--text-only set the synchronous demo's step"),
    (["demo", "--dp", "9", "--batch", "4"], "a rank would read none"),  # (an 81-line traceback before)
    (["two-node", "--path", "auto"], "forces the client onto te or zmq"),  # (accepted, and could never pass)
    (["bench", "--codec", "-w", "claim"], "--codec encodes one batch workload"),  # (a KeyError before)
])
def test_options_a_command_cannot_honour_are_refused_before_it_starts_anything(args, says):
    res = rlplane(*args, timeout=60)
    assert res.returncode == 2 and says in " ".join(res.stdout.split()), res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr


def test_a_demo_at_a_port_where_something_listens_without_answering_says_so_without_starting_ray():
    """It took that for "no service here", started Ray and Serve, and ended in a 168-line
    bind failure."""
    import socket

    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(4)  # (the kernel accepts; nobody answers)
        res = rlplane("demo", "--url", f"http://127.0.0.1:{mute.getsockname()[1]}", "--batch", "2", "--seqlen", "16",
                      timeout=120)
    out = " ".join(res.stdout.split())
    assert res.returncode == 1 and "listens at" in out and "does not answer as an rlplane service" in out, out
    assert "starting local Ray" not in out and "Traceback" not in res.stdout + res.stderr


def test_a_storage_units_code_never_loads_torch_or_the_client():
    """A unit speaks only the engine's wire (numpy views of its slab): ~190 MB of torch
    per unit process is memory it never uses."""
    code = ("import sys, rlplane_service.native.unit, rlplane_service.native.server; "
            "assert 'torch' not in sys.modules, 'torch'; assert 'rlplane.client' not in sys.modules, 'client'; "
            "import rlplane; assert callable(rlplane.connect) and rlplane.Client.__name__ == 'Client'")
    res = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


def test_import_rlplane_does_not_import_ray():
    code = "import rlplane, rlplane.client, rlplane.transports, sys; assert not any(m == 'ray' or m.startswith('ray.') for m in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_serve_on_mooncake_stops_its_master_on_sigterm(tmp_path, pid_alive):
    """`rlplane serve --backend mooncake` as an operator runs it: the master it started is
    reported in /v1/status and is gone (by pid) once SIGTERM has shut the service down."""
    import signal
    import socket
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "rlplane_tools", "serve", "--port", str(port), "--backend", "mooncake",
                             "--storage-units", "1"], stdout=log, stderr=subprocess.STDOUT,
                            env={"PATH": "/usr/bin:/bin", "RLPLANE_MOONCAKE_SEGMENT_BYTES": str(64 << 20),
                                 "RAY_AUTH_MODE": "disabled"})
    try:
        deadline, pid = time.monotonic() + 180, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    pid = httpx.get(f"{url}/v1/status", timeout=10).json()["store"]["mooncake_master"]["pid"]
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        assert pid is not None and pid_alive(pid), (tmp_path / "serve.log").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        assert not pid_alive(pid), "mooncake_master outlived `rlplane serve`"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()


def test_async_demo_consumes_every_sample_exactly_once_per_task(service):
    """rollout keeps producing while logprob and two trainers claim; one trainer is killed mid-lease."""
    res = rlplane("demo", "--async", "--batch", "6", *live_args(service))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "killed train-a" in res.stdout and "OK: every sample was consumed exactly once per task" in res.stdout
    (train,) = [line for line in res.stdout.splitlines() if line.startswith("│ train ")]
    samples, acked, expired, claimed, pending, redelivered = (int(c) for c in train.split("│")[2:8])
    assert samples == 96 and acked + expired == 96 and claimed == pending == 0 and redelivered >= 1
    # each batch a partial rollout first, finished by an extend; the groups' images stored once
    assert res.stdout.count(" extend ") == 6 and "tokens so far" in res.stdout
    written, kept = (float(x) for x in re.search(r"hold ([\d.]+) MB as written; the store keeps ([\d.]+) MB",
                                                 res.stdout).groups())
    assert kept < written / 2


#: Lines other programs print: Ray/Serve logging, the raylet, glog (Mooncake), Python warnings.
FOREIGN = [
    r"^(INFO|WARNING|ERROR|DEBUG) \d{4}-\d\d-\d\d ",  # Serve: "INFO 2026-11-30 13:53:34,645 serve ..."
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(INFO|WARNING|ERROR)",  # Ray: "2026-11-30 13:53:29,676<TAB>WARNING ..."
    r"\(raylet\)",
    r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ ",  # glog: "I1130 13:47:27.835464 ..."
    r"\w+Warning: ",
]


def test_an_async_demo_whose_workers_fail_ends_at_once_and_says_why(service):
    """With a token the service does not take, every worker failed within seconds; the run
    waited silently for its deadline (~210 s) and then lost what the workers had said."""
    t0 = time.monotonic()
    res = rlplane("demo", "--async", "--batch", "2", "--url", service.url, "--token", "not-the-token", timeout=150)
    assert res.returncode == 1 and time.monotonic() - t0 < 100, res.stdout[-2000:]
    assert "AuthenticationError" in res.stdout or "401" in res.stdout, res.stdout[-2000:]


def test_demo_prints_only_rlplanes_lines_and_names_the_log_with_the_rest(tmp_path):
    """With Ray's token authentication on (RAY_AUTH_MODE unset, as on a user's machine) and
    the embedded service started and stopped by the demo itself."""
    import re

    from rlplane_service.net import free_port

    env = {"COLUMNS": "200", "PATH": "/usr/bin:/bin", "RLPLANE_LOG_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "rlplane_tools", "demo", "--url", f"http://127.0.0.1:{free_port()}",
                          "--batch", "4", "--seqlen", "64"], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = (res.stdout + res.stderr).splitlines()
    foreign = [line for line in lines if any(re.search(p, line) for p in FOREIGN)]
    assert foreign == []
    assert "rlplane is ready at" in res.stdout and "OK: every rank read exactly what was written" in res.stdout
    (log,) = tmp_path.glob("rlplane-demo-*.log")
    assert str(log) in res.stdout.replace("\n", "")
    held = log.read_text().splitlines()
    assert any(re.search(p, line) for p in FOREIGN for line in held), held[:5]


def test_readme_links_stay_inside_the_repository():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "README.md").read_text()
    assert "../" not in text, "README points outside the repository"
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets, "the README links to its docs"
    for target in targets:
        assert not re.match(r"[a-z]+://", target), f"README links outside the repository: {target}"
        path = (root / target.split("#")[0]).resolve()
        assert path.is_relative_to(root) and path.exists(), f"README link {target} does not resolve inside the repository"
