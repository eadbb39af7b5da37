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

torch.set_num_threads(1)  # tiny GEMMs: threads only contend on a shared CI machine
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


# ---- the model and its loader, against the package's own checkpoint and forward --------------------

from gpu_worker.loader import CheckpointError  # noqa: E402
from gpu_worker.omnivoice.engine import CanvasEngine, CanvasError, CanvasSpec  # noqa: E402
from gpu_worker.omnivoice.loader import build_omnivoice, expected_shapes  # noqa: E402
from gpu_worker.omnivoice.model import OmniVoiceModel  # noqa: E402


@pytest.fixture(scope="module")
def package_checkpoint(tmp_path_factory):
    """A tiny checkpoint written by the package's save_pretrained, with weights large enough that
    logits are far from uniform. Returns (package module, package model, directory)."""
    ov = omnivoice()
    from transformers import Qwen3Config

    llm = Qwen3Config(vocab_size=151676, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      rope_theta=1e6, tie_word_embeddings=True)
    model = ov.models.omnivoice.OmniVoice(ov.models.omnivoice.OmniVoiceConfig(llm_config=llm.to_dict()))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
    directory = tmp_path_factory.mktemp("omnivoice") / "tiny-omnivoice"
    model.save_pretrained(str(directory))
    return ov, model.eval(), directory


def _package_logits(model, ids, audio_mask):
    rows = ids.shape[1]
    full = torch.ones(1, 1, rows, rows, dtype=torch.bool)
    with torch.no_grad():
        return model(input_ids=ids[None], audio_mask=audio_mask[None], attention_mask=full).logits.float()[0]


def _document(g, prefix: int, frames: int, masked: int = 0):
    ids = torch.randint(0, 1024, (8, prefix + frames), generator=g)
    ids[:, :prefix] = torch.randint(0, 151676, (1, prefix), generator=g)
    if masked:
        ids[:, -masked:] = MASK
    return ids, torch.arange(prefix + frames) >= prefix


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_checkpoint_loads_and_forward_equals_the_package(package_checkpoint, dtype):
    _, theirs, directory = package_checkpoint
    ours = build_omnivoice(model_dir=directory, dtype=str(dtype).split(".")[1])
    assert ours.cfg.name == "tiny-omnivoice" and next(ours.parameters()).dtype == dtype
    theirs = theirs.to(dtype)
    g = torch.Generator().manual_seed(1)
    # Row counts the package runs in one GEMM are multiples of 4 (see model.ROW_MULTIPLE).
    (a, ma), (b, mb) = _document(g, 12, 20, masked=9), _document(g, 0, 16, masked=3)
    expected = [_package_logits(theirs, a, ma), _package_logits(theirs, b, mb)]
    with torch.no_grad():
        packed = ours(torch.cat([a, b], 1), torch.cat([ma, mb]), torch.cat([torch.arange(32), torch.arange(16)]),
                      [32, 16], torch.arange(48))
        gathered = ours(torch.cat([b, a], 1), torch.cat([mb, ma]), torch.cat([torch.arange(16), torch.arange(32)]),
                        [16, 32], torch.tensor([40, 41, 3]))
    assert packed.dtype == torch.float32
    assert torch.equal(packed[:, :32], expected[0]) and torch.equal(packed[:, 32:], expected[1])
    assert torch.equal(gathered, torch.cat([expected[0][:, 24:26], expected[1][:, 3:4]], dim=1))
    theirs.to(torch.float32)


