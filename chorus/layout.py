"""A layout: the three services' configs plus how `chorus up` places them on one machine.

A layout file is TOML with tables [cluster], [worker], [vocoder] and [scheduler]; a top-level
`profile = "NAME"` starts from a packaged profile (chorus/profiles/NAME.toml). [cluster] holds
the placement (ClusterConfig) and the everyday shorthands (model, codec, device, dtype) that set
the services' own keys; the launcher sets every address and port except the scheduler's.

With OmniVoice served too (cluster.omnivoice, or omnivoice_model), a second worker and its own
codec vocoder(s) run beside MOSS's: their configs start from the MOSS worker's and vocoder's
device and dtype with the OmniVoice model and codec, and the tables [omnivoice_worker] and
[omnivoice_vocoder] (the [worker] and [vocoder] keys) set the rest.

    chorus up --profile two-gpu --model DIR --codec DIR
    chorus up --config my-layout.toml --print-config
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

from chorus.config import (ConfigError, add_flags, check, given_fields, markdown, merge, profile_names, profile_text,
                           read_profile, read_toml, setting, table_values, to_toml)
from chorus.launcher import Cluster, colocation, same_device
from chorus.sizing import VOCODER_SHARE, WORKER_SHARE
from gateway_svc.config import GatewayConfig
from gpu_worker.config import WorkerConfig
from chorus.tls import is_loopback
from scheduler_svc.config import SchedulerConfig
from vocoder_svc.config import VocoderConfig

DEFAULT_PROFILE = "cpu"
# Frontend processes beside a GPU worker unless the scheduler table says: a frontend spends 70-120 us
# of CPU a frame (README, Architecture), and at 256 streams one H200 makes ~11,000 frames a second.
GPU_FRONTENDS = 4
SERVICES = {"worker": WorkerConfig, "vocoder": VocoderConfig, "scheduler": SchedulerConfig}
OMNIVOICE_SERVICES = {"omnivoice_worker": WorkerConfig, "omnivoice_vocoder": VocoderConfig}
TABLES = ("cluster", *SERVICES, *OMNIVOICE_SERVICES)
OMNIVOICE_WORKER_PRESET = "omnivoice-tiny"
OMNIVOICE_CODEC_PRESET = "higgs-tiny"


@dataclass
class ClusterConfig:
    TABLE: ClassVar[str] = "cluster"

    model: str | None = setting(None, "MOSS-TTS Local v1.5 checkpoint directory: worker.model and "
                                "scheduler.tokenizer (unset: the tiny preset)", metavar="DIR")
    codec: str | None = setting(None, "MOSS-Audio-Tokenizer directory: vocoder.codec (unset: the tiny preset)",
                                metavar="DIR")
    device: str | None = setting(None, "torch device of the worker, and of the vocoder unless vocoder_device "
                                 "(unset: the tables' own)", metavar="DEVICE")
    vocoder_device: str | None = setting(None, "torch device of the vocoder (e.g. cuda:1: a GPU per service)",
                                         metavar="DEVICE")
    dtype: str | None = setting(None, "compute dtype of worker and vocoder (unset: float32 on cpu, bfloat16 "
                                "elsewhere, unless a table sets it)", choices=("float32", "float64", "bfloat16"))
    host: str = setting("127.0.0.1", "address every service listens on")
    vocoders: int = setting(1, "vocoder replicas", metavar="N", minimum=1)
    colocate_vocoder: str = setting("auto", "run the vocoder's decoder in the worker's process (auto = when "
                                    "worker and one vocoder share a CUDA device)", choices=("auto", "on", "off"))
    shared_vocoder_decoder: bool = setting(False, "the vocoder replicas share one decoder process")
    omnivoice: bool = setting(False, "also serve OmniVoice: its own worker and codec vocoder (tiny presets unless "
                              "omnivoice_model / omnivoice_codec), set further by the tables [omnivoice_worker] "
                              "and [omnivoice_vocoder] (the [worker] and [vocoder] keys)")
    omnivoice_model: str | None = setting(None, "OmniVoice checkpoint directory: the OmniVoice worker's model and "
                                          "scheduler.omnivoice_tokenizer; implies omnivoice", metavar="DIR")
    omnivoice_codec: str | None = setting(None, "Higgs-Audio-v2 codec directory (or an OmniVoice checkpoint with "
                                          "audio_tokenizer/): the OmniVoice vocoder's codec (unset: omnivoice_model, "
                                          "else the tiny preset)", metavar="DIR")
    omnivoice_vocoders: int = setting(1, "OmniVoice codec vocoder replicas", metavar="N", minimum=1)
    colocate_omnivoice_codec: str = setting("auto", "run OmniVoice's codec forwards in the OmniVoice worker's "
                                            "process (one CUDA context with it; one codec replica, which keeps "
                                            "the calls, post-processing and Encode). auto = when the OmniVoice "
                                            "worker and one codec replica share a CUDA device",
                                            choices=("auto", "on", "off"))
    quiet: bool = setting(False, "do not relay the services' logs")
    curve: str = setting("auto", "CURVE on the worker links with a key pair made for this run (auto = when host is "
                         "not loopback; keys the tables give win)", choices=("auto", "on", "off"))
    engines: int = setting(0, "engines, each a worker (and an OmniVoice worker) and a scheduler core (frontends = 0), "
                           "behind a frontend tier (0 = one scheduler with its own frontends)", metavar="N", minimum=0)
    gateways: int = setting(1, "with engines: frontend tier processes (`chorus frontend`) sharing the public port",
                            metavar="N", minimum=1)
    http_port: int | None = setting(None, "start the HTTP gateway (`chorus gateway`) on this port in front of the "
                                    "public API (0 picks a free one; unset: none)", metavar="PORT", minimum=0)

    @property
    def serves_omnivoice(self) -> bool:
        return self.omnivoice or self.omnivoice_model is not None

    def validate(self) -> None:
        if self.engines and (self.colocate_vocoder == "on" or self.shared_vocoder_decoder):
            raise ConfigError("cluster.engines: engines use vocoder replicas of their own: leave colocate_vocoder "
                              "and shared_vocoder_decoder unset")
        if self.colocate_omnivoice_codec == "on" and (self.engines or self.omnivoice_vocoders != 1):
            raise ConfigError("cluster.colocate_omnivoice_codec = \"on\" runs one OmniVoice codec replica beside one "
                              "OmniVoice worker: leave engines at 0 and omnivoice_vocoders at 1")
        if self.colocate_vocoder == "on" and self.shared_vocoder_decoder:
            raise ConfigError("cluster: colocate_vocoder = \"on\" and shared_vocoder_decoder: choose one (the "
                              "colocated decoder is the worker's; a shared one is a process of its own)")


@dataclass
class Layout:
    cluster: ClusterConfig
    worker: WorkerConfig
    vocoder: VocoderConfig
    scheduler: SchedulerConfig
    colocate: bool = False
    omnivoice_worker: WorkerConfig | None = None     # set when OmniVoice is served
    omnivoice_vocoder: VocoderConfig | None = None

    def toml(self) -> str:
        tables = {"cluster": self.cluster, "worker": self.worker, "vocoder": self.vocoder, "scheduler": self.scheduler}
        if self.omnivoice_worker is not None:
            tables.update(omnivoice_worker=self.omnivoice_worker, omnivoice_vocoder=self.omnivoice_vocoder)
        return to_toml(tables)

    @property
    def colocate_omnivoice_codec(self) -> bool:
        """Whether OmniVoice's codec runs in the OmniVoice worker's process: "on", or "auto" with one
        engine's worker and one codec replica on the same CUDA device."""
        choice, c = self.cluster.colocate_omnivoice_codec, self.cluster
        if self.omnivoice_worker is None or choice == "off":
            return False
        worker, codec = self.omnivoice_worker.device, self.omnivoice_vocoder.device
        return choice == "on" or (not c.engines and c.omnivoice_vocoders == 1 and worker.startswith("cuda")
                                  and same_device(worker, codec))

    def cluster_launcher(self, **kw) -> Cluster:
        """The launcher for this layout (kw: more Cluster fields, e.g. vocoder_metrics_ports)."""
        return Cluster(worker=self.worker, vocoder=self.vocoder, scheduler=self.scheduler, host=self.cluster.host,
                       scheduler_port=self.scheduler.port, vocoder_ports=[0] * self.cluster.vocoders,
                       echo=not self.cluster.quiet, colocate_vocoder=self.colocate,
                       shared_decoder=self.cluster.shared_vocoder_decoder, omnivoice_worker=self.omnivoice_worker,
                       omnivoice_vocoder=self.omnivoice_vocoder,
                       omnivoice_vocoder_ports=[0] * self.cluster.omnivoice_vocoders,
                       colocate_omnivoice_codec=self.colocate_omnivoice_codec,
                       curve=self.cluster.curve == "on" or (self.cluster.curve == "auto"
                                                            and not is_loopback(self.cluster.host)),
                       engines=self.cluster.engines, frontend_tier=self.cluster.gateways,
                       gateway_port=self.cluster.http_port, **kw)


