"""The service's configuration: one typed object, read once at the edge.

Every value comes from (in order of precedence) the arguments the app is bound with
(``rlplane serve`` flags, a Serve config's ``args``), ``RLPLANE_*`` environment
variables, then the defaults below.

Example::

    RLPLANE_STORAGE_UNITS=4 RLPLANE_API_TOKEN=s3cret serve run rlplane_service.app:app
    settings = ServiceSettings(port=8001)
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlplane.errors import RegistryError

if TYPE_CHECKING:  # the registry needs torch; settings alone (the CLI's --help, a unit) do not
    from rlplane.fields import Registry



def _unspecified(host: str) -> bool:
    """Whether ``host`` names every interface (0.0.0.0 in any spelling: ``0``, ``::``,
    ``[::0]``, ``::ffff:0.0.0.0``, ``*``)."""
    h = host.strip().strip("[]")
    if h == "*":
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        try:  # the short IPv4 forms a socket takes (``0``)
            return socket.inet_aton(h) == bytes(4)
        except OSError:  # a host name
            return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_unspecified or bool(mapped is not None and mapped.is_unspecified)

class ServiceSettings(BaseSettings):
    """Everything the rlplane service reads (env prefix ``RLPLANE_``)."""

    # (hide_input_in_errors: an error would quote every value given, RLPLANE_API_TOKEN's too)
    model_config = SettingsConfigDict(env_prefix="RLPLANE_", extra="forbid", hide_input_in_errors=True)

    host: str = Field("127.0.0.1", description="HTTP bind address of the embedded server (rlplane serve).")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    storage_units: int = Field(2, ge=1, le=256, description="Storage units (actors holding sample bytes).")
    replicas: int = Field(
        1, ge=1, le=8, description="Backend native: copies of every block, each on a distinct storage unit (at most "
        "storage_units). With 2, a lost unit loses no sample; reads go on from the other copy."
    )
    unit_bytes: int = Field(
        1 << 30, ge=16 << 20, le=1 << 40,
        description="Backend native: the shared-memory slab each storage unit allocates and pre-faults at start (its "
        "memory cap; a write that does not fit is StorageFullError, 507). The host needs storage_units x this much RAM.",
    )
    capacity: Optional[int] = Field(
        None, ge=1, description="Most samples held across all storage units (None: no limit)."
    )
    registry_file: Optional[Path] = Field(
        None, description="YAML or JSON file of extra FieldSpecs ({'fields': [spec, ...]}) added to the default registry."
    )
    api_token: Optional[SecretStr] = Field(
        None, description="When set, every /v1 call needs 'Authorization: Bearer <token>'."
    )
    tokens_file: Optional[Path] = Field(
        None, description="Tenants: a YAML/JSON file of tokens scoped to partition-name prefixes, read or "
        "read-write (see rlplane_service.tenants). RLPLANE_API_TOKEN stays a full-access token.",
    )
    max_request_bytes: int = Field(
        2 << 30, ge=1 << 10, description="Largest HTTP data request body (POST /v1/data/{id}/put); larger ones get 413."
    )
    max_json_bytes: int = Field(
        8 << 20, ge=1 << 10, description="Largest body of every other HTTP request (JSON: a get's, clear's, ack's "
        "sample ids...); larger ones get 413. Parsed JSON takes ~40x its bytes in memory.",
    )
    snapshot_dir: Optional[Path] = Field(
        None, description="Backend native: where POST /v1/snapshot (rlplane snapshot --to) may write; a relative path "
        "is taken inside it, one outside it is refused. Unset: any new directory the service's user may create.",
    )
    restore_from: Optional[str] = Field(
        None, description="Backend native: a snapshot directory (rlplane snapshot --to), or an fsspec URL of one "
        "(s3://..., with that scheme's driver installed; fetched into TMPDIR first), a new store loads before it "
        "reports ready: every sample bit-exact and every task's consumption as snapshotted. A damaged snapshot stops "
        "the start with SnapshotError naming the file (nothing of it loaded).",
    )
    snapshot_interval_s: float = Field(
        0.0, ge=0, description="Backend native: take a snapshot every this many seconds into "
        "RLPLANE_SNAPSHOT_DIR/auto-<UTC time> (one replica of several takes it; each truncates the journal). 0: never.",
    )
    snapshot_keep: int = Field(3, ge=1, description="How many periodic snapshots to keep (the oldest go).")
    journal_dir: Optional[Path] = Field(
        None, description="Backend native: each storage unit appends every commit (with its bytes), clear and ack "
        "to a write-ahead journal in JOURNAL_DIR/<unit> (on the units' hosts; a shared volume when they are several). "
        "put_samples(..., durable=True) returns once its commit is on disk. A new store replays it before it reports "
        "ready: after RLPLANE_RESTORE_FROM's snapshot, or, unset, after the snapshot that last truncated it (each "
        "snapshot does).",
    )
    journal_flush_ms: float = Field(
        20.0, gt=0, le=1000, description="Backend native, with a journal: how often the units fsync what was appended "
        "(the most a change that is not durable=True can lose to a power cut); durable puts fsync at once.",
    )
    namespace: str = Field("rlplane", description="Ray namespace of the store's named actors.")
    store_name: str = Field("rlplane", description="Prefix of the store's actor names (one store per name).")
    tq_num_threads: int = Field(2, ge=1, le=64, description="TQ_NUM_THREADS for the storage units.")
    backend: Literal["native", "simple", "mooncake"] = Field(
        "native",
        description="Where sample bytes live: 'native' (rlplane's own columnar block engine, ZMQ), 'simple' "
        "(TransferQueue storage units) or 'mooncake' (Mooncake store segments, TCP or RDMA; the service runs "
        "its own mooncake_master).",
    )
    native_host: str = Field(
        "", description="Address the native engine's controller and units bind and advertise ('' = the Ray node address)."
    )
    engine_port_min: int = Field(
        0, ge=0, le=65535,
        description="native: lowest port the controller's and the units' data sockets bind (0 with engine_port_max "
        "0: any free port). A fixed range lets a NetworkPolicy admit clients to exactly these ports.",
    )
    engine_port_max: int = Field(0, ge=0, le=65535, description="native: highest port of that range.")
    put_lease_s: float = Field(
        60.0, gt=0, le=3600,
        description="native: how long a put's reserved ids wait for its commit; a writer that dies frees them after this.",
    )
    unit_grace_s: float = Field(
        60.0, gt=0, le=86400,
        description="native: how long a storage unit that does not answer stays 'suspect' (its data kept, reads and "
        "writes going to other units) before it is declared lost, unless Ray reports its actor dead first. Longer "
        "than a live process stalls (a big GC, swapping, a debugger).",
    )
    claim_lease_s: float = Field(
        300.0, gt=0, le=86400,
        description="How long a claim's samples stay leased to its consumer without an ack; then they go back to the "
        "task (a claim's lease_s= overrides it).",
    )
    mooncake_protocol: Literal["tcp", "rdma"] = Field("tcp", description="Mooncake transfer protocol.")
    mooncake_device_name: str = Field(
        "", description="RDMA devices for Mooncake, e.g. 'mlx5_0,mlx5_1' ('' lets Mooncake pick)."
    )
    mooncake_hostname: str = Field(
        "",
        description="Address the store's Mooncake segments advertise ('' = the Ray node address; "
        "in Kubernetes the pod IP). Clients advertise their own (RLPLANE_MOONCAKE_HOSTNAME on the client).",
    )
    mooncake_master_port: int = Field(0, ge=0, le=65535, description="mooncake_master RPC port (0: a free port).")
    mooncake_metadata_port: int = Field(
        0, ge=0, le=65535, description="mooncake_master's HTTP metadata server port (0: a free port)."
    )
    mooncake_metrics_port: int = Field(
        0, ge=0, le=65535, description="mooncake_master's /metrics and /health port (0: a free port)."
    )
    mooncake_segment_bytes: int = Field(
        2 << 30, ge=16 << 20, description="Memory each storage unit mounts into the Mooncake pool."
    )
    mooncake_buffer_bytes: int = Field(
        64 << 20, ge=1 << 20, description="Mooncake local transfer buffer of each client (and storage unit)."
    )
    mooncake_lease_ttl_ms: int = Field(
        60_000, ge=100, description="How long a read holds the objects it reads (Mooncake's kv lease); a read slower than this fails."
    )
    mooncake_master_bin: Optional[Path] = Field(
        None, description="mooncake_master executable (default: the one beside this Python, else on PATH)."
    )
    te_protocol: Literal["", "tcp", "rdma"] = Field(
        "",
        description="native: register every storage unit's slab with Mooncake's transfer engine over this protocol "
        "('' = off), so clients on other hosts write and read it one-sided (RLPLANE_DATA_PATH=auto|te). Off by "
        "default: the engine authenticates nobody and listens on every interface, so turn it on only where the "
        "network (the chart's NetworkPolicy) confines its ports to the store's pods.",
    )
    te_devices: str = Field(
        "", description="native, with te_protocol 'rdma': the RDMA NICs the units' engines use, e.g. 'mlx5_0,mlx5_1' "
        "('' lets the engine pick)."
    )
    te_port_min: int = Field(
        0, ge=0, le=65535, description="native, with te_protocol: the lowest port the units' transfer engines may "
        "listen on (each takes two: its handshake and its TCP data port), so a NetworkPolicy can name them; 0 (with "
        "te_port_max 0): the engine's own choice, observed in 15000-17000.",
    )
    te_port_max: int = Field(0, ge=0, le=65535, description="native, with te_protocol: the highest such port.")
    storage_resource: Optional[str] = Field(
        None,
        description="Custom Ray resource each storage unit requests one of, so units run only on nodes that "
        "offer it (the Helm chart gives its worker group 'rlplane_storage'). None: any node.",
    )

    @model_validator(mode="after")
    def _engine_ports(self) -> "ServiceSettings":
        lo, hi = self.engine_port_min, self.engine_port_max
        if (lo == 0) != (hi == 0) or lo > hi or (lo and lo < 1024):
            raise ValueError(f"engine_port_min..engine_port_max must be a range of ports >= 1024 (or both 0), "
                             f"got {lo}..{hi}")
        return self

    @model_validator(mode="after")
    def _mooncake_ports(self) -> "ServiceSettings":
        named = {"mooncake_master_port": self.mooncake_master_port, "mooncake_metadata_port": self.mooncake_metadata_port,
                 "mooncake_metrics_port": self.mooncake_metrics_port}
        set_ = [p for p in named.values() if p]
        if len(set_) != len(set(set_)):
            raise ValueError(f"the mooncake_master's ports must differ (each server binds its own), got {named}")
        return self

    @model_validator(mode="after")
    def _no_transfer_engine_for_tenants(self) -> "ServiceSettings":
        if self.te_protocol and self.tokens_file is not None:
            raise ValueError("RLPLANE_TE_PROTOCOL with RLPLANE_TOKENS_FILE: Mooncake's transfer engine authenticates "
                             "nobody (any peer that reaches a storage unit's engine port learns its slab's address "
                             "and reads and writes every tenant's samples), so tenants would not be kept apart; "
                             "run a store per tenant, or leave the transfer engine off")
        return self

    @model_validator(mode="after")
    def _durability_is_native(self) -> "ServiceSettings":
        if self.snapshot_interval_s and self.snapshot_dir is None:
            raise ValueError("RLPLANE_SNAPSHOT_INTERVAL_S needs RLPLANE_SNAPSHOT_DIR (where the periodic snapshots go)")
        if self.backend != "native" and (self.journal_dir is not None or self.restore_from is not None
                                         or self.snapshot_interval_s):
            what = "RLPLANE_JOURNAL_DIR" if self.journal_dir is not None else "RLPLANE_RESTORE_FROM" \
                if self.restore_from is not None else "RLPLANE_SNAPSHOT_INTERVAL_S"
            raise ValueError(f"{what} needs the native backend (snapshots and the journal are the native engine's); "
                             f"this service is configured for backend {self.backend!r}")
        return self

    @model_validator(mode="after")
    def _te_port_range(self) -> "ServiceSettings":
        if (self.te_port_min or self.te_port_max) and not 1024 <= self.te_port_min < self.te_port_max:
            raise ValueError(f"RLPLANE_TE_PORT_MIN/MAX must both be set, 1024 <= min < max (each transfer engine "
                             f"listens on two ports of the range), got {self.te_port_min}-{self.te_port_max}")
        return self

    def te_ports(self) -> tuple[int, int] | None:
        """The range the units' transfer engines listen in, or None (the engine's choice)."""
        return (self.te_port_min, self.te_port_max) if self.te_port_min else None

    def engine_ports(self) -> tuple[int, int] | None:
        """The native engine's port range, or None (any free port)."""
        return (self.engine_port_min, self.engine_port_max) if self.engine_port_min else None

    @field_validator("api_token")
    @classmethod
    def _empty_token_is_none(cls, v: Optional[SecretStr]) -> Optional[SecretStr]:
        return None if v is not None and not v.get_secret_value() else v

    @field_validator("native_host")
    @classmethod
    def _an_address_to_advertise(cls, v: str) -> str:
        """The units and the controller tell clients this address: a wildcard would send every
        client to its own host (and make every unit one host to the copies' placement)."""
        if _unspecified(v):
            raise ValueError(f"RLPLANE_NATIVE_HOST={v!r} is a wildcard, and the engine advertises this address to "
                             "clients: leave it unset (each unit binds its Ray node's address) or name one address")
        return v.strip()

    @field_validator("registry_file", "tokens_file", "snapshot_dir", "restore_from", "journal_dir",
                     "mooncake_master_bin", "storage_resource", "capacity", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: Any) -> Any:
        """An optional setting given empty is unset: ``RLPLANE_JOURNAL_DIR=""`` means no journal,
        not one in the working directory."""
        return None if isinstance(v, str) and not v.strip() else v

    @model_validator(mode="after")
    def _copies_fit(self) -> "ServiceSettings":
        if self.backend != "native" and (self.replicas > 1 or self.te_protocol):
            what = "RLPLANE_REPLICAS > 1" if self.replicas > 1 else "RLPLANE_TE_PROTOCOL"
            raise ValueError(f"{what} needs the native backend; this service is configured for backend "
                             f"{self.backend!r} (it would be ignored)")
        if self.replicas > self.storage_units:
            raise ValueError(f"RLPLANE_REPLICAS={self.replicas} copies need as many storage units (each copy on a "
                             f"distinct one); RLPLANE_STORAGE_UNITS is {self.storage_units}")
        return self

    def token(self) -> str | None:
        return None if self.api_token is None else self.api_token.get_secret_value()

    def as_args(self) -> dict[str, Any]:
        """Plain values (token revealed) to bind the Serve app with."""
        out = self.model_dump(mode="json")
        out["api_token"] = self.token()
        return out


