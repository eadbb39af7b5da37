"""OmniVoice prompt and length (spec 3): the spec's vectors, then parity with the `omnivoice`
package's own functions and, token for token, with the canvases its generate() path builds."""

import types

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from chorus.omnivoice.duration import char_weight, estimate_frames, estimate_length, text_weight
from chorus.omnivoice.instruct import InstructError, resolve_instruct
from chorus.omnivoice.languages import ID_BY_NAME, LANGUAGE_IDS, resolve_language
from chorus.omnivoice.prompt import LONG_FORM_FRAMES, Piece, PromptError, plan_pieces, style_text
from chorus.omnivoice.text import NONVERBAL_TAGS, add_end_punctuation, chunk_text, combine_text
from chorus.omnivoice.tokenizer import SPECIAL_TOKENS, load_omnivoice_tokenizer
from omnivoice_oracle import PackageTokenizer, omnivoice

TOK = load_omnivoice_tokenizer(None)

# ---------------------------------------------------------------------------------------------
# Spec section 7 vectors
# ---------------------------------------------------------------------------------------------

DURATION = [  # text, W, estimate, T (no reference)
    ("Hello world.", 10.7, 36.1977, 36),
    ("Hello, world.", 11.2, 36.7530, 36),
    ("Hi.", 2.5, 22.2946, 22),
    ("Hello, this is a test of duration control", 34.9, 61.8794, 61),
    ("The quick brown fox jumps over the lazy dog.", 37.1, 65.7801, 65),
    ("今天天气很好。", 18.5, 43.4454, 43),
    ("今天天气很好，我们出去走走吧。", 40.0, 70.9220, 70),
    ("Xin chào, đây là một câu thử.", 23.2, 46.8507, 46),
    ("I have 3 apples.", 15.6, 41.0451, 41),
    ("Hello [laughter] world.", 19.9, 44.5148, 44),
    ("안녕하세요", 12.5, 38.1233, 38),
    ("こんにちは", 11.0, 36.5329, 36),
]


@pytest.mark.parametrize("text,weight,estimate,frames", DURATION)
def test_duration_vectors(text, weight, estimate, frames):
    assert text_weight(text) == pytest.approx(weight, abs=1e-9)
    assert estimate_length(text, "Nice to meet you.", 25) == pytest.approx(estimate, abs=1e-4)
    assert estimate_frames(text) == frames
    assert plan_pieces(TOK, text)[0].target_frames == frames


def test_duration_speed_and_reference_vectors():
    assert estimate_frames("Hello, this is a test of duration control", speed=1.2) == 51
    ref = "This is the reference transcript."
    assert estimate_length("Good morning.", ref, 75) == pytest.approx(42.1476, abs=1e-4)
    assert estimate_frames("Good morning.", ref, 75) == 42
    long = "The weather today is absolutely beautiful and I feel wonderful."
    assert text_weight(long) == pytest.approx(55.3)
    assert estimate_frames(long, ref, 75) == 141
    assert plan_pieces(TOK, long, has_reference=True, reference_text=ref, reference_frames=75)[0].target_frames == 141


def test_duration_edges():
    assert text_weight("Nice to meet you.") == pytest.approx(14.1)
    assert estimate_frames("", None, None) == 1  # no weight: 0 frames, floored to 1
    assert estimate_frames("Hello", "...", 0) == 1  # a reference with no frames gives 0
    assert estimate_frames("Hello", "", 80) == estimate_frames("Hello")  # empty transcript: default rate
    assert estimate_frames("Hello world.", speed=0) == 36  # a non-positive speed is ignored


@pytest.mark.parametrize("ch,weight", [
    ("é", 1.0), ("\u0301", 0.0), ("5", 3.5), ("٣", 3.5), ("€", 0.5), ("🌍", 0.5), ("。", 0.5),
    ("\u3000", 0.2), ("\t", 1.0), ("\U00020000", 1.0), ("\U00020001", 3.0), ("\u0640", 0.0), (" ", 0.2),
])
def test_char_weight_vectors(ch, weight):
    assert char_weight(ch) == weight


def test_combine_vectors():
    assert combine_text("  Hello   world\n") == "Hello world"
    assert combine_text("今天 天气 很好 。") == "今天天气很好。"
    assert combine_text("Good morning.", " Nice to meet you. ") == "Nice to meet you. Good morning."
    assert combine_text("（test）") == "(test)"
    assert combine_text("Hello 你好 world") == "Hello你好world"
    assert combine_text("a\r\nb") == "ab"


