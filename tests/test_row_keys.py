"""Radix keys: spec moss_tts_local.md §4.4 and the §7.8 vectors."""

import hashlib

import numpy as np

from scheduler_svc.row_keys import generated_row_key, generated_row_keys, prompt_row_key, prompt_row_keys

ROW_0_11 = [151656, *range(12)]
ROW_ZEROS = [151656] + [0] * 12
AUDIO_START_ROW = [151669] + [1024] * 12


def test_generated_row_vectors():
    assert generated_row_key(ROW_0_11) == 40976
    assert generated_row_key(ROW_ZEROS) == 19662
    assert generated_row_key([151670] + [0] * 12) == 151670
    assert generated_row_key([151670] + [1024] * 12) == 151670
    assert generated_row_key(np.array([151670, *range(5, 17)], dtype=np.int32)) == 151670


def test_generated_row_keys_below_special_band():
    rng = np.random.default_rng(0)
    rows = np.concatenate([np.full((500, 1), 151656), rng.integers(0, 1024, (500, 12))], axis=1)
    keys = generated_row_keys(rows)
    assert keys.min() >= 0 and keys.max() < 151643
    assert keys.tolist() == [generated_row_key(r) for r in rows]


def test_prompt_row_vectors():
    assert prompt_row_key(ROW_0_11) == 2571782315595056494
    assert prompt_row_key(AUDIO_START_ROW) == 3371933513111111179
    assert prompt_row_key(np.array(AUDIO_START_ROW, dtype=np.int32)) == 3371933513111111179
    # definition: blake2b over 13 little-endian int64, digest 8, LE, top bit cleared
    raw = b"".join(v.to_bytes(8, "little") for v in ROW_0_11)
    assert prompt_row_key(ROW_0_11) == int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") & (2**63 - 1)


def test_vectorised_matches_scalar():
    rows = np.array([ROW_0_11, ROW_ZEROS, AUDIO_START_ROW, [151670] + [3] * 12], dtype=np.int32)
    assert prompt_row_keys(rows).tolist() == [2571782315595056494, prompt_row_key(ROW_ZEROS),
                                              3371933513111111179, prompt_row_key(rows[3])]
    assert generated_row_keys(rows).tolist() == [40976, 19662, generated_row_key(AUDIO_START_ROW), 151670]
    assert prompt_row_keys(np.zeros((0, 13), dtype=np.int64)).shape == (0,)
    assert generated_row_keys(np.zeros((0, 13), dtype=np.int64)).shape == (0,)
