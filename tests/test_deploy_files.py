"""The deployment files agree with the code and with each other: docker-compose.yml, the Dockerfile,
deploy/prometheus/prometheus.yml and deploy/k8s/ name real settings, run the README's commands, scrape the ports
the processes listen on, and give every service a health check. (No Docker engine runs in CI.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"gateway", "worker", "qdrant", "redis", "prometheus", "grafana"}
COMMANDS = {"gateway": ["kvstitch", "serve"], "worker": ["kvstitch", "worker"]}


def load(path: str) -> Any:
    return yaml.safe_load((ROOT / path).read_text(encoding="utf-8"))


def compose() -> dict[str, Any]:
    services: dict[str, Any] = load("docker-compose.yml")["services"]
    return services


def readme_commands() -> set[str]:
    """Every line of the README's bash blocks, without the `.venv/bin/` prefix and trailing comments."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = [line for block in re.findall(r"```bash\n(.*?)```", readme, re.S) for line in block.splitlines()]
    return {line.split("#")[0].strip().removeprefix(".venv/bin/") for line in lines}


def kvstitch_env(env: dict[str, Any]) -> set[str]:
    return {k.removeprefix("KVSTITCH_").lower() for k in env if k.startswith("KVSTITCH_")}


def k8s_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    return docs


def test_compose_has_every_service_with_a_health_check() -> None:
    services = compose()

    assert set(services) >= SERVICES
    for name in SERVICES:
        assert services[name]["healthcheck"]["test"], name
    checks = {name: " ".join(services[name]["healthcheck"]["test"]) for name in SERVICES}
    assert "http://127.0.0.1:8000/readyz" in checks["gateway"]
    assert "redis-cli ping" in checks["redis"]
    assert "/dev/tcp/127.0.0.1/6333" in checks["qdrant"] and "GET /readyz" in checks["qdrant"]


def test_compose_runs_the_readme_commands_with_real_settings() -> None:
    services = compose()
    commands = readme_commands()

    for name, command in COMMANDS.items():
        service = services[name]
        assert service["command"] == command
        assert " ".join(command) in commands, f"the README does not run `{' '.join(command)}`"
        env = service["environment"]
        assert kvstitch_env(env) <= set(Settings.model_fields), f"{name}: unknown KVSTITCH_* variable"
        assert env["KVSTITCH_REDIS_URL"].startswith("redis://redis:6379")
        assert env["KVSTITCH_QDRANT_URL"] == "http://qdrant:6333"
        mounts = dict(v.split(":")[:2] for v in service["volumes"])
        assert mounts["kv-cache"] == env["KVSTITCH_CACHE_DIR"]  # gateway and worker share the KV files
        assert env["KVSTITCH_MODEL"].split(":-")[-1].rstrip("}").startswith(mounts["models"])
        assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert set(load("docker-compose.yml")["volumes"]) >= {"kv-cache", "models"}


def test_prometheus_scrapes_the_ports_the_processes_listen_on() -> None:
    services = compose()
    jobs = {job["job_name"]: job for job in load("deploy/prometheus/prometheus.yml")["scrape_configs"]}
    targets = {name: [t for c in job["static_configs"] for t in c["targets"]] for name, job in jobs.items()}

    assert targets["kvstitch-gateway"] == [f"gateway:{services['gateway']['environment']['KVSTITCH_PORT']}"]
    port = services["worker"]["environment"]["KVSTITCH_WORKER_METRICS_PORT"]
    assert targets["kvstitch-worker"] == [f"worker:{port}"]
    mounted = {v.split(":")[0]: v.split(":")[1] for v in services["prometheus"]["volumes"]}
    assert mounted["./deploy/prometheus/prometheus.yml"] == "/etc/prometheus/prometheus.yml"


def test_grafana_mounts_the_provisioning_and_dashboards_that_exist() -> None:
    volumes = [v.split(":") for v in compose()["grafana"]["volumes"]]
    provider = load("deploy/grafana/provisioning/dashboards/kvstitch.yml")["providers"][0]

    for source, *_ in volumes:
        if source.startswith("./"):
            assert (ROOT / source).is_dir(), source
    mounted = {target: source for source, target, *_ in volumes}
    assert mounted[provider["options"]["path"]] == "./deploy/grafana/dashboards"
    assert mounted["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"


def test_the_dockerfile_has_cpu_and_cuda_runtimes_running_the_gateway() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    stage_of = {name: image for image, name in re.findall(r"^FROM (\S+) AS (\S+)$", dockerfile, re.M)}

    assert set(stage_of) == {"builder-cpu", "cpu", "builder-cuda", "cuda"}
    assert stage_of["cuda"].startswith("nvidia/cuda:") and "runtime" in stage_of["cuda"]
    assert dockerfile.count("COPY --from=builder-") == 2
    assert dockerfile.count('CMD ["kvstitch", "serve"]') == 2
    assert set(compose()["gateway"]["build"]["target"].strip("${}").split(":-")) <= {"KVSTITCH_TARGET", "cuda"}


def test_k8s_manifests_name_real_settings_services_and_scrape_ports() -> None:
    docs = k8s_documents()
    by_kind_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    config = by_kind_name[("ConfigMap", "kvstitch")]["data"]
    services = {name for kind, name in by_kind_name if kind == "Service"}

    assert kvstitch_env(config) <= set(Settings.model_fields)
    assert config["KVSTITCH_REDIS_URL"].split("//")[1].split(":")[0] in services
    assert config["KVSTITCH_QDRANT_URL"].split("//")[1].split(":")[0] in services
    assert ("StatefulSet", "kvstitch-redis") in by_kind_name and ("StatefulSet", "kvstitch-qdrant") in by_kind_name
    for name, role in (("kvstitch-gateway", "gateway"), ("kvstitch-worker", "worker")):
        pod = by_kind_name[("Deployment", name)]["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        assert container["command"] == COMMANDS[role]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        annotations = pod["metadata"]["annotations"]
        ports = {p["containerPort"] for p in container["ports"]}
        assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) in ports
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["kv"] == config["KVSTITCH_CACHE_DIR"]
        kv_volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "kv")
        assert kv_volume["hostPath"]["path"].startswith("/mnt/nvme/")  # the node's local NVMe
    gateway_port = by_kind_name[("Deployment", "kvstitch-gateway")]["spec"]["template"]["metadata"]["annotations"]
    worker_port = by_kind_name[("Deployment", "kvstitch-worker")]["spec"]["template"]["metadata"]["annotations"]
    assert gateway_port["prometheus.io/port"] == config["KVSTITCH_PORT"]
    assert worker_port["prometheus.io/port"] == config["KVSTITCH_WORKER_METRICS_PORT"]
