"""Voice design (spec 3.1): the instruct vocabulary OmniVoice understands and how a request's
`instructions` become the prompt's instruct string.

Items are comma separated (ASCII or fullwidth comma), case-insensitive, at most one per category.
The prompt states them all in one language: Chinese when a dialect is asked for or (without an
accent) when the text has Chinese characters, else English. The vocabulary is a fact of
omnivoice 0.2.1 (utils/voice_design.py).
"""

from __future__ import annotations

import difflib
import re

from chorus.omnivoice.text import has_han

# Categories that translate: English item -> Chinese item.
TRANSLATED: tuple[dict[str, str], ...] = (
    {"male": "男", "female": "女"},
    {"child": "儿童", "teenager": "少年", "young adult": "青年", "middle-aged": "中年", "elderly": "老年"},
    {"very low pitch": "极低音调", "low pitch": "低音调", "moderate pitch": "中音调",
     "high pitch": "高音调", "very high pitch": "极高音调"},
    {"whisper": "耳语"},
)
# English-only and Chinese-only categories.
ACCENTS = frozenset(f"{who} accent" for who in (
    "american", "british", "australian", "chinese", "canadian", "indian", "korean", "portuguese",
    "russian", "japanese"))
DIALECTS = frozenset(f"{place}话" for place in (
    "河南", "陕西", "四川", "贵州", "云南", "桂林", "济南", "石家庄", "甘肃", "宁夏", "青岛", "东北"))

TO_CHINESE = {en: zh for category in TRANSLATED for en, zh in category.items()}
TO_ENGLISH = {zh: en for en, zh in TO_CHINESE.items()}
CATEGORIES: tuple[frozenset[str], ...] = (
    *(frozenset(c) | frozenset(c.values()) for c in TRANSLATED), ACCENTS, DIALECTS)
VOCABULARY = frozenset().union(*CATEGORIES)

_ITEM_SEPARATOR = re.compile(r"\s*[,，]\s*")
_SHOWN = 40  # at most this many characters of a request's input are quoted back


class InstructError(ValueError):
    """An instruct the model cannot follow; the message says what is accepted."""


def accepted_text() -> str:
    english = "; ".join(", ".join(c) for c in TRANSLATED)
    accents = ", ".join(sorted(a.removesuffix(" accent") for a in ACCENTS))
    return (f"accepted: {english}; <{accents}> accent; their Chinese forms "
            f"({'，'.join(TO_CHINESE.values())}); a dialect ({'，'.join(sorted(DIALECTS))})")


def _quote(s: str) -> str:
    return repr(s if len(s) <= _SHOWN else s[:_SHOWN] + "...")


def resolve_instruct(instructions: str | None, text: str) -> str | None:
    """The prompt's instruct string for a request's `instructions` and target `text`, or None
    when there is none; InstructError for an unknown item or a conflict."""
    if instructions is None or not instructions.strip():
        return None
    items = [raw.strip().lower() for raw in _ITEM_SEPARATOR.split(instructions.strip()) if raw]
    for item in items:
        if item not in VOCABULARY:
            close = difflib.get_close_matches(item, VOCABULARY, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InstructError(f"unknown voice-design item {_quote(item)}{hint}; {accepted_text()}")
    has_dialect = any(item in DIALECTS for item in items)
    has_accent = any(item in ACCENTS for item in items)
    if has_dialect and has_accent:
        raise InstructError("a Chinese dialect and an English accent cannot be combined")
    chinese = has_dialect or (not has_accent and has_han(text))
    items = [(TO_CHINESE if chinese else TO_ENGLISH).get(item, item) for item in items]
    for category in CATEGORIES:
        chosen = [item for item in items if item in category]
        if len(chosen) > 1:
            raise InstructError(f"at most one item per category (gender, age, pitch, whisper, accent, "
                                f"dialect); got {_quote(', '.join(chosen))}")
    if not items:
        return None
    return ("，" if any(has_han(item) for item in items) else ", ").join(items)
