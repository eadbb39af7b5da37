"""chorus bench --resume and the README rows, without services: a resumed run keeps the levels its
--out file holds and refuses a file from other settings."""

import json

import pytest

from chorus import bench
from chorus.bench.report import readme_rows
from chorus.bench.sweep import measured
from chorus.config import ConfigError


def _level(concurrency: int) -> dict:
    return {"workload": "W1", "mode": "closed", "concurrency": concurrency, "rate": None, "requests": 40,
            "errors": 0, "audio_s_per_s": 1234.56, "ttfa_ms": {"p50": 41.2, "p99": 48.0}}


def test_a_resumed_run_keeps_the_measured_levels_and_its_seed(tmp_path):
    out = tmp_path / "run.json"
    args = bench.parse_args(["--layout", "w1-1gpu-defaults", "--resume", "--out", str(out)])
    bench.prepare(args)
    assert bench._previous_run(args) is None  # nothing there yet: a fresh run
    out.write_text(json.dumps({"config": bench._config(args, 77), "levels": [_level(1), _level(16)],
                               "records": []}))
    previous = bench._previous_run(args)
    assert previous["config"]["seed"] == 77
    assert measured(previous, "W1", "closed", 16) and not measured(previous, "W1", "closed", 64)
    other = bench.parse_args(["--layout", "w1-1gpu-defaults", "--resume", "--out", str(out), "--duration", "30"])
    bench.prepare(other)
    with pytest.raises(ConfigError, match="duration = 15.0, this run 30.0"):
        bench._previous_run(other)
    bare = bench.parse_args(["--layout", "cpu-smoke", "--resume"])
    bench.prepare(bare)
    with pytest.raises(ConfigError, match="--out FILE"):
        bench._previous_run(bare)


def test_the_one_gpu_defaults_layout_leaves_sizing_to_the_gpu():
    layout = bench.resolve("w1-1gpu-defaults")
    services = layout.services()
    assert layout.settings["concurrency"] == [1, 16, 64, 128, 256]
    assert (layout.settings["duration"], layout.settings["warmup"]) == (15.0, 5.0)
    assert services.colocate
    assert (services.worker.max_batch, services.worker.kv_slots, services.vocoder.slots) == (0, 0, 0)


def test_readme_rows():
    rows = readme_rows([_level(1), dict(_level(256), errors=3)]).splitlines()
    assert rows[0].startswith("| workload | concurrency | audio s/s | TTFA p50 / p99 (ms)")
    assert rows[2] == "| W1 | 1 | 1,234.6 | 41 / 48 | 40 | 0 |" and rows[3].endswith("| 40 | 3 |")
