"""Prompt rows (spec moss_tts_local.md §5, §7.9) and the text tokenizer."""

import numpy as np
import pytest

from chorus.moss_config import tiny_config
from chorus.prompt import (
    build_prompt_rows,
    clamp_duration_frames,
    duration_frame_bounds,
    estimate_duration_frames,
    normalize_field,
)
from chorus.tokenizer import HFTextTokenizer, QwenBPETextTokenizer, load_tokenizer

CFG = tiny_config()
PAD = 1024
TOK = load_tokenizer(None)


class Recorder:
    """Wraps a tokenizer and records every piece it is asked to encode."""

    def __init__(self, inner):
        self.inner, self.pieces = inner, []

    def encode(self, piece):
        self.pieces.append(piece)
        return self.inner.encode(piece)


def E(lang="English", inst="None", tokens="None", quality="None", event="None", ambient="None"):
    return (f"\n- Instruction:\n{inst}\n- Tokens:\n{tokens}\n- Quality:\n{quality}\n- Sound Event:\n{event}"
            f"\n- Ambient Sound:\n{ambient}\n- Language:\n{lang}\n- Text:\n")


def codes(frames, offset=0):
    return (np.arange(frames * 12).reshape(frames, 12) + offset) % 1024


def enc(s):
    return TOK.encode(s)


# ---- §7.9 structure ---------------------------------------------------------------
def test_plain_prompt_structure():
    text = "Hello, world."
    rec = Recorder(TOK)
    rows = build_prompt_rows(CFG, rec, text, language="English")
    assert rows.dtype == np.int32 and rows.ndim == 2 and rows.shape[1] == 13
    # every literal piece tokenized on its own, in order
    assert rec.pieces == ["user\n", "<user_inst>\n- Reference(s):\n", "None", E(), text, "\n</user_inst>", "\n",
                          "assistant\n"]
    B, C, D0, Ep, F, G, J, M = (enc(p) for p in rec.pieces)
    assert len(rows) == 1 + len(B) + len(C) + len(D0) + len(Ep) + len(F) + len(G) + 1 + len(J) + 1 + len(M) + 1
    expect = [151644, *B, *C, *D0, *Ep, *F, *G, 151645, *J, 151644, *M, 151669]
    assert rows[:, 0].tolist() == expect
    assert (rows[:, 1:] == PAD).all()
    assert rows[0, 0] == 151644
    assert rows[-1].tolist() == [151669] + [PAD] * 12
    # 151645 and 151644 lie between G and M
    g_end = 1 + len(B) + len(C) + len(D0) + len(Ep) + len(F) + len(G)
    assert rows[g_end:g_end + 1 + len(J) + 1, 0].tolist() == [151645, *J, 151644]


def test_pieces_tokenized_separately_not_joined():
    # "." + "\n</user_inst>" separately gives "." "\n" ...; joined BPE would merge ".\n" (one token)
    text = "Hello."
    rows = build_prompt_rows(CFG, TOK, text)
    joined = enc(text + "\n</user_inst>")
    separate = enc(text) + enc("\n</user_inst>")
    assert joined != separate
    ids = rows[:, 0].tolist()
    start = ids.index(151645) - len(separate)
    assert ids[start:start + len(separate)] == separate
    # the whole readable prompt tokenized at once also differs from the rows
    readable = ("user\n<user_inst>\n- Reference(s):\nNone" + E(lang="None") + text + "\n</user_inst>")
    assert enc(readable) != ids[1:ids.index(151645)]


def test_voice_clone_one_reference():
    plain = build_prompt_rows(CFG, TOK, "Hi there", language="English")
    ref = codes(7)
    rec = Recorder(TOK)
    rows = build_prompt_rows(CFG, rec, "Hi there", language="English", references=[ref])
    assert "None" not in rec.pieces  # no D0
    assert len(rows) == len(plain) + 7 + 2 - len(enc("None"))
    head = 1 + len(enc("user\n")) + len(enc("<user_inst>\n- Reference(s):\n"))
    assert rows[head].tolist() == [151669] + [PAD] * 12
    assert (rows[head + 1:head + 8, 0] == 151654).all()
    assert np.array_equal(rows[head + 1:head + 8, 1:], ref)
    assert rows[head + 8].tolist() == [151670] + [PAD] * 12
    assert rows[head + 9:, 0].tolist() == plain[head + len(enc("None")):, 0].tolist()
    assert rows[-1].tolist() == [151669] + [PAD] * 12


def test_voice_clone_two_references_no_separator():
    r1, r2 = codes(3), codes(5, offset=100)
    rows = build_prompt_rows(CFG, TOK, "Hi", references=[r1, r2])
    one = build_prompt_rows(CFG, TOK, "Hi", references=[r1])
    assert len(rows) == len(one) + 5 + 2
    head = 1 + len(enc("user\n")) + len(enc("<user_inst>\n- Reference(s):\n"))
    span = rows[head:head + 3 + 2 + 5 + 2]
    assert span[:, 0].tolist() == [151669] + [151654] * 3 + [151670, 151669] + [151654] * 5 + [151670]
    assert np.array_equal(span[1:4, 1:], r1) and np.array_equal(span[6:11, 1:], r2)
    assert (span[[0, 4, 5, 11], 1:] == PAD).all()


def test_continuation():
    p = codes(6, offset=5)
    rec = Recorder(TOK)
    rows = build_prompt_rows(CFG, rec, " and the rest.", continuation=p, continuation_transcript="The start")
    assert "The start and the rest." in rec.pieces  # F = transcript + text, no separator
    plain = build_prompt_rows(CFG, TOK, "The start and the rest.")
    assert len(rows) == len(plain) + 6
    assert np.array_equal(rows[:len(plain)], plain)
    assert rows[len(plain) - 1].tolist() == [151669] + [PAD] * 12
    assert (rows[len(plain):, 0] == 151656).all()
    assert np.array_equal(rows[len(plain):, 1:], p)
    assert 151670 not in rows[:, 0]