def add_layout_flags(p, cluster_keys=("model", "codec", "device", "vocoder_device", "vocoders", "host", "quiet",
                                     "omnivoice", "omnivoice_model", "omnivoice_codec", "curve", "engines",
                                     "gateways", "http_port"),
                     scheduler_keys=()) -> None:
    """--config, --profile and the everyday flags (each a [cluster] or [scheduler] key); their
    values land in the namespace as "cluster.KEY" / "scheduler.KEY", only when given."""
    p.add_argument("--config", metavar="FILE", default=None,
                   help="layout TOML file ([cluster], [worker], [vocoder], [scheduler]; profile = NAME to start "
                        "from a profile)")
    p.add_argument("--profile", metavar="NAME", default=None,
                   help=f"start from a packaged layout profile (default {DEFAULT_PROFILE}; chorus.config lists them)")
    for cls, keys, prefix in ((ClusterConfig, cluster_keys, "cluster."), (SchedulerConfig, scheduler_keys,
                                                                         "scheduler.")):
        add_flags(p, cls, only=keys, dest_prefix=prefix)


def given(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The layout flags given in args, as tables: {"cluster": {...}, "scheduler": {...}}."""
    out: dict[str, dict[str, Any]] = {}
    for k, v in vars(args).items():
        table, dot, key = k.partition(".")
        if dot and table in ("cluster", *SERVICES):
            out.setdefault(table, {})[key] = v
    return out


def read_tables(file: str | None = None, profile: str | None = None) -> dict[str, Any]:
    """The tables of a layout: the profile's (--profile, the file's `profile`, or the default) under the file's."""
    tables = read_toml(file, resolve_profile=False) if file else {}
    named = tables.pop("profile", None)
    if named and profile and named != profile:
        raise ConfigError(f"{file} starts from profile {named!r} and --profile says {profile!r}: give one")
    tables = merge(read_profile(profile or named or DEFAULT_PROFILE), tables)
    unknown = set(tables) - set(TABLES)
    if unknown:
        raise ConfigError(f"{file or profile}: unknown table(s) {', '.join(sorted(unknown))}: the tables are "
                          f"{', '.join(f'[{t}]' for t in TABLES)}")
    return tables


