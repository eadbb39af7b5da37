"""The gateway's settings (chorus.config turns them into flags, a TOML [gateway] table and the
chorus.v1.GatewayConfig message)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from chorus.config import setting


@dataclass
class GatewayConfig:
    TABLE: ClassVar[str] = "gateway"

    host: str = setting("127.0.0.1", "address to serve HTTP on")
    port: int = setting(8000, "HTTP port (0 picks a free one)", minimum=0)
    scheduler: str = setting("127.0.0.1:50051", "address of the public gRPC API the gateway translates to",
                             metavar="HOST:PORT")
    channels: int = setting(4, "gRPC connections to the scheduler, calls spread over them (the kernel gives each "
                            "connection to one frontend: give at least --frontends)", minimum=1)
    max_body_bytes: int = setting(32 << 20, "largest accepted request body in bytes (larger: 413)", minimum=1024)
    retry_after: int = setting(1, "seconds a 429 or 503 answer asks the client to wait (Retry-After)",
                               flag="--retry-after-s", metavar="S", minimum=0)
    mp3_bitrate_kbps: int = setting(128, "constant bit rate of mp3 output in kbit/s", minimum=32, maximum=320)
    voice_name_cache: float = setting(2.0, "seconds the gateway remembers that an OpenAI voice name is no stored "
                                      "voice, skipping the lookup (0 = ask every time)", flag="--voice-name-cache-s",
                                      metavar="S", minimum=0)
    drain_seconds: float = setting(5.0, "seconds open streams get to finish on SIGTERM", minimum=0)
    log_level: str = setting("warning", "uvicorn's log level",
                             choices=("critical", "error", "warning", "info", "debug"))
    scheduler_tls_dir: str | None = setting(None, "directory whose ca.crt verifies the scheduler and whose tls.crt "
                                            "and tls.key (if present) are the gateway's client certificate; "
                                            "unset: plaintext", metavar="DIR")
    aac_bitrate_kbps: int = setting(128, "bit rate of aac output per channel in kbit/s", minimum=16, maximum=256)
