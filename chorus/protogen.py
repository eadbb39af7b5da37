"""Regenerate the protobuf/gRPC Python code in chorus/v1 from protos/.

The generated files are committed (so a plain install needs no protoc);
tests/test_protos.py regenerates into a temporary folder and fails when the
committed code differs, so it can never go stale. grpcio-tools is pinned in
the `dev` extra because its output embeds its own version.

    python -m chorus.protogen            # rewrite chorus/v1/*_pb2*.py
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
PACKAGE_DIR = "chorus/v1"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc for every .proto into out_root/chorus/v1; return the files written."""
    from grpc_tools import protoc  # dev-only dependency
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    protos = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_root / PACKAGE_DIR).glob("*_pb2*.py*"))


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for f in generate(Path(tmp)):
            dest = REPO / PACKAGE_DIR / f.name
            shutil.copyfile(f, dest)
            print(f"wrote {dest.relative_to(REPO)}")


if __name__ == "__main__":
    main()