# ---- fields ------------------------------------------------------------------------
def test_normalize_field():
    assert normalize_field(None) == "None"
    assert normalize_field("") == "None"
    assert normalize_field("  \n\t") == "None"
    assert normalize_field("  calm voice \n") == "calm voice"
    assert normalize_field(125) == "125"


def test_fields_in_piece_e_and_text_as_is():
    rec = Recorder(TOK)
    build_prompt_rows(CFG, rec, "  spaced text  ", language=" Chinese ", instruction="   ", tokens=125,
                      quality=None, sound_event="laugh", ambient_sound=" rain ")
    assert rec.pieces[3] == E(lang="Chinese", tokens="125", event="laugh", ambient="rain")
    assert rec.pieces[4] == "  spaced text  "  # F not stripped
    rec = Recorder(TOK)
    build_prompt_rows(CFG, rec, None, language="Auto")
    assert rec.pieces[3] == E(lang="None") and rec.pieces[4] == ""


def test_validation_messages():
    with pytest.raises(ValueError, match="transpose"):
        build_prompt_rows(CFG, TOK, "x", references=[codes(20).T])
    with pytest.raises(ValueError, match="pad code 1024"):
        build_prompt_rows(CFG, TOK, "x", references=[np.full((3, 12), 1024)])
    with pytest.raises(ValueError, match=r"outside \[0, 1024\)"):
        build_prompt_rows(CFG, TOK, "x", continuation=np.full((3, 12), -1))
    with pytest.raises(ValueError, match="integer"):
        build_prompt_rows(CFG, TOK, "x", references=[codes(3).astype(np.float32)])
    with pytest.raises(ValueError, match="2-D"):
        build_prompt_rows(CFG, TOK, "x", references=[np.zeros(12, dtype=np.int64)])
    with pytest.raises(ValueError, match="no frames"):
        build_prompt_rows(CFG, TOK, "x", references=[np.zeros((0, 12), dtype=np.int64)])
    with pytest.raises(ValueError, match="wrap"):
        build_prompt_rows(CFG, TOK, "x", references=codes(3))
    with pytest.raises(ValueError, match="not both"):
        build_prompt_rows(CFG, TOK, "x", references=[codes(2)], continuation=codes(2))
    with pytest.raises(ValueError, match="without continuation"):
        build_prompt_rows(CFG, TOK, "x", continuation_transcript="hello")
    with pytest.raises(ValueError, match="positive"):
        build_prompt_rows(CFG, TOK, "x", tokens=0)


# ---- duration -------------------------------------------------------------------------
def test_duration_estimator():
    assert estimate_duration_frames("Hello world") == round(11 * 0.8673376262755219) == 10
    assert estimate_duration_frames("你好世界") == round(4 * 3.098411951313033) == 12  # CJK detected -> zh
    assert estimate_duration_frames("Hello 世界") == round(8 * 3.098411951313033) == 25
    assert estimate_duration_frames("Bonjour", "French") == round(7 * 0.9) == 6
    assert estimate_duration_frames("こんにちは", "Japanese") == 11
    assert estimate_duration_frames("こんにちは", "ja") == 11
    assert estimate_duration_frames("こんにちは") == round(5 * 0.8673376262755219)  # kana is not U+3400-9FFF
    assert estimate_duration_frames("안녕하세요", "Korean") == 9
    assert estimate_duration_frames("你好世界", "English") == round(4 * 0.8673376262755219)
    assert estimate_duration_frames("你好世界", "German") == 12  # no rate for the tag: detect
    assert estimate_duration_frames("") == 1
    assert estimate_duration_frames("a") == 1


def test_duration_clamp():
    assert duration_frame_bounds("Hello world") == (5, 15)
    assert clamp_duration_frames(100, "Hello world") == 15
    assert clamp_duration_frames(1, "Hello world") == 5
    assert clamp_duration_frames(12, "Hello world") == 12
    assert duration_frame_bounds("a") == (1, 1)


# ---- tokenizer ------------------------------------------------------------------------
def test_fallback_tokenizer_basics():
    assert isinstance(TOK, QwenBPETextTokenizer)
    assert load_tokenizer(None) is TOK  # cached
    assert enc("hello world") == [14990, 1879]
    assert enc("") == []


def test_fallback_splits_added_tokens_like_hf():
    assert enc("<|im_end|>") == [151645]
    assert enc("<|endoftext|>") == [151643]
    assert enc("<think>") == [151667]
    assert enc("<|audio_start|>") == [151669]
    assert enc("a<|im_start|>b") == enc("a") + [151644] + enc("b")
    assert enc("<|im_end|><|im_end|>") == [151645, 151645]
    # NFC applies to the text between added tokens, not across them
    assert enc("e\u0301") == enc("\u00e9")
    assert enc("<|im_end|>\u0338") == [151645] + enc("\u0338")


def test_load_tokenizer_dir_without_files_falls_back(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is TOK


def test_load_tokenizer_hf_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<|im_end|>": 3}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", bos_token="hello")
    hf.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    hf.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTextTokenizer)
    assert load_tokenizer(str(tmp_path)) is tok
    assert tok.encode("hello world") == [1, 2]  # no BOS added
    assert tok.encode("world<|im_end|>hello") == [2, 3, 1]  # added token split out of text
    rows = build_prompt_rows(CFG, tok, "hello")
    assert rows[0, 0] == 151644 and rows[-1, 0] == 151669
