"""The Ray a server runs on: a local one that this process starts and stops, listening on
loopback unless told another address, or a running cluster that it joins (``--address``).

Ray's own servers (GCS, raylet and object manager, each worker's gRPC server, the agents) listen
on 127.0.0.1 only when the node's address is exactly 127.0.0.1, and on every interface for any
other address. ``ray.init`` turns a loopback address into the machine's external one unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is 0, which each Ray process reads when it imports Ray: a
local Ray started here is given 127.0.0.1 with that setting, in the processes it starts and in
this one. A joined cluster keeps the node address Ray finds (its cluster address).
"""

from __future__ import annotations

import ipaddress
import os

import ray

LOOPBACK = "127.0.0.1"
_CLUSTERS_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps a loopback node address


def start_ray(address: str | None, node_ip: str | None = None) -> None:
    """Joins the Ray cluster at ``address`` ("auto": the one running on this node), or, with
    None, starts a local Ray whose processes listen on ``node_ip`` (default: loopback only).

    ``node_ip`` is this node's address in the cluster: Ray's processes advertise it, and, when
    it is not loopback, listen on every interface (Ray binds either loopback or all of them).
    A local Ray starts without Ray's dashboard.
    """
    if address is not None:
        ray.init(
            address=address,
            _node_ip_address=node_ip,  # None: the node's address as Ray finds it
            ignore_reinit_error=True,
            log_to_driver=False,
        )
        return
    host = LOOPBACK if node_ip is None or is_loopback(node_ip) else node_ip
    if host == LOOPBACK:
        _keep_loopback_node_address()
    ray.init(
        # a new Ray of its own, even where one runs on this machine (`ray start`, a test's
        # cluster: Ray would join the last one started) or RAY_ADDRESS names one
        address="local",
        _node_ip_address=host,
        include_dashboard=False,
        ignore_reinit_error=True,
        log_to_driver=False,
    )


def stop_ray() -> None:
    """Stops the local Ray this process started and waits for its processes to exit; from a
    joined cluster, only disconnects. Does nothing when Ray is not running here."""
    if ray.is_initialized():
        ray.shutdown(wait_for_processes=True)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _keep_loopback_node_address() -> None:
    """Makes Ray keep 127.0.0.1 as this node's address rather than the machine's external one:
    in the processes it starts (they read the setting when they import Ray) and in this one,
    which may have imported Ray before the setting was made."""
    os.environ[_CLUSTERS_ENV] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
