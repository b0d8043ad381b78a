"""Two Ray nodes on this machine with different custom resources: workers land where theirs are.

The nodes are separate raylet processes, one advertising ``prefill`` and one ``decode``,
started by Ray's own multi-node test utility (``ray.cluster_utils.Cluster``). A second
``ray start --address`` on one machine is refused while Ray is held to loopback
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), and without that setting Ray binds wildcard addresses and
announces the machine's external address; the utility starts the same node processes on
127.0.0.1. The driver runs in a subprocess, joining by address as ``pdserve serve --address``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

DRIVER = """
import asyncio, json, sys
import ray
from ray.cluster_utils import Cluster as RayNodes
from engine.sampling.params import SamplingParams
from router.cluster import Cluster
from router.cluster_config import ClusterConfig

nodes = RayNodes(initialize_head=True, head_node_args={
    "num_cpus": 1, "resources": {"prefill": 1}, "include_dashboard": False})
nodes.add_node(num_cpus=1, resources={"decode": 1})
ray.init(address=nodes.address, log_to_driver=False)
config = ClusterConfig(
    model_dir=sys.argv[1], dtype="float32", block_size=8, num_kv_blocks=200,
    worker_num_cpus=0, data_plane_host="127.0.0.1",
    prefill_resources={"prefill": 1}, decode_resources={"decode": 1},
)
cluster = Cluster.start(config)
placed = {w.worker_id: ray.get(w.actor.node_id.remote()) for w in cluster.pool.workers.values()}
resources = {n["NodeID"]: sorted(k for k in n["Resources"] if k in ("prefill", "decode"))
             for n in ray.nodes() if n["Alive"]}

async def one():
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    return [e.token_id async for e in cluster.generate([5, 6, 7, 8, 9], params)]

tokens = asyncio.run(one())
cluster.shutdown()
ray.shutdown()
nodes.shutdown()
print("RESULT" + json.dumps({"placed": placed, "resources": resources, "tokens": tokens}))
"""


def test_workers_are_placed_by_custom_resources(llama_dir: Path) -> None:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(llama_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, result.stderr[-3000:]
    report = json.loads(line[len("RESULT") :])
    resources, placed = report["resources"], report["placed"]
    assert len(resources) == 2
    assert resources[placed["prefill-0"]] == ["prefill"]
    assert resources[placed["decode-0"]] == ["decode"]
    assert len(report["tokens"]) == 5
