"""The vocoder's settings: one field per flag (chorus.config turns them into flags, a TOML
[vocoder] table and the chorus.v1.VocoderConfig message). The same settings configure a decoder
that runs elsewhere: the decode process, a gpu_worker hosting it, a shared decoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from chorus.config import ConfigError, setting
from chorus.watchdog import stall_exit_setting
from vocoder_svc.codec_config import DEFAULT_CODEBOOKS

MAX_CHUNK_FRAMES = 1000  # 80 s of audio per step bounds one step's memory
# A decode link message: one chunk's PCM (<= 8192 float32 samples a frame over all channels), or a
# step's jobs; a peer sending more is disconnected (ZMQ_MAXMSGSIZE).
DECODE_LINK_BYTES = MAX_CHUNK_FRAMES * 8192 * 4 + (16 << 20)


def _int_list(text: str, key: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"vocoder.{key} = {text!r}: expected comma-separated integers") from None
    if any(v < 1 for v in values):
        raise ConfigError(f"vocoder.{key} = {text!r}: values must be >= 1")
    return values


@dataclass
class VocoderConfig:
    TABLE: ClassVar[str] = "vocoder"

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(50053, "gRPC port (0 picks a free port and prints it)", minimum=0)
    metrics_port: int = setting(9103, "Prometheus /metrics HTTP port on host (0 = off)", minimum=0)
    codec: str | None = setting(None, "codec directory (config.json + safetensors): MOSS-Audio-Tokenizer or "
                                "Higgs-Audio-v2 (also an OmniVoice checkpoint); unset: the --preset codec",
                                metavar="DIR")
    preset: str = setting("tiny", "random-weight codec without --codec: tiny or full (MOSS v2 shapes), "
                          "higgs-tiny or higgs-full (OmniVoice's codec)",
                          choices=("tiny", "full", "higgs-tiny", "higgs-full"))
    device: str = setting("cpu", "torch device the codec runs on: cpu, cuda, cuda:1")
    dtype: str = setting("float32", "codec compute dtype (the quantizer always runs in float32)",
                         choices=("float32", "float64", "bfloat16"))
    first_chunk_frames: int = setting(5, "frames in a stream's first PCM chunk (a request may ask otherwise)",
                                      minimum=1)
    chunk_frames: int = setting(25, "frames in every later PCM chunk (a request may ask otherwise)", minimum=1,
                                maximum=MAX_CHUNK_FRAMES)
    encode_cache_size: int = setting(256, "reference encodings kept in the LRU cache (0 = off)", minimum=0)
    engine: str = setting("auto", "decode engine: slots (batched slot decoder, CUDA graphs), stream (per-stream, "
                          "batch-invariant); auto = slots on CUDA, stream elsewhere",
                          choices=("auto", "slots", "stream"))
    slots: int = setting(64, "slots engine: streams decoded concurrently (a stream waits for a free slot; 0 = "
                         "sized from the device's memory: chorus/sizing.py; 64 on the CPU)", minimum=0)
    buckets: str | None = setting(None, "slots engine: batch sizes a step is padded to, the largest >= slots "
                                  "(unset: 1,2,4,8 then every 8)", metavar="B,B,...")
    graph_frames: str | None = setting(None, "slots engine: step sizes in frames that get a CUDA graph per "
                                       "bucket (unset: the first and steady chunk sizes; none = no graphs)",
                                       metavar="T,T,...")
    graphs: str = setting("auto", "slots engine: auto = CUDA graphs on CUDA; off = eager; emulate = the graph "
                          "bookkeeping with eager replays (CPU tests)", choices=("auto", "off", "emulate"))
    attach_decoder: str | None = setting(None, "use the decoder served under DIR (by a gpu_worker "
                                         "--host-vocoder-decoder, or a shared decode process) instead of a child; "
                                         "for OmniVoice's codec, the codec an OmniVoice worker hosts",
                                         metavar="DIR")
    attach_silence_s: float = setting(10.0, "with attach_decoder: seconds without a word from the decoder "
                                      "before it counts as gone", metavar="S", minimum=0)
    launch_ahead_streams: int = setting(1, "slots engine: launch a step while the previous one runs only if it "
                                        "carries at least this many streams (0 = half the slots)", metavar="N",
                                        minimum=0)
    step_frames: int = setting(0, "slots engine: decode chunks in steps of at most this many frames (0 = one "
                               "step per chunk)", metavar="N", minimum=0)
    stall_exit_s: float | None = stall_exit_setting("a launched slot-decoder step")
    priority_first_chunks: bool = setting(False, "slots engine on CUDA: run first-chunk steps on a "
                                          "high-priority CUDA stream")
    slot_codebooks: int = setting(DEFAULT_CODEBOOKS, "slots engine: codebooks per frame it decodes (streams "
                                  "with another count use the stream engine)", minimum=1)
    max_batch_streams: int = setting(8, "stream engine: streams decoded in one forward when due together",
                                     minimum=1)
    batch_mode: str = setting("invariant", "stream engine: invariant = a stream's PCM is byte-identical whatever "
                              "its batch; fast = folded GEMMs", choices=("invariant", "fast"))
    seed: int = setting(0, "seed of the random preset weights")
    torch_threads: int = setting(1, "CPU threads for torch ops (0 = torch's default, all cores)", minimum=0)
    switch_interval_ms: float = setting(0.5, "the interpreter's GIL switch interval in milliseconds", minimum=0)
    grace: float = setting(10.0, "seconds open calls get to finish on SIGINT/SIGTERM", minimum=0)
    tls_dir: str | None = setting(None, "directory with tls.crt, tls.key and ca.crt (a Kubernetes TLS secret) to "
                                  "serve over TLS; unset: plaintext", metavar="DIR")
    require_client_cert: bool = setting(True, "with tls_dir: accept only clients whose certificate ca.crt signed "
                                        "(mTLS: the schedulers)")
    memory_fraction: float = setting(0.9, "slots engine: share of the device's memory that slots = 0 is sized "
                                     "to fill", minimum=0.05, maximum=1.0)

    def bucket_sizes(self) -> list[int] | None:
        """buckets as integers (None: the slot decoder's default)."""
        return None if self.buckets is None else _int_list(self.buckets, "buckets")

    def graphed_frames(self, first: int) -> list[int]:
        """The step sizes that get graphs; first is the first chunk's size as the service uses it."""
        if self.graph_frames is None:
            return sorted({first, self.step_frames or self.chunk_frames})
        if self.graph_frames.strip().lower() in ("", "none"):
            return []
        return sorted(set(_int_list(self.graph_frames, "graph_frames")))

    def validate(self) -> None:
        buckets = self.bucket_sizes()
        if buckets is not None and (not buckets or max(buckets) < self.slots):
            raise ConfigError(f"vocoder.buckets = {self.buckets!r}: the largest must be >= slots ({self.slots})")
        if any(t > MAX_CHUNK_FRAMES for t in self.graphed_frames(1)):
            raise ConfigError(f"vocoder.graph_frames = {self.graph_frames!r}: at most {MAX_CHUNK_FRAMES} frames")
