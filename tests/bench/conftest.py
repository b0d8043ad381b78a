"""The bench tests reuse the gateway suite's running server over the tiny Llama."""

from tests.gateway.conftest import gateway_cluster, gateway_server, served_model  # noqa: F401
