"""Regenerate the Python gRPC stubs of the public API from ``proto/``.

    python proto/generate.py            # writes pdserve/v1/generation_pb2{.py,.pyi,_grpc.py}
    python proto/generate.py --out DIR  # writes them under DIR instead (the stub test does)

It runs ``python -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=.
--pyi_out=. proto/pdserve/v1/generation.proto`` from the repository root, in-process; the
output depends only on the .proto files and the pinned grpcio-tools version.
"""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # the -I root: import paths start below it
REPO_ROOT = PROTO_ROOT.parent
PROTO_FILES = ("pdserve/v1/generation.proto",)  # relative to PROTO_ROOT


def generated_files() -> list[str]:
    """Paths (relative to the output root) of the files ``generate`` writes."""
    names = []
    for proto in PROTO_FILES:
        stem = proto.removesuffix(".proto")
        names += [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]
    return names


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Run protoc on every file of ``PROTO_FILES`` into ``out_dir``; the paths written."""
    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"  # what `python -m grpc_tools.protoc` adds
    out = str(out_dir)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--pyi_out={out}",
        *(str(PROTO_ROOT / proto) for proto in PROTO_FILES),
        f"-I{well_known}",
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return [out_dir / name for name in generated_files()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: repo)")
    for path in generate(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