def build(tables: dict[str, Any], overrides: dict[str, dict[str, Any]] | None = None,
          service_flags: dict[str, dict[str, Any]] | None = None) -> Layout:
    """The layout of `tables` with `overrides` (tables of given flags) on top, then the cluster's
    shorthands applied to the services, then `service_flags` (per-service fields from flags)."""
    tables = merge(tables, overrides or {})
    service_flags = service_flags or {}
    where = "layout: "
    cluster = ClusterConfig(**table_values(ClusterConfig, tables.get("cluster", {}), where))
    cluster.validate()
    values = {name: table_values(cls, tables.get(name, {}), where) for name, cls in SERVICES.items()}
    worker, vocoder, scheduler = values["worker"], values["vocoder"], values["scheduler"]
    if cluster.model is not None:
        worker["model"] = cluster.model
        scheduler.setdefault("tokenizer", cluster.model)
    if cluster.omnivoice_model is not None:
        scheduler.setdefault("omnivoice_tokenizer", cluster.omnivoice_model)
    if cluster.codec is not None:
        vocoder["codec"] = cluster.codec
    if cluster.device is not None:
        worker["device"] = vocoder["device"] = cluster.device
    if cluster.vocoder_device is not None:
        vocoder["device"] = cluster.vocoder_device
    for table in (worker, vocoder):
        table.update(service_flags.get("worker" if table is worker else "vocoder", {}))
        device = table.get("device", "cpu")
        if cluster.dtype is not None:
            table["dtype"] = cluster.dtype
        else:
            table.setdefault("dtype", "float32" if device == "cpu" else "bfloat16")
        if device.startswith("cuda"):  # 0: sized from the GPU's memory at start-up (chorus/sizing.py)
            for key in (("max_batch", "kv_slots") if table is worker else ("slots",)):
                table.setdefault(key, 0)
    if worker.get("device", "cpu").startswith("cuda") and not cluster.engines:
        scheduler.setdefault("frontends", GPU_FRONTENDS)
    scheduler.update(service_flags.get("scheduler", {}))
    configs = {name: cls(**values[name]) for name, cls in SERVICES.items()}
    choice = "off" if cluster.engines else cluster.colocate_vocoder  # an engine's vocoders are their own
    colocate, configs["vocoder"] = colocation(choice, configs["worker"].device,
                                              cluster.vocoder_device, cluster.vocoders, configs["vocoder"],
                                              given=set(vocoder))
    share_memory(configs["worker"], configs["vocoder"], colocate, cluster.vocoders, set(worker), set(vocoder))
    for config in configs.values():
        check(config)
    if colocate and cluster.vocoders != 1:
        raise ConfigError("cluster: colocate_vocoder = \"on\" runs one vocoder replica (its decoder is the worker's)")
    layout = Layout(cluster, configs["worker"], configs["vocoder"], configs["scheduler"], colocate)
    if cluster.serves_omnivoice:
        layout.omnivoice_worker, layout.omnivoice_vocoder = _omnivoice_services(cluster, layout, tables, where)
    return layout


