"""deploy/: pdserve's gateway as the deployments run it, checked offline.

Security first: a head that listens beyond loopback has API keys (and never
--allow-unauthenticated); the `ray up` key file is created once, private, never printed and
never overwritten; on Kubernetes the keys come from a Secret, and only the gateway's two ports
reach a Service. The shell the manifests run (the key-file command, the KubeRay container
commands) is executed here with stand-in `ray` and `pdserve` commands, so quoting and ordering
are checked as bash sees them, not as a regex reads them.
"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.manifests import (
    KEY_FILE,
    assert_keys_guard_the_bind,
    kuberay_pool_nodes,
    kuberay_ray_start,
    parse_serve,
    pool_problems,
    recorded_pdserve_argv,
    recorded_ray_start_argv,
    run_with_fakes,
    served_model,
)

SECRET_NAME = "pdserve-api-keys"  # what deploy/README.md tells operators to create


# ---- deploy/cluster.yaml (ray up) ------------------------------------------------------------
def _key_file_command(cluster: dict[str, Any]) -> str:
    commands = [c for c in cluster["head_setup_commands"] if "secrets.token_urlsafe" in c]
    assert len(commands) == 1, "the head has exactly one command that makes the API key file"
    return str(commands[0])


def _remote_home(cluster: dict[str, Any]) -> str:
    return f"/home/{cluster['auth']['ssh_user']}"


def test_ray_up_head_listens_everywhere_only_behind_its_key_file(
    cluster: dict[str, Any], head_serve_argv: list[str]
) -> None:
    args = parse_serve(head_serve_argv)
    assert args.host == "0.0.0.0"
    assert args.api_key_file == KEY_FILE
    assert_keys_guard_the_bind(args)
    for flag in ("--host", "--http-port", "--grpc-port", "--api-key-file"):
        assert flag in head_serve_argv, f"the start script spells out {flag}"
    assert (args.http_port, args.grpc_port) == (8000, 50051)
    # The key file the server reads is the one head_setup_commands makes.
    command = _key_file_command(cluster)
    assert KEY_FILE.replace(_remote_home(cluster), "~") in command


def test_ray_up_key_file_is_made_once_private_and_never_printed(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    command = _key_file_command(cluster)
    key_file = tmp_path / "home" / Path(KEY_FILE).name
    first = run_with_fakes(tmp_path, ["bash", "-c", command])
    assert first.returncode == 0, first.stderr
    key = key_file.read_text()
    assert re.fullmatch(r"sk-[A-Za-z0-9_-]{43}\n", key), "one random key, one line"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    secret = key.strip()[3:]
    assert secret not in first.stdout + first.stderr, "the key must not reach the setup log"

    again = run_with_fakes(tmp_path, ["bash", "-c", command])  # every later `ray up`
    assert again.returncode == 0, again.stderr
    assert key_file.read_text() == key, "a later `ray up` must keep the key"


def test_ray_up_key_file_is_never_overwritten(cluster: dict[str, Any], tmp_path: Path) -> None:
    command = _key_file_command(cluster)
    key_file = tmp_path / "home" / Path(KEY_FILE).name
    key_file.parent.mkdir()
    key_file.write_text("# the operator's keys\nsk-operator-key\n")
    assert run_with_fakes(tmp_path, ["bash", "-c", command]).returncode == 0
    assert key_file.read_text() == "# the operator's keys\nsk-operator-key\n"

    # Even if the file appears between the existence check and the write (noclobber).
    test_free = command.replace("test -e ~/pdserve-api-keys", "false", 1)
    assert test_free != command
    run_with_fakes(tmp_path, ["bash", "-c", test_free])
    assert key_file.read_text() == "# the operator's keys\nsk-operator-key\n"


def test_ray_up_keys_live_on_the_head_only(cluster: dict[str, Any]) -> None:
    for key in ("setup_commands", "worker_setup_commands", "file_mounts"):
        assert "pdserve-api-keys" not in json.dumps(cluster[key]), key


def test_ray_up_security_group_stays_closed(cluster: dict[str, Any]) -> None:
    """Ray's own group only (SSH and intra-cluster traffic): the gateway's ports are opened, if
    ever, on the head alone (deploy/README.md), never by rules Ray applies to every node."""
    assert "security_group" not in cluster["provider"]
    for name, node in cluster["available_node_types"].items():
        assert "SecurityGroupIds" not in node["node_config"], name
    start = " ".join(cluster["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start


# ---- deploy/kuberay --------------------------------------------------------------------------
def _head_script_run(
    raycluster: dict[str, Any], head_container: dict[str, Any], tmp_path: Path
) -> list[str]:
    """Run the head container's command as KubeRay would; the argv pdserve gets."""
    params = raycluster["spec"]["headGroupSpec"]["rayStartParams"]
    generated = kuberay_ray_start(params, head=True)
    command = [*head_container["command"], *head_container["args"]]
    assert command[:2] == ["/bin/bash", "-lc"]
    # -c, not -lc: a login shell here would take its PATH from this machine's /etc/profile.
    result = run_with_fakes(
        tmp_path, ["/bin/bash", "-c", *command[2:]], {"KUBERAY_GEN_RAY_START_CMD": generated}
    )
    assert result.returncode == 0, result.stderr
    assert "--head" in generated
    assert recorded_ray_start_argv(tmp_path)[0] == "--head"
    return recorded_pdserve_argv(tmp_path)


