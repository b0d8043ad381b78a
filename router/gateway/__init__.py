"""The front doors: the OpenAI-compatible HTTP gateway and the gRPC service, over one cluster."""
