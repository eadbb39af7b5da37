"""OmniVoice's text handling (spec 3.2 and 3.5): cleaning the prompt text, closing a reference
transcript with punctuation, cutting out non-verbal tags, and splitting a long text into pieces.

All of it reproduces the reference's string rules character for character, since the model was
trained on text shaped this way and the length estimate counts these very characters.
"""

from __future__ import annotations

import re

HAN = "\u4e00-\u9fff"  # the CJK unified ideographs block: "Chinese" wherever the reference asks
_HAN_CHAR = re.compile(f"[{HAN}]")

# Tags the model voices as sounds; each is tokenized on its own so its ids never depend on the
# neighbouring text.
NONVERBAL_TAGS: tuple[str, ...] = (
    "laughter", "sigh", "confirmation-en", "question-en", "question-ah", "question-oh",
    "question-ei", "question-yi", "surprise-ah", "surprise-oh", "surprise-wa", "surprise-yo",
    "dissatisfaction-hnn",
)
_NONVERBAL = re.compile(r"\[(?:" + "|".join(re.escape(t) for t in NONVERBAL_TAGS) + r")\]")

_LINE_BREAKS = re.compile(r"[\r\n]+")
_BLANK_RUNS = re.compile(r"[ \t]+")
_SPACE_BY_HAN = re.compile(rf"(?<=[{HAN}])\s+|\s+(?=[{HAN}])")
_FULLWIDTH_PARENS = str.maketrans({"\uff08": "(", "\uff09": ")"})

# A transcript ending in one of these is already closed.
END_PUNCTUATION = frozenset(";:,.!?…)]}\"'“”‘’；：，。！？、）】")
# A long text may be cut after these (spec 3.5) ...
SPLIT_PUNCTUATION = frozenset(".,;:!?。，；：！？")
# ... and these stay with the sentence they close when they follow such a cut.
CLOSING_MARKS = frozenset("\"'“”‘’）]》>」】")
# A full stop ending one of these words does not end a sentence (exact spelling, case included).
ABBREVIATIONS = frozenset((
    "Mr. Mrs. Ms. Dr. Prof. Sr. Jr. Rev. Fr. Hon. Pres. Gov. Capt. Gen. Sen. Rep. Col. Maj. Lt. "
    "Cmdr. Sgt. Cpl. Co. Corp. Inc. Ltd. Est. Dept. St. Ave. Blvd. Rd. Mt. Ft. No. Jan. Feb. "
    "Mar. Apr. Aug. Sep. Sept. Oct. Nov. Dec. i.e. e.g. vs. Vs. Etc. approx. fig. def."
).split())


def has_han(text: str) -> bool:
    return _HAN_CHAR.search(text) is not None


def combine_text(text: str, reference_text: str | None = None) -> str:
    """The text segment's content: the reference transcript (if any) then the text, one space
    apart, with line breaks dropped, fullwidth parentheses made ASCII, runs of spaces and tabs
    made one space, and no whitespace left beside a Chinese character."""
    joined = f"{reference_text.strip()} {text.strip()}" if reference_text else text.strip()
    joined = _LINE_BREAKS.sub("", joined)
    joined = joined.translate(_FULLWIDTH_PARENS)
    joined = _BLANK_RUNS.sub(" ", joined)
    return _SPACE_BY_HAN.sub("", joined)


def add_end_punctuation(text: str) -> str:
    """`text` stripped, ending in punctuation: a full stop ("。" if it has Chinese) is added
    unless it already ends in one of END_PUNCTUATION. Empty stays empty."""
    text = text.strip()
    if not text or text[-1] in END_PUNCTUATION:
        return text
    return text + ("。" if has_han(text) else ".")


def split_nonverbal(text: str) -> list[str]:
    """`text` cut into its non-verbal tags and the (non-empty) runs between them, in order."""
    parts: list[str] = []
    start = 0
    for tag in _NONVERBAL.finditer(text):
        if tag.start() > start:
            parts.append(text[start:tag.start()])
        parts.append(tag.group())
        start = tag.end()
    if start < len(text):
        parts.append(text[start:])
    return parts


def _sentences(text: str) -> list[str]:
    """`text` cut after each split mark, except a full stop ending an abbreviation; marks met at
    the very start of a sentence join the sentence before."""
    sentences: list[str] = []
    current = ""
    for ch in text:
        if not current and sentences and (ch in SPLIT_PUNCTUATION or ch in CLOSING_MARKS):
            sentences[-1] += ch
            continue
        current += ch
        if ch not in SPLIT_PUNCTUATION:
            continue
        if ch == "." and current.split()[-1] in ABBREVIATIONS:
            continue
        sentences.append(current)
        current = ""
    if current:
        sentences.append(current)
    return sentences


def _pack(sentences: list[str], chunk_len: int) -> list[str]:
    """Consecutive sentences joined greedily while a chunk stays within chunk_len characters
    (a longer sentence is a chunk of its own)."""
    chunks: list[str] = []
    current = ""
    for sentence in sentences:
        if len(current) + len(sentence) <= chunk_len:
            current += sentence
            continue
        if current:
            chunks.append(current)
        current = sentence
    if current:
        chunks.append(current)
    return chunks


def _absorb_short(chunks: list[str], min_chunk_len: int) -> list[str]:
    """Chunks under min_chunk_len characters joined to the chunk before (a short first chunk
    takes the second one in instead)."""
    kept: list[str] = []
    first_is_short = bool(chunks) and len(chunks[0]) < min_chunk_len
    for i, chunk in enumerate(chunks):
        if (i == 1 and first_is_short) or (kept and len(chunk) < min_chunk_len):
            kept[-1] += chunk
        else:
            kept.append(chunk)
    return kept


def chunk_text(text: str, chunk_len: int, min_chunk_len: int | None = None) -> list[str]:
    """A long text as the pieces the reference generates one after another: sentences packed
    into chunks of at most chunk_len characters where the sentences allow it, short chunks
    absorbed, each stripped, empty ones dropped."""
    chunks = _pack(_sentences(text), chunk_len)
    if min_chunk_len is not None:
        chunks = _absorb_short(chunks, min_chunk_len)
    return [c.strip() for c in chunks if c.strip()]