def test_punctuation_vectors():
    assert add_end_punctuation("Hello world") == "Hello world."
    assert add_end_punctuation("你好") == "你好。"
    assert add_end_punctuation("Yes!") == "Yes!"
    assert add_end_punctuation("Done)") == "Done)"
    assert add_end_punctuation("  ") == ""


def test_instruct_vectors():
    assert resolve_instruct("Female, British Accent", "Hello") == "female, british accent"
    assert resolve_instruct("female, low pitch", "今天天气很好。") == "女，低音调"
    assert resolve_instruct("male, 四川话", "Hello") == "男，四川话"
    assert resolve_instruct("elderly,whisper", "Hello") == "elderly, whisper"
    assert resolve_instruct("男，青年", "Good morning.") == "male, young adult"
    assert resolve_instruct(None, "x") is None and resolve_instruct("  ", "x") is None


def test_chunk_vector():
    text = "Mr. Smith went to Washington. He arrived at noon; the weather was fine! Then he left, quietly. Dr. Who?"
    assert chunk_text(text, 40, 3) == ["Mr. Smith went to Washington.", "He arrived at noon;",
                                       "the weather was fine! Then he left,", "quietly. Dr. Who?"]
    assert chunk_text("A. There is more.", 5, 3) == ["A. There is more."]
    assert chunk_text("One. Two. Three. G", 5, 3) == ["One.", "Two.", "Three. G"]


def test_style_vectors():
    plain = "<|lang_start|>en<|lang_end|><|instruct_start|>None<|instruct_end|>"
    assert style_text("en", None, False) == plain
    assert style_text("en", None, True) == "<|denoise|>" + plain
    assert style_text("en", "female, british accent", False) == (
        "<|lang_start|>en<|lang_end|><|instruct_start|>female, british accent<|instruct_end|>")
    assert style_text(None, None, False) == "<|lang_start|>None<|lang_end|><|instruct_start|>None<|instruct_end|>"


def test_plan_pieces_layout():
    [piece] = plan_pieces(TOK, "Hello world.", language="English", instructions="female")
    assert isinstance(piece, Piece) and piece.reference == "none" and piece.text == "Hello world."
    expected = TOK.encode(style_text("en", "female", False)) + TOK.encode("<|text_start|>Hello world.<|text_end|>")
    assert piece.text_ids == expected
    [clone] = plan_pieces(TOK, "Hello world.", has_reference=True, reference_text="Hi there", reference_frames=50)
    assert clone.reference == "request" and clone.text_ids[0] == SPECIAL_TOKENS["<|denoise|>"]
    assert clone.text_ids[-1] == SPECIAL_TOKENS["<|text_end|>"]
    assert TOK.encode("<|text_start|>Hi there. Hello world.<|text_end|>") == clone.text_ids[-len(
        TOK.encode("<|text_start|>Hi there. Hello world.<|text_end|>")):]
    [quiet] = plan_pieces(TOK, "Hello world.", has_reference=True, reference_text="Hi", reference_frames=50,
                          denoise=False)
    assert SPECIAL_TOKENS["<|denoise|>"] not in quiet.text_ids
    [plain] = plan_pieces(TOK, "Hello world.", denoise=True)  # denoise only with a reference
    assert SPECIAL_TOKENS["<|denoise|>"] not in plain.text_ids


def test_plan_pieces_duration_and_long_form():
    assert plan_pieces(TOK, "Hello world.", duration_seconds=2.0, speed=3.0)[0].target_frames == 50
    assert plan_pieces(TOK, "Hello world.", duration_seconds=0.01)[0].target_frames == 1
    text = " ".join(["The quick brown fox jumps over the lazy dog, and then it rests."] * 12)
    pieces = plan_pieces(TOK, text)
    assert estimate_frames(text) > LONG_FORM_FRAMES and len(pieces) > 1
    assert [p.reference for p in pieces] == ["none"] + ["first_piece"] * (len(pieces) - 1)
    assert all(p.target_frames <= LONG_FORM_FRAMES for p in pieces)
    later = pieces[1]
    assert later.target_frames == estimate_frames(later.text, pieces[0].text, pieces[0].target_frames)
    cloned = plan_pieces(TOK, text, has_reference=True, reference_text="", reference_frames=80)
    assert {p.reference for p in cloned} == {"request"}


