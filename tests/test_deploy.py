"""The Kubernetes manifests: valid against the API schema, and consistent with the code they run."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from harness.processes import REPO
from runner_service.main import parse_args as parse_runner_args
from runner_service.platforms import group_devices
from worker_service.main import parse_args as parse_worker_args

pytestmark = pytest.mark.unit
MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
CORE_KINDS = {"Deployment", "Service", "HorizontalPodAutoscaler"}


def documents() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def deployment(name: str) -> dict:
    [doc] = [doc for path, doc in documents() if path.name == name and doc["kind"] == "Deployment"]
    return doc


@pytest.fixture(scope="module")
def pod() -> dict:
    return deployment("deployment.yaml")["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def group_pod() -> dict:
    """The pod of deployment-group.yaml: one runner group over 4 GPUs (issue 27)."""
    return deployment("deployment-group.yaml")["spec"]["template"]["spec"]


def container(pod: dict, name: str) -> dict:
    return next(c for c in [*pod["containers"], *pod.get("initContainers", [])] if c["name"] == name)


def flag(args: list[str], name: str) -> str:
    [value] = [arg.split("=", 1)[1] for arg in args if arg.startswith(f"{name}=")]
    return value


def volume_at(pod: dict, container_spec: dict, path: str) -> dict:
    """The pod volume that holds ``path`` in the container (the deepest mount above it)."""
    mounts = [m for m in container_spec.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{path} is on no volume of {container_spec['name']}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    return next(v for v in pod["volumes"] if v["name"] == mount["name"])


@pytest.fixture(scope="module")
def worker_args(pod, tmp_path_factory) -> list[str]:
    """The worker's args with the runner token file (made by the init container in the pod) here."""
    token = tmp_path_factory.mktemp("token") / "runner.token"
    token.write_text("test-token\n")
    args = container(pod, "worker")["args"]
    return [f"--runner-token-file={token}" if a.startswith("--runner-token-file=") else a for a in args]


@pytest.mark.parametrize("path, doc", [(p, d) for p, d in documents() if d["kind"] in CORE_KINDS],
                         ids=lambda value: getattr(value, "name", None) or value.get("kind", "?"))
