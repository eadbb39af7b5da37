"""A Hugging Face checkpoint's safetensors files, read header first.

Both models load the same way: find the shards (one model.safetensors, or the shards an
index's weight_map names), read every tensor's name and shape from the headers alone, let the
model's loader judge each name, and fail with one error naming every problem before any
device memory is allocated. Tensors are then read one at a time, so the host never holds a
second full copy of the weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class CheckpointError(ValueError):
    pass


def shard_map(model_dir: Path) -> dict[Path, set[str] | None]:
    """Shard file -> the tensor names the index puts there (None: single file, no index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e})") from e
        shards: dict[Path, set[str] | None] = {}
        for name, file in weight_map.items():
            shards.setdefault(model_dir / file, set()).add(name)
        absent = sorted(str(p.name) for p in shards if not p.is_file())
        if absent:
            raise CheckpointError(f"{index} lists shard file(s) that are not in {model_dir}: {absent}")
        return dict(sorted(shards.items()))
    single = model_dir / "model.safetensors"
    if single.is_file():
        return {single: None}
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def _names(names: list[str], limit: int = 20) -> str:
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")


@dataclass
class Headers:
    """What the headers hold (name -> shard, shape) and what the loader found wrong with them."""

    model_dir: Path
    shards: dict[str, Path] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    misplaced: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    bad_shape: list[str] = field(default_factory=list)

    def check(self, expected: set[str], unexpected_hint: str = "") -> dict[str, Path]:
        """Raise one CheckpointError naming every problem; else name -> shard of every tensor."""
        missing = sorted(expected - set(self.shards))
        problems = []
        if missing:
            problems.append(f"missing tensors: {_names(missing)}")
        if self.unexpected:
            problems.append(f"unexpected tensors: {_names(sorted(self.unexpected))}{unexpected_hint}")
        if self.misplaced:
            problems.append(f"tensors the index maps to the wrong shard: {_names(self.misplaced)}")
        if self.bad_shape:
            problems.append("shape mismatches: " + "; ".join(self.bad_shape[:20]))
        if problems:
            raise CheckpointError(f"checkpoint {self.model_dir} does not match its config.json: "
                                  + " | ".join(problems))
        return self.shards


def read_headers(model_dir: str | Path, skip: Callable[[str], bool]) -> Headers:
    """Every tensor's shard and shape, from the headers only; names `skip` accepts are left out."""
    from safetensors import safe_open

    headers = Headers(Path(model_dir))
    for shard, listed in shard_map(headers.model_dir).items():
        with safe_open(str(shard), framework="pt") as f:
            names = list(f.keys())
            if listed is not None:
                headers.misplaced += [f"{n} (index: {shard.name}, absent there)"
                                      for n in sorted(listed - set(names))]
            for name in names:
                if skip(name):
                    continue
                if name in headers.shards:
                    raise CheckpointError(f"tensor {name} appears in both {headers.shards[name].name} "
                                          f"and {shard.name}")
                headers.shards[name] = shard
                headers.shapes[name] = tuple(f.get_slice(name).get_shape())
    return headers


def read_tensors(shards: dict[str, Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time, each shard opened once."""
    from safetensors import safe_open

    by_shard: dict[Path, list[str]] = {}
    for name, shard in shards.items():
        by_shard.setdefault(shard, []).append(name)
    for shard, names in by_shard.items():
        with safe_open(str(shard), framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)
