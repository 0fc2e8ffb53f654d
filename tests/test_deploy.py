"""The Kubernetes manifests: valid against the API schema, and consistent with the code they run."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from harness.processes import REPO
from runner_service.main import parse_args as parse_runner_args
from worker_service.main import parse_args as parse_worker_args

MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
CORE_KINDS = {"Deployment", "Service", "HorizontalPodAutoscaler"}


def documents() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.fixture(scope="module")
def pod() -> dict:
    deployment = next(doc for _, doc in documents() if doc["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]


def container(pod: dict, name: str) -> dict:
    return next(c for c in pod["containers"] if c["name"] == name)


@pytest.mark.parametrize("path, doc", [(p, d) for p, d in documents() if d["kind"] in CORE_KINDS],
                         ids=lambda value: getattr(value, "name", None) or value.get("kind", "?"))
def test_manifest_is_valid_for_kubernetes(path, doc):
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_keda_scaled_object_targets_the_deployment_on_the_queue_metric(pod):
    scaled = next(doc for _, doc in documents() if doc["kind"] == "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "diffusion"
    assert "diffusion_queue_depth" in scaled["spec"]["triggers"][0]["metadata"]["query"]


def test_container_args_are_real_flags_of_the_code(pod):
    worker, _, _ = parse_worker_args(container(pod, "worker")["args"])
    runner = parse_runner_args(container(pod, "runner")["args"])
    assert list(worker.runners) == [runner.listen] == ["unix:/run/diffusion/runner.sock"]
    assert worker.listen.endswith(":50051")


def test_probes_ask_for_the_health_services_the_worker_serves(pod):
    worker = container(pod, "worker")
    port = {p["name"]: p["containerPort"] for p in worker["ports"]}["grpc"]
    assert worker["livenessProbe"]["grpc"] == {"port": port, "service": ""}
    assert worker["startupProbe"]["grpc"] == {"port": port, "service": ""}
    assert worker["readinessProbe"]["grpc"] == {"port": port, "service": "diffusion.v1.WorkerService"}


def test_termination_grace_covers_the_drain_of_both_containers(pod):
    worker, runner = container(pod, "worker"), container(pod, "runner")
    grace = parse_worker_args(worker["args"])[0].grace
    worker_stop = worker["lifecycle"]["preStop"]["sleep"]["seconds"]
    runner_stop = runner["lifecycle"]["preStop"]["sleep"]["seconds"]
    runner_grace = parse_runner_args(runner["args"]).grace
    assert worker_stop + grace <= runner_stop, "the runner must outlive the worker's drain"
    assert runner_stop + runner_grace <= pod["terminationGracePeriodSeconds"]


def test_metrics_port_is_the_one_scraped(pod):
    worker = container(pod, "worker")
    config, _, _ = parse_worker_args(worker["args"])
    annotations = yaml.safe_load((REPO / "deploy/kubernetes/deployment.yaml").read_text())["spec"]["template"][
        "metadata"]["annotations"]
    assert str(config.metrics_port) == annotations["prometheus.io/port"]
