"""Request decoding for the gRPC servers (the public API, the vocoders): bytes that are not a
valid message (a corrupt body, invalid UTF-8 in a string field) end INVALID_ARGUMENT naming the
field, where gRPC's own handling would end them UNKNOWN with no word on what is wrong."""

from __future__ import annotations

import inspect

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

_LENGTH_DELIMITED = 2


class Undecodable:
    """What the deserializer hands the servicer for bytes it could not decode."""

    def __init__(self, message: str):
        self.message = message


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError
        b = data[i]
        value |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return value, i
        shift += 7


def bad_utf8_field(descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path of the first string field (e.g. references[0].transcript) whose bytes are not
    UTF-8, walking the wire format; None when there is none or the bytes are not protobuf."""
    counts: dict[str, int] = {}
    i = 0
    try:
        while i < len(data):
            key, i = _varint(data, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, i = _varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == _LENGTH_DELIMITED:
                size, i = _varint(data, i)
                chunk, i = data[i:i + size], i + size
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                name = prefix + field.name
                if field.is_repeated:
                    counts[name] = counts.get(name, -1) + 1
                    name += f"[{counts[name]}]"
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = bad_utf8_field(field.message_type, chunk, name + ".")
                    if found:
                        return found
            else:
                return None
    except ValueError:
        return None
    return None


def deserializer(cls):
    def decode(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError:
            field = bad_utf8_field(cls.DESCRIPTOR, data)
            if field:
                return Undecodable(f"{field} is not valid UTF-8")
            return Undecodable(f"request body ({len(data)} bytes) is not a valid {cls.DESCRIPTOR.full_name}")
    return decode


def _guard(behavior, client_streaming: bool, server_streaming: bool):
    async def undecodable(request, context) -> None:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    async def checked(requests, context):
        async for request in requests:
            await undecodable(request, context)
            yield request

    if server_streaming and inspect.isasyncgenfunction(behavior):
        async def call(request, context):
            if client_streaming:
                request = checked(request, context)
            else:
                await undecodable(request, context)
            async for response in behavior(request, context):
                yield response
    else:  # unary, or a streaming handler written as a coroutine (context.write, or only an abort)
        async def call(request, context):
            if client_streaming:
                request = checked(request, context)
            else:
                await undecodable(request, context)
            return await behavior(request, context)
    return call


_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


def add_service(servicer, server, module, name: str) -> None:
    """The generated add_<name>Servicer_to_server of a *_pb2 module, with the deserializers above."""
    service = module.DESCRIPTOR.services_by_name[name]
    handlers = {}
    for method in service.methods:
        request = getattr(module, method.input_type.name)
        response = getattr(module, method.output_type.name)
        streams = (method.client_streaming, method.server_streaming)
        handlers[method.name] = _HANDLERS[streams](_guard(getattr(servicer, method.name), *streams),
                                                   request_deserializer=deserializer(request),
                                                   response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
