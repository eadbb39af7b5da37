"""Vocoder replicas as seen from the scheduler.

Targets are `HOST:PORT` (one replica each) or `dns:///NAME:PORT`, which is
resolved with getaddrinfo to every A/AAAA record, one replica per address,
at startup and again every `resolve_interval` seconds (replicas appear and
retire as the records change; a retired replica keeps its open streams).

Each replica has one gRPC channel, the count of Decode streams this
scheduler has open on it (the least-loaded choice per request), and a health
state: a replica whose stream or call broke is skipped by pick() until a
background Info probe succeeds or its cooldown passes. Info and Encode go to
a healthy replica and move on to another one when a replica is down.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Awaitable, Callable, Iterable

import grpc

from chorus.tls import aio_channel
from chorus.v1 import vocoder_pb2, vocoder_pb2_grpc

log = logging.getLogger("chorus.scheduler")

# Status codes that say "this replica is gone or stuck" rather than "this request is wrong".
REPLICA_FAILURE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                   grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
                                   grpc.StatusCode.UNKNOWN})
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                   # reconnect quickly once a replica is back
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]


class NoReplica(RuntimeError):
    """No vocoder replica is known (e.g. the DNS name has no records yet)."""


def codec_facts(info: vocoder_pb2.VocoderInfo) -> tuple:
    """What must agree across replicas for a stream to move between them."""
    return (info.codec, info.sample_rate, info.channels, info.samples_per_frame)


def chunk_defaults(info: vocoder_pb2.VocoderInfo) -> tuple[int, int]:
    """A replica's (first, steady) chunk frames for streams that leave them to the server."""
    return info.first_chunk_frames, info.chunk_frames


class VocoderReplica:
    def __init__(self, address: str, target: str | None = None, tls_dir: str | None = None):
        """tls_dir: TLS (and this side's client certificate) for the channel; unset: plaintext."""
        self.address = address
        self.target = target or address  # the --vocoder value it came from
        dns = parse_target(self.target)  # an address resolved from a name: the certificate carries the name
        self.channel = aio_channel(address, tls_dir, CHANNEL_OPTIONS, server_name=dns[1] if dns else None)
        self.stub = vocoder_pb2_grpc.VocoderStub(self.channel)
        self.open_streams = 0
        self.healthy = True
        self.retry_after = 0.0  # monotonic time after which an unhealthy replica is tried again
        self.failures = 0       # consecutive failures
        self.last_error = ""
        self.incompatible = False  # serves a different codec than the pool: never picked
        self.other_chunks = False  # announces other chunk defaults than the pool's (reported once)
        self.verified = False      # has answered Info with the pool's codec at least once
        self.retired = False

    def available(self, now: float | None = None) -> bool:
        if self.incompatible or self.retired:
            return False
        return self.healthy or (now if now is not None else time.monotonic()) >= self.retry_after

    def __repr__(self) -> str:
        state = "healthy" if self.healthy else f"unhealthy ({self.last_error})"
        return f"<vocoder {self.address} streams={self.open_streams} {state}>"


