"""Generated gRPC stubs of the public API ``pdserve.v1`` (``proto/pdserve/v1/*.proto``).

Do not edit the ``*_pb2*`` files: regenerate them from the repository root with

    python proto/generate.py

which runs ``python -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=.
--pyi_out=. proto/pdserve/v1/generation.proto``; ``tests/gateway/test_grpc_stubs.py`` checks
that the committed files match the .proto.
"""