def test_manifest_is_valid_for_kubernetes(path, doc):
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_keda_scaled_object_targets_the_deployment_on_the_queue_metric(pod):
    scaled = next(doc for _, doc in documents() if doc["kind"] == "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "diffusion"
    assert "diffusion_queue_depth" in scaled["spec"]["triggers"][0]["metadata"]["query"]


def test_container_args_are_real_flags_of_the_code(pod, worker_args):
    worker, _, _ = parse_worker_args(worker_args)
    runner = parse_runner_args(container(pod, "runner")["args"])
    assert list(worker.runners) == [runner.listen] == ["unix:/run/diffusion/runner.sock"]
    assert worker.listen.endswith(":50051")


def test_probes_ask_for_the_health_services_the_worker_serves(pod):
    worker = container(pod, "worker")
    port = {p["name"]: p["containerPort"] for p in worker["ports"]}["grpc"]
    assert worker["livenessProbe"]["grpc"] == {"port": port, "service": ""}
    assert worker["startupProbe"]["grpc"] == {"port": port, "service": ""}
    assert worker["readinessProbe"]["grpc"] == {"port": port, "service": "diffusion.v1.WorkerService"}


def test_termination_grace_covers_the_drain_of_both_containers(pod, worker_args):
    worker, runner = container(pod, "worker"), container(pod, "runner")
    grace = parse_worker_args(worker_args)[0].grace
    worker_stop = worker["lifecycle"]["preStop"]["sleep"]["seconds"]
    runner_stop = runner["lifecycle"]["preStop"]["sleep"]["seconds"]
    runner_grace = parse_runner_args(runner["args"]).grace
    assert worker_stop + grace <= runner_stop, "the runner must outlive the worker's drain"
    assert runner_stop + runner_grace <= pod["terminationGracePeriodSeconds"]


def test_metrics_port_is_the_one_scraped(pod, worker_args):
    config, _, _ = parse_worker_args(worker_args)
    annotations = yaml.safe_load((REPO / "deploy/kubernetes/deployment.yaml").read_text())["spec"]["template"][
        "metadata"]["annotations"]
    assert str(config.metrics_port) == annotations["prometheus.io/port"]


def test_worker_and_runner_share_a_runner_token_on_a_memory_volume(pod, worker_args):
    worker, runner, init = container(pod, "worker"), container(pod, "runner"), container(pod, "runner-token")
    token_file = flag(worker["args"], "--runner-token-file")
    assert flag(runner["args"], "--auth-token-file") == token_file
    assert parse_runner_args(runner["args"]).auth_token_file == token_file
    assert parse_worker_args(worker_args)[0].runner_token_file == flag(worker_args, "--runner-token-file")
    volume = volume_at(pod, worker, token_file)
    assert volume_at(pod, runner, token_file) == volume == volume_at(pod, init, token_file)
    assert volume["emptyDir"]["medium"] == "Memory"
    # The init container writes it: from the optional Secret when mounted, else a random one.
    secret = next(v for v in pod["volumes"] if "secret" in v)["secret"]
    assert secret["optional"] is True
    assert token_file in init["command"][-1]


def run_token_init(pod: dict, root: Path) -> Path:
    """The init container's command, run here (in this process) with its paths moved under ``root``."""
    init = container(pod, "runner-token")
    script = init["command"][-1]
    for mount in init["volumeMounts"]:
        (root / mount["mountPath"].lstrip("/")).mkdir(parents=True, exist_ok=True)
        script = script.replace(f'"{mount["mountPath"]}/', f'"{root}{mount["mountPath"]}/')
    assert init["command"][:2] == ["python", "-c"]
    exec(compile(script, "runner-token init container", "exec"), {"__name__": "__main__"})  # python -c, in-process
    return root / flag(container(pod, "worker")["args"], "--runner-token-file").lstrip("/")


def test_the_init_container_generates_a_private_token_or_copies_the_secret(pod, tmp_path):
    generated = run_token_init(pod, tmp_path / "a")
    again = run_token_init(pod, tmp_path / "b")
    assert stat.S_IMODE(os.stat(generated).st_mode) == 0o600
    assert len(generated.read_text().strip()) >= 32 and generated.read_text() != again.read_text()

    secret_mount = next(m["mountPath"] for m in container(pod, "runner-token")["volumeMounts"]
                        if m["name"] == next(v["name"] for v in pod["volumes"] if "secret" in v))
    secret_dir = tmp_path / "c" / secret_mount.lstrip("/")
    secret_dir.mkdir(parents=True)
    (secret_dir / "token").write_text("from-the-secret\n")
    assert run_token_init(pod, tmp_path / "c").read_text().strip() == "from-the-secret"


def test_worker_state_file_is_on_an_empty_dir(pod):
    worker = container(pod, "worker")
    env = {e["name"]: e["value"] for e in worker["env"]}
    path = env["DIFFUSION_WORKER_STATE_FILE"]
    assert path == "/var/run/diffusion/state/worker-state.json"
    assert "emptyDir" in volume_at(pod, worker, path)


def test_the_runners_compile_cache_outlives_a_runner_restart(pod):
    """torch's inductor (and the Triton kernels it writes under it) caches compiled kernels under
    TORCHINDUCTOR_CACHE_DIR; on an emptyDir it survives the runner container's restarts."""
    runner = container(pod, "runner")
    path = {e["name"]: e["value"] for e in runner["env"]}["TORCHINDUCTOR_CACHE_DIR"]
    assert "emptyDir" in volume_at(pod, runner, f"{path}/fxgraph")


def test_worker_state_file_env_is_a_worker_flag(pod, worker_args, monkeypatch):
    path = {e["name"]: e["value"] for e in container(pod, "worker")["env"]}["DIFFUSION_WORKER_STATE_FILE"]
    monkeypatch.setenv("DIFFUSION_WORKER_STATE_FILE", path)
    config, _, _ = parse_worker_args(worker_args)
    assert str(config.state_file) == path


def test_the_openai_http_port_is_exposed_by_the_container_and_the_service(pod, worker_args):
    config, _, _ = parse_worker_args(worker_args)
    ports = {p["name"]: p["containerPort"] for p in container(pod, "worker")["ports"]}
    assert config.http_port == ports["http"] == 8000
    service = next(doc for _, doc in documents() if doc["kind"] == "Service" and doc["metadata"]["name"] == "diffusion")
    assert {"name": "http", "port": 8000, "targetPort": "http", "appProtocol": "http"} in service["spec"]["ports"]


def test_the_group_deployment_replaces_the_single_device_one_for_the_same_service_and_scalers():
    single, group = deployment("deployment.yaml"), deployment("deployment-group.yaml")
    assert group["metadata"] == single["metadata"]
    assert group["spec"]["selector"] == single["spec"]["selector"]
    assert group["spec"]["template"]["metadata"] == single["spec"]["template"]["metadata"]


def test_the_group_pod_differs_from_the_single_device_pod_only_in_its_runner_and_plan(pod, group_pod):
    worker, group_worker = container(pod, "worker"), container(group_pod, "worker")
    plan = ("--cfg-parallel", "--ulysses-degree=")
    assert {**group_worker, "args": [a for a in group_worker["args"] if not a.startswith(plan)]} == worker
    assert group_pod["initContainers"] == pod["initContainers"]
    assert group_pod["terminationGracePeriodSeconds"] == pod["terminationGracePeriodSeconds"]
    runner, group_runner = container(pod, "runner"), container(group_pod, "runner")
    for key in ("image", "env", "livenessProbe", "lifecycle"):
        assert group_runner[key] == runner[key], key
    assert [v for v in group_pod["volumes"] if v["name"] != "dshm"] == pod["volumes"]
    assert [a for a in group_runner["args"] if not a.startswith(("--device=", "--devices="))] == [
        a for a in runner["args"] if not a.startswith("--device=")]


def test_the_group_runner_has_a_rank_per_gpu_of_its_limit_and_shared_memory(group_pod):
    runner = container(group_pod, "runner")
    args = parse_runner_args(runner["args"])
    devices = group_devices(args.devices, args.device)  # what the runner makes of its flags
    assert devices == [f"cuda:{rank}" for rank in range(runner["resources"]["limits"]["nvidia.com/gpu"])]
    assert len(devices) == 4
    # the worker's plan uses every rank (a group refuses one that does not)
    args_here = [a for a in container(group_pod, "worker")["args"] if not a.startswith("--runner-token-file=")]
    plan = parse_worker_args(args_here)[0].parallel
    assert (2 if plan.cfg_parallel else 1) * max(plan.ulysses_degree, 1) * max(plan.ring_degree, 1) == 4
    # NCCL's transport between the ranks' processes: /dev/shm must be memory, not the runtime's 64 MiB
    shm = volume_at(group_pod, runner, "/dev/shm/nccl-segment")
    assert shm["emptyDir"]["medium"] == "Memory"
