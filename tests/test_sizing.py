"""Batch, KV and vocoder slots sized from the device's memory (chorus/sizing.py), with H200-like and
small-GPU numbers; and the layout rule that leaves them to sizing on CUDA only."""

import pytest

from chorus.sizing import (CPU_KV_SLOTS, CPU_MAX_BATCH, GiB, MAX_BATCH, ModelFootprint, size_vocoder, size_worker)
from vocoder_svc.config import VocoderConfig
from vocoder_svc.footprint import footprint

# MOSS-TTS Local v1.5's backbone in bf16 (36 layers, 8 KV heads of 128): 144 KiB of KV a row.
MOSS = ModelFootprint(layers=36, kv_heads=8, head_dim=128, dtype_bytes=2, weight_bytes=int(4.5 * GiB))
CODEC = footprint(VocoderConfig(preset="full", dtype="bfloat16"))
H200 = int(139.8 * GiB)


def test_the_full_codec_footprint_matches_its_measured_numbers():
    # chorus bench vocoder on the full preset: 88,678,400 KV bytes a stream; 2.12 B parameters in all
    assert CODEC.slot_bytes == 3 * 88_678_400
    assert CODEC.weight_bytes / 2 == pytest.approx(2.12e9, rel=0.01)
    assert MOSS.kv_row_bytes == 147_456


def test_an_h200_with_the_decoder_colocated_runs_a_batch_of_256():
    s = size_worker(H200 - GiB, H200, 0.9, MOSS, max_context=8192, codec=CODEC)
    assert (s.max_batch, s.vocoder_slots) == (MAX_BATCH, MAX_BATCH)
    assert s.kv_slots >= 256 * 1024  # KV for the whole batch at 1,024 rows each, and more for the cache
    used = MOSS.weight_bytes + CODEC.weight_bytes + s.kv_slots * MOSS.kv_row_bytes + 256 * CODEC.slot_bytes
    assert used <= 0.9 * H200
    assert "max_batch 256" in s.explain() and "kv_slots" in s.explain()


def test_an_h200_shared_by_two_processes_still_gives_both_256():
    worker = size_worker(H200 - GiB, H200, 0.35, MOSS, max_context=8192)
    vocoder = size_vocoder(H200 - GiB, H200, 0.55, CODEC)
    assert worker.max_batch == vocoder.vocoder_slots == 256
    assert worker.kv_slots * MOSS.kv_row_bytes + MOSS.weight_bytes <= 0.35 * H200


def test_a_small_gpu_gets_a_smaller_batch_and_what_is_left_for_kv():
    s = size_worker(int(23.5 * GiB), 24 * GiB, 0.9, MOSS, max_context=8192, codec=CODEC)
    assert (s.max_batch, s.vocoder_slots) == (16, 16)
    assert 16 * 1024 <= s.kv_slots < 64 * 1024
    a100 = size_worker(79 * GiB, 80 * GiB, 0.9, MOSS, max_context=8192, codec=CODEC)
    assert a100.max_batch == 128


def test_free_memory_bounds_the_allowance_and_given_values_are_kept():
    busy = size_worker(40 * GiB, H200, 0.9, MOSS, max_context=8192)  # another process holds 100 GiB
    assert busy.max_batch == 128 and "40.0 GiB allowed" in busy.explain()
    given = size_worker(H200 - GiB, H200, 0.9, MOSS, max_context=8192, max_batch=64)
    assert given.max_batch == 64 and given.kv_slots == 64 * 8192  # capped at max_batch x max_context
    kept = size_worker(H200 - GiB, H200, 0.9, MOSS, max_context=8192, kv_slots=150_000)
    assert kept.kv_slots == 150_000 and kept.max_batch == 256


def test_a_vocoders_buckets_cap_its_slots():
    assert size_vocoder(H200 - GiB, H200, 0.9, CODEC, largest_bucket=96).vocoder_slots == 96
    assert size_vocoder(int(23.5 * GiB), 24 * GiB, 0.9, CODEC).vocoder_slots == 32


def test_the_layout_sizes_on_cuda_and_keeps_the_cpu_defaults():
    from chorus.layout import build, read_tables

    cpu = build(read_tables(None, "cpu"))
    assert (cpu.worker.max_batch, cpu.worker.kv_slots, cpu.vocoder.slots) == (CPU_MAX_BATCH, CPU_KV_SLOTS, 64)
    one = build(read_tables(None, "one-gpu"))  # colocated: the worker sizes the decoder it hosts
    assert (one.worker.max_batch, one.worker.kv_slots, one.vocoder.slots) == (0, 0, 0)
    assert one.colocate and one.vocoder.launch_ahead_streams == 0  # half the sized slots
    assert one.worker.memory_fraction == 0.9
    two = build(read_tables(None, "cpu"), {"cluster": {"device": "cuda", "colocate_vocoder": "off"}})
    assert (two.worker.memory_fraction, two.vocoder.memory_fraction) == (0.35, 0.55)
    given = build(read_tables(None, "two-gpu-high-load"))  # the profile's own values win
    assert (given.worker.max_batch, given.worker.kv_slots, given.vocoder.slots) == (256, 150000, 128)
    assert given.worker.memory_fraction == 0.9  # a GPU each
