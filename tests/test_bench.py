"""chorus bench: a smoke run of the load generator against the real services
(tiny model, CPU), its metric arithmetic on hand-made records, and the named layouts of
benchmarks/layouts.toml (each one resolves; cpu-smoke runs end to end)."""

import json
import re
import runpy
import sys
from pathlib import Path

import pytest

from chorus import bench
from chorus.bench import flags, layouts
from chorus.cli import main as cli_main
from chorus.config import ConfigError


def _run(cluster, tmp_path, *flags):
    out = tmp_path / "results.json"
    args = bench.parse_args(["--server", cluster.address, "--warmup", "0", "--no-progress", "--seed", "7",
                             "--out", str(out), *flags])
    returned = bench.run_bench(args)
    data = json.loads(out.read_text())
    assert data["levels"] == json.loads(json.dumps(returned["levels"]))
    return data


def test_w1_closed_loop_sweep_writes_json_and_plot(cluster, tmp_path):
    flags = ["--workload", "W1", "--concurrency", "1,2", "--frames", "4", "--requests", "2"]
    try:
        import matplotlib  # noqa: F401
        flags += ["--plot", str(tmp_path / "results.png")]
    except ImportError:
        pass
    data = _run(cluster, tmp_path, *flags)

    assert data["schema"] == bench.SCHEMA and data["complete"] is True
    assert data["config"]["concurrency"] == [1, 2] and data["config"]["seed"] == 7
    assert data["config"]["workloads"]["W1"]["frames"] == 4
    assert data["server"]["address"] == cluster.address and data["server"]["models"][0]["codebooks"] == 12
    assert "revision" in data["git"] and data["host"]["cpu_count"] >= 1

    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    for lv in data["levels"]:
        assert lv["workload"] == "W1" and lv["mode"] == "closed"
        assert lv["requests"] == 2 and lv["completed"] == 2 and lv["errors"] == 0 and lv["first_error"] is None
        for key in ("req_per_s", "audio_s_per_s", "frames_per_s", "window_s"):
            assert lv[key] > 0, key
        for q in ("p50", "p95", "p99"):
            assert lv["ttfa_ms"][q] > 0
        assert lv["rtf"]["p50"] > 0 and lv["rtf"]["p99"] >= lv["rtf"]["p50"]
        assert lv["ttfa_ms"]["p99"] >= lv["ttfa_ms"]["p50"]

    records = data["records"]
    assert len(records) == 4 and all(r["measured"] for r in records)
    assert len({r["seed"] for r in records}) == 4  # every request has its own seed
    for r in records:
        assert r["error"] is None and r["frames"] == 4 and r["frames_requested"] == 4
        assert r["audio_s"] == pytest.approx(4 * 0.08)
        assert 0 < r["ttfa_ms"] <= r["total_ms"] and r["rtf"] == pytest.approx(r["total_ms"] / 1e3 / r["audio_s"])
        assert r["chunks"] == len(r["gaps_ms"]) + 1 >= 1
        assert r["cached_prompt_rows"] is not None and r["prompt_rows"] > 0
    assert {r["level"] for r in records} == {0, 1}
    if "--plot" in flags:
        assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_w2_repeated_voices_hit_the_radix_cache(cluster, tmp_path):
    # Two voices over four sequential requests: at least two requests reuse a
    # voice whose prompt rows an earlier, finished request left in the cache.
    data = _run(cluster, tmp_path, "--workload", "W2", "--concurrency", "1", "--frames", "3", "--requests", "4",
                "--voices", "2")
    (lv,) = data["levels"]
    assert lv["errors"] == 0 and lv["completed"] == 4
    records = sorted(data["records"], key=lambda r: r["t_send_s"])
    seen, first, repeat = set(), [], []
    for r in records:
        assert r["voice"] in (0, 1)
        (repeat if r["voice"] in seen else first).append(r["cached_prompt_rows"])
        seen.add(r["voice"])
    assert len(repeat) >= 2
    # The reference (63 rows) sits before the text, so a repeat reuses it all.
    assert min(repeat) > bench.VOICE_FRAMES and min(repeat) > max(first)
    assert lv["cached_prompt_rows"]["total"] > 0


def test_open_loop_poisson_arrivals(cluster, tmp_path):
    data = _run(cluster, tmp_path, "--workload", "W1", "--rate", "20", "--frames", "3", "--requests", "3")
    (lv,) = data["levels"]
    assert lv["mode"] == "open" and lv["rate"] == 20 and lv["concurrency"] is None
    assert lv["requests"] == 3 and lv["errors"] == 0 and lv["audio_s_per_s"] > 0


