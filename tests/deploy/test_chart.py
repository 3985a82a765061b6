"""helm/rlplane lints, renders offline (Helm's own Go SDK via helm-python-sdk), and what
it renders is a RayService KubeRay and Serve accept, with the knobs wired through."""

import base64
import copy
import json
import os
import subprocess
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from test_serve_config import check_serve_config

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "rlplane"
RDMA_VALUES = CHART / "values-rdma-gpu.yaml"
RAYSERVICE_SCHEMA = json.loads((Path(__file__).parent / "schemas" / "rayservice.schema.json").read_text())
KUBE_VERSION = "1.30.0"
MOONCAKE_ENV = {
    "RLPLANE_MOONCAKE_PROTOCOL", "RLPLANE_MOONCAKE_DEVICE_NAME", "RLPLANE_MOONCAKE_HOSTNAME",
    "RLPLANE_MOONCAKE_MASTER_PORT", "RLPLANE_MOONCAKE_METADATA_PORT", "RLPLANE_MOONCAKE_METRICS_PORT",
    "RLPLANE_MOONCAKE_SEGMENT_BYTES", "RLPLANE_MOONCAKE_BUFFER_BYTES",
}


#: Snapshots and the journal on, on the chart's volume.
DURABLE = {"durability": {"volume": {"enabled": True}, "journal": True,
                          "restoreFrom": "/var/lib/rlplane/snapshots/auto-20261201T000000Z"},
           "service": {"snapshotIntervalS": 600}}


def rdma_values() -> dict:
    return yaml.safe_load(RDMA_VALUES.read_text())


