"""chorus bench's OmniVoice workloads (O1 short, O2 clone of stored voices, O3 mixed knobs) through
the real services on the CPU (tiny OmniVoice and codec), and their named GPU layouts."""

import json

from chorus import bench
from chorus.bench import layouts
from chorus.bench.server_counters import canvas_stats, scheduler_counters


def test_o_workloads_run_end_to_end(omnivoice_cluster, tmp_path):
    out = tmp_path / "o.json"
    args = bench.parse_args(["--server", omnivoice_cluster.address, "--warmup", "0", "--no-progress", "--seed", "3",
                             "--workload", "O1,O2,O3", "--concurrency", "2", "--requests", "2", "--frames", "10",
                             "--num-step", "4", "--voices", "2", "--out", str(out)])
    before = scheduler_counters(omnivoice_cluster.metrics_port)
    bench.run_bench(args)
    steps = canvas_stats(before, scheduler_counters(omnivoice_cluster.metrics_port), wall=1.0)
    assert steps["steps_per_s"] > 0 and steps["packed_rows_per_step"] > 0 and steps["worker_step_ms"] > 0
    assert steps["canvases_per_s"] >= 6  # per second of a 1 s "level": the canvases the three levels ended
    data = json.loads(out.read_text())
    assert [lv["workload"] for lv in data["levels"]] == ["O1", "O2", "O3"]
    assert all(lv["errors"] == 0 and lv["completed"] == 2 for lv in data["levels"]), \
        [lv["first_error"] for lv in data["levels"]]
    assert all(lv["audio_s_per_s"] > 0 and lv["server_last_frame_ms"]["p50"] > 0 for lv in data["levels"])
    records = [r for r in data["records"] if r["measured"]]
    assert {r["voice"] is not None for r in records if r["workload"] == "O2"} == {True}
    assert {(r["num_step"], r["guidance_scale"]) for r in records if r["workload"] == "O1"} == {(4, 2.0)}
    assert all(r["frames"] == 10 for r in records)
    assert data["server"]["models"] and any(m["architecture"] == "omnivoice" for m in data["server"]["models"])


def test_the_omnivoice_layouts_put_omnivoice_on_the_gpu():
    one = layouts.resolve("o1-1gpu").services()
    assert (one.omnivoice_worker.device, one.omnivoice_worker.dtype, one.omnivoice_worker.preset) == \
        ("cuda:0", "float16", "omnivoice-full")
    assert one.omnivoice_vocoder.preset == "higgs-full" and one.worker.device == "cpu"
    assert layouts.resolve("o3-1gpu").settings["workload"] == ["O3"]
    assert layouts.resolve("o1-1gpu-eager").services().omnivoice_worker.cuda_graphs is False


def test_a_launched_o1_run_says_where_its_time_went(tmp_path):
    """Launched, a level records the canvas steps (from the scheduler's metrics) and the codec's
    clips (from the OmniVoice vocoder's)."""
    out = tmp_path / "o1.json"
    bench.run_bench(bench.parse_args(["--launch", "--profile", "cpu", "--workload", "O1", "--concurrency", "1",
                                      "--requests", "2", "--frames", "10", "--num-step", "4", "--warmup", "0",
                                      "--no-progress", "--seed", "3", "--out", str(out)]))
    (lv,) = json.loads(out.read_text())["levels"]
    assert lv["completed"] == 2 and lv["errors"] == 0
    canvas, codec = lv["canvas_steps"], lv["vocoder_steps"]
    assert canvas["steps_per_s"] > 0 and canvas["worker_step_ms"] > 0 and canvas["canvases_per_s"] > 0
    assert codec["clips_per_s"] > 0 and codec["clips_per_batch"] >= 1 and codec["clip_batch_ms"] > 0
    assert codec["clip_finish_ms"] > 0 and codec["forwards_per_batch"] >= 1
