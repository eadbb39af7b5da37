"""The gpu_worker's settings: one field per flag (chorus.config turns them into flags, a TOML
[worker] table and the chorus.v1.WorkerConfig message)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from chorus.config import ConfigError, setting
from chorus.watchdog import stall_exit_setting

DTYPES = ("float32", "float64", "bfloat16", "float16")  # gpu_worker.loader.DTYPES, without importing torch


@dataclass
class WorkerConfig:
    TABLE: ClassVar[str] = "worker"

    bind: str = setting("tcp://127.0.0.1:5560", "ZeroMQ endpoint the scheduler connects to (tcp://HOST:PORT; "
                        "port 0 picks a free one)", metavar="ENDPOINT")
    model: str | None = setting(None, "checkpoint directory (config.json + safetensors): MOSS-TTS Local v1.5, or "
                                "OmniVoice when its model_type is omnivoice; unset: the --preset model", metavar="DIR")
    preset: str = setting("tiny", "random-weight model without --model: MOSS tiny (CPU tests, demo) or full-size, "
                          "or OmniVoice omnivoice-tiny / omnivoice-full",
                          choices=("tiny", "full", "omnivoice-tiny", "omnivoice-full"))
    load_format: str = setting("auto", "dummy: --model's shapes with random weights (benchmarks)",
                               choices=("auto", "dummy"))
    device: str = setting("cpu", "torch device: cpu, cuda, cuda:1, ...")
    dtype: str = setting("float32", "compute dtype (bfloat16 on GPU; float64 for exact CPU parity tests)",
                         choices=DTYPES)
    kv_slots: int = setting(32768, "KV cache capacity in rows (tokens), shared by all requests (0 = sized from "
                            "the device's memory: chorus/sizing.py; 32768 on the CPU)", minimum=0)
    page_size: int = setting(16, "KV rows per page; the scheduler allocates whole pages", minimum=1)
    decode_split_kv: bool = setting(True, "flashinfer decode splits long contexts over several thread blocks")
    decode_kernel: str = setting("auto", "decode attention on CUDA: auto = Triton for large batches, "
                                 "flashinfer for small ones", choices=("auto", "flashinfer", "triton"))
    max_batch: int = setting(64, "requests holding decode state at once (0 = sized from the device's memory: "
                             "chorus/sizing.py; 64 on the CPU)", minimum=0)
    max_context: int = setting(8192, "rows (prompt + frames) per request", minimum=1)
    seed: int = setting(0, "seed of the random preset weights")
    attention: str = setting("auto", "attention backend: auto = flashinfer on CUDA when installed, else torch "
                             "(OmniVoice: its Triton document kernel first); triton: that kernel (OmniVoice only)",
                             choices=("auto", "torch", "flashinfer", "triton"))
    cuda_graphs: bool = setting(True, "replay decode steps from CUDA graphs (--no-cuda-graphs: eager, for "
                                "debugging)")
    capture_graphs: bool = setting(True, "capture every batch bucket's graph at startup, not on first use",
                                   flag="--capture-at-start")
    host_vocoder_decoder: str | None = setting(
        None, "also run the vocoder's decoder in this process, for `vocoder_svc.server --attach-decoder DIR`; "
        "its settings are the [vocoder] table", metavar="DIR")
    stall_exit_s: float | None = stall_exit_setting("a launched step")
    max_packed_rows: int = setting(24576, "OmniVoice: rows one packed step may run (prefix + target, + target "
                                   "again with guidance, summed over its canvases)", minimum=1)
    curve_secret_key: str | None = setting(None, "this worker's CURVE key pair file (.key_secret): only clients "
                                           "in curve_clients may connect; unset: no CURVE", metavar="FILE")
    curve_clients: str | None = setting(None, "directory of the CURVE public keys (.key) allowed to connect: "
                                        "the scheduler's", metavar="DIR")
    max_message_bytes: int = setting(256 << 20, "a peer sending a larger ZeroMQ message is disconnected",
                                     minimum=1024)
    memory_fraction: float = setting(0.9, "share of the device's memory that settings left at 0 are sized to "
                                     "fill (weights, KV, workspace, a hosted decoder)", minimum=0.05, maximum=1.0)
    drain_seconds: float = setting(30.0, "seconds after SIGTERM the worker keeps serving its connected schedulers "
                                   "(it exits as soon as none is connected)", minimum=0)

    def validate(self) -> None:
        if not (self.bind.startswith(("tcp://", "ipc://", "inproc://"))):
            raise ConfigError(f"worker.bind = {self.bind!r}: give a ZeroMQ endpoint such as tcp://127.0.0.1:5560")
        if bool(self.curve_secret_key) != bool(self.curve_clients):
            raise ConfigError("worker.curve_secret_key and worker.curve_clients go together: give both (CURVE on) "
                              "or neither")