@pytest.mark.parametrize("kwargs,field", [
    (dict(text="   \n"), "text"),
    (dict(text="Hi", instructions="female, male"), "instructions"),
    (dict(text="Hi", instructions="angry pirate"), "instructions"),
    (dict(text="Hi", instructions="british accent, 四川话"), "instructions"),
    (dict(text="Hi", instructions="x" * 500), "instructions"),
    (dict(text="Hi", has_reference=True, reference_text="Hey", reference_frames=0), "references"),
    (dict(text="Hi", reference_text="Hey"), "references"),
    (dict(text="Hi", duration_seconds=0.0), "duration_seconds"),
    (dict(text="Hi", duration_seconds=float("nan")), "duration_seconds"),
])
def test_plan_pieces_errors(kwargs, field):
    with pytest.raises(PromptError) as err:
        plan_pieces(TOK, **kwargs)
    assert err.value.field == field and isinstance(err.value, ValueError)
    assert "x" * 41 not in str(err.value)  # user input is quoted back at most ~40 characters


# ---------------------------------------------------------------------------------------------
# Parity with the package's own functions
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ov():
    return omnivoice()


def test_language_table_matches_package(ov):
    from omnivoice.utils.lang_map import LANG_IDS, LANG_NAME_TO_ID

    assert ID_BY_NAME == LANG_NAME_TO_ID and LANGUAGE_IDS == LANG_IDS and len(LANGUAGE_IDS) == 646


LANGUAGES = [None, "", "none", "None", "NONE", "en", "EN", "English", "ENGLISH", "english", "zh", "Chinese",
             "yue", "Cantonese", "vi", "Vietnamese", "ja", "Japanese", "de", "German", "Klingon", "xx",
             "Arbëreshë Albanian", "aae", "fe'fe'", "  English", "en-US", "Western Frisian"]


@pytest.mark.parametrize("language", LANGUAGES)
def test_language_parity(ov, language):
    assert resolve_language(language) == ov.models.omnivoice._resolve_language(language)


INSTRUCTS = [
    "female", "Male", "FEMALE, British Accent", "female, low pitch", "male, 四川话", "elderly,whisper",
    "男，青年", "女， 中年 ，耳语", "young adult, high pitch, whisper, american accent", "child, 东北话",
    "female ,  very low pitch", ",female,", "，，", " , ", "teenager，moderate pitch",
    "middle-aged, indian accent", "very high pitch, 女", "female, male", "男，女", "female, 女",
    "low pitch, high pitch", "british accent, american accent",
    "四川话，河南话", "british accent, 四川话", "angry", "femail", "whisper, shouting", "female; low pitch",
    "女，british accent", "korean accent, 老年", "老年, japanese accent",
]


@pytest.mark.parametrize("instruct", INSTRUCTS)
@pytest.mark.parametrize("text", ["Hello there.", "今天天气很好。", "Hello 你好"])
def test_instruct_parity(ov, instruct, text):
    use_zh = bool(text and ov.utils.voice_design._ZH_RE.search(text))
    try:
        theirs = ov.models.omnivoice._resolve_instruct(instruct, use_zh=use_zh)
    except ValueError:
        with pytest.raises(InstructError):
            resolve_instruct(instruct, text)
        return
    assert resolve_instruct(instruct, text) == (theirs or None)


def test_char_weight_parity_every_code_point(ov):
    weight = ov.utils.duration.RuleDurationEstimator()._get_char_weight
    codes = list(range(0x30000)) + list(range(0x30000, 0x110000, 97))
    bad = [hex(c) for c in codes if char_weight(chr(c)) != weight(chr(c))]
    assert not bad, bad[:20]


_ALPHABET = st.sampled_from(list(
    "abcXYZ .,;:!?。，；：！？…\"'“”）】》」]>()（）\t\r\n\u3000今天好你我的éüñđ١٣5٫ا\u0640\u0301"
    "안녕こんにちはАБВабвשלוםनमस्ते🌍€") + [" ", "Mr.", "Dr.", "e.g.", "No.", " Sept. "]
    + [f"[{t}]" for t in NONVERBAL_TAGS[:4]])
