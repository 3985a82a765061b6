"""The ``rlplane`` command line's service commands: ``serve``, ``status`` and ``snapshot``. The tools
package adds ``demo`` (the main job), ``bench`` and ``soak`` (:mod:`rlplane_tools.cli`,
the ``rlplane`` script's entry point), so the service never imports the tools.

Example::

    rlplane serve                      # local Ray + the service on 127.0.0.1:8000 (Ctrl-C stops)
    rlplane demo                       # one VLM GRPO step through the service, verified bit for bit
    rlplane status
    rlplane bench --quick --json out/bench.json --plot out/bench.png
"""

from __future__ import annotations

import inspect
import json
import os

# Large fresh buffers dominate the codec's cost; huge pages make first touch ~5x cheaper.
# Read by torch's CPU allocator once, at its first allocation: set before torch loads.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import logging  # noqa: E402
from enum import Enum  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from rlplane_service.backends import BACKENDS  # noqa: E402
from rlplane_service.quiet import captured_output, stages  # noqa: E402

app = typer.Typer(
    help="rlplane: the data plane for RL post-training. Declared fields, bit-exact from rollout to trainer.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
# torch's nested-tensor constructor logs a one-off fx deprecation notice; it is not ours to act on.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


#: The storage backends, as the registry names them (rlplane_service.backends.BACKENDS).
Backend = Enum("Backend", {name: name for name in BACKENDS}, type=str)  # type: ignore[misc]


URL_OPTION = typer.Option(
    "http://127.0.0.1:8000", "--url", envvar="RLPLANE_URL", help="The service's base URL."
)
TOKEN_OPTION = typer.Option(
    None, "--token", envvar="RLPLANE_API_TOKEN", help="API token, when the service has one.", show_default=False
)


#: The ``serve`` flags of settings (an error about one names the flag, not only RLPLANE_*).
FLAGS = {"host": "--host", "port": "--port", "storage_units": "--storage-units", "capacity": "--capacity",
         "unit_bytes": "--unit-bytes", "registry_file": "--registry", "api_token": "--token",
         "backend": "--backend", "restore_from": "--restore", "journal_dir": "--journal"}


@app.command()
def serve(
    host: Optional[str] = typer.Option(None, help="HTTP bind address (default 127.0.0.1).", show_default=False),
    port: Optional[int] = typer.Option(None, min=1, max=65535, help="HTTP port (default 8000).", show_default=False),
    storage_units: Optional[int] = typer.Option(
        None, "--storage-units", min=1, max=256, help="Storage units: the actors (or processes) that hold the "
        "samples' bytes (default 2; RLPLANE_STORAGE_UNITS).", show_default=False
    ),
    capacity: Optional[int] = typer.Option(None, min=1, help="Most samples held (default: no limit)."),
    unit_bytes: Optional[int] = typer.Option(
        None, "--unit-bytes", min=16 << 20, help="native: shared memory each storage unit allocates and pre-faults at "
        "start, its cap (default 1 GiB; RLPLANE_UNIT_BYTES).", show_default=False),
    registry_file: Optional[Path] = typer.Option(
        None, "--registry", exists=True, dir_okay=False, help="YAML/JSON file of extra FieldSpecs."
    ),
    token: Optional[str] = TOKEN_OPTION,
    backend: Optional[Backend] = typer.Option(
        None, help="Where samples live: rlplane's own block engine (native: authenticated, never unpickles), "
        "TransferQueue storage units (simple) or Mooncake segments (mooncake; the service starts its own mooncake_master). "
        "simple and mooncake speak TransferQueue's ZMQ wire: no authentication, and its units unpickle what they "
        "receive, so anyone who reaches a unit's port runs code as the service; keep those ports on a private network. "
        "Default: native.", show_default=False,
    ),
    restore: Optional[str] = typer.Option(
        None, "--restore", help="native: load this snapshot (a directory rlplane snapshot --to wrote, or an fsspec URL "
        "of one, e.g. s3://bucket/snaps/run7 with s3fs installed) into the new store before it reports ready "
        "(RLPLANE_RESTORE_FROM). A damaged one stops the start.", show_default=False),
    journal: Optional[Path] = typer.Option(
        None, "--journal", file_okay=False, help="native: keep a write-ahead journal here (RLPLANE_JOURNAL_DIR); "
        "one a dead store left is replayed (after --restore's snapshot) before the store reports ready.",
        show_default=False),
    num_cpus: int = typer.Option(8, "--num-cpus", min=1, help="Logical CPUs of the local Ray."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Ray's, Serve's, Mooncake's and torch's own "
                                 "output live instead of in the log file."),
) -> None:
    """Run the service on a local Ray (the embedded default) until Ctrl-C, then shut it all down.

    Other RLPLANE_* environment variables (see rlplane_service.settings) apply too, e.g.
    RLPLANE_MOONCAKE_PROTOCOL=rdma, RLPLANE_MOONCAKE_SEGMENT_BYTES.
    """
    import signal

    from rlplane.snapplace import Local, place
    from rlplane_service.embedded import EmbeddedService
    from pydantic import ValidationError

    from rlplane_service.settings import ServiceSettings, settings_problem, unknown_variables

    where = place(restore) if restore is not None else None
    if isinstance(where, Local) and not where.path.is_dir():
        raise typer.BadParameter(f"{restore} is not a directory (a snapshot rlplane snapshot --to wrote)",
                                 param_hint="--restore")
    given = {"host": host, "port": port, "storage_units": storage_units, "capacity": capacity, "unit_bytes": unit_bytes,
             "registry_file": registry_file, "api_token": token, "backend": backend.value if backend else None,
             "restore_from": restore, "journal_dir": journal}
    try:
        settings = ServiceSettings(**{k: v for k, v in given.items() if v is not None})  # the rest: RLPLANE_*, defaults
    except ValidationError as err:
        console.print(f"[red]error[/]: {settings_problem(err, FLAGS)}")
        raise typer.Exit(2)
    for name in unknown_variables(os.environ):
        console.print(f"[yellow]warning[/]: {name} is set but no rlplane setting has that name (ignored)")
    def on_signal(*_: object) -> None:
        raise KeyboardInterrupt

    service = EmbeddedService(settings, num_cpus=num_cpus)
    # Ctrl-C and SIGTERM (docker stop, kill) both end in the same clean shutdown, also
    # during start-up and when started in the background (EmbeddedService keeps these
    # handlers across ray.init).
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    with captured_output(console, "serve", verbose=verbose):
        _serve(service, settings)


def _serve(service: Any, settings: Any) -> None:
    import time

    from rlplane.errors import RlplaneError

    try:
        with stages(console, "starting") as say:
            service.say = say
            try:
                service.start()
            except RlplaneError as err:  # e.g. a damaged --restore: the file and what to do, not a traceback
                console.print(f"[red]error[/]: {type(err).__name__}: {err}")
                raise typer.Exit(1) from None
        console.print(
            f"[green]rlplane serving[/] at {service.url}  (API docs {service.url}/docs; "
            f"{'token required' if settings.api_token else 'no token'}). Ctrl-C to stop."
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        console.print("shutting down")
    finally:
        service.stop()
    console.print("stopped")


@app.command()
def status(url: str = URL_OPTION, token: Optional[str] = TOKEN_OPTION, as_json: bool = typer.Option(False, "--json", help="Print the raw JSON.")) -> None:
    """Show a running service: registry version, storage units, partitions and bytes, and
    each streaming task's consumption (pending, claimed, acked, expired per partition)."""

    st = _call(url, token, "GET", "/v1/status", timeout=30)
    if as_json:
        print(json.dumps(st, indent=2))
        return
    store = st["store"]
    console.print(
        f"rlplane {st['version']} at {url}: registry {st['registry_version']} ({st['fields']} fields), "
        f"store {store['backend']} with {store['storage_units']} storage units, capacity {store['capacity'] or 'unlimited'}"
    )
    table = Table(title=f"{len(st['partitions'])} partitions, {st['samples']} samples, {st['nbytes'] / 1e6:.1f} MB")
    for col in ("partition", "samples", "MB", "fields"):
        table.add_column(col, justify="right" if col in ("samples", "MB") else "left")
    for p in st["partitions"]:
        table.add_row(p["partition"], str(p["num_samples"]), f"{p['nbytes'] / 1e6:.1f}", ", ".join(sorted(p["fields"])))
    console.print(table)
    for unit, m in sorted((st.get("memory") or {}).items()):
        console.print(f"  {unit}: slab {m['used_bytes'] / 2**20:.0f} of {m['slab_bytes'] / 2**20:.0f} MiB used, "
                      f"largest hole {m['largest_free'] / 2**20:.0f} MiB, fragmentation {m['fragmentation']:.2f}")
    tasks = st.get("consumption") or []
    if tasks:
        states = ("samples", "pending", "claimed", "acked", "expired", "redelivered")
        per_task = Table(title="consumption per task (streaming claims)")
        for col in ("partition", "task", *states):
            per_task.add_column(col, justify="left" if col in ("partition", "task") else "right")
        for t in tasks:
            per_task.add_row(t["partition"], t["task"], *(str(t.get(k, 0)) for k in states))
        console.print(per_task)


@app.command()
def snapshot(
    to: str = typer.Option(..., "--to", help="A new directory on the service's host (a shared filesystem, for "
                           "another host to restore from), or an fsspec URL (s3://bucket/snaps/run7, with that "
                           "scheme's driver installed where the service runs; not with RLPLANE_SNAPSHOT_DIR set): the "
                           "snapshot is complete there, or not there at all."),
    url: str = URL_OPTION, token: Optional[str] = TOKEN_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print the raw JSON."),
) -> None:
    """Snapshot a running native store: every partition and every task's consumption, one
    consistent cut, while writes and claims go on. Restore with `rlplane serve --restore PATH`
    (or RLPLANE_RESTORE_FROM) into a new store of any size."""

    from rlplane.client import SNAPSHOT_TIMEOUT_S

    with console.status(f"snapshot of {url} -> {to}"):
        info = _call(url, token, "POST", "/v1/snapshot", json={"path": str(to)}, timeout=SNAPSHOT_TIMEOUT_S)
    if as_json:
        print(json.dumps(info, indent=2))
        return
    console.print(f"[green]snapshot[/] {info['path']}: {info['samples']} samples in {info['partitions']} partitions, "
                  f"{info['nbytes'] / 1e6:.1f} MB, {info['tasks']} tasks' consumption, in {info['seconds']:.2f} s "
                  f"(cut {info['cut_ms']:.1f} ms)")


def _call(url: str, token: Optional[str], method: str, path: str, *, timeout: float, **kwargs: Any) -> Any:
    """The service's JSON answer; an rlplane error is printed and exits 1."""
    from rlplane.errors import RlplaneError
    from rlplane.http_api import ServiceAPI

    try:
        api = ServiceAPI(url, token=token, timeout=timeout)
    except RlplaneError as err:
        console.print(f"[red]error[/]: {err}")
        raise typer.Exit(2)
    try:
        return api.json(method, path, timeout=timeout, **kwargs)
    except RlplaneError as err:
        console.print(f"[red]error[/]: {err}")
        raise typer.Exit(1)
    finally:
        api.close()


def prose(doc: str) -> str:
    r"""A command's docstring as ``--help`` shows it: each paragraph on one line, for the
    terminal to wrap (Typer keeps a docstring's line breaks, which then wrap raggedly).

    Example: ``prose("Run it\n    until Ctrl-C.\n\n    Example: x")`` is ``"Run it until Ctrl-C.\n\nExample: x"``.
    """
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs if p.strip())


def main() -> None:
    """Entry point of the ``rlplane`` script (the tools' commands registered on ``app`` first)."""
    for command in app.registered_commands:
        if command.help is None and command.callback is not None and command.callback.__doc__:
            command.help = prose(command.callback.__doc__)
    app()


if __name__ == "__main__":
    main()
