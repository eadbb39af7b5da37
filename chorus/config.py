"""Typed service configs: one dataclass per service, read from flags, a TOML file or protobuf.

A config is a dataclass whose fields are declared with `setting(...)`: a default, a one-line
help, and optionally the flag's name when it is not `--field-name`, choices, a metavar and a
minimum. From that one declaration come the service's command-line flags (`add_flags`), its
table in a TOML file (`[worker]`, `[vocoder]`, `[scheduler]`), its protobuf message in
protos/chorus/v1/config.proto (`to_proto` / `from_proto`, by field name) and the reference
table in the docs (`python -m chorus.layout --markdown`).

`parse` builds a config with this precedence: the dataclass defaults, then the TOML file's
table (or a serialized config from `--config-proto`, how one process hands a config to
another it starts), then the flags actually given on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import tomllib
import types
import typing
from importlib import resources
from typing import Any

MISSING = dataclasses.MISSING


class ConfigError(ValueError):
    """A config value or key that cannot be used; the message names it and what to do."""


def setting(default: Any, help: str, *, flag: str | None = None, choices: tuple | None = None,
            metavar: str | None = None, minimum: float | None = None, maximum: float | None = None,
            internal: bool = False) -> Any:
    """A config field. flag: its command-line name when not --field-name; internal: set by the
    process itself, never by a flag or a file (it still travels in the protobuf)."""
    meta = {"help": help, "flag": flag, "choices": choices, "metavar": metavar, "minimum": minimum,
            "maximum": maximum, "internal": internal}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# ---- field types --------------------------------------------------------------------------------

def _kind(tp) -> tuple[type, bool]:
    """(scalar or list type, optional?) of an annotation: int, float, str, bool, list, or X | None."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    if typing.get_origin(tp) is list:
        return list, False
    return tp, False


def settings(cls) -> list[tuple[dataclasses.Field, type, bool]]:
    """(field, type, optional?) of every field of a config class, in declaration order."""
    hints = typing.get_type_hints(cls)
    return [(f, *_kind(hints[f.name])) for f in dataclasses.fields(cls)]


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list of strings"}


def _check_value(f: dataclasses.Field, tp: type, optional: bool, value: Any, name: str) -> Any:
    """value converted to the field's type, or ConfigError naming it (`name`: the key or flag)."""
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name}: needs {_TYPE_WORDS[tp]}")
    ok = (isinstance(value, bool) if tp is bool else
          isinstance(value, int) and not isinstance(value, bool) if tp is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if tp is float else
          isinstance(value, list) and all(isinstance(v, str) for v in value) if tp is list else
          isinstance(value, str))
    if not ok:
        raise ConfigError(f"{name} = {value!r}: expected {_TYPE_WORDS[tp]}")
    if tp is float:
        value = float(value)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{name} = {value!r}: choose one of {', '.join(map(str, choices))}")
    minimum = f.metadata.get("minimum")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} = {value!r}: must be >= {minimum:g}")
    maximum = f.metadata.get("maximum")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} = {value!r}: must be <= {maximum:g}")
    return value


def check(obj) -> None:
    """Every field of a config object has its type, choices and minimum, and the class's own
    cross-field `validate()` passes; else ConfigError."""
    for f, tp, optional in settings(type(obj)):
        setattr(obj, f.name, _check_value(f, tp, optional, getattr(obj, f.name), f"{obj.TABLE}.{f.name}"))
    if hasattr(obj, "validate"):
        obj.validate()


# ---- flags --------------------------------------------------------------------------------------

def add_flags(parser, cls, only: tuple[str, ...] | None = None, dest_prefix: str = "") -> None:
    """One flag per field of cls (parser: a parser or an argument group; only: these fields), each
    defaulting to argparse.SUPPRESS so that parse() sees only the flags actually given."""
    for f, tp, optional in settings(cls):
        if f.metadata.get("internal") or (only is not None and f.name not in only):
            continue
        default = default_of(f)
        shown = "" if default is None or default == [] else f" (default: {default})"
        help_ = (f.metadata["help"] + shown).replace("%", "%%")
        kw: dict[str, Any] = {"dest": dest_prefix + f.name, "default": argparse.SUPPRESS, "help": help_}
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif tp is list:
            kw.update(action="append", metavar=f.metadata.get("metavar"))
        else:
            kw.update(type=tp, choices=f.metadata.get("choices"), metavar=f.metadata.get("metavar"))
        parser.add_argument(flag_name(f), **kw)


def add_config_flags(parser, cls) -> None:
    """The service's flags plus --config FILE (its TOML table) and --config-proto FILE (a
    serialized config written by the process that started this one)."""
    add_flags(parser, cls)
    parser.add_argument("--config", metavar="FILE", default=None,
                        help=f"TOML file whose [{cls.TABLE}] table sets these flags (the flags given win)")
    parser.add_argument("--config-proto", metavar="FILE", default=None, help=argparse.SUPPRESS)


# ---- files --------------------------------------------------------------------------------------

PROFILES = "chorus.profiles"


def profile_names() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in resources.files(PROFILES).iterdir()
                  if p.name.endswith(".toml"))


def profile_text(name: str) -> str:
    path = resources.files(PROFILES) / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"no profile {name!r}: the profiles are {', '.join(profile_names())}")
    return path.read_text()


def read_profile(name: str) -> dict[str, Any]:
    data = tomllib.loads(profile_text(name))
    parent = data.pop("profile", None)  # a profile may start from another
    return merge(read_profile(parent), data) if parent else data