def test_level_metrics_windows_and_percentiles():
    def rec(t_send, chunk_times, measured=True, error=None):
        return {"measured": measured, "error": error, "t_send_s": t_send, "t_end_s": chunk_times[-1],
                "ttfa_ms": (chunk_times[0] - t_send) * 1e3, "total_ms": (chunk_times[-1] - t_send) * 1e3,
                "rtf": 1.0, "gaps_ms": [(b - a) * 1e3 for a, b in zip(chunk_times, chunk_times[1:])],
                "max_gap_ms": None, "server_queue_ms": 1.0, "server_first_audio_ms": 1.0, "prompt_rows": 10,
                "cached_prompt_rows": 4, "sample_rate": 100, "samples_per_frame": 10,
                "_chunks": [(t, 50) for t in chunk_times]}

    records = [rec(0.0, [0.5, 1.5], measured=False),   # warm-up: its chunk at 1.5 s is in the window
               rec(1.0, [1.2, 2.0]), rec(1.5, [1.9, 3.5]),  # the second one's last chunk is past the window
               {**rec(2.0, [2.0]), "error": "UNAVAILABLE: gone", "_chunks": []}]
    m = bench.level_metrics(records, (1.0, 3.0))
    assert m["requests"] == 3 and m["completed"] == 2 and m["errors"] == 1 and m["warmup_requests"] == 1
    assert m["first_error"] == "UNAVAILABLE: gone"
    # chunks inside [1, 3]: 1.5, 1.2, 2.0, 1.9 -> 4 x 50 samples = 2 s of audio, 20 frames over 2 s
    assert m["audio_s_per_s"] == pytest.approx(1.0) and m["frames_per_s"] == pytest.approx(10.0)
    assert m["req_per_s"] == pytest.approx(1.0)  # warm-up's end (1.5) and 2.0 are inside; 3.5 is not
    assert m["ttfa_ms"]["p50"] == pytest.approx(300.0) and m["chunk_gap_ms"]["max"] == pytest.approx(1600.0)
    assert bench.percentile([1, 2, 3, 4], 50) == 2.5 and bench.percentile([], 99) is None


def test_bench_is_a_cli_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--concurrency", "--rate", "--launch", "--worker-arg", "--frames", "--out", "--plot"):
        assert flag in text
    assert text.count("chorus bench --") >= 2  # the examples


def test_a_given_revision_wins_over_git(monkeypatch):
    """On the device machine the copy's .git is stale: CHORUS_GIT_REV names the tree that ran."""
    from chorus import provenance
    monkeypatch.setenv("CHORUS_GIT_REV", "abc1234")
    assert provenance.git_revision() == {"revision": "abc1234", "dirty": None, "source": "env"}
    monkeypatch.delenv("CHORUS_GIT_REV")
    assert provenance.git_revision()["source"] in ("git", None)


def _bench_scripts() -> list[str]:
    """The chorus.bench modules run as `python -m chorus.bench.NAME`."""
    return sorted(p.stem for p in Path(bench.__file__).parent.glob("*.py")
                  if 'if __name__ == "__main__":' in p.read_text())


def test_the_bench_scripts_live_in_the_package():
    assert "worker" in _bench_scripts() and len(_bench_scripts()) >= 20


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # a script another imported
@pytest.mark.parametrize("name", _bench_scripts())
def test_every_bench_script_says_what_it_measures(name, monkeypatch, capsys):
    """--help runs on the CPU without triton and describes the script, with no history in it."""
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module(f"chorus.bench.{name}", run_name="__main__")
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage:") and len(text.split("\n\n")[1]) > 40  # the description
    assert not re.search(r"[Ss]ession \d|_s\d+_|benchmarks/\w+\.py", text)


# ---- named layouts (benchmarks/layouts.toml) -------------------------------------------------

DOCUMENTED = ("w1-1gpu", "w1-1gpu-c256", "w1-2gpu", "w1-2gpu-high-load", "w1-2gpu-high-load-shared", "w2-radix",
              "w2-no-radix", "w1-c16-no-lookahead", "w1-c16-eager", "cpu-smoke")


def test_the_documented_layouts_are_in_the_file():
    assert set(DOCUMENTED) <= set(layouts.names())


@pytest.mark.parametrize("name", layouts.names())
def test_every_layout_resolves_to_valid_configs(name):
    """Its profile and tables build checked configs and its settings parse as bench flags; no process starts."""
    layout = layouts.resolve(name)
    services = layout.services()
    assert layout.about and "\n" not in layout.about
    assert set(layout.settings) <= set(flags.DEFAULTS) and layout.settings["workload"]
    assert bool(layout.settings.get("concurrency")) != bool(layout.settings.get("rate"))
    if services.worker.device.startswith("cuda"):  # benchmarks: full-size models unless --model/--codec
        assert (services.worker.preset, services.vocoder.preset, services.worker.dtype) == ("full", "full", "bfloat16")


