"""`chorus bench worker` runs end to end on the CPU (the H200 numbers come from the same code)."""

import json

from chorus import cli


def test_worker_bench_smoke(tmp_path):
    out = tmp_path / "worker.json"
    cli.main(["bench", "worker", "--preset", "tiny", "--device", "cpu", "--dtype", "float32",
              "--batches", "1,2", "--contexts", "16", "--steps", "2", "--warmup", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert [p["batch"] for p in report["points"]] == [1, 2]
    assert all(p["step_ms"] > 0 and p["frames_per_s"] > 0 and p["floor_ms"] > 0 for p in report["points"])
    assert report["prefill"][0]["rows_per_s"] > 0 and len(report["frame_decode"]) == 2
    assert report["attention"] == "TorchPagedAttention" and report["cuda_graphs"] is False
