"""Vocoder replicas as seen from the scheduler: one gRPC channel each, and
the least-loaded choice per request (fewest streams this scheduler has open)."""

from __future__ import annotations

import grpc

from chorus.v1 import vocoder_pb2, vocoder_pb2_grpc


class VocoderReplica:
    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
        self.stub = vocoder_pb2_grpc.VocoderStub(self.channel)
        self.open_streams = 0


class VocoderPool:
    def __init__(self, addresses: list[str]):
        if not addresses:
            raise ValueError("at least one vocoder address is required")
        self.replicas = [VocoderReplica(a) for a in addresses]

    def pick(self) -> VocoderReplica:
        return min(self.replicas, key=lambda r: r.open_streams)

    async def info(self, timeout: float = 30.0) -> vocoder_pb2.VocoderInfo:
        replica = self.replicas[0]
        return await replica.stub.Info(vocoder_pb2.VocoderInfoRequest(), timeout=timeout, wait_for_ready=True)

    async def encode(self, request: vocoder_pb2.EncodeRequest, timeout: float = 120.0) -> vocoder_pb2.EncodeResponse:
        return await self.pick().stub.Encode(request, timeout=timeout)

    async def close(self) -> None:
        for r in self.replicas:
            await r.channel.close()
