"""Security against the real services (tiny model, CPU), one cluster for the module: the public API
over TLS with API keys, the vocoder over mTLS, the worker link under CURVE with a small maximum
message size, and the gateway passing the caller's bearer through.

Certificates come from a CA made here with the openssl CLI; CURVE keys from the launcher's
throwaway pair (Cluster(curve=True), as `chorus up --curve on` does)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import time

import grpc
import httpx
import numpy as np
import pytest
import soundfile as sf
import zmq
import zmq.auth
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chorus.client import channel, credentials, synthesize
from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc, vocoder_pb2, vocoder_pb2_grpc, worker_pb2
from helpers import make_cluster

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")

KEY_A = "key-of-alice-0123456789abcdef"
KEY_B = "key-of-bob-0123456789abcdef"
WRONG = "not-a-key-0123456789abcdef"
WORKER_MAX_BYTES = 4 << 20


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(ca_dir: str, out_dir: str, name: str) -> None:
    """out_dir/{tls.crt, tls.key, ca.crt}: a certificate for `name` (also valid for 127.0.0.1 and
    localhost, as a server and as a client) signed by the CA in ca_dir, as cert-manager mounts it."""
    os.makedirs(out_dir)
    ext = os.path.join(out_dir, "ext.cnf")
    with open(ext, "w") as fh:
        fh.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "tls.key",
             "-out", "req.csr", "-subj", f"/CN={name}", cwd=out_dir)
    _openssl("x509", "-req", "-in", "req.csr", "-CA", os.path.join(ca_dir, "ca.crt"), "-CAkey",
             os.path.join(ca_dir, "ca.key"), "-CAcreateserial", "-days", "2", "-out", "tls.crt", "-extfile", ext,
             cwd=out_dir)
    shutil.copy(os.path.join(ca_dir, "ca.crt"), os.path.join(out_dir, "ca.crt"))


def _ca(directory: str) -> str:
    os.makedirs(directory)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             "ca.key", "-out", "ca.crt", "-days", "2", "-subj", f"/CN={os.path.basename(directory)}", cwd=directory)
    return directory


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pki"))
    ca = _ca(os.path.join(root, "ca"))
    for name in ("server", "client"):
        _issue(ca, os.path.join(root, name), name)
    _issue(_ca(os.path.join(root, "other-ca")), os.path.join(root, "stranger"), "stranger")
    keys = os.path.join(root, "api_keys")
    with open(keys, "w") as fh:
        fh.write(f"# owner key\nalice {KEY_A}\nbob {KEY_B}\n")
    return root


@pytest.fixture(scope="module")
def cluster(pki):
    server, client = os.path.join(pki, "server"), os.path.join(pki, "client")
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "8192",
                                   "--max-message-bytes", str(WORKER_MAX_BYTES)],
                      vocoder_args=["--tls-dir", server],
                      scheduler_args=["--tls-dir", server, "--api-keys", os.path.join(pki, "api_keys"),
                                      "--vocoder-tls-dir", client],
                      curve=True) as c:
        c.port = int(c.address.rsplit(":", 1)[1])
        yield c


def _creds(pki: str, who: str = "client") -> grpc.ChannelCredentials:
    d = os.path.join(pki, who)
    return credentials(os.path.join(d, "ca.crt"), os.path.join(d, "tls.crt"), os.path.join(d, "tls.key"))


@pytest.fixture(scope="module")
def stub(cluster, pki):
    return tts_pb2_grpc.TextToSpeechStub(channel(f"localhost:{cluster.port}", _creds(pki)))


def _auth(key: str | None):
    return (("authorization", f"Bearer {key}"),) if key else None


def _request(voice_id: str = "") -> tts_pb2.SynthesizeRequest:
    req = tts_pb2.SynthesizeRequest(text="Hello there.", min_frames=4, max_frames=4)
    req.sampling.seed = 3
    if voice_id:
        req.references.add(voice_id=voice_id)
    return req


def _wav() -> bytes:
    t = np.arange(48000 // 2) / 48000
    buf = io.BytesIO()
    sf.write(buf, 0.3 * np.sin(2 * np.pi * 220 * t), 48000, format="WAV")
    return buf.getvalue()


# ---- TLS ------------------------------------------------------------------------------------------

def test_tls_with_the_right_ca_works(stub):
    out = synthesize(stub, _request(), timeout=120, api_key=KEY_A)
    assert out.summary.frames == 4 and out.pcm().size > 0


def test_plaintext_and_an_unknown_ca_fail(cluster, pki):
    for ch in (channel(f"127.0.0.1:{cluster.port}"), channel(f"localhost:{cluster.port}", _creds(pki, "stranger"))):
        with pytest.raises(grpc.RpcError) as e:
            tts_pb2_grpc.TextToSpeechStub(ch).ListModels(tts_pb2.ListModelsRequest(), timeout=5,
                                                         metadata=_auth(KEY_A))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        ch.close()


def test_the_vocoder_requires_a_client_certificate(cluster, pki):
    address = cluster.service("vocoder").address
    ca = os.path.join(pki, "client", "ca.crt")
    anonymous = channel(address, credentials(ca))  # verifies the vocoder, shows no certificate
    with pytest.raises(grpc.RpcError) as e:
        vocoder_pb2_grpc.VocoderStub(anonymous).Info(vocoder_pb2.VocoderInfoRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError):
        vocoder_pb2_grpc.VocoderStub(channel(address)).Info(vocoder_pb2.VocoderInfoRequest(), timeout=5)
    info = vocoder_pb2_grpc.VocoderStub(channel(address, _creds(pki))).Info(vocoder_pb2.VocoderInfoRequest(), timeout=10)
    assert info.sample_rate > 0


# ---- API keys -------------------------------------------------------------------------------------

def _every_rpc(stub, key):
    """Each public RPC called with key; yields (name, the RpcError or None)."""
    calls = {
        "Synthesize": lambda md: list(stub.Synthesize(_request(), timeout=30, metadata=md)),
        "ListModels": lambda md: stub.ListModels(tts_pb2.ListModelsRequest(), timeout=30, metadata=md),
        "CreateVoice": lambda md: stub.CreateVoice(tts_pb2.CreateVoiceRequest(
            audio=common_pb2.AudioData(data=_wav())), timeout=60, metadata=md),
        "ListVoices": lambda md: stub.ListVoices(tts_pb2.ListVoicesRequest(), timeout=30, metadata=md),
        "DeleteVoice": lambda md: stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id="x"), timeout=30,
                                                   metadata=md),
    }
    for name, call in calls.items():
        try:
            call(_auth(key))
            yield name, None
        except grpc.RpcError as e:
            yield name, e


@pytest.mark.parametrize("key", [None, WRONG])
def test_every_rpc_needs_a_valid_key(stub, key):
    for name, error in _every_rpc(stub, key):
        assert error is not None and error.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert "authorization: Bearer" in error.details() and WRONG not in error.details(), name


def test_health_stays_open(cluster, pki):
    health = health_pb2_grpc.HealthStub(channel(f"localhost:{cluster.port}", _creds(pki)))
    resp = health.Check(health_pb2.HealthCheckRequest(service="chorus.v1.TextToSpeech"), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_voices_belong_to_the_key_that_made_them(stub):
    voice = stub.CreateVoice(tts_pb2.CreateVoiceRequest(voice_id="alices", audio=common_pb2.AudioData(
        data=_wav())), timeout=120, metadata=_auth(KEY_A))
    assert voice.voice_id == "alices"
    assert "alices" in [v.voice_id for v in stub.ListVoices(tts_pb2.ListVoicesRequest(), metadata=_auth(KEY_A)).voices]
    assert "alices" not in [v.voice_id for v in
                            stub.ListVoices(tts_pb2.ListVoicesRequest(), metadata=_auth(KEY_B)).voices]
    for call in (lambda: synthesize(stub, _request("alices"), timeout=60, api_key=KEY_B),
                 lambda: stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id="alices"), metadata=_auth(KEY_B))):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert synthesize(stub, _request("alices"), timeout=120, api_key=KEY_A).summary.frames == 4
    stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id="alices"), metadata=_auth(KEY_A))


def test_keys_are_reread_when_the_file_changes(stub, pki):
    path = os.path.join(pki, "api_keys")
    new = "key-of-carol-0123456789abcdef"
    original = open(path).read()
    with open(path, "a") as fh:
        fh.write(f"carol {new}\n")
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                stub.ListModels(tts_pb2.ListModelsRequest(), timeout=10, metadata=_auth(new))
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() < deadline
                time.sleep(0.3)
    finally:
        with open(path, "w") as fh:
            fh.write(original)


# ---- the gateway ----------------------------------------------------------------------------------

def test_the_gateway_passes_the_bearer_through(cluster, pki):
    from test_gateway import start_gateway

    gateway = start_gateway(f"localhost:{cluster.port}", "--scheduler-tls-dir", os.path.join(pki, "client"))
    try:
        with httpx.Client(base_url=f"http://{gateway.address}", timeout=60) as http:
            for headers in ({}, {"Authorization": f"Bearer {WRONG}"}):
                r = http.get("/v1/audio/voices", headers=headers)
                assert r.status_code == 401, r.text
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and "Bearer" in err["message"]
                assert WRONG not in r.text
            r = http.get("/v1/audio/voices", headers={"Authorization": f"Bearer {KEY_A}"})
            assert r.status_code == 200 and "data" in r.json()
            r = http.post("/v1/audio/speech", json={"input": "Hi.", "voice": "alloy", "response_format": "pcm",
                                                   "seed": 7, "min_frames": 4, "max_frames": 4},
                          headers={"Authorization": f"Bearer {KEY_B}"})
            assert r.status_code == 200 and len(r.content) > 0, (r.status_code, r.text[:300])
    finally:
        gateway.stop()


# ---- ZeroMQ ---------------------------------------------------------------------------------------

def _dealer(endpoint: str, keys: tuple[str, str] | None = None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys:
        public, secret = zmq.auth.load_certificate(keys[0])
        sock.curve_secretkey, sock.curve_publickey = secret, public
        sock.curve_serverkey, _ = zmq.auth.load_certificate(keys[1])
    sock.connect(endpoint)
    return sock


def _send(sock: zmq.Socket, data: bytes, timeout_ms: int = 1000) -> bool:
    """False when the socket has no peer to queue data for (a refused CURVE handshake leaves none)."""
    if not sock.poll(timeout_ms, zmq.POLLOUT):
        return False
    sock.send(data, zmq.NOBLOCK)
    return True


def _hello(sock: zmq.Socket, timeout_ms: int) -> worker_pb2.Hello | None:
    _send(sock, worker_pb2.WorkerCommand(hello=worker_pb2.HelloRequest()).SerializeToString(), timeout_ms)
    if not sock.poll(timeout_ms):
        return None
    return worker_pb2.WorkerEvent.FromString(sock.recv()).hello


def _scheduler_keys(cluster) -> tuple[str, str]:
    curve = os.path.join(cluster._tmp.name, "curve")
    return os.path.join(curve, "scheduler.key_secret"), os.path.join(curve, "worker.key")


def test_the_worker_answers_only_its_scheduler(cluster, stub):
    endpoint = cluster.services[0].address
    for keys in (None, (os.path.join(cluster._tmp.name, "curve", "worker.key_secret"),
                        os.path.join(cluster._tmp.name, "curve", "worker.key"))):
        stranger = _dealer(endpoint, keys)  # no key, or a key pair not on the allow-list
        assert _hello(stranger, 1500) is None
        _send(stranger, worker_pb2.WorkerCommand(shutdown=worker_pb2.Shutdown()).SerializeToString())
        time.sleep(0.3)
        stranger.close()
    assert cluster.services[0].proc.poll() is None
    ours = _dealer(endpoint, _scheduler_keys(cluster))
    assert _hello(ours, 10000).model_name
    ours.close()
    assert synthesize(stub, _request(), timeout=120, api_key=KEY_A).summary.frames == 4


def test_an_oversized_message_drops_its_sender_not_the_worker(cluster, stub):
    endpoint = cluster.services[0].address
    big = _dealer(endpoint, _scheduler_keys(cluster))
    assert _send(big, b"\0" * (WORKER_MAX_BYTES + 1), 10000)
    assert big.poll(1500) == 0  # no answer: the worker dropped the connection unread
    big.close()
    assert cluster.services[0].proc.poll() is None
    ours = _dealer(endpoint, _scheduler_keys(cluster))
    assert _hello(ours, 10000).model_name
    ours.close()
    assert synthesize(stub, _request(), timeout=120, api_key=KEY_A).summary.frames == 4


# ---- files ----------------------------------------------------------------------------------------

def test_a_bad_key_file_names_the_line_never_the_key(tmp_path):
    from chorus.api_keys import KeyFileError, read_keys

    path = tmp_path / "keys"
    path.write_text("alice short-key\n")
    with pytest.raises(KeyFileError, match="line 1") as e:
        read_keys(str(path))
    assert "short-key" not in str(e.value)
    path.write_text("alice\n")
    with pytest.raises(KeyFileError, match="OWNER KEY"):
        read_keys(str(path))


def test_a_tls_dir_without_its_files_says_which(tmp_path):
    from chorus.tls import TlsError, server_credentials

    with pytest.raises(TlsError, match="tls.key is missing"):
        server_credentials(str(tmp_path), require_client_cert=False)
