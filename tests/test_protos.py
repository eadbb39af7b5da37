"""The committed generated code must equal what protoc makes of protos/ now."""

from pathlib import Path

from chorus import protogen


def test_generated_code_is_current(tmp_path: Path):
    fresh = {p.name: p.read_bytes() for p in protogen.generate(tmp_path)}
    committed_dir = protogen.REPO / protogen.PACKAGE_DIR
    committed = {p.name: p.read_bytes() for p in committed_dir.glob("*_pb2*.py*")}
    assert sorted(fresh) == sorted(committed), "run: python -m chorus.protogen"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"generated code is stale for {stale}; run: python -m chorus.protogen"
