"""The committed gRPC stubs are exactly what protoc makes of the committed .proto files."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    # loaded by path: a top-level ``proto`` module would clash with the proto-plus package
    spec = importlib.util.spec_from_file_location(
        "_pdserve_proto_generate", REPO_ROOT / "proto" / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    generator = _generator()
    written = generator.generate(tmp_path)
    assert written, "protoc wrote nothing"
    for path in written:
        relative = path.relative_to(tmp_path)
        committed = REPO_ROOT / relative
        assert committed.exists(), f"{relative} is not committed; run python proto/generate.py"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{relative} differs from what protoc makes of the .proto; "
            "run python proto/generate.py and commit the result"
        )


def test_every_generated_module_is_importable_from_the_package() -> None:
    from pdserve.v1 import generation_pb2, generation_pb2_grpc

    assert generation_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert set(generation_pb2.DESCRIPTOR.services_by_name["Generation"].methods_by_name) == {
        "Generate",
        "Abort",
        "Health",
        "ListModels",
    }
    assert hasattr(generation_pb2_grpc, "GenerationStub")