def share_memory(worker: WorkerConfig, vocoder: VocoderConfig, colocate: bool, replicas: int,
                 worker_given: set[str], vocoder_given: set[str]) -> None:
    """Vocoder processes on the worker's CUDA device: sizing (chorus/sizing.py) gives the worker
    WORKER_SHARE of its memory and the replicas VOCODER_SHARE between them (a replica's slots take
    more than the worker's KV for a batch as large), unless a table or flag sets memory_fraction.
    (Colocated, the worker sizes the decoder it hosts within its own share.)"""
    if colocate or not worker.device.startswith("cuda") or not same_device(worker.device, vocoder.device):
        return
    if "memory_fraction" not in worker_given:
        worker.memory_fraction = WORKER_SHARE
    if "memory_fraction" not in vocoder_given:
        vocoder.memory_fraction = VOCODER_SHARE / max(1, replicas)


def _omnivoice_services(cluster: ClusterConfig, layout: Layout, tables: dict[str, Any],
                        where: str) -> tuple[WorkerConfig, VocoderConfig]:
    """The OmniVoice worker's and vocoder's configs: the MOSS services' device and dtype, the OmniVoice
    model and codec (or the tiny presets), then the [omnivoice_worker] / [omnivoice_vocoder] tables."""
    # The reference runs OmniVoice's body in float16 on a GPU (the codec stays float32 by itself).
    dtype = layout.worker.dtype if layout.worker.device == "cpu" or cluster.dtype else "float16"
    base = {"omnivoice_worker": {"device": layout.worker.device, "dtype": dtype,
                                 "preset": OMNIVOICE_WORKER_PRESET, "model": cluster.omnivoice_model},
            "omnivoice_vocoder": {"device": layout.vocoder.device, "dtype": layout.vocoder.dtype,
                                  "preset": OMNIVOICE_CODEC_PRESET,
                                  "codec": cluster.omnivoice_codec or cluster.omnivoice_model}}
    configs = []
    for name, cls in OMNIVOICE_SERVICES.items():
        try:
            values = table_values(cls, tables.get(name, {}), where)
            config = cls(**{**base[name], **values})
            check(config)
        except ConfigError as e:  # the messages name the [worker] / [vocoder] table whose keys these are
            raise ConfigError(re.sub(rf"(?<![\w.])(\[?){cls.TABLE}(?=[.\]])", rf"\g<1>{name}", str(e))) from None
        configs.append(config)
    return configs[0], configs[1]


def load(args: argparse.Namespace) -> Layout:
    """The layout `chorus up` / `chorus demo` / `chorus bench --launch` flags describe."""
    flags = {name: given_fields(cls, list(getattr(args, f"{name}_arg", None) or []))
             for name, cls in SERVICES.items()}
    return build(read_tables(args.config, args.profile), given(args), flags)


def all_configs() -> list[type]:
    """The config classes, one reference table each ([omnivoice_worker] and [omnivoice_vocoder] take the
    [worker] and [vocoder] keys; [gateway] is the HTTP gateway's own file, not a table of a layout)."""
    return [ClusterConfig, WorkerConfig, VocoderConfig, SchedulerConfig, GatewayConfig]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m chorus.layout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--markdown", action="store_true", help="print every table's keys as Markdown (the docs' reference)")
    p.add_argument("--profile", metavar="NAME", help="print a packaged profile's TOML")
    args = p.parse_args(argv)
    if args.profile:
        print(profile_text(args.profile), end="")
    elif args.markdown:
        print("\n".join(markdown(cls) for cls in all_configs()), end="")
    else:
        print("profiles:", ", ".join(profile_names()))


if __name__ == "__main__":
    sys.exit(main())
