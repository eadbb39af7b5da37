"""OmniVoice on the worker: config, reveal schedule, packing layout, scoring and reveal, the model and
its loader, and the packed canvas engine, checked against spec section 7 and the `omnivoice` package."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from chorus.omnivoice.config import PRESETS, ConfigError, OmniVoiceConfig, tiny_config
from chorus.omnivoice.knobs import UnmaskKnobs
from gpu_worker.omnivoice.packing import Document, layout
from gpu_worker.omnivoice.unmask import noise_seed, reveal_counts, step_generator, unmask_step
from omnivoice_oracle import omnivoice

MASK = 1024


def _expand(*groups) -> list[int]:
    """Schedules written as in the spec: ints, or (value, repeat) pairs."""
    out = []
    for g in groups:
        out += [g[0]] * g[1] if isinstance(g, tuple) else [g]
    return out


# ---- spec section 7: reveal schedules ------------------------------------------------------------

SCHEDULES = [
    (100, 32, 0.1, [3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 6, 6, 6, 7, 8, 8, 9, 10, 11, 13, 14, 17, 19, 22, 26, 32, 39, 49,
                    64, 87, 125, 182]),
    (100, 16, 0.1, [6, 6, 7, 8, 9, 11, 13, 15, 19, 24, 30, 41, 58, 88, 151, 314]),
    (25, 32, 0.1, _expand((1, 7), (2, 9), 3, 3, 3, 4, 4, 5, 5, 6, 7, 8, 10, 13, 16, 22, 32, 34)),
    (36, 32, 0.1, _expand(1, 1, (2, 10), 3, 3, 3, 3, 4, 4, 4, 5, 6, 6, 7, 8, 10, 12, 14, 18, 23, 32, 45, 56)),
    (750, 32, 0.1, [20, 21, 22, 24, 25, 27, 29, 31, 33, 35, 38, 41, 45, 49, 54, 59, 66, 73, 82, 93, 105, 121, 140,
                    164, 195, 236, 290, 367, 479, 651, 937, 1448]),
    (1, 32, 0.1, _expand((1, 8), (0, 24))),
    (7, 8, 0.1, [1, 2, 2, 2, 3, 5, 11, 30]),
    (60, 8, 0.1, [7, 9, 12, 17, 25, 43, 87, 280]),
    (100, 32, 1.0, [25] * 32),
]


@pytest.mark.parametrize("frames,num_step,t_shift,expected", SCHEDULES)
def test_reveal_schedule_vectors(frames, num_step, t_shift, expected):
    assert list(reveal_counts(frames, num_step, t_shift)) == expected


def test_reveal_schedule_cumulative_for_100_frames():
    cumulative = np.cumsum(reveal_counts(100, 32, 0.1)).tolist()
    assert cumulative[:8] == [3, 6, 9, 13, 17, 21, 25, 30] and cumulative[-3:] == [493, 618, 800]


@pytest.mark.parametrize("num_step", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("frames", [1, 7, 137, 750])
def test_reveal_schedule_reveals_every_cell(num_step, frames):
    counts = reveal_counts(frames, num_step, 0.1)
    assert len(counts) == num_step and sum(counts) == 8 * frames and min(counts) >= 0


def test_reveal_schedule_equals_the_package():
    ov = omnivoice()
    get_time_steps = ov.models.omnivoice._get_time_steps
    for frames, num_step, t_shift in [(100, 32, 0.1), (13, 5, 0.3), (333, 64, 0.7), (100, 32, 1.0)]:
        s = get_time_steps(0.0, 1.0, num_step, t_shift).tolist()
        total, left, expected = 8 * frames, 8 * frames, []
        for k in range(num_step):
            n = left if k == num_step - 1 else min(int(np.ceil(total * (s[k + 1] - s[k]))), left)
            expected.append(n)
            left -= n
        assert list(reveal_counts(frames, num_step, t_shift)) == expected


# ---- spec section 7: packing ----------------------------------------------------------------------

def _ranges(*spans) -> list[int]:
    return [i for a, b in spans for i in range(a, b + 1)]


def test_packing_two_guided_requests():
    lay = layout([Document(40, 100, True), Document(12, 20, True)])
    assert lay.doc_lens == [140, 100, 32, 20] and lay.rows == 292
    assert lay.gather.tolist() == _ranges((40, 139), (252, 271), (140, 239), (272, 291))
    expected = np.concatenate([np.arange(140), np.arange(100), np.arange(32), np.arange(20)])
    assert lay.positions.tolist() == expected.tolist()
    assert lay.cond_column == [0, 100] and lay.uncond_column == [120, 220]


def test_packing_without_guidance_has_no_uncond_document():
    lay = layout([Document(40, 100, True), Document(12, 20, False)])
    assert lay.doc_lens == [140, 100, 32] and lay.rows == 272
    assert lay.gather.tolist() == _ranges((40, 139), (252, 271), (140, 239))
    assert lay.cond_column == [0, 100] and lay.uncond_column == [120, None]


def test_packing_single_request():
    lay = layout([Document(9, 6, True)])
    assert lay.doc_lens == [15, 6] and lay.gather.tolist() == _ranges((9, 14), (15, 20))
    assert lay.positions.tolist() == list(range(15)) + list(range(6))


# ---- config ---------------------------------------------------------------------------------------

def test_full_config_counts_the_released_parameters():
    assert OmniVoiceConfig().num_params == 612_577_280
    assert set(PRESETS) == {"tiny", "full"} and tiny_config().name == "omnivoice-tiny"


def test_config_round_trips_and_the_package_reads_it():
    ov = omnivoice()
    for cfg in (tiny_config(), OmniVoiceConfig()):
        d = cfg.to_dict()
        assert OmniVoiceConfig.from_dict(json.loads(json.dumps(d))) == cfg
        theirs = ov.models.omnivoice.OmniVoiceConfig(**{k: v for k, v in d.items() if k != "model_type"})
        assert theirs.llm_config.hidden_size == cfg.hidden_size
        assert theirs.llm_config.rope_parameters["rope_theta"] == cfg.rope_theta
        assert theirs.audio_mask_id == cfg.audio_mask_id and theirs.num_audio_codebook == 8


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.update(model_type="qwen3"), "model_type"),
    (lambda d: d.pop("llm_config"), "llm_config"),
    (lambda d: d["llm_config"].pop("head_dim"), "llm_config.head_dim"),
    (lambda d: d["llm_config"].update(hidden_size="64"), "llm_config.hidden_size"),
    (lambda d: d["llm_config"].update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda d: d["llm_config"].update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "rope_type"),
    (lambda d: d["llm_config"].update(rope_parameters={}), "rope_theta"),
    (lambda d: d["llm_config"].update(attention_bias=True), "attention_bias"),
    (lambda d: d.update(num_audio_codebook=12), "num_audio_codebook"),
    (lambda d: d.update(audio_mask_id=1025), "audio_mask_id"),
])
def test_bad_config_field_is_named(edit, field):
    d = tiny_config().to_dict()
    edit(d)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        OmniVoiceConfig.from_dict(d)


def test_from_pretrained_names_the_checkpoint_by_its_directory(tmp_path):
    d = tiny_config().to_dict()
    del d["chorus_name"]
    (tmp_path / "my-voice").mkdir()
    (tmp_path / "my-voice" / "config.json").write_text(json.dumps(d))
    assert OmniVoiceConfig.from_pretrained(tmp_path / "my-voice").name == "my-voice"
    with pytest.raises(ConfigError, match="config.json"):
        OmniVoiceConfig.from_pretrained(tmp_path)


# ---- scoring and reveal (tier A'): the package's own functions on identical logits ----------------

def _package_step(ov, canvas, cond, uncond, knobs: UnmaskKnobs, count: int, seed: int):
    """The package's scoring and reveal of one request (as _generate_iterative runs them), with the
    global RNG seeded so its noise is the stream our generator draws."""
    mod = ov.models.omnivoice
    gen = mod.OmniVoiceGenerationConfig(num_step=knobs.num_step, guidance_scale=knobs.guidance_scale,
                                        t_shift=knobs.t_shift, layer_penalty_factor=knobs.layer_penalty_factor,
                                        position_temperature=knobs.position_temperature,
                                        class_temperature=knobs.class_temperature)
    model = types.SimpleNamespace(config=types.SimpleNamespace(audio_mask_id=MASK))
    torch.manual_seed(seed)
    pred, scores = mod.OmniVoice._predict_tokens_with_scoring(model, cond[None], uncond[None], gen)
    scores = scores - torch.arange(8).view(1, -1, 1) * gen.layer_penalty_factor
    if gen.position_temperature > 0.0:
        scores = mod._gumbel_sample(scores, gen.position_temperature)
    tokens = canvas[None].clone()
    scores.masked_fill_(tokens != MASK, -float("inf"))
    _, idx = torch.topk(scores.flatten(), count)
    flat = tokens.flatten()
    flat[idx] = pred.flatten()[idx]
    return flat.view(8, -1)


@pytest.mark.parametrize("knobs", [
    UnmaskKnobs(position_temperature=0.0, class_temperature=0.0),
    UnmaskKnobs(position_temperature=0.0, class_temperature=0.0, guidance_scale=0.0),
    UnmaskKnobs(),  # position temperature 5
    UnmaskKnobs(class_temperature=0.8, guidance_scale=3.0, layer_penalty_factor=1.5),
    UnmaskKnobs(class_temperature=1.0, position_temperature=0.0, guidance_scale=0.0),
])
def test_scoring_and_reveal_equal_the_package(knobs):
    ov = omnivoice()
    g = torch.Generator().manual_seed(7)
    frames = 37
    canvas = torch.full((8, frames), MASK, dtype=torch.long)
    for count in (5, 40, 100):
        cond = torch.randn(8, frames, 1025, generator=g) * 4
        uncond = torch.randn(8, frames, 1025, generator=g) * 4
        seed = 1234 + count
        ours = unmask_step(canvas, cond, uncond if knobs.guidance_scale else None, knobs, count, MASK,
                           torch.Generator().manual_seed(seed))
        theirs = _package_step(ov, canvas, cond, uncond, knobs, count, seed)
        assert torch.equal(ours, theirs)
        assert int((ours != MASK).sum()) == int((canvas != MASK).sum()) + count
        assert torch.equal(ours[canvas != MASK], canvas[canvas != MASK])  # revealed cells stay
        assert MASK not in ours[canvas == MASK][ours[canvas == MASK] != MASK].tolist()
        canvas = ours


def test_reveal_does_not_mutate_its_inputs():
    canvas = torch.full((8, 5), MASK, dtype=torch.long)
    cond = torch.randn(8, 5, 1025)
    before = (canvas.clone(), cond.clone())
    unmask_step(canvas, cond, None, UnmaskKnobs(guidance_scale=0.0), 10, MASK, step_generator(1, 0))
    assert torch.equal(canvas, before[0]) and torch.equal(cond, before[1])


def test_noise_seed_differs_per_step_and_request():
    seeds = {noise_seed(s, k) for s in (0, 1, 2, 2**64 - 1) for k in range(64)}
    assert len(seeds) == 4 * 64 and all(0 <= x < 2**63 for x in seeds)
