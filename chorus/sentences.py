"""Sentences cut from text that arrives in pieces (an LLM's output), for English and Chinese.
The scheduler's SynthesizeStream and long-form Synthesize cut text with it.

A boundary is decided from the characters up to a short look-ahead (the closing quotes after a
full stop, the next word's first letter), and a cut waits until those characters have arrived.
So where the text is cut depends on the text alone, never on how it was split into pieces: the
same text gives the same sentences whether it comes whole or a word at a time. Only `flush`
(cut what is buffered now) and `end` (the text is complete) decide without the look-ahead.

Rules: `。！？；` (and their half-width `!?`) end a sentence with any closing quotes or brackets
after them; `!` and `?` need whitespace after them; `.` and `…` need whitespace and then a next
word that does not start in lower case, and a word before them that is no title or initial
("Mr.", "Dr.", "J.", "e.g."), nor one that a number follows ("p. 5", "No. 3", "Jan. 2"). A dot
between digits ("3.5") or letters ("U.S") is no boundary, and one after a dotted acronym ("U.S.",
"p.m.") is a boundary only before a word that usually starts a sentence ("U.S. Army" stays whole,
"in the U.S. It is" is cut).
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
# words whose trailing dot is no boundary before a number
NUMBERED = frozenset("no nos nr p pp vol fig figs ch chap sec art op eq ex jan feb mar apr jun jul aug sep sept "
                     "oct nov dec".split())
# words that usually start a sentence: after a dotted acronym only these make its dot a boundary
STARTERS = frozenset("a an the i it its he she we they you this that these those there here his her our their my "
                     "your but and so yet however then now if when while what why how who where in on at after "
                     "before as for since although though".split())
WAIT = -1


def speakable(text: str) -> bool:
    return any(ch.isalnum() for ch in text)


def wide(ch: str) -> bool:
    """A CJK character or full-width punctuation: no space joins it to its neighbour."""
    return ord(ch) >= 0x2E80


def join_sentences(sentences: list[str]) -> str:
    """Sentences as one text: a space between them, none next to a CJK character."""
    out = sentences[0] if sentences else ""
    for s in sentences[1:]:
        out += s if wide(out[-1]) or wide(s[0]) else " " + s
    return out


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _word_before(text: str, i: int) -> str:
    j = i
    while j > 0 and (text[j - 1].isalpha() or text[j - 1] == "."):
        j -= 1
    return text[j:i]


def _word_after(text: str, k: int) -> str | None:
    """The word that starts at text[k], or None while it may still be growing."""
    j = k
    while j < len(text) and text[j].isalpha():
        j += 1
    return None if j == len(text) else text[k:j]


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
        if text[k].islower() or (text[k].isdigit() and bare in NUMBERED):
            return None
        if "." in word and not wide(text[k]):  # a dotted acronym: U.S., a.m.
            nxt = _word_after(text, k)
            if nxt is None:
                return WAIT
            return j if nxt.lower() in STARTERS else None
        return j
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


def pieces(text: str, max_chars: int) -> list[str]:
    """A long text's pieces: its sentences, consecutive ones grouped while the group has at most
    max_chars characters (a sentence longer than that is cut at a comma or space)."""
    out: list[str] = []
    for sentence in split_sentences(text, max_chars):
        if out and len(joined := join_sentences([out[-1], sentence])) <= max_chars:
            out[-1] = joined
        else:
            out.append(sentence)
    return out
