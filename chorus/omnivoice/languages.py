"""The languages OmniVoice was trained on, and how a request's `language` picks one (spec 3.1).

The prompt carries a language id ("en", "zh", "yue", ...) or the literal "None". A request may
name the language by id (exact spelling) or by English name (any case); anything else falls back
to "None", the model's language-agnostic mode, as the reference does (a wrong hint must not fail
a request the model can still speak).
"""

from __future__ import annotations

import logging
from importlib import resources

log = logging.getLogger(__name__)


def _load() -> dict[str, str]:
    table: dict[str, str] = {}
    text = resources.files(__package__).joinpath("languages.tsv").read_text(encoding="utf-8")
    for line in text.splitlines():
        if line and not line.startswith("#"):
            language_id, name = line.split("\t")
            table[name] = language_id
    return table


ID_BY_NAME: dict[str, str] = _load()  # lowercase English name -> language id
LANGUAGE_IDS: frozenset[str] = frozenset(ID_BY_NAME.values())


def resolve_language(language: str | None) -> str | None:
    """The language id the prompt carries for `language`, or None for "no language"."""
    if language is None or language.lower() == "none":
        return None
    if language in LANGUAGE_IDS:
        return language
    language_id = ID_BY_NAME.get(language.lower())
    if language_id is None and language:
        log.warning("language %.40r is not known; generating without a language hint", language)
    return language_id
