"""The Kubernetes manifests in configs/k8s are valid and agree with what kvgate serves.

Offline: every manifest is validated against the Kubernetes OpenAPI schemas bundled with the
`kubernetes-validate` package (strict: unknown fields fail). The gateway config in the ConfigMap
is parsed by the gateway's own pydantic model, the names the manifests use for each other
(Services, ports, the Secret, the ConfigMap, the KV-event sockets) are cross-checked, and a real
`kvgate serve` started from that config answers the Deployment's probes as documented.
"""

from __future__ import annotations

import ast
import copy
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

import adapters.vllm_plugins
from gateway.config import GatewayConfig, parse_config
from kvgate.procs import Child, free_port, spawn, start_sim, wait_healthy
from kvgate.vllm_engines import PACE_SCHEDULER, PRIORITY_ARGS
from tests.conftest import MODEL
from tests.redis_server import RedisServer, redis_server_available

K8S = Path(__file__).resolve().parent.parent / "configs" / "k8s"
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())

Doc = dict[str, Any]


def manifests() -> list[tuple[str, Doc]]:
    """(file name, document) for every resource manifest (the kustomization aside)."""
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


def find(kind: str, name: str) -> Doc:
    for _, doc in manifests():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name!r} in {K8S}")


def container(workload: Doc, name: str) -> Doc:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"]
                if c["name"] == name)


def port_of(c: Doc, name: str) -> int:
    return int(next(p["containerPort"] for p in c["ports"] if p["name"] == name))


def gateway_config() -> GatewayConfig:
    data = yaml.safe_load(find("ConfigMap", "kvgate-config")["data"]["kvgate.yaml"])
    return parse_config(data, "configs/k8s/gateway-configmap.yaml")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "doc"), manifests(),
                         ids=[f"{n}:{d['kind']}" for n, d in manifests()])
