"""The typed service configs: dataclass <-> protobuf, flags over a TOML file over the defaults,
errors that name the key, and the layouts `chorus up` builds from profiles."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from chorus.config import ConfigError, from_proto, merge, message_class, parse, profile_names, settings, to_proto
from chorus.layout import build, read_tables
from gateway_svc.config import GatewayConfig
from gpu_worker.config import WorkerConfig
from scheduler_svc.config import SchedulerConfig
from vocoder_svc.config import VocoderConfig

CONFIGS = [WorkerConfig, VocoderConfig, SchedulerConfig, GatewayConfig]


@pytest.mark.parametrize("cls", CONFIGS)
def test_each_dataclass_has_its_message_field_for_field(cls):
    assert [f.name for f, _, _ in settings(cls)] == [f.name for f in message_class(cls).DESCRIPTOR.fields]


@pytest.mark.parametrize("cls", CONFIGS)
def test_round_trip_through_protobuf_is_exact(cls):
    default = cls()
    assert from_proto(cls, to_proto(default)) == default
    changed = {}
    for f, tp, optional in settings(cls):  # every field away from its default (None where it may be)
        value = getattr(default, f.name)
        if f.metadata.get("choices"):
            changed[f.name] = f.metadata["choices"][-1]
        elif tp is bool:
            changed[f.name] = not value
        elif tp is list:
            changed[f.name] = ["a:1", "b:2"]
        elif tp is str:
            changed[f.name] = "tcp://10.0.0.1:7" if f.name in ("bind", "worker") else "x"
        elif optional:
            changed[f.name] = None if value is not None else tp(3)
        else:
            changed[f.name] = tp(value) + tp(3) if tp is int else float(value) + 0.25
    obj = cls(**changed)
    back = from_proto(cls, message_class(cls).FromString(to_proto(obj).SerializeToString()))
    assert back == obj and back != default


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path):
    path = tmp_path / "layout.toml"
    path.write_text('[worker]\nkv_slots = 1000\nmax_batch = 8\ncuda_graphs = false\n'
                    '[scheduler]\nstep_timeout = 9.5\nvocoder = ["h:1", "h:2"]\n')
    worker = parse(WorkerConfig, ["--config", str(path), "--max-batch", "16"])
    assert (worker.kv_slots, worker.max_batch, worker.cuda_graphs, worker.page_size) == (1000, 16, False, 16)
    assert parse(WorkerConfig, ["--config", str(path), "--cuda-graphs"]).cuda_graphs is True
    # a flag's name may differ from its key; repeated flags replace the file's list
    sched = parse(SchedulerConfig, ["--config", str(path), "--step-timeout-s", "2", "--vocoder", "v:3"])
    assert (sched.step_timeout, sched.vocoder) == (2.0, ["v:3"])
    assert parse(SchedulerConfig, ["--config", str(path)]).vocoder == ["h:1", "h:2"]
    # the spellings of before still work
    assert parse(SchedulerConfig, ["--no-radix-cache", "--no-lookahead"]).radix_cache is False
    assert parse(WorkerConfig, ["--no-capture-at-start", "--no-cuda-graphs"]).capture_graphs is False
    assert parse(SchedulerConfig, ["--prefill-interval-loaded", "2"]).loaded_prefill_interval == 2


@pytest.mark.parametrize("text,needle", [
    ("[worker]\nkv_slot = 5\n", "[worker] has no key 'kv_slot' (did you mean 'kv_slots'?)"),
    ("[worker]\nkv_slots = \"many\"\n", "[worker] kv_slots = 'many': expected an integer"),
    ("[vocoder]\nengine = \"session\"\n", "[vocoder] engine = 'session': choose one of auto, slots, stream"),
    ("[scheduler]\nfrontends = -1\n", "[scheduler] frontends = -1: must be >= 0"),
    ("[worker\n", "not valid TOML"),
])
def test_a_bad_file_names_the_key_and_what_to_fix(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    cls = {"vocoder": VocoderConfig, "scheduler": SchedulerConfig}.get(text[1:].split("]")[0], WorkerConfig)
    with pytest.raises(ConfigError) as e:
        parse(cls, ["--config", str(path)])
    assert needle in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("cls,flags,needle", [
    (SchedulerConfig, ["--loaded-batch", "-1"], "--loaded-batch = -1: must be >= 0"),
    (SchedulerConfig, ["--prefill-interval-loaded", "0"], "--prefill-interval-loaded = 0: must be >= 1"),
    (SchedulerConfig, ["--first-chunk-frames-loaded", "999"], "--first-chunk-frames-loaded = 999: must be <= 250"),
    (VocoderConfig, ["--slots", "8", "--buckets", "1,4"], "vocoder.buckets = '1,4': the largest must be >= slots"),
])
def test_bad_flags_name_the_flag(cls, flags, needle):
    with pytest.raises(ConfigError, match=__import__("re").escape(needle)):
        parse(cls, flags)


def test_a_service_refuses_a_bad_flag_value_at_startup():
    out = subprocess.run([sys.executable, "-m", "scheduler_svc.server", "--loaded-batch", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--loaded-batch = -1: must be >= 0" in out.stderr


def test_every_profile_builds_and_the_high_load_one_is_the_readme_layout():
    for name in profile_names():
        build(read_tables(profile=name))
    high = build(read_tables(profile="two-gpu-high-load"))
    assert (high.worker.device, high.vocoder.device, high.cluster.vocoders) == ("cuda:0", "cuda:1", 2)
    assert (high.worker.max_batch, high.worker.kv_slots, high.vocoder.slots) == (256, 150000, 128)
    assert (high.vocoder.chunk_frames, high.scheduler.first_chunk_frames_loaded, high.scheduler.frontends) == (10, 10, 4)
    assert high.worker.dtype == high.vocoder.dtype == "bfloat16" and not high.colocate
    one = build(read_tables(profile="one-gpu"))
    # launch_ahead_streams 0: half the slots, which are sized at start-up
    assert one.colocate and (one.vocoder.launch_ahead_streams, one.vocoder.step_frames) == (0, 5)
    cpu = build(read_tables())
    assert (cpu.worker.device, cpu.worker.dtype, cpu.colocate) == ("cpu", "float32", False)
    # Beside a GPU worker four frontends relay the audio unless the scheduler table says otherwise.
    assert (one.scheduler.frontends, cpu.scheduler.frontends) == (4, 1)
    two = merge(read_tables(profile="one-gpu"), {"scheduler": {"frontends": 2}})
    assert build(two).scheduler.frontends == 2


def test_a_file_starts_from_a_profile_and_its_keys_win(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('profile = "two-gpu-high-load"\n[vocoder]\nslots = 64\nlaunch_ahead_streams = 2\n'
                    '[cluster]\nmodel = "/models/moss"\n')
    layout = build(read_tables(str(path)), {"scheduler": {"port": 0}})
    assert (layout.vocoder.slots, layout.vocoder.launch_ahead_streams, layout.worker.max_batch) == (64, 2, 256)
    assert (layout.worker.model, layout.scheduler.tokenizer, layout.scheduler.port) == (
        "/models/moss", "/models/moss", 0)
    with pytest.raises(ConfigError, match="--profile says"):
        read_tables(str(path), profile="cpu")


def test_print_config_round_trips(tmp_path):
    out = subprocess.run([sys.executable, "-m", "chorus.cli", "up", "--profile", "two-gpu-high-load",
                          "--model", "/m", "--print-config"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path = tmp_path / "printed.toml"
    path.write_text(out.stdout)
    again = build(read_tables(str(path), profile="cpu"))
    assert again == build(read_tables(profile="two-gpu-high-load"), {"cluster": {"model": "/m"}})


def test_colocation_reads_the_vocoders_defaults():
    from chorus.launcher import colocation

    base = VocoderConfig()
    on, v = colocation("auto", "cuda", None, 1, base)
    assert on and (v.launch_ahead_streams, v.step_frames) == (base.slots // 2, base.first_chunk_frames)
    _, v = colocation("auto", "cuda:0", None, 1, dataclasses.replace(base, slots=8, step_frames=0), {"step_frames"})
    assert (v.launch_ahead_streams, v.step_frames) == (4, 0)


def test_the_reference_table_lists_every_key():
    from chorus.config import markdown
    from chorus.layout import all_configs

    for cls in all_configs():
        table = markdown(cls)
        for f, _, _ in settings(cls):
            assert (f"| `{f.name}` |" in table) != bool(f.metadata.get("internal")), f.name


def test_a_worker_hosting_the_decoder_gets_the_vocoders_config(tmp_path):
    """From the launcher's --config-proto file, or from a --config file's [vocoder] table: no flag string."""
    import argparse

    from chorus.launcher import write_worker_proto
    from chorus.colocate import load as load_config
    from gpu_worker.server import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    worker = WorkerConfig(max_batch=4, host_vocoder_decoder=str(tmp_path / "d"))
    vocoder = VocoderConfig(slots=8, step_frames=5, priority_first_chunks=True)
    path = write_worker_proto(worker, vocoder, str(tmp_path / "worker.pb"))
    assert load_config(p.parse_args(["--config-proto", path, "--kv-slots", "99"])) == (
        dataclasses.replace(worker, kv_slots=99), vocoder)
    assert load_config(p.parse_args(["--config-proto", write_worker_proto(WorkerConfig(), None, path)])) == (
        WorkerConfig(), None)
    toml = tmp_path / "pod.toml"
    toml.write_text(f'[worker]\nhost_vocoder_decoder = "{tmp_path}/d"\n[vocoder]\nslots = 8\n')
    config, hosted = load_config(p.parse_args(["--config", str(toml)]))
    assert config.host_vocoder_decoder == f"{tmp_path}/d" and hosted == VocoderConfig(slots=8)


def test_the_readme_carries_the_current_configuration_reference():
    """README.md's reference is `python -m chorus.layout --markdown`'s output, as the code says now."""
    from pathlib import Path

    from chorus.config import markdown
    from chorus.layout import all_configs

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for cls in all_configs():
        assert markdown(cls) in readme, f"README.md's [{cls.TABLE}] table is stale: paste `python -m chorus.layout --markdown`"
