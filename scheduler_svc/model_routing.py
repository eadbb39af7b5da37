"""Which served model a request's `model` names: by exact name, or by architecture when exactly
one model of it is served ("moss" stands for "moss_tts_local"); empty: the configured default,
else the MOSS model. The core routes canvases with it and the frontends their requests."""

from __future__ import annotations

MOSS = "moss_tts_local"
OMNIVOICE = "omnivoice"
ALIASES = {"moss": MOSS}


class UnknownModel(ValueError):
    """The name matches no served model, or more than one; the message lists the served ones."""


def resolve_model(requested: str, served: dict[str, str], default: str = "") -> str:
    """The name of the served model `requested` means. served: {model name: architecture}."""
    name = requested or default
    if not name:
        mosses = [n for n, arch in served.items() if arch == MOSS]
        if len(mosses) != 1:
            raise UnknownModel(f"no model given and no single MOSS model served to default to: give one of "
                               f"{_listing(served)}")
        return mosses[0]
    if name in served:
        return name
    arch = ALIASES.get(name, name)
    matches = [n for n, a in served.items() if a == arch]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise UnknownModel(f"model {name!r} is ambiguous: {', '.join(matches)} are all {arch}; name one")
    raise UnknownModel(f"model {name!r} is not served here: give one of {_listing(served)}")


def _listing(served: dict[str, str]) -> str:
    return ", ".join(f"{n!r} ({a})" for n, a in served.items()) or "(none)"