def test_every_manifest_matches_the_kubernetes_schema(name: str, doc: Doc, version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_wrong_type_and_an_unknown_field() -> None:
    deployment = copy.deepcopy(find("Deployment", "kvgate-gateway"))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError, match="'two' is not of type"):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)
    deployment = copy.deepcopy(find("Deployment", "kvgate-gateway"))
    container(deployment, "gateway")["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)


def test_the_kustomization_lists_every_manifest_once() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(listed) == on_disk
    namespace = kustomization["namespace"]
    assert all(doc["metadata"].get("namespace", namespace) == namespace
               for _, doc in manifests() if doc["kind"] != "Namespace")


def test_two_gateway_replicas_share_redis_and_read_the_admin_key_from_the_secret() -> None:
    config = gateway_config()
    deployment = find("Deployment", "kvgate-gateway")
    assert deployment["spec"]["replicas"] == 2
    # Replicas share the KV index and the workflows, through the Redis the manifests run.
    assert config.index.backend == "redis" and config.workflows.store == "redis"
    redis = find("Service", "kvgate-redis")
    for url in (config.index.redis_url, config.workflows.redis_url):
        assert url is not None
        parsed = urlparse(url)
        assert parsed.hostname == redis["metadata"]["name"]
        assert parsed.port == redis["spec"]["ports"][0]["port"]
    redis_pod = container(find("Deployment", "kvgate-redis"), "redis")
    assert redis["spec"]["ports"][0]["targetPort"] in [p["name"] for p in redis_pod["ports"]]
    gw = container(deployment, "gateway")
    key = next(e for e in gw["env"] if e["name"] == "KVGATE_ADMIN_KEY")["valueFrom"]
    secret = find("Secret", key["secretKeyRef"]["name"])
    assert key["secretKeyRef"]["key"] in secret["stringData"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "kvgate-config"
    mount = next(m for m in gw["volumeMounts"] if m["name"] == "config")
    assert gw["args"] == ["serve", "--config", f"{mount['mountPath']}/kvgate.yaml"]
    find("PersistentVolumeClaim", volumes["models"]["persistentVolumeClaim"]["claimName"])
    assert config.tokenizer is not None and config.tokenizer.startswith(
        next(m["mountPath"] for m in gw["volumeMounts"] if m["name"] == "models"))


def test_services_select_the_pods_they_front() -> None:
    for _, svc in manifests():
        if svc["kind"] != "Service":
            continue
        workload = next(d for _, d in manifests() if d["kind"] in ("Deployment", "StatefulSet")
                        and d["spec"]["template"]["metadata"]["labels"].items()
                        >= svc["spec"]["selector"].items())
        ports = {p["name"] for c in workload["spec"]["template"]["spec"]["containers"]
                 for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, svc["metadata"]["name"]


def test_every_engine_in_the_config_is_a_statefulset_pod_with_its_kv_event_sockets() -> None:
    config = gateway_config()
    sts = find("StatefulSet", "vllm")
    headless = find("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    vllm = container(sts, "vllm")
    flag = next(a for a in vllm["args"] if a.startswith("--kv-events-config="))
    events = json.loads(flag.split("=", 1)[1])
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    # "*": vLLM binds its PUB and replay sockets, and every gateway replica connects.
    assert events["endpoint"] == f"tcp://*:{port_of(vllm, 'kv-events')}"
    assert events["replay_endpoint"] == f"tcp://*:{port_of(vllm, 'kv-replay')}"
    pod_name = next(e for e in vllm["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert events["topic"] == "$(POD_NAME)"
    assert "--enable-prefix-caching" in vllm["args"]
    # The gateway tokenises with the tokenizer of the model the engines serve.
    assert f"--model={config.tokenizer}" in vllm["args"]
    pods = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    assert sorted(e.kv_topic or "" for e in config.engines) == pods
    for e in config.engines:
        host = f"{e.kv_topic}.{headless['metadata']['name']}"
        assert e.url == f"http://{host}:{port_of(vllm, 'http')}"
        assert e.kv_events == f"tcp://{host}:{port_of(vllm, 'kv-events')}"
        assert e.kv_replay == f"tcp://{host}:{port_of(vllm, 'kv-replay')}"
    assert config.kv_events_bind is None  # connect mode: each replica subscribes itself
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert vllm[probe]["httpGet"] == {"path": "/health", "port": "http"}


def test_the_engines_run_kvgates_pacing_scheduler_and_vllms_priority_scheduling(
    tmp_path: Path,
) -> None:
    """Engine pacing as `kvgate vllm-pool --engine-pace` sets it up: each engine runs
    `--scheduler-cls` kvgate's scheduler from a directory on its PYTHONPATH, which an init
    container of the gateway's own image fills with the plugin; the gateway config names the
    engines `scheduler: kvgate-pace`. The init container's command, run here, copies exactly
    the plugin's files."""
    sts = find("StatefulSet", "vllm")
    pod = sts["spec"]["template"]["spec"]
    vllm = container(sts, "vllm")
    assert f"--scheduler-cls={PACE_SCHEDULER}" in vllm["args"]
    path = next(e["value"] for e in vllm["env"] if e["name"] == "PYTHONPATH")
    mount = next(m for m in vllm["volumeMounts"] if m["mountPath"] == path)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume
    init = next(c for c in pod["initContainers"]
                if any(m["name"] == mount["name"] and m["mountPath"] == path
                       for m in c.get("volumeMounts", [])))
    assert init["image"] == container(find("Deployment", "kvgate-gateway"), "gateway")["image"]
    assert all(e.scheduler == "kvgate-pace" for e in gateway_config().engines)
    # And vLLM's priority scheduling, so the planner's ranks go to the engines as `priority`.
    assert f"{PRIORITY_ARGS[0]}={PRIORITY_ARGS[1]}" in vllm["args"]
    assert all(e.scheduling_policy == "priority" for e in gateway_config().engines)
    command = [*init["command"], *init.get("args", [])]
    assert command[0] == "python" and command[-1] == path
    subprocess.run([sys.executable, *command[1:-1], str(tmp_path)], check=True, timeout=60)
    source = Path(adapters.vllm_plugins.__file__).parent
    copied = sorted(p.name for p in tmp_path.iterdir())
    assert copied == ["kvgate_pace.py", "kvgate_pace_caps.py"]
    for name in copied:
        assert (tmp_path / name).read_bytes() == (source / name).read_bytes()
    module, cls = PACE_SCHEDULER.rsplit(".", 1)
    tree = ast.parse((tmp_path / f"{module}.py").read_text())
    assert cls in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@pytest.fixture
def gateway_from_configmap(tmp_path: Path) -> Iterator[tuple[Child, Child, int]]:
    """`kvgate serve` with the ConfigMap's config, its engines swapped for one local sim, its
    Redis for a private one and its bind address for 127.0.0.1 on a free port."""
    if not redis_server_available():
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    data = yaml.safe_load(find("ConfigMap", "kvgate-config")["data"]["kvgate.yaml"])
    declared_port = data["port"]
    with RedisServer() as redis_url:
        sim = start_sim("k8s-sim", tmp_path, ["--model", MODEL])
        port = free_port()
        data.update(host="127.0.0.1", port=port, engines=[{"url": sim.url}])
        data.pop("tokenizer")  # the model directory lives in the cluster's volume
        data["index"]["redis_url"] = data["workflows"]["redis_url"] = redis_url
        path = tmp_path / "kvgate.yaml"
        path.write_text(yaml.safe_dump(data))
        gw = spawn("k8s-gateway", ["serve", "--config", str(path)],
                   f"http://127.0.0.1:{port}", tmp_path)
        try:
            wait_healthy(gw)
            yield gw, sim, declared_port
        finally:
            gw.stop()
            sim.stop()


def test_the_gateway_answers_its_probes_as_the_deployment_expects(
    gateway_from_configmap: tuple[Child, Child, int],
) -> None:
    gw, sim, declared_port = gateway_from_configmap
    c = container(find("Deployment", "kvgate-gateway"), "gateway")
    assert port_of(c, "http") == declared_port  # the container port is the config's port
    probes = {p: c[p]["httpGet"] for p in ("readinessProbe", "livenessProbe", "startupProbe")}
    assert all(p["port"] == "http" for p in probes.values())
    assert get(gw.url + probes["readinessProbe"]["path"]) == 200
    assert get(gw.url + probes["livenessProbe"]["path"]) == 200
    assert get(gw.url + probes["startupProbe"]["path"]) == 200
    # With no healthy engine the replica is taken out of the Service, but not restarted.
    sim.stop()
    deadline = time.monotonic() + 20
    while get(gw.url + probes["readinessProbe"]["path"]) != 503:
        assert time.monotonic() < deadline, "readiness stayed 200 without a healthy engine"
        time.sleep(0.2)
    assert get(gw.url + probes["livenessProbe"]["path"]) == 200


def test_the_prometheus_example_discovers_the_gateway_and_engine_pods() -> None:
    config = yaml.safe_load((K8S.parent / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for job, workload in (("kvgate-k8s", find("Deployment", "kvgate-gateway")),
                          ("vllm-k8s", find("StatefulSet", "vllm"))):
        rules = {tuple(r["source_labels"]): r for r in jobs[job]["relabel_configs"]
                 if r.get("action") == "keep"}
        label = rules[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)]["regex"]
        assert workload["spec"]["template"]["metadata"]["labels"][
            "app.kubernetes.io/name"] == label
        port = rules[("__meta_kubernetes_pod_container_port_name",)]["regex"]
        c = workload["spec"]["template"]["spec"]["containers"][0]
        assert port in [p["name"] for p in c["ports"]]
        assert jobs[job]["metrics_path"] == "/metrics"


def test_only_the_gateway_and_the_engines_reach_redis_and_the_engines() -> None:
    def selector(doc: Doc) -> dict[str, str]:
        return dict(doc["spec"]["selector"]["matchLabels"])

    gateway = selector(find("Deployment", "kvgate-gateway"))
    redis = find("NetworkPolicy", "kvgate-redis")
    assert redis["spec"]["podSelector"]["matchLabels"] == selector(
        find("Deployment", "kvgate-redis"))
    assert [p["podSelector"]["matchLabels"] for p in redis["spec"]["ingress"][0]["from"]] == [
        gateway]
    engines = find("NetworkPolicy", "vllm")
    vllm = selector(find("StatefulSet", "vllm"))
    assert engines["spec"]["podSelector"]["matchLabels"] == vllm
    assert [p["podSelector"]["matchLabels"] for p in engines["spec"]["ingress"][0]["from"]] == [
        gateway, vllm]
    # Prometheus reaches the engines' HTTP port (the one its vllm-k8s job keeps), nothing else.
    scrape = engines["spec"]["ingress"][1]
    (source,) = scrape["from"]
    assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert "namespaceSelector" in source
    http = next(p for p in find("StatefulSet", "vllm")["spec"]["template"]["spec"][
        "containers"][0]["ports"] if p["name"] == "http")
    assert scrape["ports"] == [{"protocol": "TCP", "port": http["containerPort"]}]
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml")
                                    if p.name != "kustomization.yaml")