def test_every_ray_container_runs_kuberays_ray_start(raycluster: dict[str, Any]) -> None:
    """With ray.io/overwrite-container-cmd, KubeRay runs each Ray container's own command; one
    without a command would run the image's default instead of Ray."""
    assert raycluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    spec = raycluster["spec"]
    templates = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for template in templates:
        container = template["template"]["spec"]["containers"][0]
        script = " ".join(container["args"])
        assert container["command"] == ["/bin/bash", "-lc", "--"], container["name"]
        assert "ulimit -n 65536" in script, container["name"]
        assert "eval" in script and "$KUBERAY_GEN_RAY_START_CMD" in script, container["name"]


def test_head_starts_ray_then_serves_the_gateway_behind_keys(
    raycluster: dict[str, Any], head_container: dict[str, Any], tmp_path: Path
) -> None:
    argv = _head_script_run(raycluster, head_container, tmp_path)
    args = parse_serve(argv)
    assert (args.address, args.device, args.kv_transport) == ("auto", "cuda", "nccl")
    assert (args.prefill_resource, args.decode_resource) == ("prefill", "decode")
    assert args.prompt is None, "the head serves; one-shot runs are the RayJob's"
    assert args.host == "0.0.0.0"
    assert_keys_guard_the_bind(args)
    assert not args.api_key, "keys never appear in a manifest"
    groups = {g["groupName"]: g for g in raycluster["spec"]["workerGroupSpecs"]}
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        nodes = kuberay_pool_nodes(groups[role])
        assert pool_problems(args, nodes, count, served_model(args)) == [], role


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_ray_start_keeps_the_quoting_of_its_resources(
    raycluster: dict[str, Any], role: str, tmp_path: Path
) -> None:
    group = next(g for g in raycluster["spec"]["workerGroupSpecs"] if g["groupName"] == role)
    container = group["template"]["spec"]["containers"][0]
    generated = kuberay_ray_start(group["rayStartParams"], head=False)
    result = run_with_fakes(
        tmp_path,
        ["/bin/bash", "-c", *container["args"]],
        {"KUBERAY_GEN_RAY_START_CMD": generated},
    )
    assert result.returncode == 0, result.stderr
    argv = recorded_ray_start_argv(tmp_path)
    resources = [arg for arg in argv if arg.startswith("--resources=")]
    assert len(resources) == 1, argv
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert json.loads(resources[0].removeprefix("--resources=")) == {role: gpus}
    assert "--block" in argv