TEXTS = st.lists(_ALPHABET, max_size=80).map("".join)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@FAST
@given(text=TEXTS, ref=st.one_of(st.none(), TEXTS))
def test_cleaning_parity(text, ref):
    ov = omnivoice()
    assert combine_text(text, ref) == ov.models.omnivoice._combine_text(text, ref_text=ref)
    assert add_end_punctuation(text) == ov.utils.text.add_punctuation(text)


@FAST
@given(text=TEXTS, chunk_len=st.integers(0, 60), min_len=st.sampled_from([None, 1, 3, 10]))
@example(text="A. There is more.", chunk_len=5, min_len=3)  # a short first chunk takes in the second
@example(text="Hi!. Dr. No. i.e. fine, ok. x", chunk_len=4, min_len=3)
def test_chunk_parity(text, chunk_len, min_len):
    ov = omnivoice()
    assert chunk_text(text, chunk_len, min_len) == ov.utils.text.chunk_text_punctuation(text, chunk_len, min_len)


@FAST
@given(text=TEXTS, ref=TEXTS, frames=st.integers(0, 400), speed=st.sampled_from([1.0, 0.5, 1.2, 2.0, 0.0]))
def test_estimate_parity(text, ref, frames, speed):
    ov = omnivoice()
    estimator = ov.utils.duration.RuleDurationEstimator()
    assert text_weight(text) == estimator.calculate_total_weight(text)
    assert estimate_length(text, ref, frames) == estimator.estimate_duration(text, ref, frames)
    fake = types.SimpleNamespace(duration_estimator=estimator)
    package = ov.models.omnivoice.OmniVoice._estimate_target_tokens
    assert estimate_frames(text, ref, frames, speed) == package(fake, text, ref, frames, speed=speed)
    assert estimate_frames(text, None, None, speed) == package(fake, text, None, None, speed=speed)


# ---------------------------------------------------------------------------------------------
# Token-level parity with the canvases the package's generate() builds
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def package_model(ov):
    from transformers import Qwen3Config

    llm = Qwen3Config(vocab_size=151676, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      rope_theta=1e6, tie_word_embeddings=True)
    m = ov.models.omnivoice
    model = m.OmniVoice(m.OmniVoiceConfig(llm_config=llm.to_dict()))
    model.text_tokenizer = PackageTokenizer(TOK)
    model.duration_estimator = ov.utils.duration.RuleDurationEstimator()
    model.audio_tokenizer = types.SimpleNamespace(config=types.SimpleNamespace(frame_rate=25))
    return model


def package_canvases(ov, model, monkeypatch, text, *, language=None, instruct=None, ref_text=None,
                     ref_frames=None, denoise=True, speed=None, duration=None, preprocess_prompt=True):
    """What generate() would hand _generate_iterative, canvas by canvas in generation order:
    (text, prompt ids without reference codes, T, reference frames or None)."""
    import torch

    m = ov.models.omnivoice
    prompt = None
    if ref_frames is not None:  # as create_voice_clone_prompt leaves a transcript
        text_of_ref = ov.utils.text.add_punctuation(ref_text) if preprocess_prompt else ref_text
        prompt = m.VoiceClonePrompt(torch.zeros(8, ref_frames, dtype=torch.long), text_of_ref, 0.05)
    config = m.OmniVoiceGenerationConfig(denoise=denoise, preprocess_prompt=preprocess_prompt)
    task = model._preprocess_all(text=text, language=language, voice_clone_prompt=prompt, instruct=instruct,
                                 preprocess_prompt=preprocess_prompt, speed=speed, duration=duration)
    seen = []

    def iterate(sub, gen_config):
        out = []
        for i in range(sub.batch_size):
            inputs = model._prepare_inference_inputs(sub.texts[i], sub.target_lens[i], sub.ref_texts[i],
                                                     sub.ref_audio_tokens[i], sub.langs[i], sub.instructs[i],
                                                     gen_config.denoise)
            ids = inputs["input_ids"][0, 0][~inputs["audio_mask"][0]].tolist()
            ref = sub.ref_audio_tokens[i]
            seen.append((sub.texts[i], ids, sub.target_lens[i], None if ref is None else ref.size(-1)))
            out.append(torch.zeros(8, sub.target_lens[i], dtype=torch.long))
        return out

    monkeypatch.setattr(model, "_generate_iterative", iterate)
    short, long = task.get_indices(config, 25)
    if short:
        model._generate_iterative(task.slice_task(short), config)
    if long:
        model._generate_chunked(task.slice_task(long), config)
    return seen


