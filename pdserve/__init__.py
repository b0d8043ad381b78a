"""pdserve's public wire API: generated gRPC stubs, one subpackage per API version."""
