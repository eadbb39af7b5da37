"""TLS for every gRPC server and channel, from the files a Kubernetes TLS secret mounts.

A TLS directory holds tls.crt (certificate chain), tls.key (its private key) and ca.crt (the CA
that signs the peers). cert-manager writes exactly these, and renews them in place: a server
reads them again on the next handshake after they change. A server with `require_client_cert`
accepts only clients whose certificate ca.crt signed (mTLS between services); a channel
verifies the server against ca.crt and presents tls.crt when the directory has one.

Without a TLS directory everything is plaintext, as suits loopback; serving plaintext on any
other address is logged as a warning.
"""

from __future__ import annotations

import ipaddress
import logging
import os

import grpc

log = logging.getLogger("chorus.tls")

CERT, KEY, CA = "tls.crt", "tls.key", "ca.crt"


class TlsError(ValueError):
    """A TLS directory that cannot be used; the message names the file and what to fix."""


def _read(directory: str, name: str, required: bool = True) -> bytes | None:
    path = os.path.join(directory, name)
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        if required:
            raise TlsError(f"{path} is missing: a TLS directory holds {CERT}, {KEY} and {CA} "
                           "(a Kubernetes TLS secret)") from None
        return None
    except OSError as e:
        raise TlsError(f"{path}: {e.strerror}") from None


def _stamp(directory: str) -> tuple:
    out = []
    for name in (CERT, KEY, CA):
        try:
            st = os.stat(os.path.join(directory, name))
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


def server_credentials(directory: str, require_client_cert: bool) -> grpc.ServerCredentials:
    """Credentials that serve tls.crt/tls.key and, with require_client_cert, demand a client
    certificate signed by ca.crt; the files are read again after they change (renewal)."""
    def load() -> grpc.ServerCertificateConfiguration:
        ca = _read(directory, CA, required=require_client_cert)
        return grpc.ssl_server_certificate_configuration([(_read(directory, KEY), _read(directory, CERT))],
                                                          root_certificates=ca)

    state = {"stamp": _stamp(directory)}

    def fetch():
        stamp = _stamp(directory)
        if stamp == state["stamp"]:
            return None
        try:
            config = load()
        except TlsError as e:  # half-written during a renewal: keep serving the old pair
            log.warning("TLS files changed but cannot be read yet: %s", e)
            return None
        state["stamp"] = stamp
        log.info("TLS certificate reloaded from %s", directory)
        return config

    return grpc.dynamic_ssl_server_credentials(load(), fetch, require_client_authentication=require_client_cert)


def channel_credentials(directory: str) -> grpc.ChannelCredentials:
    """Credentials that verify the server against ca.crt and present tls.crt/tls.key when present."""
    cert = _read(directory, CERT, required=False)
    key = _read(directory, KEY, required=cert is not None)
    return grpc.ssl_channel_credentials(root_certificates=_read(directory, CA), private_key=key,
                                        certificate_chain=cert)


def is_loopback(host: str) -> bool:
    bare = host.strip("[]")
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def add_port(server, host: str, port: int, tls_dir: str | None, require_client_cert: bool, what: str) -> int:
    """Binds host:port on a gRPC server (sync or aio) with TLS from tls_dir, or plaintext; the port bound."""
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    if tls_dir:
        bound = server.add_secure_port(address, server_credentials(tls_dir, require_client_cert))
        log.info("%s serves TLS on %s%s", what, address, " and requires client certificates"
                 if require_client_cert else "")
        return bound
    if not is_loopback(host):
        log.warning("%s serves PLAINTEXT gRPC on %s: anyone who reaches it can read and send traffic; "
                    "give it a tls_dir", what, address)
    return server.add_insecure_port(address)


def aio_channel(target: str, tls_dir: str | None, options: list | None = None, server_name: str | None = None,
                interceptors=None) -> grpc.aio.Channel:
    """An asyncio channel to target, TLS from tls_dir or plaintext; server_name: the name the
    server's certificate must carry when it is not target's host (an address resolved from it)."""
    options = list(options or [])
    if tls_dir:
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        return grpc.aio.secure_channel(target, channel_credentials(tls_dir), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
