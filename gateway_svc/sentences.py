"""Sentences cut from text that arrives in pieces (an LLM's output), for English and Chinese.

A boundary is decided from the characters up to a short look-ahead (the closing quotes after a
full stop, the next word's first letter), and a cut waits until those characters have arrived.
So where the text is cut depends on the text alone, never on how it was split into pieces: the
same text gives the same sentences whether it comes whole or a word at a time. Only `flush`
(cut what is buffered now) and `end` (the text is complete) decide without the look-ahead.

Rules: `。！？；` (and their half-width `!?`) end a sentence with any closing quotes or brackets
after them; `!` and `?` need whitespace after them; `.` and `…` need whitespace and then a next
word that does not start in lower case, and a word before them that is no title or initial
("Mr.", "Dr.", "J.", "e.g."). A dot between digits ("3.5") or letters ("U.S") is no boundary.
A line break ends a sentence. Text with no boundary for `max_chars` is cut at its last comma or
space before that.

Why not pysbd, the usual rule-based segmenter: it segments a whole text, so a stream would mean
re-segmenting a growing buffer, and nothing in it promises that a cut stays where it was as text
is added, which the pieces-independence above needs. (Its English abbreviation list is longer.)
"""

from __future__ import annotations

WIDE_ENDS = "。！？；"            # full-width: a boundary with no space after
NARROW_ENDS = "!?"
DOTS = ".…"
CLOSERS = "\"'”’)]}」』）】》"
SOFT_BREAKS = "，、,;；:：—"
# words whose trailing dot never ends a sentence
TITLES = frozenset("mr mrs ms dr prof sr jr st mt rev gen col lt sgt capt hon fig vol pp ca approx eg ie vs cf "
                   "dept est".split())
WAIT = -1


def speakable(text: str) -> bool:
    return any(ch.isalnum() for ch in text)


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _word_before(text: str, i: int) -> str:
    j = i
    while j > 0 and (text[j - 1].isalpha() or text[j - 1] == "."):
        j -= 1
    return text[j:i]


def _boundary(text: str, i: int) -> int | None:
    """Where a sentence that may end at text[i] is cut: an index, None (it does not end here), or
    WAIT (the characters that decide have not arrived)."""
    c = text[i]
    if c == "\n":
        return i + 1
    if c in WIDE_ENDS:
        j = _skip(text, i + 1, WIDE_ENDS + NARROW_ENDS + CLOSERS)
        return WAIT if j == len(text) else j
    if c in NARROW_ENDS:
        j = _skip(text, i + 1, WIDE_ENDS + NARROW_ENDS + CLOSERS + DOTS)
        if j == len(text):
            return WAIT
        return j if text[j].isspace() else None
    if c in DOTS:
        if i + 1 < len(text) and text[i + 1].isalnum():  # 3.5, U.S, e.g
            return None
        j = _skip(text, i + 1, DOTS + NARROW_ENDS + CLOSERS)
        if j == len(text):
            return WAIT
        if not text[j].isspace():
            return None
        word = _word_before(text, i)
        bare = word.replace(".", "").lower()
        if bare in TITLES or (len(word) == 1 and word.isupper()):
            return None
        k = j
        while k < len(text) and text[k].isspace():
            k += 1
        if k == len(text):
            return WAIT
        return None if text[k].islower() else j
    return None


def next_cut(text: str, max_chars: int) -> int:
    """Where the first sentence of `text` ends (an index into it), or WAIT."""
    for i in range(min(len(text), max_chars)):
        cut = _boundary(text, i)
        if cut is not None:
            return cut
    if len(text) <= max_chars:
        return WAIT
    soft = max((text.rfind(ch, 0, max_chars) for ch in SOFT_BREAKS), default=-1)
    space = max((i for i in range(max_chars) if text[i].isspace()), default=-1)
    best = soft if soft > 0 else space
    return best + 1 if best > 0 else max_chars


class SentenceCutter:
    """Text pieces in, complete sentences out, in order."""

    def __init__(self, max_chars: int = 400):
        self.max_chars = max_chars
        self.buffer = ""

    def feed(self, piece: str) -> list[str]:
        self.buffer += piece
        return self._cut(final=False)

    def flush(self) -> list[str]:
        """Everything buffered, cut where it can be, the rest as one last sentence."""
        return self._cut(final=True)

    def _cut(self, final: bool) -> list[str]:
        out = []
        while True:
            self.buffer = self.buffer.lstrip()
            cut = next_cut(self.buffer, self.max_chars)
            if cut == WAIT:
                if not final:
                    return out
                cut = len(self.buffer)
            if cut == 0:
                return out
            sentence, self.buffer = self.buffer[:cut].strip(), self.buffer[cut:]
            if speakable(sentence):
                out.append(sentence)


def split_sentences(text: str, max_chars: int = 400) -> list[str]:
    """The sentences of a complete text."""
    cutter = SentenceCutter(max_chars)
    return cutter.feed(text) + cutter.flush()