LONG_EN = " ".join([
    "It was a bright cold day in April, and the clocks were striking thirteen.",
    "Winston Smith, his chin nuzzled into his breast in an effort to escape the vile wind, slipped quickly",
    "through the glass doors of Victory Mansions, though not quickly enough to prevent a swirl of gritty dust",
    "from entering along with him. The hallway smelt of boiled cabbage and old rag mats. At one end of it a",
    "coloured poster, too large for indoor display, had been tacked to the wall. It depicted simply an enormous",
    "face, more than a metre wide: the face of a man of about forty-five, with a heavy black moustache and",
    "ruggedly handsome features. Mr. Smith made for the stairs; it was no use trying the lift! Even at the best",
    "of times it was seldom working, and at present the electric current was cut off during daylight hours.",
])
LONG_ZH = "今天天气很好，我们出去走走吧。" * 14 + "（完）"

CASES = {
    "plain English": dict(text="Hello, this is a test of duration control.", language="English"),
    "Chinese": dict(text="今天天气很好，我们出去走走吧。", language="zh"),
    "nonverbal and breaks": dict(text="Well [laughter] that was\r\nfunny [sigh]. （Really）", language="en"),
    "clone with transcript": dict(text="Good morning, everyone.", ref_text="This is the reference transcript",
                                  ref_frames=75),
    "clone without denoise": dict(text="Good morning, everyone.", ref_text="Hi there!", ref_frames=60, denoise=False),
    "clone raw transcript": dict(text="Good morning.", ref_text=" spoken words ", ref_frames=60,
                                 preprocess_prompt=False),
    "clone without transcript": dict(text="Good morning, everyone.", ref_text="", ref_frames=90),
    "instruct": dict(text="Hello there.", instruct="Female, British Accent, low pitch"),
    "instruct in Chinese": dict(text="你好，世界。", instruct="female, elderly", language="Chinese"),
    "speed": dict(text="Hello, this is a test of duration control.", speed=1.2),
    "duration": dict(text="Hello, this is a test of duration control.", duration=3.3, speed=2.0),
    "long": dict(text=LONG_EN, language="en"),
    "long with reference": dict(text=LONG_EN, ref_text="This is the reference transcript", ref_frames=75),
    "long without transcript": dict(text=LONG_EN, ref_text="", ref_frames=75),
    "long Chinese": dict(text=LONG_ZH, instruct="男"),
    "long with speed": dict(text=LONG_EN, speed=0.8),
    "long by duration": dict(text=LONG_EN[:300], duration=45.0),
    "short by duration": dict(text=LONG_EN, duration=20.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pieces_match_package(ov, package_model, monkeypatch, case):
    kw = CASES[case]
    theirs = package_canvases(ov, package_model, monkeypatch, **kw)
    has_ref = kw.get("ref_frames") is not None
    pieces = plan_pieces(TOK, kw["text"], language=kw.get("language"), instructions=kw.get("instruct"),
                         has_reference=has_ref, reference_text=kw.get("ref_text"),
                         reference_frames=kw.get("ref_frames") or 0, denoise=kw.get("denoise", True),
                         speed=kw.get("speed"), duration_seconds=kw.get("duration"),
                         preprocess_prompt=kw.get("preprocess_prompt", True))
    assert len(pieces) == len(theirs)
    if case.startswith("long"):
        assert len(pieces) > 1
    for piece, (text, ids, frames, ref_frames) in zip(pieces, theirs):
        assert piece.text == text
        assert piece.text_ids == ids
        assert piece.target_frames == frames
        expected_ref = {None: "none"}.get(ref_frames, "request" if has_ref else "first_piece")
        assert piece.reference == expected_ref
        if piece.reference == "first_piece":
            assert ref_frames == pieces[0].target_frames


def test_product_code_does_not_import_the_package():
    import pathlib
    import re

    import chorus.omnivoice

    here = pathlib.Path(chorus.omnivoice.__file__).parent
    importing = re.compile(r"^\s*(from|import)\s+omnivoice\b", re.M)
    assert [p.name for p in here.glob("*.py") if importing.search(p.read_text(encoding="utf-8"))] == []