def parse_target(target: str) -> tuple[str, str, int] | None:
    """`dns://[authority]/NAME:PORT` -> ("dns", NAME, PORT); a plain address -> None."""
    if not target.startswith("dns:"):
        return None
    rest = target[len("dns:"):]
    if rest.startswith("//"):
        rest = rest[2:]
        rest = rest.split("/", 1)[1] if "/" in rest else rest  # drop the authority
    if rest.startswith("["):  # [v6]:port
        host, _, port = rest[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    if not host:
        raise ValueError(f"vocoder target {target!r}: expected dns:///NAME:PORT")
    try:
        return "dns", host, int(port or 50053)
    except ValueError:
        raise ValueError(f"vocoder target {target!r}: port {port!r} is not a number") from None


def format_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def resolve(host: str, port: int) -> list[str]:
    """Every A/AAAA record of host as HOST:PORT strings, sorted, without duplicates."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({format_address(info[4][0], port) for info in infos})


class VocoderPool:
    def __init__(self, addresses: Iterable[str], *, cooldown: float = 10.0, resolve_interval: float = 30.0,
                 probe_interval: float = 1.0, resolver: Callable[[str, int], list[str]] = resolve,
                 tls_dir: str | None = None):
        targets = list(dict.fromkeys(addresses))
        if not targets:
            raise ValueError("at least one vocoder address is required")
        self.targets = targets
        self.tls_dir = tls_dir
        self.cooldown = cooldown
        self.resolve_interval = resolve_interval
        self.probe_interval = probe_interval
        self._resolver = resolver
        self._dns = {t: p[1:] for t in targets if (p := parse_target(t)) is not None}
        self.replicas: list[VocoderReplica] = []
        self._retired: list[VocoderReplica] = []
        self.facts: tuple | None = None  # codec facts of the first replica that answered Info
        self.chunks: tuple[int, int] | None = None  # its chunk defaults: every stream's unless the client's
        self._task: asyncio.Task | None = None
        self._closed = False
        for t in targets:
            if t in self._dns:
                host, port = self._dns[t]
                try:
                    addrs = self._resolver(host, port)
                except OSError as e:
                    log.warning("vocoder %s does not resolve yet (%s); gRPC resolves it until it does", t, e)
                    addrs = []
                # Nothing yet: one replica on the name itself, replaced once records appear.
                self._set_target_addresses(t, addrs or [t])
            else:
                self._set_target_addresses(t, [t])

    # ---- membership -----------------------------------------------------------------
    def _set_target_addresses(self, target: str, addresses: list[str]) -> None:
        current = {r.address: r for r in self.replicas if r.target == target}
        for a in addresses:
            if a not in current and not any(r.address == a for r in self.replicas):
                self.replicas.append(VocoderReplica(a, target, self.tls_dir))
                log.info("vocoder replica %s added (%s)", a, target)
        for a, r in current.items():
            if a not in addresses:
                self.replicas.remove(r)
                r.retired = True
                log.info("vocoder replica %s retired (%s no longer resolves to it)", a, target)
                if r.open_streams:
                    self._retired.append(r)  # closed once its streams end
                else:
                    self._close_soon(r)

    def _close_soon(self, r: VocoderReplica) -> None:
        try:
            asyncio.get_running_loop().create_task(r.channel.close())
        except RuntimeError:
            pass

    async def refresh(self) -> None:
        """Resolve every dns:/// target again and apply the changes."""
        loop = asyncio.get_running_loop()
        for target, (host, port) in self._dns.items():
            try:
                addrs = await loop.run_in_executor(None, self._resolver, host, port)
            except OSError as e:
                log.warning("vocoder %s: resolution failed (%s); keeping %d replicas", target, e,
                            sum(r.target == target for r in self.replicas))
                continue
            if addrs:  # an empty answer is treated like a failure: keep what we have
                self._set_target_addresses(target, addrs)

    # ---- health -----------------------------------------------------------------------
    def mark_failed(self, replica: VocoderReplica, error: str) -> None:
        replica.failures += 1
        replica.last_error = error
        replica.retry_after = time.monotonic() + self.cooldown
        if replica.healthy:
            log.warning("vocoder replica %s marked unhealthy for %.0fs: %s", replica.address, self.cooldown, error)
        replica.healthy = False
        self._ensure_background()

    def live(self) -> bool:
        """Whether a replica of the pool's codec is healthy (as the last call or probe found it)."""
        return any(r.healthy and not r.incompatible for r in self.replicas)

    async def check(self, timeout: float = 5.0) -> bool:
        """Probe every replica and say whether one serves: for health, which must see a replica die while
        the pool carries no traffic (calls find it only when they fail)."""
        if self.replicas:
            await asyncio.gather(*(self.probe(r, timeout) for r in list(self.replicas)))
        return self.live()

    def mark_healthy(self, replica: VocoderReplica) -> None:
        if not replica.healthy:
            log.info("vocoder replica %s is healthy again", replica.address)
        replica.healthy, replica.failures, replica.last_error = True, 0, ""

    def _check_facts(self, replica: VocoderReplica, info: vocoder_pb2.VocoderInfo) -> bool:
        facts = codec_facts(info)
        if self.facts is None:
            self.facts, self.chunks = facts, chunk_defaults(info)
        if facts != self.facts:
            if not replica.incompatible:
                log.error("vocoder replica %s serves %s but the pool serves %s; not using it", replica.address,
                          facts, self.facts)
            replica.incompatible = True
            return False
        replica.incompatible = False
        self._check_chunks(replica, info)
        return True

    def _check_chunks(self, replica: VocoderReplica, info: vocoder_pb2.VocoderInfo) -> None:
        """Every DecodeStart names its chunk sizes, so a replica with other defaults still serves (and
        replays) streams alike; but its own defaults are not what this scheduler uses: say so."""
        other = chunk_defaults(info) != self.chunks
        if other and not replica.other_chunks:
            log.warning("vocoder replica %s announces first chunk %d, chunk %d frames, but the pool's defaults are "
                        "first chunk %d, chunk %d frames (those of the first replica that answered): streams "
                        "that leave streaming.* unset get the pool's on every replica; give the replicas one "
                        "[vocoder] first_chunk_frames / chunk_frames", replica.address, *chunk_defaults(info),
                        *self.chunks)
        replica.other_chunks = other

    async def probe(self, replica: VocoderReplica, timeout: float = 2.0) -> bool:
        try:
            info = await replica.stub.Info(vocoder_pb2.VocoderInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            self.mark_failed(replica, f"Info: {e.code().name}: {e.details()}")  # still down: cooldown restarts
            return False
        if self._check_facts(replica, info):
            replica.verified = True
            self.mark_healthy(replica)
            return True
        return False

    def _ensure_background(self) -> None:
        if self._task is not None or self._closed:
            return
        try:
            self._task = asyncio.get_running_loop().create_task(self._background())
        except RuntimeError:
            pass  # no loop yet: started by the first async use

    async def _background(self) -> None:
        next_resolve = time.monotonic() + self.resolve_interval
        while not self._closed:
            try:
                await asyncio.sleep(self.probe_interval)
                # new replicas once (codec check; a dead one is found before a stream is sent to it),
                # then every unhealthy or incompatible one each round
                probes = [self.probe(r) for r in self.replicas if not (r.healthy and r.verified) or r.incompatible]
                if probes:
                    await asyncio.gather(*probes)
                if self._dns and time.monotonic() >= next_resolve:
                    next_resolve = time.monotonic() + self.resolve_interval
                    await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep probing whatever one round did
                log.exception("vocoder pool maintenance failed")

    # ---- choosing -----------------------------------------------------------------------
    def pick(self, exclude: Iterable[VocoderReplica] = ()) -> VocoderReplica:
        """The healthy replica with the fewest open streams. If none is healthy,
        the one that comes off its cooldown first (it may be back already)."""
        self._ensure_background()
        excluded = {id(r) for r in exclude}
        now = time.monotonic()
        candidates = [r for r in self.replicas if not r.incompatible and id(r) not in excluded]
        if not candidates:
            candidates = [r for r in self.replicas if not r.incompatible]
        if not candidates:
            raise NoReplica("no vocoder replica is known" + (f" ({', '.join(self.targets)})" if self.targets else ""))
        ready = [r for r in candidates if r.available(now)]
        if ready:
            return min(ready, key=lambda r: r.open_streams)  # ties: the first listed
        return min(candidates, key=lambda r: (r.retry_after, r.open_streams))

    def acquire(self, replica: VocoderReplica) -> None:
        replica.open_streams += 1

    def release(self, replica: VocoderReplica) -> None:
        replica.open_streams -= 1
        if replica.retired and replica.open_streams <= 0 and replica in self._retired:
            self._retired.remove(replica)
            self._close_soon(replica)

    # ---- unary calls --------------------------------------------------------------------------
    async def info(self, timeout: float = 30.0) -> vocoder_pb2.VocoderInfo:
        """Codec facts and chunk defaults from the first replica that answers (waiting for one to come up)."""
        self._ensure_background()
        deadline = time.monotonic() + timeout
        last = "no replica answered"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), details=f"no vocoder replica answered Info "
                                                                        f"within {timeout:.0f}s: {last}")
            replicas = [r for r in self.replicas if not r.incompatible] or list(self.replicas)
            if not replicas:
                await self.refresh()
                await asyncio.sleep(min(1.0, max(0.0, left)))
                continue
            calls = {asyncio.ensure_future(r.stub.Info(vocoder_pb2.VocoderInfoRequest(), timeout=min(left, 5.0),
                                                       wait_for_ready=True)): r for r in replicas}
            pending = set(calls)
            try:
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for fut in done:
                        r = calls[fut]
                        if fut.exception() is None:
                            info = fut.result()
                            if self._check_facts(r, info):
                                r.verified = True
                                self.mark_healthy(r)
                                return info
                            last = f"{r.address} serves a different codec"
                        else:
                            e = fut.exception()
                            last = f"{r.address}: {getattr(e, 'details', lambda: str(e))()}"
            finally:
                for fut in pending:
                    fut.cancel()

    async def _unary(self, name: str, call: Callable[[VocoderReplica], Awaitable], attempts: int = 3):
        tried: list[VocoderReplica] = []
        while True:
            replica = self.pick(exclude=tried)
            try:
                result = await call(replica)
            except grpc.aio.AioRpcError as e:
                if e.code() not in REPLICA_FAILURE_CODES or e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise  # the request's own fault, or its own deadline: another replica would not help
                self.mark_failed(replica, f"{name}: {e.code().name}: {e.details()}")
                tried.append(replica)
                if len(tried) >= min(attempts, max(1, len(self.replicas))):
                    raise
                log.warning("%s on vocoder %s failed (%s); trying another replica", name, replica.address,
                            e.code().name)
                continue
            self.mark_healthy(replica)
            return result

    async def encode(self, request: vocoder_pb2.EncodeRequest, timeout: float = 120.0) -> vocoder_pb2.EncodeResponse:
        return await self._unary("Encode", lambda r: r.stub.Encode(request, timeout=timeout))

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        for r in self.replicas + self._retired:
            await r.channel.close()
