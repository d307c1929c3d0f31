"""The fleet's deployment files agree with the code and with each other: deploy/k8s/fleet/ (engines as a
StatefulSet behind a headless Service, the routing gateway, the ingest worker, SeaweedFS as the shared tier's S3
store) and docker-compose.yml's `fleet` profile name real settings, reach each other by the names and ports they
declare, and probe the engines' health routes. (No cluster or Docker engine runs in CI.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
# Settings the fleet's gateway and engines read that branch `fleet` adds (KVSTITCH_ENGINES, KVSTITCH_ENGINE_URL);
# once it is merged they are fields and this set adds nothing.
FLEET_SETTINGS = {"engines", "engine_url"}
BASE_FILES = ("config.yaml", "models.yaml", "redis.yaml", "qdrant.yaml")  # applied with the fleet (docs/deploy.md)
ENGINE_COMMAND = ["kvstitch", "engine", "--host", "0.0.0.0", "--port", "8100"]
FLEET_SERVICES = {"engine-0", "engine-1", "fleet-gateway", "fleet-worker", "seaweedfs"}


def known_settings() -> set[str]:
    return set(Settings.model_fields) | FLEET_SETTINGS


def kvstitch_names(names: Any) -> set[str]:
    return {n.removeprefix("KVSTITCH_").lower() for n in names if n.startswith("KVSTITCH_")}


# ---- Kubernetes --------------------------------------------------------------------------------------------


def k8s_fleet() -> dict[tuple[str, str], dict[str, Any]]:
    paths = [ROOT / "deploy" / "k8s" / name for name in BASE_FILES]
    paths += sorted((ROOT / "deploy" / "k8s" / "fleet").glob("*.yaml"))
    docs = [d for p in paths for d in yaml.safe_load_all(p.read_text(encoding="utf-8")) if d]
    by_kind_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(by_kind_name) == len(docs), "two objects of one kind share a name"
    return by_kind_name


def pod_of(docs: dict[tuple[str, str], dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    template: dict[str, Any] = docs[(kind, name)]["spec"]["template"]
    return template


def container_of(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    result: dict[str, Any] = container
    return result


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def port_named(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return int(number)


def service_target(docs: dict[tuple[str, str], dict[str, Any]], service: str, port: int) -> tuple[dict[str, Any], int]:
    """The pod template a Service selects (among the workloads) and the container port `port` reaches."""
    spec = docs[("Service", service)]["spec"]
    (service_port,) = [p for p in spec["ports"] if p["port"] == port]
    pods = [
        d["spec"]["template"]
        for (kind, _), d in docs.items()
        if kind in ("Deployment", "StatefulSet")
        and spec["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    (pod,) = pods
    return pod, port_named(container_of(pod), service_port["targetPort"])


def test_engines_are_a_statefulset_with_one_gpu_each_behind_a_headless_service() -> None:
    docs = k8s_fleet()
    engines = docs[("StatefulSet", "kvstitch-engine")]
    pod = engines["spec"]["template"]
    engine = container_of(pod)
    service = docs[("Service", "kvstitch-engine")]["spec"]
    env = env_of(engine)

    assert engines["spec"]["serviceName"] == "kvstitch-engine" and engines["spec"]["replicas"] == 2
    assert engines["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["clusterIP"] == "None"  # headless: one DNS name per engine pod
    assert engine["command"] == ENGINE_COMMAND
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert port_named(engine, engine["readinessProbe"]["httpGet"]["port"]) == 8100
    assert engine["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert port_named(engine, engine["livenessProbe"]["httpGet"]["port"]) == 8100
    assert service_target(docs, "kvstitch-engine", 8100) == (pod, 8100)
    assert env["KVSTITCH_ENGINE_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["KVSTITCH_ENGINE_URL"] == "http://$(KVSTITCH_ENGINE_ID).kvstitch-engine:8100"
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == 8100


def test_the_gateway_routes_to_every_engine_by_its_stable_name() -> None:
    docs = k8s_fleet()
    gateway = container_of(pod_of(docs, "Deployment", "kvstitch-gateway"))
    engines = docs[("StatefulSet", "kvstitch-engine")]
    urls = [urlsplit(u) for u in env_of(gateway)["KVSTITCH_ENGINES"].split(",")]
    replicas = engines["spec"]["replicas"]

    assert gateway["command"] == ["kvstitch", "serve"]
    assert "nvidia.com/gpu" not in gateway["resources"]["limits"]  # the engines answer
    assert [u.hostname for u in urls] == [f"kvstitch-engine-{i}.kvstitch-engine" for i in range(replicas)]
    assert {u.scheme for u in urls} == {"http"} and {u.port for u in urls} == {8100}
    assert service_target(docs, "kvstitch-gateway", 8000)[1] == 8000


def test_the_shared_tier_points_at_seaweedfs_with_the_keys_it_accepts() -> None:
    docs = k8s_fleet()
    fleet_config = docs[("ConfigMap", "kvstitch-fleet")]["data"]
    secret = docs[("Secret", "kvstitch-s3")]["stringData"]
    url = urlsplit(fleet_config["KVSTITCH_S3_URL"])
    seaweed_pod, seaweed_port = service_target(docs, url.hostname or "", url.port or 0)
    seaweed = container_of(seaweed_pod)
    settings = Settings(**{k.removeprefix("KVSTITCH_").lower(): v for k, v in fleet_config.items()})

    assert (url.hostname, url.port) == ("kvstitch-seaweedfs", 8333)
    assert seaweed["args"][0] == "server" and "-s3" in seaweed["args"]
    assert f"-s3.port={seaweed_port}" in seaweed["args"]
    assert seaweed["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert set(secret) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert {"secretRef": {"name": "kvstitch-s3"}} in seaweed["envFrom"]
    assert settings.s3_url == "http://kvstitch-seaweedfs:8333" and settings.s3_bucket == "kvstitch"
    for kind, name in (("StatefulSet", "kvstitch-engine"), ("Deployment", "kvstitch-worker")):
        env_from = container_of(pod_of(docs, kind, name))["envFrom"]
        assert {"configMapRef": {"name": "kvstitch-fleet"}} in env_from, name
        assert {"secretRef": {"name": "kvstitch-s3"}} in env_from, name


def test_every_reference_of_the_fleet_manifests_resolves() -> None:
    docs = k8s_fleet()
    config = docs[("ConfigMap", "kvstitch")]["data"]
    workloads = [d for (kind, _), d in docs.items() if kind in ("Deployment", "StatefulSet")]

    assert kvstitch_names(config) <= known_settings()
    Settings(**{k.removeprefix("KVSTITCH_").lower(): v for k, v in config.items() if k.startswith("KVSTITCH_")})
    for workload in workloads:
        pod = workload["spec"]["template"]
        name = workload["metadata"]["name"]
        for container in pod["spec"]["containers"]:
            for source in container.get("envFrom", []):
                kind, ref = (
                    ("ConfigMap", source["configMapRef"])
                    if "configMapRef" in source
                    else ("Secret", source["secretRef"])
                )
                assert (kind, ref["name"]) in docs, f"{name}: no {kind} {ref['name']}"
            assert kvstitch_names(env_of(container)) <= known_settings(), name
            mounts = {m["name"] for m in container.get("volumeMounts", [])}
            volumes = {v["name"] for v in pod["spec"].get("volumes", [])}
            claims = {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
            assert mounts <= volumes | claims, name
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if "httpGet" in container.get(probe, {}):
                    port_named(container, container[probe]["httpGet"]["port"])  # the named port exists
        for volume in pod["spec"].get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in docs, name
        if "kvstitch" in (container_of(pod).get("command") or [""])[0]:
            mounts = {m["name"]: m["mountPath"] for m in container_of(pod)["volumeMounts"]}
            assert mounts.get("models") == "/models" and config["KVSTITCH_MODEL"].startswith("/models/"), name
            assert mounts.get("data") == config["KVSTITCH_DATA_DIR"], name
            assert mounts.get("kv", config["KVSTITCH_CACHE_DIR"]) == config["KVSTITCH_CACHE_DIR"], name
    for (kind, name), doc in docs.items():
        if kind == "Service":
            service_target(docs, name, doc["spec"]["ports"][0]["port"])  # selects exactly one workload


# ---- docker compose ----------------------------------------------------------------------------------------


def compose_services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))["services"]
    return services


def test_the_fleet_profile_leaves_the_default_services_as_they_are() -> None:
    services = compose_services()
    profiled = {name for name, service in services.items() if service.get("profiles")}

    assert profiled == FLEET_SERVICES
    assert all(services[name]["profiles"] == ["fleet"] for name in profiled)
    assert (
        services["gateway"]["command"] == ["kvstitch", "serve"]
        and "KVSTITCH_ENGINES" not in services["gateway"]["environment"]
    )


def test_the_compose_fleet_has_two_engines_a_gateway_routing_to_them_and_seaweedfs() -> None:
    services = compose_services()
    top_volumes = set(yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))["volumes"])
    gateway = services["fleet-gateway"]
    urls = [urlsplit(u) for u in gateway["environment"]["KVSTITCH_ENGINES"].split(",")]
    engines = [services[u.hostname or ""] for u in urls]
    seaweed = services["seaweedfs"]

    assert gateway["command"] == ["kvstitch", "serve"] and gateway["deploy"] == {}
    assert [u.hostname for u in urls] == ["engine-0", "engine-1"] and {u.port for u in urls} == {8100}
    assert {name for name, dep in gateway["depends_on"].items() if dep["condition"] == "service_healthy"} == {
        "engine-0",
        "engine-1",
    }
    devices = [e["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for e in engines]
    assert devices == [["0"], ["1"]]  # one GPU each
    kv_volumes = set()
    for name, engine in zip(("engine-0", "engine-1"), engines, strict=True):
        env = engine["environment"]
        assert engine["command"] == ENGINE_COMMAND
        assert "http://127.0.0.1:8100/readyz" in " ".join(engine["healthcheck"]["test"])
        assert env["KVSTITCH_ENGINE_ID"] == name and env["KVSTITCH_ENGINE_URL"] == f"http://{name}:8100"
        assert engine["depends_on"]["seaweedfs"]["condition"] == "service_healthy"
        mounts = dict(v.split(":")[:2] for v in engine["volumes"])
        kv_volumes |= {v for v, path in mounts.items() if path == env["KVSTITCH_CACHE_DIR"]}
    assert len(kv_volumes) == 2 and kv_volumes <= top_volumes  # as on two nodes: the shared tier links them
    for name in ("engine-0", "engine-1", "fleet-worker"):
        env = services[name]["environment"]
        url = urlsplit(env["KVSTITCH_S3_URL"])
        assert (url.hostname, url.port) == ("seaweedfs", 8333), name
        assert env["AWS_ACCESS_KEY_ID"] == seaweed["environment"]["AWS_ACCESS_KEY_ID"], name
        assert env["AWS_SECRET_ACCESS_KEY"] == seaweed["environment"]["AWS_SECRET_ACCESS_KEY"], name
    assert "-s3" in seaweed["command"] and "-s3.port=8333" in seaweed["command"]
    assert "http://127.0.0.1:8333/healthz" in seaweed["healthcheck"]["test"]
    assert {v.split(":")[0] for v in seaweed["volumes"]} <= top_volumes
    for name in FLEET_SERVICES - {"seaweedfs"}:
        assert kvstitch_names(services[name]["environment"]) <= known_settings(), name


def test_the_images_carry_the_shared_tiers_client() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")

    assert dockerfile.count('RUN pip install ".[s3]"') == 2  # the CPU and the CUDA builder
    assert 's3 = ["boto3' in pyproject