def _rewrite(directory, dest, edit):
    from safetensors.torch import load_file, save_file

    dest.mkdir()
    (dest / "config.json").write_text((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("audio_heads.weight"), "missing tensors: audio_heads.weight"),
    (lambda t: t.update({"lm_head.weight": torch.zeros(2, 2)}), "unexpected tensors: lm_head.weight"),
    (lambda t: t.update({"audio_embeddings.weight": torch.zeros(8200, 32)}),
     r"audio_embeddings.weight: checkpoint \(8200, 32\), config.json implies \(8200, 64\)"),
    (lambda t: t.update({"codebook_layer_offsets": torch.arange(8)}), "codebook_layer_offsets"),
])
def test_checkpoint_errors_name_the_tensor(package_checkpoint, tmp_path, edit, message):
    bad = _rewrite(package_checkpoint[2], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        build_omnivoice(model_dir=bad)


def test_checkpoint_without_offsets_and_sharded(package_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = package_checkpoint[2]
    reference = build_omnivoice(model_dir=directory)
    plain = build_omnivoice(model_dir=_rewrite(directory, tmp_path / "plain", lambda t: t.pop("codebook_layer_offsets")))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(sharded / file))
        weight_map.update({n: file for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for other in (plain, build_omnivoice(model_dir=sharded)):
        for (name, p), q in zip(reference.state_dict().items(), other.state_dict().values()):
            assert torch.equal(p, q), name


def test_full_size_shapes_on_the_meta_device():
    shapes = expected_shapes(OmniVoiceConfig())
    assert shapes["llm.embed_tokens.weight"] == (151676, 1024)
    assert shapes["llm.layers.27.self_attn.q_proj.weight"] == (2048, 1024)
    assert shapes["llm.layers.0.self_attn.o_proj.weight"] == (1024, 2048)
    assert shapes["llm.layers.0.self_attn.k_proj.weight"] == (1024, 1024)
    assert shapes["llm.layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["llm.layers.0.mlp.down_proj.weight"] == (1024, 3072)
    assert shapes["audio_embeddings.weight"] == shapes["audio_heads.weight"] == (8200, 1024)
    assert sum(1 for n in shapes if n.startswith("llm.")) == 310
    with torch.device("meta"):
        model = OmniVoiceModel(OmniVoiceConfig())
    assert sum(p.numel() for p in model.parameters()) == 612_577_280
    assert sum(p.numel() for p in model.llm.parameters()) == 595_783_680


def test_tiny_preset_builds():
    model = build_omnivoice(preset="tiny", seed=3)
    assert model.cfg.name == "omnivoice-tiny" and next(model.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="preset"):
        build_omnivoice(preset="huge")


# ---- tier A: whole generations equal the package's _generate_iterative -----------------------------

def _package_generate(ov, model, *, text, frames, knobs, lang=None, instruct=None, ref_text=None, ref_codes=None):
    """The package's generation of one request (its own prompt code over our tokenizer), and the
    prepared cond input it built, captured."""
    from omnivoice_oracle import PackageTokenizer

    mod = ov.models.omnivoice
    model.text_tokenizer = PackageTokenizer()
    captured = []
    prepare = model._prepare_inference_inputs

    def capture(*a, **k):
        out = prepare(*a, **k)
        captured.append(out)
        return out

    model._prepare_inference_inputs = capture
    try:
        task = mod.GenerationTask(batch_size=1, texts=[text], target_lens=[frames], langs=[lang],
                                  instructs=[instruct], ref_texts=[ref_text],
                                  ref_audio_tokens=[None if ref_codes is None else torch.as_tensor(ref_codes).T],
                                  ref_rms=[None])
        gen = mod.OmniVoiceGenerationConfig(num_step=knobs.num_step, guidance_scale=knobs.guidance_scale,
                                            t_shift=knobs.t_shift, layer_penalty_factor=knobs.layer_penalty_factor,
                                            position_temperature=knobs.position_temperature,
                                            class_temperature=knobs.class_temperature)
        with torch.no_grad():
            tokens = model._generate_iterative(task, gen)[0]
    finally:
        del model._prepare_inference_inputs
    ids, audio_mask = captured[0]["input_ids"][0], captured[0]["audio_mask"][0]
    text_rows = int(audio_mask.long().argmax())
    return tokens, ids[0, :text_rows].numpy()


GREEDY = dict(position_temperature=0.0, class_temperature=0.0, num_step=8)
CASES = {
    "english": dict(text="Hello world, this is a parity test.", frames=23, lang="en", knobs=UnmaskKnobs(**GREEDY)),
    "chinese": dict(text="今天天气很好，我们出去走走吧。", frames=31, lang="zh", knobs=UnmaskKnobs(**GREEDY)),
    "clone": dict(text="Good morning.", frames=17, lang="en", ref_text="Nice to meet you.",
                  ref_codes=np.random.default_rng(4).integers(0, 1024, (12, 8)),
                  knobs=UnmaskKnobs(guidance_scale=3.0, layer_penalty_factor=2.0, **GREEDY)),
    "instruct": dict(text="Speak softly please.", frames=19, instruct="female, low pitch",
                     knobs=UnmaskKnobs(guidance_scale=0.0, t_shift=0.3, **GREEDY)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_final_canvas_equals_the_package(package_checkpoint, case, dtype):
    ov, theirs, directory = package_checkpoint
    args = CASES[case]
    expected, text_ids = _package_generate(ov, theirs.to(dtype), **args)
    theirs.to(torch.float32)
    engine = CanvasEngine(build_omnivoice(model_dir=directory, dtype=str(dtype).split(".")[1]))
    engine.start(CanvasSpec(1, text_ids, args.get("ref_codes"), args["frames"], args["knobs"], seed=0))
    for k in range(args["knobs"].num_step):
        (outcome,) = engine.step([(1, k)])
    assert outcome.finished and outcome.codes.shape == (args["frames"], 8) and len(engine) == 0
    assert (outcome.codes != MASK).all() and len(np.unique(outcome.codes)) > args["frames"]  # not a degenerate model
    assert np.array_equal(outcome.codes, expected.T.numpy())


# ---- tier B and seeded sampling: a request's tokens do not depend on its neighbours ---------------

def _spec(rid: int, rng: np.random.Generator, frames: int, knobs: UnmaskKnobs, seed: int, reference: int = 0):
    text = rng.integers(0, 151676, int(rng.integers(5, 30)))
    codes = rng.integers(0, 1024, (reference, 8)) if reference else None
    return CanvasSpec(rid, text, codes, frames, knobs, seed)


def _alone(engine: CanvasEngine, spec: CanvasSpec) -> np.ndarray:
    engine.start(spec)
    for k in range(spec.knobs.num_step):
        (outcome,) = engine.step([(spec.request_id, k)])
    return outcome.codes


def _packed(engine: CanvasEngine, target: CanvasSpec, neighbours: list[tuple[CanvasSpec, int]]) -> np.ndarray:
    """`target` from step 0 to its end, packed beside neighbours that start `lead` steps earlier."""
    for spec, lead in neighbours:
        engine.start(spec)
        for k in range(lead):
            engine.step([(spec.request_id, k)])
    engine.start(target)
    done = {}
    while target.request_id not in done:
        items = [(rid, c.steps_done) for rid, c in sorted(engine.canvases.items(), key=lambda kv: -kv[0])]
        for outcome in engine.step(items):
            if outcome.finished:
                done[outcome.request_id] = outcome.codes
    for spec, _ in neighbours:
        engine.release(spec.request_id)
    return done[target.request_id]


@pytest.fixture(scope="module")
def engine64():
    return CanvasEngine(build_omnivoice(preset="tiny", dtype="float64", seed=11), max_batch=8)


@pytest.mark.parametrize("knobs", [UnmaskKnobs(num_step=8, position_temperature=0.0),
                                   UnmaskKnobs(num_step=8, guidance_scale=0.0, position_temperature=0.0),
                                   UnmaskKnobs(num_step=8, class_temperature=0.7)])
def test_packed_beside_others_equals_alone(engine64, knobs):
    rng = np.random.default_rng(2)
    target = _spec(1, rng, 29, knobs, seed=77, reference=6)
    alone = _alone(engine64, target)
    neighbours = [(_spec(2, rng, 41, UnmaskKnobs(num_step=12, guidance_scale=3.5), seed=5), 3),
                  (_spec(3, rng, 13, UnmaskKnobs(num_step=16, guidance_scale=0.0, class_temperature=1.0), seed=6,
                         reference=9), 5)]
    assert np.array_equal(_packed(engine64, target, neighbours), alone)
    assert len(engine64) == 0


def test_seeded_sampling(engine64):
    rng = np.random.default_rng(3)
    knobs = UnmaskKnobs(num_step=8, class_temperature=0.9, position_temperature=5.0)
    first = _spec(1, rng, 25, knobs, seed=1234)
    same = _alone(engine64, first)
    assert np.array_equal(_alone(engine64, first), same)
    other = _alone(engine64, CanvasSpec(1, first.text_ids, None, 25, knobs, seed=1235))
    assert (other != same).mean() > 0.3
    neighbour = (_spec(2, rng, 30, UnmaskKnobs(num_step=10, class_temperature=2.0), seed=1234), 2)
    assert np.array_equal(_packed(engine64, first, [neighbour]), same)


def test_random_start_step_release_sequences_leave_no_canvas_held():
    engine = CanvasEngine(build_omnivoice(preset="tiny", seed=2), max_batch=6, max_packed_rows=400)
    rng = np.random.default_rng(9)
    for _ in range(100):
        rids = list(range(int(rng.integers(1, 6))))
        for rid in rids:
            knobs = UnmaskKnobs(num_step=int(rng.integers(1, 5)), guidance_scale=float(rng.choice([0.0, 2.0])))
            engine.start(_spec(rid, rng, int(rng.integers(1, 9)), knobs, seed=rid))
        finished = set()
        for _ in range(int(rng.integers(0, 6))):
            live = [(rid, c.steps_done) for rid, c in engine.canvases.items()]
            if rng.random() < 0.3 and live:
                engine.release(live[int(rng.integers(len(live)))][0])
                continue
            if live:
                finished |= {o.request_id for o in engine.step(live) if o.finished}
        for rid in rids:  # what the scheduler does for each of its requests, finished or not
            engine.release(rid)
        assert len(engine) == 0
    assert engine.steps > 0


def test_bad_canvas_requests_name_the_field():
    engine = CanvasEngine(build_omnivoice(preset="tiny"), max_batch=2, max_packed_rows=100)
    ok = dict(request_id=1, text_ids=np.arange(5), reference_codes=None, target_frames=10, knobs=UnmaskKnobs(),
              seed=0)
    for change, field in [(dict(text_ids=np.zeros(0, np.int64)), "text_ids"),
                          (dict(text_ids=np.array([151676])), "text_ids"),
                          (dict(reference_codes=np.zeros((3, 7), np.int64)), "reference_codes"),
                          (dict(reference_codes=np.full((3, 8), MASK)), "reference_codes"),
                          (dict(target_frames=0), "target_frames"),
                          (dict(knobs=UnmaskKnobs(num_step=65)), "num_step"),
                          (dict(knobs=UnmaskKnobs(t_shift=0.0)), "t_shift"),
                          (dict(target_frames=60), "max_packed_rows")]:
        with pytest.raises(CanvasError, match=field):
            engine.start(CanvasSpec(**{**ok, **change}))
    engine.start(CanvasSpec(**ok))
    with pytest.raises(CanvasError, match="already held"):
        engine.start(CanvasSpec(**ok))
    for items, message in [([(2, 0)], "no canvas"), ([(1, 1)], "next step is 0"), ([(1, 0), (1, 0)], "twice")]:
        with pytest.raises(CanvasError, match=message):
            engine.step(items)
    engine.start(CanvasSpec(**{**ok, "request_id": 2, "target_frames": 40}))
    with pytest.raises(CanvasError, match="max_packed_rows"):
        engine.step([(1, 0), (2, 0)])
    assert [o.step for o in engine.step([(1, 0)])] == [0] and len(engine) == 2


def test_steps_that_reveal_nothing_skip_the_forward(monkeypatch):
    engine = CanvasEngine(build_omnivoice(preset="tiny"))
    engine.start(CanvasSpec(1, np.arange(4), None, 1, UnmaskKnobs(num_step=32), seed=1))  # reveals 1,1,...,0,0
    calls = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda *a: calls.append(1) or forward(*a))
    outcomes = [engine.step([(1, k)])[0] for k in range(32)]
    assert len(calls) == 8 and outcomes[-1].finished and (outcomes[-1].codes != MASK).all()
