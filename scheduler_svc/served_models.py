"""The models one scheduler serves and how a request's `model` names one of them.

A name matches a served model exactly, or names an architecture ("omnivoice", "moss_tts_local",
also "moss") when exactly one model of that architecture is served. An empty name is the
configured default model, else the MOSS model."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.validation import InvalidRequest, shown

MOSS = "moss_tts_local"
OMNIVOICE = "omnivoice"
ALIASES = {"moss": MOSS}


@dataclass(frozen=True)
class ServedModel:
    name: str
    architecture: str


class ServedModels:
    def __init__(self, models: list[ServedModel], default: str = ""):
        """models: the MOSS model first; default: a name or architecture (empty: the MOSS model)."""
        self.models = list({m.name: m for m in models}.values())  # several workers may serve one model
        self.default = self.models[0]
        if default:
            try:
                self.default = self.resolve(default)
            except InvalidRequest as e:
                raise ValueError(f"default_model: {e}") from None

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def resolve(self, name: str) -> ServedModel:
        if not name:
            return self.default
        for m in self.models:
            if m.name == name:
                return m
        arch = ALIASES.get(name, name)
        matches = [m for m in self.models if m.architecture == arch]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise InvalidRequest(f"model {shown(name)} names {len(matches)} served models; name one: "
                                 f"{', '.join(m.name for m in matches)}")
        raise InvalidRequest(f"model {shown(name)} is not served here; available: {', '.join(self.names)}")
