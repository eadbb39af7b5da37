"""Building the codec and the slot decoder from the vocoder's options: the codec for the gRPC process
(vocoder_svc/server.py), both for a decode process (vocoder_svc/decode_process.py)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from chorus.sizing import CPU_VOCODER_SLOTS, size_vocoder
from chorus.watchdog import stall_limit
from vocoder_svc.codec import MossAudioTokenizer
from vocoder_svc.codec_checkpoint import build_codec, load_codec
from vocoder_svc.codec_config import full_v2, tiny_v2
from vocoder_svc.config import VocoderConfig
from vocoder_svc.footprint import footprint
from vocoder_svc.selfcheck import check_slot_decoder, describe_slot_check
from vocoder_svc.slot_decoder import SlotDecoder, default_buckets

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def make_codec(args: VocoderConfig) -> tuple[MossAudioTokenizer, str]:
    if getattr(args, "torch_threads", 0) > 0:
        torch.set_num_threads(args.torch_threads)
    dtype = DTYPES[args.dtype]
    if torch.device(args.device).type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: no CUDA device is available")
        if torch.device(args.device).index is not None:
            torch.cuda.set_device(torch.device(args.device))  # capture streams and graph pools follow it
    if args.codec:
        return load_codec(args.codec, dtype=dtype, device=args.device), Path(args.codec).name
    config = tiny_v2() if args.preset == "tiny" else full_v2()
    codec = build_codec(config, seed=args.seed, dtype=dtype, device=args.device)
    return codec, f"{config.name} (random weights, seed {args.seed})"


def resolve_engine(engine: str, device: str) -> str:
    """auto -> slot decoder on CUDA devices, stream otherwise."""
    if engine == "auto":
        return "slots" if torch.device(device).type == "cuda" else "stream"
    return engine


def first_chunk(args: VocoderConfig) -> int:
    """The first chunk's frames as the service uses them: never above the steady chunk size."""
    return max(1, min(args.first_chunk_frames, args.chunk_frames))


def stall_exit_seconds(args: VocoderConfig) -> float:
    return stall_limit(args.stall_exit_s, torch.device(args.device).type)


def auto_slots(codec: MossAudioTokenizer, args: VocoderConfig, log=print) -> int:
    """slots = 0: sized from the device's memory (chorus/sizing.py), 64 on the CPU. The codec is loaded
    already: its weights are taken from what is free now and counted against the share."""
    if torch.device(args.device).type != "cuda":
        return CPU_VOCODER_SLOTS
    free, total = torch.cuda.mem_get_info(torch.device(args.device))
    weights = sum(t.numel() * t.element_size() for t in (*codec.parameters(), *codec.buffers()))
    buckets = args.bucket_sizes()
    sizing = size_vocoder(free + weights, total, args.memory_fraction,
                          dataclasses.replace(footprint(args, codec.config), weight_bytes=weights),
                          max(buckets) if buckets else 0)
    log(f"vocoder: sized {sizing.vocoder_slots} slots ({sizing.explain()})", flush=True)
    return sizing.vocoder_slots


def build_slot_decoder(codec: MossAudioTokenizer, args: VocoderConfig, log=print) -> SlotDecoder:
    """The slots engine's SlotDecoder, ready to serve: every (bucket, T in --graph-frames) graph
    captured now (largest first, one progress line each), then the self-check of its byte-identity
    facts (also the warm-up), logged with a warning if the fused glue kernels fell back."""
    n_q = args.slot_codebooks
    if n_q > codec.num_codebooks:
        raise SystemExit(f"--slot-codebooks {n_q}: this codec decodes 1..{codec.num_codebooks}")
    if not args.slots:
        args = dataclasses.replace(args, slots=auto_slots(codec, args, log))
    buckets = args.bucket_sizes() or default_buckets(args.slots)
    first = first_chunk(args)
    frames = args.graphed_frames(first)
    graphs = {"auto": None, "off": False, "emulate": "emulate"}[args.graphs] if frames else False
    slot_decoder = SlotDecoder(codec, slots=args.slots, n_q=n_q, buckets=buckets, graphs=graphs, graph_frames=frames,
                           priority_frames=[first] if args.priority_first_chunks else [])
    log(f"vocoder: slots engine: {slot_decoder.slots} slots, buckets {list(slot_decoder.buckets)}, {n_q} codebooks, "
        f"compute {str(slot_decoder.compute_dtype).removeprefix('torch.')}, state "
        f"{slot_decoder.state_nbytes() / 1e9:.3f} GB, graphs {slot_decoder.graph_mode or 'off'}"
        + (f" for {frames} frames" if slot_decoder.graph_mode else "")
        + (f", {sorted(slot_decoder.priority_frames)}-frame steps on a high-priority stream"
           if slot_decoder.priority_frames else ""), flush=True)
    if slot_decoder.graph_mode:
        pairs = sorted({(b, t) for b in slot_decoder.buckets for t in frames}, key=lambda bt: (-bt[0] * bt[1], -bt[0]))
        started = time.perf_counter()
        for i, (b, t) in enumerate(pairs, 1):
            t0 = time.perf_counter()
            slot_decoder.capture([b], [t])
            if slot_decoder.device.type == "cuda":
                torch.cuda.synchronize(slot_decoder.device)
            if slot_decoder.graphs_disabled:
                log(f"vocoder: graph capture failed, every step runs eagerly: {slot_decoder.graphs_disabled}", flush=True)
                break
            log(f"vocoder: captured graph {i}/{len(pairs)} (bucket {b}, {t} frames) in "
                f"{time.perf_counter() - t0:.2f} s", flush=True)
        else:
            log(f"vocoder: {len(pairs)} graphs captured in {time.perf_counter() - started:.2f} s", flush=True)
    if slot_decoder.glue_fallback:
        log(f"vocoder: WARNING: fused glue kernels unusable, running the torch path: {slot_decoder.glue_fallback}",
            flush=True)
    log(describe_slot_check(check_slot_decoder(slot_decoder, first)), flush=True)
    return slot_decoder
