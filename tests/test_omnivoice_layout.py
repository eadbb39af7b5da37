"""`chorus up` serving OmniVoice beside MOSS: the layout's OmniVoice worker and codec vocoder, the
[omnivoice_worker] / [omnivoice_vocoder] tables, --print-config, and one cluster serving both."""

import dataclasses
import subprocess
import sys

import pytest

from chorus.config import ConfigError
from chorus.layout import build, read_tables
from gpu_worker.config import WorkerConfig
from vocoder_svc.config import VocoderConfig


def _has_preset(cls, name: str) -> bool:
    return name in next(f for f in dataclasses.fields(cls) if f.name == "preset").metadata["choices"]


presets = pytest.mark.skipif(not (_has_preset(WorkerConfig, "omnivoice-tiny") and
                                  _has_preset(VocoderConfig, "higgs-tiny")),
                             reason="the omnivoice-tiny worker / higgs-tiny codec presets are not merged yet")


@presets
def test_the_cpu_profile_serves_omnivoice_with_the_tiny_presets_and_gpu_profiles_do_not():
    cpu = build(read_tables())
    assert (cpu.omnivoice_worker.preset, cpu.omnivoice_worker.model, cpu.omnivoice_worker.device) == (
        "omnivoice-tiny", None, "cpu")
    assert (cpu.omnivoice_vocoder.preset, cpu.omnivoice_vocoder.codec, cpu.omnivoice_vocoder.dtype) == (
        "higgs-tiny", None, "float32")
    for name in ("one-gpu", "two-gpu", "two-gpu-high-load"):
        assert build(read_tables(profile=name)).omnivoice_worker is None
    assert build(read_tables(), {"cluster": {"omnivoice": False}}).omnivoice_worker is None


@presets
def test_an_omnivoice_checkpoint_sets_model_tokenizer_and_codec_and_the_tables_set_the_rest():
    two = build(read_tables(profile="two-gpu"), {"cluster": {"omnivoice_model": "/m/ov"},
                                                 "omnivoice_worker": {"max_batch": 8}})
    w, v = two.omnivoice_worker, two.omnivoice_vocoder
    assert (w.model, w.device, w.dtype, w.max_batch) == ("/m/ov", "cuda:0", "float16", 8)  # the reference's GPU dtype
    assert (v.codec, v.device) == ("/m/ov", "cuda:1") and two.scheduler.omnivoice_tokenizer == "/m/ov"
    assert two.worker.model is None and two.vocoder.codec is None  # MOSS keeps its own
    own = build(read_tables(), {"cluster": {"omnivoice_model": "/m/ov", "omnivoice_codec": "/m/higgs"}})
    assert own.omnivoice_vocoder.codec == "/m/higgs"
    with pytest.raises(ConfigError, match=r"\[omnivoice_worker\] has no key 'max_bach' \(did you mean 'max_batch'"):
        build(read_tables(), {"omnivoice_worker": {"max_bach": 8}})
    with pytest.raises(ConfigError, match=r"\[omnivoice_vocoder\] dtype = 'int8'"):
        build(read_tables(), {"omnivoice_vocoder": {"dtype": "int8"}})


@presets
def test_print_config_shows_the_omnivoice_services_and_round_trips(tmp_path):
    out = subprocess.run([sys.executable, "-m", "chorus.cli", "up", "--profile", "two-gpu", "--omnivoice-model",
                          "/m/ov", "--print-config"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[omnivoice_worker]" in out.stdout and "[omnivoice_vocoder]" in out.stdout
    path = tmp_path / "printed.toml"
    path.write_text(out.stdout)
    assert build(read_tables(str(path))) == build(read_tables(profile="two-gpu"),
                                                  {"cluster": {"omnivoice_model": "/m/ov"}})


def test_unknown_tables_are_named_with_the_omnivoice_ones(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text("[omnivoice]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"unknown table\(s\) omnivoice: .*\[omnivoice_worker\], "
                                          r"\[omnivoice_vocoder\]"):
        read_tables(str(path))


@presets
def test_one_cluster_serves_both_models():
    """The launcher starts the OmniVoice worker and vocoder and hands their addresses to the scheduler,
    whose `ready on` line names both models."""
    layout = build(read_tables(), {"cluster": {"quiet": True}, "scheduler": {"port": 0}})
    with layout.cluster_launcher() as cluster:
        names = [s.name for s in cluster.services]
        assert names[-3:] == ["omnivoice-worker", "omnivoice-vocoder", "scheduler"]
        ready = next(line for line in cluster.service("scheduler").lines if "ready on" in line)
        models = ready.split("models=")[1].split()[0].split(",")
        assert len(models) == 2 and models[1] == "omnivoice-tiny"


@presets
def test_the_codec_runs_in_the_worker_process_where_the_two_share_a_gpu():
    gpu = {"omnivoice_worker": {"device": "cuda:0"}, "omnivoice_vocoder": {"device": "cuda"}}
    one = build(read_tables(), gpu)
    assert one.colocate_omnivoice_codec and one.cluster_launcher().colocate_omnivoice_codec
    assert not build(read_tables()).colocate_omnivoice_codec  # on the CPU: a replica of its own
    assert not build(read_tables(profile="two-gpu"), {"cluster": {"omnivoice": True}}).colocate_omnivoice_codec
    assert not build(read_tables(), {**gpu, "cluster": {"omnivoice_vocoders": 2}}).colocate_omnivoice_codec
    assert not build(read_tables(), {**gpu, "cluster": {"colocate_omnivoice_codec": "off"}}).colocate_omnivoice_codec
    assert build(read_tables(), {"cluster": {"colocate_omnivoice_codec": "on"}}).colocate_omnivoice_codec
    with pytest.raises(ConfigError, match="runs one OmniVoice codec replica"):
        build(read_tables(), {"cluster": {"colocate_omnivoice_codec": "on", "omnivoice_vocoders": 2}})
