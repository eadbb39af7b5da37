"""`chorus bench worker` runs end to end on the CPU (the H200 numbers come from the same code)."""

import json
import runpy
import sys

from chorus import cli


def test_worker_bench_smoke(tmp_path):
    out = tmp_path / "worker.json"
    cli.main(["bench", "worker", "--preset", "tiny", "--device", "cpu", "--dtype", "float32",
              "--batches", "1,2", "--contexts", "16", "--steps", "2", "--warmup", "1", "--mixed-batch", "2",
              "--mixed-intervals", "1,2", "--mixed-rows", "6", "--mixed-request-rows", "4", "--launch-phases",
              "--out", str(out)])
    report = json.loads(out.read_text())
    assert [p["batch"] for p in report["points"]] == [1, 2]
    assert all(p["step_ms"] > 0 and p["frames_per_s"] > 0 and p["floor_ms"] > 0 for p in report["points"])
    assert report["prefill"][0]["rows_per_s"] > 0 and len(report["frame_decode"]) == 2
    assert report["attention"] == "TorchPagedAttention" and report["cuda_graphs"] is False
    mixed = report["mixed"]  # decode steps carrying new requests' prefill every k-th step
    assert mixed["batch"] == 2 and [p["interval"] for p in mixed["points"]] == [1, 2]
    assert all(p["step_ms"] > 0 for p in mixed["points"]) and mixed["decode_step_ms"] > 0
    assert all(p["host_launch_ms"] > 0 for p in report["points"])  # host time in Engine.launch
    # contexts as decoded: the prompt plus the rows earlier points added (bs 2's first request decoded at bs 1)
    first, second = (p["decode_context_mean"] for p in report["points"])
    assert 16 < first < second and mixed["points"][1]["decode_context_mean"] > mixed["decode_context_mean"] > second
    two = mixed["points"][1]  # every 2nd step prefills: its launches and the others' apart, in parts
    assert two["host_launch_ms_prefill_steps"] > 0 and two["host_launch_ms_other_steps"] > 0
    assert set(two["host_launch_parts_ms"]["other_steps"]) == {"folded step", "frame sampling", "prefill graph",
                                                               "decode graph", "attention plans", "journal copy"}


def test_sync_audit_runs_its_steps_on_cpu(tmp_path):
    """chorus.bench.sync_audit (run on the H200) drives the worker's, the vocoder session's and
    OmniVoice's engine's steps; on the CPU it finds nothing (torch's sync debug mode is CUDA-only)
    but every step must run."""
    out = tmp_path / "sync.json"
    argv, sys.argv = sys.argv, ["sync_audit.py", "--device", "cpu", "--out", str(out)]
    try:
        runpy.run_module("chorus.bench.sync_audit", run_name="__main__", alter_sys=True)
    finally:
        sys.argv = argv
    assert json.loads(out.read_text()) == {"device": "cpu", "syncs": []}