#: RLPLANE_* variables read elsewhere than ServiceSettings (the client, the CLI, the tools).
OTHER_VARIABLES = frozenset({"RLPLANE_URL", "RLPLANE_DATA_PATH", "RLPLANE_TE_STAGING_BYTES", "RLPLANE_TE_HOSTNAME",
                             "RLPLANE_LOG_DIR", "RLPLANE_LOCAL_SECRET", "RLPLANE_LOCAL_CONTROL"})


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """The RLPLANE_* variables of ``environ`` that nothing reads (a misspelling is
    otherwise silently ignored), each with the closest known name.

    Example::

        unknown_variables({"RLPLANE_STORAGE_UNIT": "5"})  # ['RLPLANE_STORAGE_UNIT (RLPLANE_STORAGE_UNITS?)']
    """
    import difflib

    known = {f"RLPLANE_{name.upper()}" for name in ServiceSettings.model_fields} | OTHER_VARIABLES
    out = []
    for name in sorted(n for n in environ if n.startswith("RLPLANE_") and n not in known):
        near = difflib.get_close_matches(name, known, n=1)
        out.append(f"{name} ({near[0]}?)" if near else name)
    return out


def settings_problem(err: ValidationError, flags: Mapping[str, str] | None = None) -> str:
    """What is wrong with the settings, one line per fault, each naming the setting as its
    flag (``flags``: field -> flag) and its RLPLANE_* variable, never quoting a value.

    Example: ``settings_problem(err)  # 'port (RLPLANE_PORT): Input should be a valid integer...'``
    """
    lines = []
    for e in err.errors(include_input=False, include_url=False):
        field = str(e["loc"][0]) if e.get("loc") else ""
        what = "/".join(x for x in ((flags or {}).get(field), f"RLPLANE_{field.upper()}" if field else None) if x)
        msg = str(e["msg"]).removeprefix("Value error, ")
        lines.append(f"{what}: {msg}" if what else msg)
    return "; ".join(lines)


