"""deploy/: the `ray up` cluster config and the KubeRay manifests, checked offline.

cluster.yaml goes through the same two calls `ray up` makes before it talks to the cloud
(ray.autoscaler._private.commands._bootstrap_config): ``prepare_config`` (merge the provider's
defaults, merge setup commands, fill per-type worker bounds) and ``validate_config`` (Ray's
JSON schema plus its cross-field rules). The provider-specific steps in between need cloud
credentials; node types here spell out their resources, so none is needed from them.
The serve command lines are parsed with pdserve's own CLI parser, so a renamed or missing flag
fails here rather than on a freshly started cluster. Each pool's tensor-parallel workers are
checked against its nodes: the model's heads split (pdserve's own check), a worker's ranks fit
one node and fill it, the nodes' resources hold the ranks, and a rank's GPU holds its share of
the weights and one longest sequence's KV.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from typing import Any

import jsonschema
import pytest
from ray.autoscaler._private.providers import _NODE_PROVIDERS
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.deploy.manifests import (
    DEPLOY,
    NODE_GPUS,
    NODE_TYPES,
    OTHER_ROLE,
    REMOTE_SOURCE,
    ROOT,
    assert_keys_guard_the_bind,
    cluster_pool_nodes,
    kuberay_pool_nodes,
    packages,
    parse_serve,
    pinned_ray,
    pool_problems,
    serve_argv,
    served_model,
    tensor_parallel_sizes,
)


def _ray_up_validate(config: dict[str, Any]) -> dict[str, Any]:
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


# ---- deploy/cluster.yaml (ray up) ------------------------------------------------------------
def test_cluster_yaml_passes_ray_up_validation(cluster: dict[str, Any]) -> None:
    prepared = _ray_up_validate(cluster)
    assert cluster["provider"]["type"] in _NODE_PROVIDERS
    assert prepared["head_node_type"] == "head"
    assert set(prepared["available_node_types"]) == {"head", *NODE_TYPES.values()}


def test_ray_validation_rejects_what_ray_up_rejects(cluster: dict[str, Any]) -> None:
    """The check has teeth: per-type start commands and unsatisfiable bounds both fail."""
    per_type_start = copy.deepcopy(cluster)
    per_type_start["available_node_types"]["prefill_gpu"]["worker_start_ray_commands"] = []
    with pytest.raises(jsonschema.ValidationError):
        _ray_up_validate(per_type_start)

    too_many = copy.deepcopy(cluster)
    too_many["available_node_types"]["decode_gpu"]["min_workers"] = cluster["max_workers"] + 1
    with pytest.raises(ValueError, match="max_workers"):
        _ray_up_validate(too_many)


def test_worker_node_types_advertise_their_role_and_gpus(cluster: dict[str, Any]) -> None:
    node_types = cluster["available_node_types"]
    for role, type_name in NODE_TYPES.items():
        node = node_types[type_name]
        resources = node["resources"]
        assert resources["GPU"] >= 1, type_name
        assert resources[role] == resources["GPU"], f"{type_name}: one {role} unit per GPU"
        assert OTHER_ROLE[role] not in resources, f"{type_name} must not take the other pool"
        assert 0 <= node["min_workers"] <= node["max_workers"], type_name
        assert node["node_config"]["InstanceType"]
    head = node_types[cluster["head_node_type"]]
    assert head["resources"] == {"CPU": 0, "GPU": 0}, "no worker actor may land on the head"
    assert head["max_workers"] == 0


def test_head_starts_ray_with_the_autoscaler_then_pdserve(cluster: dict[str, Any]) -> None:
    commands = cluster["head_start_ray_commands"]
    ray_start = next(i for i, c in enumerate(commands) if "ray start" in c)
    serve = next(i for i, c in enumerate(commands) if "pdserve-serve.sh" in c)
    assert "--head" in commands[ray_start]
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in commands[ray_start]
    assert "--num-gpus=0" in commands[ray_start]
    assert ray_start < serve
    assert "tmux new-session -d -s pdserve" in commands[serve]


def test_head_serve_command_joins_the_cluster(head_serve_argv: list[str]) -> None:
    command = shlex.join(head_serve_argv)
    assert command.startswith("pdserve serve ")
    assert "--address auto" in command
    assert "--prefill-resource prefill" in command
    assert "--decode-resource decode" in command


def test_head_serve_command_parses_and_fits_the_pools(
    cluster: dict[str, Any], head_serve_argv: list[str]
) -> None:
    args = parse_serve(head_serve_argv)
    assert (args.address, args.device, args.kv_transport) == ("auto", "cuda", "nccl")
    assert (args.prefill_resource, args.decode_resource) == ("prefill", "decode")
    gpus_per_rank = args.worker_num_gpus if args.worker_num_gpus is not None else 1.0
    tp = tensor_parallel_sizes(args)
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        node = cluster["available_node_types"][NODE_TYPES[role]]
        num_ranks = count * tp[role]  # each rank reserves one unit and its GPUs
        assert num_ranks <= node["max_workers"] * node["resources"][role], role
        assert num_ranks * gpus_per_rank <= node["max_workers"] * node["resources"]["GPU"], role
    # The model directory the head and the workers download to is the one pdserve reads.
    for key in ("head_setup_commands", "worker_setup_commands"):
        assert any(f"local_dir='{args.model}'" in c for c in cluster[key]), key


def test_ray_up_pools_are_tensor_parallel_and_fit_their_nodes(
    cluster: dict[str, Any], head_serve_argv: list[str]
) -> None:
    args = parse_serve(head_serve_argv)
    tp = tensor_parallel_sizes(args)
    assert tp["prefill"] > 1 and tp["decode"] > 1, "the deployment shows tensor-parallel pools"
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        nodes = cluster_pool_nodes(cluster, role)
        assert nodes.node_type in NODE_GPUS, f"add {nodes.node_type} to NODE_GPUS"
        assert nodes.num_gpus == NODE_GPUS[nodes.node_type][0], f"{role}: all the node's GPUs"
        assert pool_problems(args, nodes, count, served_model(args)) == [], role


def test_pool_checks_refuse_what_cannot_run(
    cluster: dict[str, Any], head_serve_argv: list[str]
) -> None:
    """The checks have teeth: sizes the heads, the nodes or the GPUs cannot hold all fail."""

    def problems(role: str, *flags: str) -> str:
        args = parse_serve([*head_serve_argv, *flags])  # later flags win
        count = args.prefill if role == "prefill" else args.decode
        nodes = cluster_pool_nodes(cluster, role)
        return " ".join(pool_problems(args, nodes, count, served_model(args)))

    three = problems("prefill", "--prefill-tp", "3")
    assert "must divide num_attention_heads 64" in three and "idle" in three
    assert "cannot fit one node" in problems("prefill", "--prefill-tp", "16")
    assert "workers per node" in problems("decode", "--decode", "5")  # 2 nodes x 2 workers
    assert "of its GPU" in problems("decode", "--decode-tp", "1", "--decode", "4")  # 145 GB
    assert "of its GPU" in problems(  # 72.7 GB + 5.4 GB of KV > 0.9 x 85.5 GB
        "prefill", "--max-model-len", "32768", "--gpu-memory-utilization", "0.9"
    )
    assert problems("decode", "--decode-tp", "8", "--decode", "2") == ""


def test_workers_join_the_head_with_their_node_type_resources(cluster: dict[str, Any]) -> None:
    start = " ".join(cluster["worker_start_ray_commands"])
    assert "ray start --address=$RAY_HEAD_IP:6379" in start
    assert "--head" not in start
    # One list serves every worker type: their resources come from available_node_types.
    assert "--resources" not in start
    assert "RAY_worker_niceness=0 ray start" in start, "engines must not run niced"


def test_setup_installs_pdserve_in_a_venv(cluster: dict[str, Any]) -> None:
    setup = "\n".join(cluster["setup_commands"])
    assert "python3 -m venv" in setup
    assert f"cd {REMOTE_SOURCE.replace('/home/ubuntu', '~')}" in setup
    assert re.search(r"pip install .*-e '\.\[gpu\]'", setup)
    assert f"'ray[default]=={pinned_ray()}'" in setup
    assert any("boto3" in c for c in cluster["head_setup_commands"]), "AWS autoscaler SDK"


def test_file_mounts_carry_the_whole_package(cluster: dict[str, Any]) -> None:
    mounts = cluster["file_mounts"]
    for remote, local in mounts.items():
        assert (ROOT / local).exists(), f"{local} (paths are relative to the repository root)"
        assert remote == f"{REMOTE_SOURCE}/{local}"
    mounted = set(mounts.values())
    for needed in ("pyproject.toml", "constraints.txt", "README.md", *packages()):
        assert needed in mounted, f"cluster.yaml does not copy {needed}"
    assert ".gitignore" in cluster["rsync_filter"]
    assert cluster["auth"]["ssh_user"] == "ubuntu"


# ---- deploy/kuberay ----------------------------------------------------------------------------
def _pod_specs(raycluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = raycluster["spec"]
    pods = {"head": spec["headGroupSpec"]["template"]["spec"]}
    pods.update({g["groupName"]: g["template"]["spec"] for g in spec["workerGroupSpecs"]})
    return pods


def test_raycluster_carries_the_kuberay_required_fields(raycluster: dict[str, Any]) -> None:
    assert raycluster["apiVersion"] == "ray.io/v1"
    assert raycluster["kind"] == "RayCluster"
    assert raycluster["metadata"]["name"]
    spec = raycluster["spec"]
    assert spec["rayVersion"] == pinned_ray()
    head = spec["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP", "Ray's ports stay inside the cluster network"
    assert head["rayStartParams"]["num-cpus"] == "0"
    groups = spec["workerGroupSpecs"]
    for group in groups:
        for key in ("groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams"):
            assert key in group, f"{group.get('groupName')}: {key}"
        bounds = (group["minReplicas"], group["replicas"], group["maxReplicas"])
        assert all(isinstance(n, int) for n in bounds)
        assert 0 <= bounds[0] <= bounds[1] <= bounds[2], group["groupName"]
    for params in [head["rayStartParams"], *(g["rayStartParams"] for g in groups)]:
        assert all(isinstance(v, str) for v in params.values()), "rayStartParams are strings"
    for name, pod in _pod_specs(raycluster).items():
        assert pod["containers"], name
        assert all(c["name"] and c["image"] for c in pod["containers"]), name


def test_worker_groups_advertise_their_role_and_gpus(raycluster: dict[str, Any]) -> None:
    groups = {g["groupName"]: g for g in raycluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == set(NODE_TYPES)
    for role, group in groups.items():
        raw = group["rayStartParams"]["resources"]
        # KubeRay's format: a JSON object inside a quoted string, '"{\"prefill\": 1}"'.
        assert raw.startswith('"') and raw.endswith('"'), raw
        resources = json.loads(json.loads(raw))
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus = int(limits["nvidia.com/gpu"])
        assert gpus >= 1, role
        assert resources == {role: gpus}, f"{role}: one unit per GPU, nothing else"
        env = {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env.get("RAY_worker_niceness") == "0", f"{role}: engines must not run niced"
    head_pod = raycluster["spec"]["headGroupSpec"]["template"]["spec"]
    for container in head_pod["containers"]:
        assert "nvidia.com/gpu" not in container.get("resources", {}).get("limits", {})


def test_kuberay_pods_share_one_image_and_the_model_path(
    raycluster: dict[str, Any], head_container: dict[str, Any], rayjob: dict[str, Any]
) -> None:
    pods = _pod_specs(raycluster)
    images = {
        c["image"]
        for pod in pods.values()
        for c in [*pod.get("initContainers", []), *pod["containers"]]
    }
    assert len(images) == 1, images
    for name, pod in pods.items():
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts.get("/models") == "models", name
        assert mounts.get("/dev/shm") == "dshm", name
    for command in (head_container["args"][0], rayjob["spec"]["entrypoint"]):
        assert parse_serve(serve_argv(command)).model.startswith("/models/")


def test_rayjob_runs_pdserve_on_the_existing_cluster(
    raycluster: dict[str, Any], head_container: dict[str, Any], rayjob: dict[str, Any]
) -> None:
    assert rayjob["apiVersion"] == "ray.io/v1"
    assert rayjob["kind"] == "RayJob"
    spec = rayjob["spec"]
    assert spec["clusterSelector"] == {"ray.io/cluster": raycluster["metadata"]["name"]}
    assert "rayClusterSpec" not in spec
    assert not spec.get("shutdownAfterJobFinishes", False), "never delete the shared cluster"
    argv = serve_argv(spec["entrypoint"])
    assert "--address auto" in shlex.join(argv)
    args = parse_serve(argv)
    assert (args.address, args.device, args.kv_transport) == ("auto", "cuda", "nccl")
    assert (args.prefill_resource, args.decode_resource) == ("prefill", "decode")
    assert args.prompt, "a job must end: without --prompt, pdserve serve runs until stopped"
    assert_keys_guard_the_bind(args)  # one-shot mode opens no server, but checks the flags
    # The job's workers come on top of the serving gateway's, in the same worker groups.
    serving = parse_serve(serve_argv(head_container["args"][0]))
    groups = {g["groupName"]: g for g in raycluster["spec"]["workerGroupSpecs"]}
    # The job serves the gateway's model (the same /models/model), in workers of the same shape.
    assert tensor_parallel_sizes(args) == tensor_parallel_sizes(serving), "same worker shapes"
    model = served_model(serving)
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        nodes = kuberay_pool_nodes(groups[role])
        assert pool_problems(args, nodes, count + getattr(serving, role), model) == [], role


def test_kuberay_pools_are_tensor_parallel_one_pod_per_node(
    raycluster: dict[str, Any], head_container: dict[str, Any]
) -> None:
    args = parse_serve(serve_argv(head_container["args"][0]))
    tp = tensor_parallel_sizes(args)
    assert tp["prefill"] > 1 and tp["decode"] > 1, "the deployment shows tensor-parallel pools"
    for group in raycluster["spec"]["workerGroupSpecs"]:
        nodes = kuberay_pool_nodes(group)
        assert nodes.node_type in NODE_GPUS, f"add {nodes.node_type} to NODE_GPUS"
        # A worker's ranks share one Ray node: a pod, which takes all of its node's GPUs.
        assert nodes.num_gpus == NODE_GPUS[nodes.node_type][0], nodes.role
        assert nodes.num_gpus % tp[nodes.role] == 0, nodes.role


def test_dockerfile_installs_the_whole_package() -> None:
    dockerfile = (DEPLOY / "kuberay" / "Dockerfile").read_text()
    for package in packages():
        assert f"COPY {package} {package}" in dockerfile, package
    assert "COPY pyproject.toml constraints.txt README.md ./" in dockerfile
    assert f"'.[gpu]' 'ray[default]=={pinned_ray()}'" in dockerfile
