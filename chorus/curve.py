"""ZeroMQ link security: CURVE (authenticated, encrypted) and a maximum message size.

A gpu_worker with a CURVE key serves only clients whose public key is in its allow-list
directory (its scheduler's): anyone else's handshake fails, so they can neither read its model
config nor send it a step or a shutdown. Key files are zmq.auth's: `NAME.key` holds a public key,
`NAME.key_secret` the pair (`python -m chorus.curve DIR NAME` writes one pair; Kubernetes mounts
them from secrets).

Every ZeroMQ socket also gets ZMQ_MAXMSGSIZE: a peer that sends a larger message is
disconnected by libzmq before the message is read, and the socket's owner carries on.
"""

from __future__ import annotations

import logging
import os
import sys

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("chorus.curve")


class CurveError(ValueError):
    """A CURVE key file or directory that cannot be used."""


def _load(path: str, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise CurveError(f"CURVE key file {path}: {e}") from None
    if secret and secret_key is None:
        raise CurveError(f"CURVE key file {path} holds no secret key: give the `.key_secret` file")
    return public, secret_key


def limit_size(sock: zmq.Socket, max_bytes: int) -> None:
    """Peers that send a message over max_bytes are dropped (0 = no limit)."""
    if max_bytes > 0:
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)


def serve(ctx: zmq.Context, sock: zmq.Socket, secret_key_file: str, clients_dir: str) -> ThreadAuthenticator:
    """Makes sock (before bind) a CURVE server that admits only the public keys in clients_dir;
    the authenticator it returns must live as long as the socket."""
    if not os.path.isdir(clients_dir) or not any(n.endswith(".key") for n in os.listdir(clients_dir)):
        raise CurveError(f"CURVE clients directory {clients_dir} holds no `.key` public key file: put the "
                         "scheduler's public key there")
    public, secret = _load(secret_key_file, secret=True)
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("chorus.curve.auth"))
    auth.start()
    auth.configure_curve(domain="*", location=clients_dir)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    log.info("CURVE on: only the %d public keys in %s may connect", sum(n.endswith(".key") for n in
                                                                         os.listdir(clients_dir)), clients_dir)
    return auth


def router(ctx: zmq.Context, secret_key_file: str | None, clients_dir: str | None,
           max_bytes: int) -> tuple[zmq.Socket, ThreadAuthenticator | None]:
    """A worker's ROUTER socket, not yet bound: size-limited, and a CURVE server when given keys
    (stop the authenticator, if any, before terminating ctx)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    limit_size(sock, max_bytes)
    auth = serve(ctx, sock, secret_key_file, clients_dir) if secret_key_file else None
    return sock, auth


def warn_if_open(endpoint: str, auth, link: str = "worker link",
                 keys: str = "curve_secret_key and curve_clients") -> None:
    """Logs that a non-loopback endpoint without CURVE takes commands from anyone who reaches it."""
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if auth is None and endpoint.startswith("tcp://") and host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("the %s %s has no CURVE: anyone who reaches it can use and stop this service; give %s",
                    link, endpoint, keys)


def connect_as(sock: zmq.Socket, secret_key_file: str, server_public_file: str) -> None:
    """Makes sock (before connect) a CURVE client with this key pair, trusting that server key."""
    public, secret = _load(secret_key_file, secret=True)
    server_public, _ = _load(server_public_file, secret=False)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def generate(directory: str, name: str) -> tuple[str, str]:
    """A new key pair in directory: (public `.key` file, secret `.key_secret` file)."""
    os.makedirs(directory, exist_ok=True)
    return zmq.auth.create_certificates(directory, name)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m chorus.curve DIR NAME  (writes DIR/NAME.key and DIR/NAME.key_secret)")
    for path in generate(sys.argv[1], sys.argv[2]):
        print(path)