def test_head_reads_its_api_keys_from_the_secret(
    raycluster: dict[str, Any], head_container: dict[str, Any], tmp_path: Path
) -> None:
    args = parse_serve(_head_script_run(raycluster, head_container, tmp_path))
    key_file = Path(args.api_key_file)
    mounts = {m["mountPath"]: m for m in head_container["volumeMounts"]}
    mount = mounts[str(key_file.parent)]
    assert mount.get("readOnly") is True
    volumes = {
        v["name"]: v for v in raycluster["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]
    }
    secret = volumes[mount["name"]]["secret"]
    assert secret["secretName"] == SECRET_NAME
    assert not secret.get("optional", False), "no Secret, no head: never a head without keys"
    assert secret["defaultMode"] == 0o400
    # Without `items`, each key of the Secret is a file named after it.
    assert "items" not in secret and key_file.name == "api-keys"


def _container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container["ports"]}


def test_gateway_service_exposes_exactly_the_serving_ports(
    raycluster: dict[str, Any],
    head_container: dict[str, Any],
    gateway_service: dict[str, Any],
    tmp_path: Path,
) -> None:
    args = parse_serve(_head_script_run(raycluster, head_container, tmp_path))
    spec = gateway_service["spec"]
    assert gateway_service["apiVersion"] == "v1"
    assert spec.get("type", "ClusterIP") == "ClusterIP", "exposure is the operator's choice"
    name = raycluster["metadata"]["name"]
    assert spec["selector"] == {"ray.io/cluster": name, "ray.io/node-type": "head"}
    container_ports = _container_ports(head_container)
    targets = {}
    for port in spec["ports"]:
        target = port["targetPort"]
        targets[port["name"]] = container_ports[target] if isinstance(target, str) else target
        assert port["port"] == targets[port["name"]], "clients use the ports pdserve prints"
    assert targets == {"http": args.http_port, "grpc": args.grpc_port}
    assert not set(targets.values()) & {6379, 8265, 10001}, "no Ray port in this Service"


def test_head_probes_check_the_gateway_health(
    raycluster: dict[str, Any], head_container: dict[str, Any], tmp_path: Path
) -> None:
    args = parse_serve(_head_script_run(raycluster, head_container, tmp_path))
    container_ports = _container_ports(head_container)
    probes = {k: head_container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    for kind, probe in probes.items():
        get = probe["httpGet"]
        assert get["path"] == "/health", kind  # the one route that needs no API key
        port = container_ports[get["port"]] if isinstance(get["port"], str) else get["port"]
        assert port == args.http_port, kind

    def budget_s(probe: dict[str, Any]) -> int:
        return int(probe.get("periodSeconds", 10)) * int(probe.get("failureThreshold", 3))

    # pdserve opens its port only once every worker is placed and loaded: minutes.
    assert budget_s(probes["startupProbe"]) >= 20 * 60
    # /health says 503 whenever no prefill or no decode worker is alive; a restart (of Ray's
    # head as well) is the answer only once that has lasted.
    assert budget_s(probes["livenessProbe"]) >= 5 * 60
    assert budget_s(probes["readinessProbe"]) < budget_s(probes["livenessProbe"])


def test_served_model_name_is_the_downloaded_model(
    cluster: dict[str, Any],
    head_serve_argv: list[str],
    raycluster: dict[str, Any],
    head_container: dict[str, Any],
    tmp_path: Path,
) -> None:
    ray_up = parse_serve(head_serve_argv)
    for key in ("head_setup_commands", "worker_setup_commands"):
        assert any(f"snapshot_download('{ray_up.served_model_name}'" in c for c in cluster[key])
    kuberay = parse_serve(_head_script_run(raycluster, head_container, tmp_path))
    pods = [raycluster["spec"]["headGroupSpec"], *raycluster["spec"]["workerGroupSpecs"]]
    for pod in pods:
        for init in pod["template"]["spec"]["initContainers"]:
            env = {e["name"]: e.get("value") for e in init["env"]}
            assert env["MODEL_ID"] == kuberay.served_model_name, init["name"]


def test_no_manifest_carries_a_key(kuberay_documents: dict[str, dict[str, Any]]) -> None:
    assert "Secret" not in kuberay_documents, "keys are made by the operator, never committed"
    text = json.dumps(list(kuberay_documents.values()))
    assert "--api-key " not in text and not re.search(r"sk-[A-Za-z0-9_-]{20,}", text)