def test_the_layouts_say_what_the_docs_say_they_are():
    high = layouts.resolve("w1-2gpu-high-load")
    shared = layouts.resolve("w1-2gpu-high-load-shared").services()
    assert high.profile == "two-gpu-high-load" and high.settings["concurrency"] == [256]
    assert high.settings["channels"] == 32 and high.services().scheduler.frontends == 4
    assert (shared.cluster.shared_vocoder_decoder, shared.cluster.vocoders, shared.vocoder.slots) == (True, 2, 256)
    assert layouts.resolve("w2-radix").services().scheduler.radix_cache is True
    assert layouts.resolve("w2-no-radix").services().scheduler.radix_cache is False
    assert layouts.resolve("w1-c16-eager").services().worker.cuda_graphs is False
    assert layouts.resolve("w1-c16-no-lookahead").services().scheduler.lookahead is False
    one = layouts.resolve("w1-1gpu")
    assert one.services().colocate and one.settings["concurrency"] == [1, 16, 64]
    assert (one.settings["duration"], one.settings["warmup"]) == (10.0, 5.0)


def test_an_unknown_layout_names_the_ones_there_are(capsys):
    with pytest.raises(ConfigError, match="no layout 'w9'.*w1-1gpu, .*cpu-smoke"):
        layouts.resolve("w9")
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "--layout", "w9"])
    assert "w1-2gpu-high-load" in str(e.value.code)
    cli_main(["bench", "--list-layouts"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == layouts.names()


@pytest.mark.parametrize("text, needle", [
    ('[a]\nabout = "x"\nconcurency = [1]\n', "did you mean 'concurrency'"),
    ('[a]\nabout = "x"\nconcurrency = [0]\n', "integers >= 1"),
    ('[a]\nabout = "x"\nconcurrency = [1]\nrate = [2]\n', "not allowed with"),
    ('[a]\nabout = "x"\nworker.max_bach = 8\n', "did you mean 'max_batch'"),
    ('[a]\nabout = "x"\nlike = "b"\n[b]\nabout = "y"\nlike = "a"\n', "loop"),
    ('[a]\nlike = "w1"\n', "not a layout"),
    ('[a]\nconcurrency = [1]\n', "needs about"),
])
def test_a_bad_layout_names_what_to_fix(tmp_path, text, needle):
    path = tmp_path / "layouts.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        layouts.resolve("a", path)


def test_flags_given_win_over_the_layout():
    args = bench.parse_args(["--layout", "w1-2gpu-high-load", "--concurrency", "16", "--channels", "4",
                             "--vocoders", "1", "--vocoder-arg=--slots=64", "--scheduler-arg=--frontends=2"])
    named = bench.prepare(args)
    assert args.launch and (args.concurrency, args.channels, args.duration, args.rate) == ([16], 4, 10.0, None)
    layout, cluster, _ = bench._launch_cluster(args, named)  # built, not started
    assert (layout.cluster.vocoders, len(cluster.vocoder_ports)) == (1, 1)
    worker, vocoder, scheduler = cluster.configs()
    assert (worker.max_batch, vocoder.slots, vocoder.chunk_frames, scheduler.frontends) == (256, 64, 10, 2)
    args = bench.parse_args(["--layout", "w1-1gpu", "--rate", "2,5"])
    bench.prepare(args)
    assert args.rate == [2.0, 5.0]
    with pytest.raises(ConfigError, match="--server"):
        bench.prepare(bench.parse_args(["--layout", "w1-1gpu", "--server", "h:1"]))


def test_launch_without_a_layout_builds_the_profile():
    args = bench.parse_args(["--launch", "--profile", "two-gpu-high-load", "--duration", "3"])
    assert bench.prepare(args) is None and (args.concurrency, args.duration) == (flags.DEFAULTS["concurrency"], 3.0)
    layout, cluster, _ = bench._launch_cluster(args, None)
    assert len(cluster.vocoder_ports) == 2 and layout.worker.max_batch == 256


def test_the_cpu_smoke_layout_runs_end_to_end(tmp_path):
    """Real services on the CPU, launched and stopped by chorus bench --layout."""
    out = tmp_path / "smoke.json"
    # A count, not the layout's 2 s: on a loaded CI machine a request can outlast a 2 s window.
    cli_main(["bench", "--layout", "cpu-smoke", "--no-progress", "--seed", "3", "--requests", "3", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["complete"] and data["layout"]["name"] == "cpu-smoke" and data["config"]["layout"] == "cpu-smoke"
    assert data["server"]["launched"] and data["server"]["launch_configs"]["cluster"]["device"] == "cpu"
    assert data["server"]["launch_configs"]["worker"]["preset"] == "tiny"
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    for lv in data["levels"]:
        assert lv["requests"] >= 1 and lv["errors"] == 0 and lv["audio_s_per_s"] > 0
