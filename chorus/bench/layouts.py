"""Named benchmark layouts (benchmarks/layouts.toml), run by `chorus bench --layout NAME`.

A layout is a table [NAME]: the services it launches (a profile from chorus/profiles/, and
[cluster], [worker], [vocoder], [scheduler] keys on top of it) and the settings of the bench
run on them (any key of chorus.bench.flags.DEFAULTS: workload, concurrency, duration, ...);
[omnivoice_worker] and [omnivoice_vocoder] keys set the OmniVoice services (cluster.omnivoice):

    [w1-2gpu]
    about = "two GPUs, W1 c1-c256"   # the line --list-layouts prints
    profile = "two-gpu"
    worker.max_batch = 256
    concurrency = [1, 16, 64, 256]

    [w1-2gpu-c16]
    like = "w1-2gpu"                 # starts from another layout, keys win one by one
    concurrency = [16]

Every layout starts from the [defaults] table. Flags given to chorus bench win over the layout.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chorus.bench.flags import DEFAULTS, add_arguments
from chorus.config import ConfigError, load_toml, merge, read_profile
from chorus.layout import DEFAULT_PROFILE, TABLES, Layout, build

DEFAULT_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "layouts.toml"
OWN_KEYS = ("about", "like", "profile")


@dataclass
class BenchLayout:
    name: str
    about: str
    profile: str
    file: str
    tables: dict[str, dict[str, Any]]  # the services' tables: the profile's, the layout's keys on top
    settings: dict[str, Any] = field(default_factory=dict)  # chorus bench settings, by flag dest

    def services(self, overrides: dict | None = None, service_flags: dict | None = None) -> Layout:
        """The services' checked configs, with chorus.layout.build's overrides on top."""
        try:
            return build(self.tables, overrides, service_flags)
        except ConfigError as e:
            raise ConfigError(f"{self.file}: [{self.name}]: {e}") from None


def read(file: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """The file's tables by name, [defaults] included."""
    path = file or DEFAULT_FILE
    data = load_toml(path, "layouts file", " (give one with --layouts FILE)")
    for name, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {name} = {table!r}: a layout is a table [{name}]")
    return data


def names(file: str | Path | None = None) -> list[str]:
    return [n for n in read(file) if n != "defaults"]


def listing(file: str | Path | None = None) -> str:
    """One line per layout: its name and what it runs."""
    data = read(file)
    width = max((len(n) for n in data), default=0)
    return "\n".join(f"{n:<{width}}  {t.get('about', '')}" for n, t in data.items() if n != "defaults")


def resolve(name: str, file: str | Path | None = None) -> BenchLayout:
    """The layout `name`, checked: its services' configs build and its settings parse as flags would."""
    data = read(file)
    path = str(file or DEFAULT_FILE)
    if name not in data or name == "defaults":
        raise ConfigError(f"no layout {name!r} in {path}; the layouts are {', '.join(names(file))}")
    chain: list[str] = []
    at: str | None = name
    while at is not None:
        if at in chain:
            raise ConfigError(f"{path}: layouts {' -> '.join(chain + [at])} go round in a loop")
        if at not in data or at == "defaults":
            raise ConfigError(f"{path}: [{chain[-1]}] is like {at!r}, which is not a layout")
        chain.append(at)
        at = data[at].get("like")
    merged: dict[str, Any] = {}
    for entry in [data.get("defaults", {})] + [data[n] for n in reversed(chain)]:
        merged = merge(merged, entry)
    where = f"{path}: [{name}]"
    about = data[name].get("about")
    if not isinstance(about, str) or not about:
        raise ConfigError(f"{where} needs about = \"...\": one line saying what it runs")
    profile = merged.get("profile", DEFAULT_PROFILE)
    tables = merge(read_profile(profile), {t: merged[t] for t in TABLES if t in merged})
    settings = bench_settings({k: v for k, v in merged.items() if k not in TABLES + OWN_KEYS}, where)
    layout = BenchLayout(name, about, profile, path, tables, settings)
    layout.services()
    return layout


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


def bench_settings(values: dict[str, Any], where: str) -> dict[str, Any]:
    """A layout's bench settings, parsed by chorus bench's own flags (so a value means what the
    flag means: concurrency = [1, 16] is --concurrency 1,16)."""
    argv = []
    for key, value in values.items():
        if key not in DEFAULTS:
            close = difflib.get_close_matches(key, DEFAULTS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; the keys are {', '.join(DEFAULTS)}"
            raise ConfigError(f"{where} has no key {key!r}{hint}")
        flag = "--" + key.replace("_", "-")
        if isinstance(DEFAULTS[key], bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{where} {key} = {value!r}: expected true or false")
            argv += [flag] if value else []
        else:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    parser = _Parser(prog=where, add_help=False)
    add_arguments(parser)
    try:
        given = vars(parser.parse_args(argv))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return {k: given.get(k, False) for k in values}
