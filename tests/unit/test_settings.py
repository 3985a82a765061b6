"""The operator's edges: settings from flags and RLPLANE_* variables, the registry file,
and the URL and timeout a client connects with. Each mistake is one typed line that names
the setting, never a traceback and never a secret."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from rlplane import errors as E
from rlplane_service.settings import ServiceSettings, load_registry, settings_problem

SECRET = "SUPERSECRET-token-0123"


@pytest.mark.parametrize("args, says", [
    ({"snapshot_interval_s": 5}, "RLPLANE_SNAPSHOT_DIR"),
    ({"engine_port_min": 30000, "engine_port_max": 20000}, "engine_port_min"),
    ({"port": "abc"}, "RLPLANE_PORT"),
    ({"replicas": 2, "storage_units": 1}, "RLPLANE_STORAGE_UNITS is 1"),
    ({"replicas": 2, "backend": "simple"}, "needs the native backend"),
    ({"te_protocol": "tcp", "backend": "mooncake"}, "needs the native backend"),
    ({"native_host": "0.0.0.0"}, "is a wildcard, and the engine advertises this address"),
    ({"native_host": "[::]"}, "leave it unset"),
    ({"native_host": "0"}, "is a wildcard"),
    ({"native_host": "::ffff:0.0.0.0"}, "is a wildcard"),
    ({"native_host": "0:0:0:0:0:0:0:0"}, "is a wildcard"),
])
def test_a_refused_setting_is_named_and_no_value_is_quoted(args, says):
    """pydantic quoted every input in a model check's error: the API token too (it reached
    Serve's deployment status and the logs)."""
    with pytest.raises(ValidationError) as err:
        ServiceSettings(api_token=SECRET, **args)
    assert SECRET not in str(err.value)
    line = settings_problem(err.value, {"port": "--port"})
    assert says in line and SECRET not in line and "\n" not in line


@pytest.mark.parametrize("name", ["RLPLANE_JOURNAL_DIR", "RLPLANE_RESTORE_FROM", "RLPLANE_SNAPSHOT_DIR",
                                  "RLPLANE_REGISTRY_FILE", "RLPLANE_TOKENS_FILE", "RLPLANE_CAPACITY"])
def test_an_empty_variable_means_unset_not_the_working_directory(monkeypatch, name):
    monkeypatch.setenv(name, "")
    settings = ServiceSettings()
    assert getattr(settings, name.removeprefix("RLPLANE_").lower()) is None


def test_serve_with_a_bad_setting_says_one_line_and_exits_2():
    env = {"PATH": "/usr/bin:/bin", "RLPLANE_API_TOKEN": SECRET, "RLPLANE_SNAPSHOT_INTERVAL_S": "5", "COLUMNS": "300"}
    res = subprocess.run([sys.executable, "-m", "rlplane_tools", "serve"], capture_output=True, text=True,
                         timeout=120, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "RLPLANE_SNAPSHOT_DIR" in out and "Traceback" not in out and SECRET not in out


@pytest.mark.parametrize("text, says", [
    (b"\xff\xfe fields: []", "cannot read"),
    (b"fields: [my_field]", "each field is a mapping"),
    (b"fields: [{name: f, alignment: sample, container: dense, dtype: float32, optional: 'false'}]", "optional"),
    (b"fields: [{name: f, alignment: sample, container: dense, dtype: uint8, pad_value: 300}]", "does not fit"),
    (b"fields: [{name: f, alignment: sample, container: dense, dtype: float32, stages: {train: 1}}]", "mapping"),
])
def test_a_registry_file_mistake_is_a_registry_error_naming_the_file(tmp_path, text, says):
    path = tmp_path / "fields.yaml"
    path.write_bytes(text)
    with pytest.raises(E.RegistryError, match="fields.yaml") as err:
        load_registry(ServiceSettings(registry_file=str(path)))
    assert says in str(err.value)


@pytest.mark.parametrize("url, kwargs, error, says", [
    ("http://127.0.0.1:abc", {}, E.TransportError, "does not parse"),
    ("http://127.0.0.1:99999", {}, E.TransportError, "not in 1-65535"),
    ("http://[::1:8000", {}, E.TransportError, "does not parse"),
    (None, {}, E.TransportError, "http://"),
    ("localhost:8000", {}, E.TransportError, "http://"),
    ("http://admin:PASSW0RD@127.0.0.1:9", {}, E.TransportError, "***@127.0.0.1:9"),
    ("http://127.0.0.1:9", {"timeout": -1}, E.InvalidArgumentError, "timeout"),
    ("http://127.0.0.1:9", {"timeout": float("nan")}, E.InvalidArgumentError, "timeout"),
])
def test_connect_refuses_what_it_cannot_use_typed_and_never_shows_a_password(url, kwargs, error, says):
    import rlplane

    with pytest.raises(error) as err:
        rlplane.connect(url, **kwargs)
    assert says in str(err.value) and "PASSW0RD" not in str(err.value)


def test_the_cli_says_one_line_for_a_url_that_does_not_parse():
    res = subprocess.run([sys.executable, "-m", "rlplane_tools", "status", "--url", "http://127.0.0.1:abc"],
                         capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "COLUMNS": "300"})
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "does not parse" in out and "Traceback" not in out


def test_a_misspelled_variable_is_named_with_the_setting_it_was_likely_meant_for():
    from rlplane_service.settings import unknown_variables

    env = {"RLPLANE_STORAGE_UNIT": "5", "RLPLANE_STORAGE_UNITS": "2", "RLPLANE_DATA_PATH": "shm", "PATH": "/bin"}
    assert unknown_variables(env) == ["RLPLANE_STORAGE_UNIT (RLPLANE_STORAGE_UNITS?)"]
    import http.server
    import threading

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler) as taken:
        threading.Thread(target=taken.serve_forever, daemon=True).start()
        try:  # (serve stops at once: something answers on its port)
            res = subprocess.run([sys.executable, "-m", "rlplane_tools", "serve", "--port", str(taken.server_port)],
                                 capture_output=True, text=True, timeout=120,
                                 env={"PATH": "/usr/bin:/bin", "RLPLANE_STORAGE_UNIT": "5", "COLUMNS": "300"})
        finally:
            taken.shutdown()
    assert "RLPLANE_STORAGE_UNIT (RLPLANE_STORAGE_UNITS?) is set but no rlplane setting" in res.stdout, res.stdout
