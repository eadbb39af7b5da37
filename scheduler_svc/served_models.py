"""The models one frontend serves (what ListModels answers) and the one a request's `model` names,
by the rule the core routes canvases with (scheduler_svc/model_routing.py)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.model_routing import MOSS, OMNIVOICE, UnknownModel, resolve_model
from scheduler_svc.validation import InvalidRequest

__all__ = ["MOSS", "OMNIVOICE", "ServedModel", "ServedModels"]


@dataclass(frozen=True)
class ServedModel:
    name: str
    architecture: str


class ServedModels:
    def __init__(self, models: list[ServedModel], default: str = ""):
        """models: the MOSS model first; default: a name or architecture (empty: the MOSS model)."""
        self.models = list({m.name: m for m in models}.values())  # several workers may serve one model
        self._architectures = {m.name: m.architecture for m in self.models}
        try:
            self.default = self._named(resolve_model(default, self._architectures))
        except UnknownModel as e:
            raise ValueError(f"default_model: {e}") from None

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def _named(self, name: str) -> ServedModel:
        return next(m for m in self.models if m.name == name)

    def resolve(self, name: str) -> ServedModel:
        """The model `name` means; the caller has checked its length (the message repeats it)."""
        try:
            return self._named(resolve_model(name, self._architectures, self.default.name))
        except UnknownModel as e:
            raise InvalidRequest(str(e)) from None