def load_registry(settings: ServiceSettings) -> Registry:
    """The default GRPO/VLM registry plus the specs in ``settings.registry_file``.

    Raises RegistryError naming the file and field when a spec is illegal or clashes.

    Example::

        registry = load_registry(ServiceSettings(registry_file="fields.yaml"))
    """
    from rlplane.fields import FieldSpec, default_registry

    registry = default_registry()
    path = settings.registry_file
    if path is None:
        return registry
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise RegistryError(f"cannot read registry file {str(path)!r}: {err}") from None
    import yaml  # JSON is YAML too

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise RegistryError(f"registry file {str(path)!r} is not YAML/JSON: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("fields"), list):
        raise RegistryError(f"registry file {str(path)!r} must hold {{'fields': [spec, ...]}}")
    for entry in data["fields"]:
        if not isinstance(entry, dict):
            raise RegistryError(f"registry file {str(path)!r}: each field is a mapping (name, dtype, ...), got "
                                f"{entry!r:.80}")
        try:
            registry.register(FieldSpec.from_dict(entry))
        except RegistryError as err:
            raise RegistryError(f"registry file {str(path)!r}: {err}", field=err.field) from None
        except (TypeError, KeyError, ValueError) as err:
            raise RegistryError(f"registry file {str(path)!r}: bad field spec {entry!r} ({err})") from None
    return registry
