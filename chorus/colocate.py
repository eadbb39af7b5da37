"""`chorus worker`: a gpu_worker process that, given `host_vocoder_decoder`, also hosts the vocoder's
slot decoder, or beside an OmniVoice worker OmniVoice's codec (for `vocoder_svc.server
--attach-decoder DIR`).

On one GPU, two processes are two CUDA contexts that the GPU time-slices; with the decoder inside
the worker's process they share one context and the GPU interleaves their kernels. The services
never import each other: this module puts the two together.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from chorus.config import ConfigError, from_proto, parse
from chorus.v1 import config_pb2
from gpu_worker import server as worker
from gpu_worker.config import WorkerConfig
from vocoder_svc.clip_host import host_clips_in_thread
from vocoder_svc.clip_servicer import serves_clips
from vocoder_svc.config import VocoderConfig
from vocoder_svc.decode_process import host_in_thread
from vocoder_svc.footprint import footprint


def load(args: argparse.Namespace) -> tuple[WorkerConfig, VocoderConfig | None]:
    """The worker's config from parsed flags, and with host_vocoder_decoder the hosted decoder's: from
    the --config-proto file (chorus.v1.WorkerProcessConfig), else the --config file's [vocoder] table,
    else the vocoder's defaults."""
    base = hosted = None
    if args.config_proto:
        with open(args.config_proto, "rb") as fh:
            msg = config_pb2.WorkerProcessConfig.FromString(fh.read())
        base = from_proto(WorkerConfig, msg.worker)
        if msg.HasField("vocoder"):
            hosted = from_proto(VocoderConfig, msg.vocoder)
        args = argparse.Namespace(**{**vars(args), "config_proto": None})
    config = parse(WorkerConfig, args, base=base)
    if not config.host_vocoder_decoder:
        return config, None
    return config, hosted or parse(VocoderConfig, [], file=args.config)


def main(argv: list[str] | None = None, prog: str = "chorus worker") -> None:
    p = argparse.ArgumentParser(prog=prog, description=worker.__doc__)
    worker.add_arguments(p)
    try:
        config, hosted = load(p.parse_args(argv))
    except ConfigError as e:
        p.error(str(e))
    if hosted is None:
        worker.run(config)
        return
    if serves_clips(hosted):  # OmniVoice's codec, beside an OmniVoice worker
        worker.run(config, lambda device, _: host_clips_in_thread(config.host_vocoder_decoder, hosted, device))
        return
    # slots 0: the worker sizes the decoder's slots with its own batch and KV (chorus/sizing.py)
    worker.run(config, lambda device, slots: host_in_thread(config.host_vocoder_decoder,
                                                            dataclasses.replace(hosted, slots=slots), device),
               hosted=footprint(hosted), hosted_slots=hosted.slots)


if __name__ == "__main__":
    main(sys.argv[1:])