def render(values: dict | None = None) -> dict[str, dict]:
    """kind -> the rendered object (the chart renders one of each kind)."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values or {}, name="rl", namespace="ml")
    docs = [d for name, text in out.items() if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), f"two objects of one kind: {[d['kind'] for d in docs]}"
    return by_kind


def groups(rs: dict) -> dict[str, dict]:
    cfg = rs["spec"]["rayClusterConfig"]
    return {"head": cfg["headGroupSpec"], **{g["groupName"]: g for g in cfg["workerGroupSpecs"]}}


def containers(rs: dict) -> list[dict]:
    return [c for g in groups(rs).values() for c in g["template"]["spec"]["containers"]]


def env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def ray_resources(group: dict) -> dict:
    """The --resources of a group: KubeRay passes the string to `ray start` through a shell."""
    raw = group["rayStartParams"].get("resources")
    return {} if raw is None else json.loads(json.loads(raw))


@pytest.fixture(scope="module", params=["default", "rdma-gpu"])
def rendered(request):
    values = {} if request.param == "default" else rdma_values()
    return values, render(values)


@pytest.mark.parametrize("values_file", [None, RDMA_VALUES])
def test_chart_lints_clean(values_file):
    values = None if values_file is None else helm.values_from_yaml(values_file.read_text())
    report = helm.lint(CHART, values, strict=True, namespace="ml", kube_version=KUBE_VERSION)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_values_schema_rejects_a_typo_and_impossible_placement():
    with pytest.raises(helm.HelmError, match="storagUnits"):
        render({"service": {"storagUnits": 3}})
    with pytest.raises(helm.HelmError, match="mooncake"):
        render({"service": {"backend": "mooncak"}})
    with pytest.raises(helm.HelmError, match="exceeds workers.replicas"):
        render({"service": {"storageUnits": 5}, "workers": {"replicas": 2, "storageUnitsPerWorker": 2}})
    with pytest.raises(helm.HelmError, match="dataReplicas"):
        render({"service": {"storageUnits": 2, "dataReplicas": 3}})


@pytest.mark.parametrize("values, says", [
    ({"mooncake": {"segmentBytes": 8 << 20}}, "segmentBytes"),
    ({"mooncake": {"bufferBytes": 65536}}, "bufferBytes"),
    ({"mooncake": {"masterPort": 15001, "metadataPort": 15001}}, "must differ"),
    ({"service": {"enginePorts": {"min": 30000, "max": 20000}}}, "enginePorts"),
    ({"storage": {"transferEngine": {"protocol": "tcp", "ports": {"min": 16000, "max": 16000}}}}, "must be below"),
    ({"storage": {"transferEngine": {"protocol": "tcp"}}, "tokensSecret": "tenants"}, "authenticates nobody"),
    ({"storage": {"transferEngine": {"protocol": "tcp"}}, "service": {"backend": "simple"}}, "needs service.backend"),
    ({"service": {"backend": "simple", "dataReplicas": 2, "storageUnits": 2}}, "dataReplicas > 1 needs"),
])
def test_values_the_service_would_refuse_at_start_are_refused_at_render(values, says):
    """Each of these rendered, and the Serve replica then failed at deploy time."""
    with pytest.raises(helm.HelmError, match=says):
        render(values)


def test_renders_the_expected_kinds(rendered):
    _, out = rendered
    assert set(out) == {"RayService", "Secret", "NetworkPolicy", "PodMonitor"}


def test_rayservice_matches_the_crd_subset(rendered):
    _, out = rendered
    jsonschema.Draft202012Validator(RAYSERVICE_SCHEMA).validate(out["RayService"])


def test_rayservice_schema_catches_mistakes():
    rs = render()["RayService"]
    validator = jsonschema.Draft202012Validator(RAYSERVICE_SCHEMA)
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["workerGroupSpec"] = bad["spec"]["rayClusterConfig"].pop("workerGroupSpecs")
    assert not validator.is_valid(bad)
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # KubeRay wants strings
    assert not validator.is_valid(bad)


def test_pod_templates_are_valid_core_pod_templates(rendered):
    _, out = rendered
    for name, group in groups(out["RayService"]).items():
        doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": group["template"]}
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_pod_template_check_catches_a_misplaced_field():
    group = groups(render()["RayService"])["head"]
    tpl = copy.deepcopy(group["template"])
    tpl["spec"]["containers"][0]["capabilities"] = {"add": ["IPC_LOCK"]}  # belongs under securityContext
    doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": tpl}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_serve_config_v2_is_a_serve_config_for_the_values(rendered):
    values, out = rendered
    rs = out["RayService"]
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    check_serve_config(config)
    args = config["applications"][0]["args"]
    chart_values = render_values(values)
    assert args["storage_units"] == chart_values["service"]["storageUnits"]
    assert args["replicas"] == chart_values["service"]["dataReplicas"]
    assert args["storage_resource"] == chart_values["placement"]["storageResource"]
    assert config["http_options"]["port"] == chart_values["service"]["httpPort"]


def render_values(values: dict) -> dict:
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(values)


def test_storage_units_are_pinned_to_the_workers(rendered):
    values, out = rendered
    v = render_values(values)
    g = groups(out["RayService"])
    resource = v["placement"]["storageResource"]
    assert ray_resources(g["storage"]) == {resource: v["workers"]["storageUnitsPerWorker"]}
    assert resource not in ray_resources(g["head"])
    # The replica (and the Mooncake master it starts) stays on the head, where the PodMonitor looks.
    config = yaml.safe_load(out["RayService"]["spec"]["serveConfigV2"])
    wanted = config["applications"][0]["deployments"][0]["ray_actor_options"]["resources"]
    assert set(wanted) <= set(ray_resources(g["head"]))
    assert not set(wanted) & set(ray_resources(g["storage"]))


def test_token_reaches_every_container_only_from_the_secret():
    out = render({"apiToken": "s3cret-value-42"})
    secret = out["Secret"]
    assert base64.b64decode(secret["data"]["token"]).decode() == "s3cret-value-42"
    assert "s3cret-value-42" not in json.dumps(out["RayService"])
    for c in containers(out["RayService"]):
        ref = env(c)["RLPLANE_API_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": "token"}


def test_existing_secret_or_a_generated_token():
    out = render({"existingSecret": "my-token"})
    assert "Secret" not in out
    for c in containers(out["RayService"]):
        assert env(c)["RLPLANE_API_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "my-token"
    token = base64.b64decode(render()["Secret"]["data"]["token"]).decode()
    assert len(token) == 40 and token.isalnum()


def test_backend_env_and_mooncake_settings(rendered):
    values, out = rendered
    mooncake = render_values(values)["service"]["backend"] == "mooncake"
    for c in containers(out["RayService"]):
        e = env(c)
        assert e["RLPLANE_BACKEND"]["value"] == render_values(values)["service"]["backend"]
        assert (MOONCAKE_ENV <= set(e)) == mooncake and (not MOONCAKE_ENV & set(e)) == (not mooncake)
        if mooncake:
            assert e["RLPLANE_MOONCAKE_HOSTNAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert e["RLPLANE_MOONCAKE_PROTOCOL"]["value"] == "rdma"
            assert e["RLPLANE_MOONCAKE_DEVICE_NAME"]["value"] == "mlx5_0,mlx5_1"
            assert int(e["RLPLANE_MOONCAKE_SEGMENT_BYTES"]["value"]) == 32 << 30


def test_rdma_gpu_workers():
    v = rdma_values()
    out = render(v)
    g = groups(out["RayService"])
    worker = g["storage"]["template"]["spec"]
    (c,) = worker["containers"]
    for kind in ("limits", "requests"):
        assert c["resources"][kind]["nvidia.com/gpu"] == v["workers"]["gpus"] == 8
        assert c["resources"][kind]["rdma/hca_shared_devices_a"] == 1
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    for group in g.values():
        spec = group["template"]["spec"]
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in spec["volumes"]
    # Default values: no GPU, no RDMA device, no extra capability, the pod network.
    default = groups(render()["RayService"])["storage"]["template"]["spec"]
    assert "securityContext" not in default["containers"][0] and "hostNetwork" not in default
    assert set(default["containers"][0]["resources"]["limits"]) == {"cpu", "memory"}


def test_pod_monitor_scrapes_the_head_metrics_ports(rendered):
    values, out = rendered
    pm = out["PodMonitor"]
    head = groups(out["RayService"])["head"]["template"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= head["metadata"]["labels"].items()
    storage = groups(out["RayService"])["storage"]["template"]
    assert not pm["spec"]["selector"]["matchLabels"].items() <= storage["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    endpoints = {e["port"]: e["path"] for e in pm["spec"]["podMetricsEndpoints"]}
    assert endpoints["serve"] == "/metrics" and ports["serve"] == 8000
    mooncake = render_values(values)["service"]["backend"] == "mooncake"
    assert ("mooncake-metrics" in endpoints) == mooncake == ("mooncake-metrics" in ports)


#: Ray's ports a client must never reach (job submission, the raylet, workers, agents, metrics).
RAY_PORTS = (6379, 6380, 6381, 8080, 8265, 10001, 10002, 10500, 10999, 52365, 52366, 52367)


def _client_ports(out: dict) -> list[tuple[int, int]]:
    rules = out["NetworkPolicy"]["spec"]["ingress"]
    clients = [r for r in rules if r["from"][0].get("podSelector", {}).get("matchLabels") == {"rlplane.io/client": "true"}]
    assert len(clients) == 1
    return [(p.get("port", 1), p.get("endPort", p.get("port", 65535))) for p in clients[0]["ports"]]


def test_network_policy_admits_own_pods_clients_and_monitoring(rendered):
    values, out = rendered
    np = out["NetworkPolicy"]["spec"]
    selector = np["podSelector"]["matchLabels"].items()
    for group in groups(out["RayService"]).values():
        assert selector <= group["template"]["metadata"]["labels"].items()
    rules = np["ingress"]
    own = [r for r in rules if r["from"] == [{"podSelector": {"matchLabels": dict(selector)}}]]
    assert len(own) == 1 and "ports" not in own[0]
    covered = _client_ports(out)
    for ray_port in RAY_PORTS:
        assert not any(lo <= ray_port <= hi for lo, hi in covered), ray_port
    backend = render_values(values)["service"]["backend"]
    if backend == "native":  # the HTTP port and the engine's range, nothing else
        engine = render_values(values)["service"]["enginePorts"]
        assert sorted(covered) == sorted([(8000, 8000), (engine["min"], engine["max"])])
    else:
        for data_port in (1024, 8000, 9003, 15000, 40000, 65535):  # HTTP, Mooncake, run-time ZMQ/transfer ports
            assert any(lo <= data_port <= hi for lo, hi in covered), data_port
    monitoring = [r for r in rules if r["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]]
    (mon,) = monitoring
    metrics_ports = {8000} | ({9003} if backend == "mooncake" else set())
    assert {p["port"] for p in mon["ports"]} == metrics_ports


@pytest.mark.parametrize("backend", ["native", "simple", "mooncake"])
def test_ray_ports_are_pinned_where_the_policy_keeps_clients_off_them(backend):
    out = render({"service": {"backend": backend}})
    for name, group in groups(out["RayService"]).items():
        params = group["rayStartParams"]
        assert params["node-manager-port"] == "6380" and params["object-manager-port"] == "6381", name
        assert (params["min-worker-port"], params["max-worker-port"]) == ("10002", "10999"), name
        assert {params[k] for k in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                    "runtime-env-agent-port")} == {"52365", "52366", "52367"}, name
    covered = _client_ports(out)
    for port in RAY_PORTS:
        assert not any(lo <= port <= hi for lo, hi in covered), (backend, port)


def test_the_engine_port_range_reaches_the_app_and_the_policy():
    out = render({"service": {"enginePorts": {"min": 31000, "max": 31010}}})
    serve = yaml.safe_load(out["RayService"]["spec"]["serveConfigV2"])
    args = serve["applications"][0]["args"]
    assert (args["engine_port_min"], args["engine_port_max"]) == (31000, 31010)
    assert (31000, 31010) in _client_ports(out)
    with pytest.raises(helm.HelmError, match="enginePorts"):
        render({"service": {"enginePorts": {"min": 80, "max": 90}}})


def test_network_policy_http_port_peers_and_client_namespaces():
    out = render({"networkPolicy": {"httpFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
                                    "clientNamespaceSelector": {"team": "rl"}}})
    rules = out["NetworkPolicy"]["spec"]["ingress"]
    http = [r for r in rules if r["from"] == [{"ipBlock": {"cidr": "10.0.0.0/8"}}]]
    assert len(http) == 1 and http[0]["ports"] == [{"protocol": "TCP", "port": 8000}]
    (client,) = [r for r in rules if "namespaceSelector" in r["from"][0] and "podSelector" in r["from"][0]
                 and r["from"][0]["podSelector"]["matchLabels"] == {"rlplane.io/client": "true"}]
    assert client["from"][0]["namespaceSelector"] == {"matchLabels": {"team": "rl"}}
    assert "NetworkPolicy" not in render({"networkPolicy": {"enabled": False}})
    opened = render({"networkPolicy": {"clientRayPorts": True}})["NetworkPolicy"]["spec"]["ingress"]
    (client,) = [r for r in opened if r["from"][0].get("podSelector", {}).get("matchLabels") == {"rlplane.io/client": "true"}]
    assert client["ports"] == [{"protocol": "TCP"}]


#: The transfer engine's TCP ports (handshake RPC and TCP data), drawn at random in this range.
TE_PORTS = (15000, 17000)
TE_TCP = {"storage": {"transferEngine": {"protocol": "tcp"}}}


def _app_args(out: dict) -> dict:
    return yaml.safe_load(out["RayService"]["spec"]["serveConfigV2"])["applications"][0]["args"]


def _rules_reaching(out: dict, lo: int, hi: int) -> list[dict]:
    """The ingress rules with a port list that opens any port of lo..hi."""
    return [r for r in out["NetworkPolicy"]["spec"]["ingress"] if "ports" in r
            and any(p.get("port", 1) <= hi and lo <= p.get("endPort", p.get("port", 65535)) for p in r["ports"])]


def test_transfer_engine_is_off_by_default():
    out = render()
    assert not [k for k in _app_args(out) if k.startswith("te_")]
    assert render_values({})["storage"]["transferEngine"] == {"protocol": "", "devices": "",
                                                               "ports": {"min": 15000, "max": 17000}}
    assert _rules_reaching(out, *TE_PORTS) == []
    # The NIC list alone turns nothing on.
    out = render({"storage": {"transferEngine": {"devices": "mlx5_0"}}})
    assert not [k for k in _app_args(out) if k.startswith("te_")] and _rules_reaching(out, *TE_PORTS) == []


def test_transfer_engine_tcp_reaches_the_service_and_opens_its_ports_to_the_stores_pods_only():
    out = render(TE_TCP)
    config = yaml.safe_load(out["RayService"]["spec"]["serveConfigV2"])
    check_serve_config(config)  # ServiceSettings(**args) takes te_protocol / te_devices
    args = config["applications"][0]["args"]
    assert (args["te_protocol"], args["te_devices"]) == ("tcp", "")
    assert (args["te_port_min"], args["te_port_max"]) == TE_PORTS  # the engines listen where the policy opens
    kubernetes_validate.validate(out["NetworkPolicy"], KUBE_VERSION, strict=True)
    own = {"podSelector": {"matchLabels": out["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"]}}
    client = {"podSelector": {"matchLabels": {"rlplane.io/client": "true"}}}
    (rule,) = _rules_reaching(out, *TE_PORTS)
    assert rule["from"] == [own, client]
    assert rule["ports"] == [{"protocol": "TCP", "port": TE_PORTS[0], "endPort": TE_PORTS[1]}]
    # The clients' other ports stay what they were.
    assert sorted(_client_ports(out)) == [(8000, 8000), (20000, 20199)]
    # Clients in other namespaces: the engine rule names the same namespaces as the data ports.
    out = render({"storage": {"transferEngine": {"protocol": "rdma", "devices": "mlx5_0"}},
                  "networkPolicy": {"clientNamespaceSelector": {"team": "rl"}}})
    assert (_app_args(out)["te_protocol"], _app_args(out)["te_devices"]) == ("rdma", "mlx5_0")
    (rule,) = _rules_reaching(out, *TE_PORTS)
    assert rule["from"] == [own, {**client, "namespaceSelector": {"matchLabels": {"team": "rl"}}}]
    # No NetworkPolicy, no rule (and the values still reach the service).
    out = render({**TE_TCP, "networkPolicy": {"enabled": False}})
    assert "NetworkPolicy" not in out and _app_args(out)["te_protocol"] == "tcp"


def test_the_transfer_engine_port_range_is_the_units_and_the_network_policys():
    out = render({"storage": {"transferEngine": {"protocol": "tcp", "ports": {"min": 31000, "max": 31099}}}})
    config = yaml.safe_load(out["RayService"]["spec"]["serveConfigV2"])
    check_serve_config(config)
    args = config["applications"][0]["args"]
    assert (args["te_port_min"], args["te_port_max"]) == (31000, 31099)
    (rule,) = _rules_reaching(out, 31000, 31099)
    assert rule["ports"] == [{"protocol": "TCP", "port": 31000, "endPort": 31099}]
    assert _rules_reaching(out, 15000, 17000) == []
    with pytest.raises(helm.HelmError, match="minimum"):
        render({"storage": {"transferEngine": {"protocol": "tcp", "ports": {"min": 80, "max": 90}}}})


def test_values_schema_refuses_an_unknown_transfer_engine_protocol():
    with pytest.raises(helm.HelmError, match=r"transferEngine/protocol.*one of '', 'tcp', 'rdma'"):
        render({"storage": {"transferEngine": {"protocol": "udp"}}})
    with pytest.raises(helm.HelmError, match="protocl"):
        render({"storage": {"transferEngine": {"protocl": "tcp"}}})


@pytest.mark.parametrize("kind", ["Secret", "NetworkPolicy"])
def test_core_kinds_validate_against_kubernetes_schemas(rendered, kind):
    _, out = rendered
    kubernetes_validate.validate(out[kind], KUBE_VERSION, strict=True)


def test_core_kinds_pass_kubectl_offline(rendered):
    """kubectl without a cluster: `apply --dry-run=client` needs API discovery even with
    --validate=false, so the offline check is `label --local`, which decodes each object
    (the schema check is kubernetes_validate's, above)."""
    _, out = rendered
    for kind in ("Secret", "NetworkPolicy"):
        proc = subprocess.run(
            ["kubectl", "label", "--local", "-f", "-", "-o", "json", "rlplane.io/checked=true"],
            input=yaml.safe_dump(out[kind]), capture_output=True, text=True,
            env={**os.environ, "KUBECONFIG": os.devnull}, timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        back = json.loads(proc.stdout)
        assert back["kind"] == kind and back["metadata"]["labels"]["rlplane.io/checked"] == "true"
        assert back["metadata"]["name"] == out[kind]["metadata"]["name"]


def leaves(node: dict, prefix=()) -> list[tuple]:
    out = []
    for k, v in node.items():
        if isinstance(v, dict) and v:
            out.extend(leaves(v, prefix + (k,)))
        else:
            out.append((prefix + (k,), v))
    return out


def perturbed(path: tuple, value):
    """A different value of the same kind, accepted by values.schema.json."""
    special = {
        ("image", "pullPolicy"): "Always", ("service", "backend"): "mooncake",
        ("mooncake", "protocol"): "tcp" if value == "rdma" else "rdma",
        ("storage", "transferEngine", "protocol"): "tcp" if value != "tcp" else "rdma",
        ("service", "storageUnits"): 1, ("service", "capacity"): 1000, ("podMonitor", "interval"): "15s",
        ("imagePullSecrets",): [{"name": "regcred"}], ("tolerations",): [{"key": "k", "operator": "Exists"}],
        ("networkPolicy", "httpFrom"): [{"podSelector": {}}], ("networkPolicy", "clientNamespaceSelector"): {"a": "b"},
        ("networkPolicy", "operatorNamespaceSelector"): {"a": "b"},
        ("durability", "volume", "accessModes"): ["ReadWriteOnce"],
    }
    if path in special:
        return special[path]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, dict):
        return {"x.io/k": "v"}
    if isinstance(value, str):
        if value[:1].isdigit():
            digits = "".join(ch for ch in value if ch.isdigit())
            return str(int(digits) + 1) + value[len(digits):]
        return value + "x" if value else "x1"
    raise AssertionError(f"no perturbation for {path}={value!r}")


def with_value(values: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(values)
    node = out
    for k in path[:-1]:
        node = node.setdefault(k, {})
    node[path[-1]] = value
    return out


def test_every_value_changes_the_rendered_output():
    """No dead knobs: changing any key of values.yaml changes what the chart renders
    (with the default values, the RDMA/GPU ones for the Mooncake keys, or the transfer
    engine on for its devices)."""
    with helm.Chart.load(CHART) as chart:
        defaults = chart.values

    def manifests(values: dict) -> dict | None:
        """What the chart renders, or None where it refuses these values (the test of
        that refusal is elsewhere): a knob counts where a base it fits changes."""
        try:
            with helm.Chart.load(CHART) as chart:
                out = chart.render(values, name="rl", namespace="ml")
        except helm.HelmError:
            return None
        return {k: v for k, v in out.items() if not k.endswith("secret.yaml") or values.get("apiToken")}

    bases = [{"apiToken": "fixed"}, {**rdma_values(), "apiToken": "fixed"},
             {"apiToken": "fixed", "storage": {"transferEngine": {"protocol": "tcp"}}},
             {"apiToken": "fixed", **DURABLE}]
    before = [manifests(b) for b in bases]
    assert None not in before  # every base renders
    merged = [dict(leaves(render_values(b))) for b in bases]
    dead = []
    for path, value in leaves(defaults):
        if path == ("apiToken",):
            continue  # checked by test_token_reaches_every_container_only_from_the_secret
        after = [manifests(with_value(b, path, perturbed(path, m.get(path, value)))) for b, m in zip(bases, merged)]
        changed = [a is not None and a != o for a, o in zip(after, before)]
        if not any(changed):
            dead.append(".".join(path))
    assert dead == [], f"values that change nothing: {dead}"


def test_a_tokens_secret_is_mounted_on_the_head_and_named_in_its_env():
    assert "RLPLANE_TOKENS_FILE" not in env(containers(render()["RayService"])[0])
    rs = render({"tokensSecret": "rl-tenants"})["RayService"]
    head = groups(rs)["head"]["template"]["spec"]
    (c,) = head["containers"]
    assert env(c)["RLPLANE_TOKENS_FILE"]["value"] == "/etc/rlplane/tokens/tokens.yaml"
    assert {"name": "tokens", "mountPath": "/etc/rlplane/tokens", "readOnly": True} in c["volumeMounts"]
    (vol,) = [v for v in head["volumes"] if v["name"] == "tokens"]
    assert vol["secret"]["secretName"] == "rl-tenants"


def test_durability_mounts_one_volume_on_head_and_workers_and_sets_the_env():
    out = render(DURABLE)
    pvc = out["PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["resources"]["requests"]["storage"] == "100Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    kubernetes_validate.validate(pvc, KUBE_VERSION, strict=True)
    for name, g in groups(out["RayService"]).items():
        spec = g["template"]["spec"]
        assert {"name": "durable", "persistentVolumeClaim": {"claimName": pvc["metadata"]["name"]}} in spec["volumes"]
        (c,) = spec["containers"]
        assert {"name": "durable", "mountPath": "/var/lib/rlplane"} in c["volumeMounts"], name
        e = {k: v.get("value") for k, v in env(c).items()}
        assert e["RLPLANE_SNAPSHOT_DIR"] == "/var/lib/rlplane/snapshots" and e["RLPLANE_JOURNAL_DIR"] == "/var/lib/rlplane/journal"
        assert e["RLPLANE_SNAPSHOT_INTERVAL_S"] == "600" and e["RLPLANE_SNAPSHOT_KEEP"] == "3"
        assert e["RLPLANE_RESTORE_FROM"] == DURABLE["durability"]["restoreFrom"]
    from rlplane_service.settings import ServiceSettings  # what the service makes of that env
    (c,) = groups(out["RayService"])["head"]["template"]["spec"]["containers"]
    got = ServiceSettings(**{k[len("RLPLANE_"):].lower(): v["value"] for k, v in env(c).items()
                             if "value" in v and k in {"RLPLANE_SNAPSHOT_DIR", "RLPLANE_JOURNAL_DIR",
                                                       "RLPLANE_SNAPSHOT_INTERVAL_S", "RLPLANE_JOURNAL_FLUSH_MS"}})
    assert got.snapshot_interval_s == 600 and str(got.journal_dir) == "/var/lib/rlplane/journal"
    claimed = render({**DURABLE, "durability": {**DURABLE["durability"], "volume": {"enabled": True,
                                                                                   "existingClaim": "nfs-rl"}}})
    assert "PersistentVolumeClaim" not in claimed
    head = groups(claimed["RayService"])["head"]["template"]["spec"]
    assert {"name": "durable", "persistentVolumeClaim": {"claimName": "nfs-rl"}} in head["volumes"]


def test_durability_without_its_volume_or_off_native_is_refused():
    with pytest.raises(helm.HelmError, match="need durability.volume.enabled"):
        render({"durability": {"journal": True}})
    with pytest.raises(helm.HelmError, match="need durability.volume.enabled"):
        render({"service": {"snapshotIntervalS": 60}})
    with pytest.raises(helm.HelmError, match="backend native"):
        render({**DURABLE, "service": {"backend": "simple", "snapshotIntervalS": 60}})
    out = render({})
    assert "PersistentVolumeClaim" not in out
    assert not {"RLPLANE_JOURNAL_DIR", "RLPLANE_SNAPSHOT_DIR"} & set(env(containers(out["RayService"])[0]))