def load_toml(path, what: str, hint: str = "") -> dict[str, Any]:
    """A TOML file's contents; errors name the file as `what` and add the hint."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as e:
        raise ConfigError(f"{what} {path}: {e.strerror}{hint}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} {path}: not valid TOML: {e}") from None


def read_toml(path: str, resolve_profile: bool = True) -> dict[str, Any]:
    """A config file's tables; a top-level `profile = "NAME"` starts from that packaged profile
    (the file's keys win, table by table) unless resolve_profile is False."""
    data = load_toml(path, "config file")
    if not resolve_profile:
        return data
    profile = data.pop("profile", None)
    return merge(read_profile(profile), data) if profile else data


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Tables of `over` on top of `base`'s, key by key."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in over.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def table_values(cls, table: dict[str, Any], where: str = "") -> dict[str, Any]:
    """A TOML table checked against cls: {field: value}; ConfigError for an unknown key or a bad value."""
    fields = {f.name: (f, tp, opt) for f, tp, opt in settings(cls) if not f.metadata.get("internal")}
    out = {}
    for key, value in table.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; the keys are {', '.join(fields)}"
            raise ConfigError(f"{where}[{cls.TABLE}] has no key {key!r}{hint}")
        out[key] = _check_value(*fields[key], value, f"{where}[{cls.TABLE}] {key}")
    return out


def to_toml(tables: dict[str, Any]) -> str:
    """TOML text of {table: obj or dict}; None values are left out (unset)."""
    lines = []
    for name, obj in tables.items():
        values = dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj
        if dataclasses.is_dataclass(obj):
            values = {f.name: values[f.name] for f, _, _ in settings(type(obj)) if not f.metadata.get("internal")}
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


# ---- protobuf -----------------------------------------------------------------------------------

def message_class(cls):
    from chorus.v1 import config_pb2
    return getattr(config_pb2, cls.__name__)


def to_proto(obj):
    """The config as its chorus.v1 message (same field names)."""
    msg = message_class(type(obj))()
    for f, tp, _ in settings(type(obj)):
        value = getattr(obj, f.name)
        if tp is list:
            getattr(msg, f.name).extend(value)
        elif value is not None:
            setattr(msg, f.name, value)
    return msg


def from_proto(cls, msg):
    """The config a chorus.v1 message holds (an unset optional field: None)."""
    values = {}
    for f, tp, optional in settings(cls):
        if tp is list:
            values[f.name] = list(getattr(msg, f.name))
        elif optional and not msg.HasField(f.name):
            values[f.name] = None
        else:
            values[f.name] = getattr(msg, f.name)
    return cls(**values)


def write_proto(obj, path: str) -> str:
    with open(path, "wb") as fh:
        fh.write(to_proto(obj).SerializeToString())
    return path


def read_proto(cls, path: str):
    with open(path, "rb") as fh:
        return from_proto(cls, message_class(cls).FromString(fh.read()))


# ---- building one -------------------------------------------------------------------------------

def parse(cls, args: list[str] | argparse.Namespace | None = None, file: str | None = None, base=None):
    """A checked cls from defaults (or `base`, a config object), then the TOML file's table (`file`,
    or the --config of args), or a --config-proto file, then the flags given in args (an argv list,
    or a namespace from a parser that add_config_flags set up). ConfigError names what is wrong."""
    if args is None or isinstance(args, list):
        parser = argparse.ArgumentParser(prog=cls.TABLE)
        add_config_flags(parser, cls)
        args = parser.parse_args(args or [])
    given = vars(args)
    if given.get("config_proto"):
        obj = read_proto(cls, given["config_proto"])
    else:
        obj = dataclasses.replace(base) if base is not None else cls()
    file = file or given.get("config")
    if file:
        for k, v in table_values(cls, read_toml(file).get(cls.TABLE, {}), f"{file}: ").items():
            setattr(obj, k, v)
    for f, tp, optional in settings(cls):
        if f.name in given:
            setattr(obj, f.name, _check_value(f, tp, optional, given[f.name], flag_name(f)))
    check(obj)
    return obj


def parse_command_line(cls, parser: argparse.ArgumentParser, argv: list[str] | None):
    """(the checked cls, the namespace) of a service's command line; a ConfigError exits through
    parser.error, with the usage and the message naming what is wrong."""
    ns = parser.parse_args(argv)
    try:
        return parse(cls, ns), ns
    except ConfigError as e:
        parser.error(str(e))


def given_fields(cls, argv: list[str]) -> dict[str, Any]:
    """Only the fields that flags in argv set: {field: value}."""
    parser = argparse.ArgumentParser(prog=cls.TABLE, add_help=False)
    add_flags(parser, cls)
    return vars(parser.parse_args(argv))


# ---- the reference table ------------------------------------------------------------------------

def markdown(cls) -> str:
    rows = [f"### [{cls.TABLE}]", "", "| key | flag | default | what |", "|---|---|---|---|"]
    for f, _, _ in settings(cls):
        if f.metadata.get("internal"):
            continue
        default = default_of(f)
        shown = "unset" if default is None else _toml_value(default)
        choices = f.metadata.get("choices")
        what = f.metadata["help"] + (f" ({' / '.join(map(str, choices))})" if choices else "")
        rows.append(f"| `{f.name}` | `{flag_name(f)}` | `{shown}` | {what.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
