"""deploy/k8s: every overlay renders with `kubectl kustomize`, validates strictly against the Kubernetes
schema, and agrees with the code: ports, probe services, flags, the TOML every pod reads, metric names."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from chorus.config import ConfigError, add_config_flags, parse
from chorus.v1 import tts_pb2, vocoder_pb2
from gateway_svc.config import GatewayConfig
from gpu_worker.config import WorkerConfig
from scheduler_svc import frontend_tier
from scheduler_svc.config import SchedulerConfig
from vocoder_svc.config import VocoderConfig

yaml = pytest.importorskip("yaml", reason="PyYAML is missing: pip install -e '.[dev]'")

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
OVERLAYS = ["base", "dev", "prod", "prod-omnivoice"]  # base: what an overlay of your own starts from
TTS_SERVICE = tts_pb2.DESCRIPTOR.services_by_name["TextToSpeech"].full_name
VOCODER_SERVICE = vocoder_pb2.DESCRIPTOR.services_by_name["Vocoder"].full_name
GPU = "nvidia.com/gpu"
DRAIN_MARGIN_S = 5  # a process's own exit after its drain, and the scheduler's wait for its frontends



class FrontendTier(SchedulerConfig):
    """`chorus frontend`: the [scheduler] settings, as a frontend tier process reads them."""


# a container's command -> the config its flags and its --config table build
COMMANDS = {("chorus", "scheduler"): SchedulerConfig, ("chorus", "worker"): WorkerConfig,
            ("chorus", "vocoder"): VocoderConfig, ("python", "-m", "gateway_svc.server"): GatewayConfig,
            ("chorus", "frontend"): FrontendTier}
ADD_FLAGS = {FrontendTier: frontend_tier.add_arguments}  # commands whose parser is their module's own


def _render(target: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the manifests are not rendered (install kubectl >= 1.27 for "
                    "`kubectl kustomize`)")
    out = subprocess.run([kubectl, "kustomize", str(target)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {target}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    name = request.param
    return name, _render(K8S / name if name == "base" else K8S / "overlays" / name)


# ---- the rendered objects ------------------------------------------------------------------------

@dataclasses.dataclass
class Container:
    pod: dict          # the Deployment
    spec: dict         # the container
    config: object     # its config object, from its flags and the mounted chorus.toml

    @property
    def cls(self):
        return type(self.config)

    @property
    def ports(self) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for p in self.spec.get("ports", [])}

    def pre_stop_s(self) -> int:
        return self.spec.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)


def _of(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def _named(docs, kind, name):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert found, f"no {kind} {name}"
    return found[0]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _config(docs, deployment, c, tmp: Path):
    """The container's config as the service builds it: its own flags, and the ConfigMap behind --config."""
    cls = COMMANDS.get(tuple(c["command"]))
    assert cls is not None, f"{deployment['metadata']['name']}/{c['name']}: unknown command {c['command']}"
    parser = argparse.ArgumentParser(prog=" ".join(c["command"]), exit_on_error=False)
    ADD_FLAGS.get(cls, lambda p: add_config_flags(p, cls))(parser)
    try:
        ns, unknown = parser.parse_known_args(c.get("args", []))
    except argparse.ArgumentError as e:
        raise AssertionError(f"{c['name']}: {c.get('args')}: {e}") from None
    assert not unknown, f"{deployment['metadata']['name']}/{c['name']}: {cls.__name__} has no flags {unknown}"
    if ns.config:
        ns.config = str(_mounted_file(docs, deployment, c, ns.config, tmp))
    try:
        return parse(cls, ns)
    except ConfigError as e:
        raise AssertionError(f"{deployment['metadata']['name']}/{c['name']}: {e}") from None


def _mounted_file(docs, deployment, c, path: str, tmp: Path) -> Path:
    """The ConfigMap key a container sees at path, written to tmp."""
    folder, key = os.path.split(path)
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    assert folder in mounts, f"{c['name']}: --config {path}, but nothing is mounted at {folder}"
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mounts[folder])
    data = _named(docs, "ConfigMap", volume["configMap"]["name"])["data"]
    assert key in data, f"{c['name']}: --config {path}: the ConfigMap has no {key}"
    out = tmp / f"{deployment['metadata']['name']}-{c['name']}-{key}"
    out.write_text(data[key])
    return out


@pytest.fixture(scope="module")
def containers(overlay, tmp_path_factory):
    name, docs = overlay
    tmp = tmp_path_factory.mktemp(name)
    return [Container(d, c, _config(docs, d, c, tmp)) for d in _of(docs, "Deployment")
            for c in d["spec"]["template"]["spec"]["containers"]]


def _by(containers, cls):
    return [c for c in containers if c.cls is cls]


# ---- the tests ------------------------------------------------------------------------------------

def _schema_version(kv) -> str:
    schemas = Path(kv.__file__).parent / "kubernetes-json-schema"
    versions = sorted((tuple(int(x) for x in p.name.split("-")[0].lstrip("v").split(".")) for p in
                       schemas.iterdir() if p.name.startswith("v1.3") and p.name.endswith("-local-strict")))
    if not versions:
        pytest.skip("kubernetes-validate has no 1.3x schema: upgrade it")
    return ".".join(map(str, versions[-1]))


def test_renders_and_validates_strictly(overlay):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is missing: pip install -e "
                                                           "'.[dev]' (the overlays rendered but were not validated)")
    name, docs = overlay
    version = _schema_version(kv)
    for d in docs:
        where = f"{name}: {d['kind']} {d['metadata']['name']}"
        if d["apiVersion"].startswith("monitoring.coreos.com/"):  # a CRD: no schema in the package
            assert d["kind"] == "PodMonitor" and d["spec"]["selector"]["matchLabels"], where
            assert all(e["port"] for e in d["spec"]["podMetricsEndpoints"]), where
            continue
        try:
            kv.validate(d, version, strict=True)
        except kv.ValidationError as e:
            raise AssertionError(f"{where} against Kubernetes {version}: {e.message} at "
                                 f"{'/'.join(map(str, e.path))}") from None


def test_ports_and_probes_agree_with_the_code(containers):
    defaults = {SchedulerConfig: SchedulerConfig(), VocoderConfig: VocoderConfig(), GatewayConfig: GatewayConfig(),
                FrontendTier: SchedulerConfig()}
    services = {SchedulerConfig: TTS_SERVICE, VocoderConfig: VOCODER_SERVICE, FrontendTier: TTS_SERVICE}
    for c in containers:
        where = f"{c.pod['metadata']['name']}/{c.spec['name']}"
        if c.cls is WorkerConfig:  # ZeroMQ stays inside the pod
            assert c.config.bind.startswith("tcp://127.0.0.1:"), f"{where}: bind {c.config.bind}"
            assert not c.ports, f"{where} exposes {c.ports}"
            continue
        assert c.config.port == defaults[c.cls].port, f"{where}: port {c.config.port}, the code's default is " \
                                                      f"{defaults[c.cls].port}"
        assert c.config.host == "0.0.0.0", f"{where}: the kubelet's probes need the pod's address"
        assert c.config.port in c.ports.values(), f"{where}: port {c.config.port} is no containerPort"
        probes = [c.spec.get(p) for p in ("startupProbe", "readinessProbe", "livenessProbe")]
        assert all(probes), f"{where}: startup, readiness and liveness probes"
        if c.cls is GatewayConfig:
            assert all("httpGet" in p and c.ports[p["httpGet"]["port"]] == c.config.port for p in probes), where
            assert c.spec["readinessProbe"]["httpGet"]["path"] == "/health", where
            continue
        if c.cls is FrontendTier:  # readiness follows the engines; liveness only the port (engines may be out)
            assert c.config.engines, f"{where}: no --engines"
            assert c.config.metrics_port and c.config.metrics_port in c.ports.values(), f"{where}: metrics port"
            assert c.spec["livenessProbe"] == {**c.spec["livenessProbe"], "tcpSocket": {"port": c.config.port}}, where
            probes = probes[:2]
            for p in probes:
                assert p["grpc"] == {"port": c.config.port, "service": TTS_SERVICE}, f"{where}: {p}"
            continue
        if c.cls is SchedulerConfig and not c.config.frontends:  # an engine: its link is a containerPort
            link = c.config.frontend_link
            assert link.startswith("tcp://0.0.0.0:") and int(link.rsplit(":", 1)[1]) in c.ports.values(), \
                f"{where}: frontend_link {link!r} on the pod's address and a containerPort"
        assert c.config.metrics_port and c.config.metrics_port in c.ports.values(), f"{where}: metrics port"
        if c.cls is VocoderConfig:
            assert c.config.metrics_port == defaults[VocoderConfig].metrics_port, where
        for p in probes:
            assert p["grpc"] == {"port": c.config.port, "service": services[c.cls]}, f"{where}: {p}"


def test_processes_find_each_other(overlay, containers):
    """The scheduler's worker and vocoder addresses, and the gateway's scheduler, lead to those processes."""
    _, docs = overlay
    services = {s["metadata"]["name"]: s for s in _of(docs, "Service")}

    def serving(target: str, cls) -> list[Container]:
        """The containers behind HOST:PORT (a Service's name, or loopback for the same pod)."""
        host, port = target.removeprefix("dns:///").rsplit(":", 1)
        svc = services.get(host)
        if svc is None:
            return []
        assert any(p["port"] == int(port) for p in svc["spec"]["ports"]), f"{target}: no such port on {host}"
        if target.startswith("dns:///"):
            assert svc["spec"].get("clusterIP") == "None", f"{target}: dns:/// needs a headless Service"
        labels = lambda c: c.pod["spec"]["template"]["metadata"]["labels"]  # noqa: E731
        return [c for c in _by(containers, cls) if _selects(svc["spec"]["selector"], labels(c))
                and c.config.port == int(port)]

    for s in _by(containers, SchedulerConfig):
        pod = [c for c in containers if c.pod is s.pod]
        binds = {c.config.bind for c in pod if c.cls is WorkerConfig}
        assert {s.config.worker, *s.config.omnivoice_worker} == binds, f"scheduler workers vs the pod's {binds}"
    for f in _by(containers, FrontendTier):
        for target in f.config.engines:
            host, port = target.removeprefix("dns:///").rsplit(":", 1)
            svc = services.get(host)
            assert target.startswith("dns:///") and svc and svc["spec"].get("clusterIP") == "None", \
                f"frontend --engines {target}: a headless Service, looked up as dns:///NAME:PORT"
            engines = [c for c in _by(containers, SchedulerConfig) if not c.config.frontends
                       and _selects(svc["spec"]["selector"], c.pod["spec"]["template"]["metadata"]["labels"])
                       and c.config.frontend_link.endswith(f":{port}")]
            assert engines and any(p["port"] == int(port) for p in svc["spec"]["ports"]), \
                f"frontend --engines {target}: no engine (frontends = 0) links on {port} behind {host}"
    for s in _by(containers, SchedulerConfig) + _by(containers, FrontendTier):
        if s.cls is SchedulerConfig and not s.config.frontends:
            continue  # an engine talks to no vocoder
        pod = [c for c in containers if c.pod is s.pod]
        for target in s.config.vocoder + s.config.omnivoice_vocoder:
            if target.startswith("127.0.0.1:"):
                found = [c for c in pod if c.cls is VocoderConfig and c.config.port == int(target.split(":")[1])]
            else:
                found = serving(target, VocoderConfig)
            assert found, f"scheduler --vocoder {target}: no vocoder serves it"
            omni = target in s.config.omnivoice_vocoder
            assert all(bool(c.config.codec and "omnivoice" in c.config.codec) == omni for c in found), target
    for g in _by(containers, GatewayConfig):
        assert serving(g.config.scheduler, FrontendTier), f"gateway --scheduler {g.config.scheduler}"


def test_colocated_decoder_is_shared(containers):
    for v in _by(containers, VocoderConfig):
        if not v.config.attach_decoder:
            continue
        workers = [c for c in containers if c.pod is v.pod and c.cls is WorkerConfig
                   and c.config.host_vocoder_decoder == v.config.attach_decoder]
        assert len(workers) == 1, f"--attach-decoder {v.config.attach_decoder}: no worker hosts it"
        volume = lambda c: {m["mountPath"]: m["name"] for m in c.spec["volumeMounts"]}.get(  # noqa: E731
            v.config.attach_decoder)
        assert volume(v) and volume(v) == volume(workers[0]), "the decoder's sockets need one shared volume"
        assert GPU not in v.spec["resources"]["limits"], "the hosted decoder runs on the worker's GPU"


def test_resources_gpus_images_and_security(overlay, containers):
    _, docs = overlay
    tags: dict[str, str] = {}
    for c in containers:
        where = f"{c.pod['metadata']['name']}/{c.spec['name']}"
        res = c.spec.get("resources", {})
        for side in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res.get(side, {})), f"{where}: {side} needs cpu and memory"
        gpu = res["limits"].get(GPU)
        if c.cls is WorkerConfig or (c.cls is VocoderConfig and not c.config.attach_decoder):
            assert gpu and res["requests"].get(GPU) == gpu, f"{where}: a GPU, requested as limited"
            assert c.config.device.startswith("cuda"), f"{where}: device {c.config.device} on a GPU"
        else:
            assert gpu is None and GPU not in res["requests"], f"{where} needs no GPU"
        image = c.spec["image"]
        name, _, tag = image.rpartition(":")
        assert "/" in name and tag and tag != "latest" and "/" not in tag, f"{where}: image {image}"
        assert tags.setdefault(name, tag) == tag, f"{name} in two versions: {tag}, {tags[name]}"
        sc = c.spec.get("securityContext", {})
        assert sc.get("allowPrivilegeEscalation") is False and sc.get("capabilities") == {"drop": ["ALL"]}, where
        assert sc.get("readOnlyRootFilesystem") is True, f"{where}: read-only root filesystem"
        mounts = {m["mountPath"]: m for m in c.spec.get("volumeMounts", [])}
        assert "/tmp" in mounts, f"{where}: a writable /tmp (emptyDir) under a read-only root"
        for path, m in mounts.items():
            if path in ("/models", "/etc/chorus"):
                assert m.get("readOnly") is True, f"{where}: {path} is mounted read-only"
    for d in _of(docs, "Deployment"):
        sc = d["spec"]["template"]["spec"]["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0, d["metadata"]["name"]


def _cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_each_frontend_has_a_core(containers):
    for s in _by(containers, SchedulerConfig):
        cpu = _cores(s.spec["resources"]["requests"]["cpu"])
        assert cpu >= s.config.frontends, f"{s.pod['metadata']['name']}: {s.config.frontends} frontends on {cpu} CPUs"
    for g in _by(containers, GatewayConfig):
        frontends = max(s.config.frontends for s in _by(containers, SchedulerConfig))
        assert g.config.channels >= frontends, f"gateway channels {g.config.channels} < frontends {frontends}"


def test_grace_covers_the_drain(containers):
    for c in containers:
        where = f"{c.pod['metadata']['name']}/{c.spec['name']}"
        grace = c.pod["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        drain = {SchedulerConfig: lambda x: x.drain_seconds + DRAIN_MARGIN_S, GatewayConfig: lambda x: x.drain_seconds,
                 FrontendTier: lambda x: x.drain_seconds + DRAIN_MARGIN_S,
                 VocoderConfig: lambda x: x.grace, WorkerConfig: lambda x: x.drain_seconds}[c.cls](c.config)
        assert c.pre_stop_s() + drain <= grace, f"{where}: preStop {c.pre_stop_s()} s + drain {drain} s > {grace} s"
        if c.cls is SchedulerConfig:  # what serves its draining streams goes after it
            for other in containers:
                if other.pod is not c.pod or other.cls not in (WorkerConfig, VocoderConfig):
                    continue
                # a worker serves on while its scheduler is connected; a vocoder refuses new streams at once
                serves = other.pre_stop_s() + (other.config.drain_seconds if other.cls is WorkerConfig else 0)
                assert serves >= c.pre_stop_s() + drain, f"{other.spec['name']} leaves before the scheduler drained"


def test_every_deployment_has_a_budget_and_an_autoscaler_that_can_read_its_metrics(overlay, containers):
    from scheduler_svc import metrics as scheduler_metrics
    from vocoder_svc.metrics import Metrics as VocoderMetrics

    name, docs = overlay
    exported = {m.name for reg in (scheduler_metrics.REGISTRY, VocoderMetrics().registry) for m in reg.collect()}
    rules = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    served = {r["name"]["as"] for r in rules}
    for r in rules:
        series = r["seriesQuery"].split("{")[0]
        assert series in exported, f"prometheus-adapter rule on {series}: no such metric in the code"
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in _of(docs, "HorizontalPodAutoscaler")}
    for d in _of(docs, "Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert any(_selects(p["spec"]["selector"]["matchLabels"], labels) for p in
                   _of(docs, "PodDisruptionBudget")), f"{name}: no PodDisruptionBudget for {d['metadata']['name']}"
        hpa = hpas.get(d["metadata"]["name"])
        if hpa is None:
            assert name == "dev" and d["metadata"]["name"] == "engine", f"{name}: {d['metadata']['name']} has no HPA"
            continue
        pods = [c for c in containers if c.pod is d]
        for m in hpa["spec"]["metrics"]:
            if m["type"] == "Resource":
                assert m["resource"]["name"] == "cpu" and all(c.cls in (GatewayConfig, FrontendTier) for c in pods), hpa
                continue
            metric, target = m["pods"]["metric"]["name"], float(m["pods"]["target"]["averageValue"])
            assert metric in served, f"HPA {d['metadata']['name']}: {metric} is not served by prometheus-adapter"
            if metric == "chorus_running_requests":
                moss = {c.config.worker for c in pods if c.cls is SchedulerConfig}
                batch = min(c.config.max_batch for c in pods if c.cls is WorkerConfig and c.config.bind in moss)
                assert target < batch, f"HPA engine: {metric} target {target} >= the worker's max_batch {batch}"
            if metric == "chorus_vocoder_active_streams":
                slots = min(c.config.slots for c in pods if c.cls is VocoderConfig)
                assert target < slots, f"HPA {d['metadata']['name']}: {metric} target {target} >= slots {slots}"


def test_every_metrics_port_is_scraped(overlay, containers):
    _, docs = overlay
    monitors = _of(docs, "PodMonitor")
    allowed = {p["port"] for n in _of(docs, "NetworkPolicy") if n["metadata"]["name"] == "metrics-scrape"
               for rule in n["spec"]["ingress"] for p in rule["ports"]}
    for c in containers:
        labels = c.pod["spec"]["template"]["metadata"]["labels"]
        for port_name, port in c.ports.items():
            if not port_name.endswith("metrics"):
                continue
            annotations = c.pod["spec"]["template"]["metadata"].get("annotations", {})
            annotated = annotations.get("prometheus.io/scrape") == "true" and \
                annotations.get("prometheus.io/port") == str(port)
            assert annotated or any(_selects(m["spec"]["selector"]["matchLabels"], labels) and
                                    port_name in {e["port"] for e in m["spec"]["podMetricsEndpoints"]}
                                    for m in monitors), \
                f"{c.pod['metadata']['name']}/{c.spec['name']}: neither a PodMonitor nor the annotations scrape {port}"
            assert port in allowed, f"the metrics NetworkPolicy keeps Prometheus from port {port}"
    for c in _by(containers, SchedulerConfig) + _by(containers, VocoderConfig) + _by(containers, FrontendTier):
        assert c.config.metrics_port in c.ports.values()


def test_only_the_gateway_is_public(overlay):
    _, docs = overlay
    policies = _of(docs, "NetworkPolicy")
    assert any(p["spec"]["podSelector"] == {} and "ingress" not in p["spec"] for p in policies), "default deny"
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            if "from" not in rule:  # open to every source
                assert p["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "chorus-gateway"}, p
    for s in _of(docs, "Service"):
        if s["spec"].get("type", "ClusterIP") != "ClusterIP":
            assert s["metadata"]["name"] == "gateway", f"Service {s['metadata']['name']} is {s['spec']['type']}"


def test_the_engine_link_answers_frontends_only(overlay, containers):
    """The frontend link takes submits and voices without an API key: only the frontend tier reaches it."""
    _, docs = overlay
    links = {int(c.config.frontend_link.rsplit(":", 1)[1]) for c in _by(containers, SchedulerConfig)
             if not c.config.frontends}
    assert links, "no engine serves a frontend link"
    frontends = {"app.kubernetes.io/name": "chorus-frontend"}
    opened = set()
    for p in _of(docs, "NetworkPolicy"):
        if not _selects(p["spec"]["podSelector"].get("matchLabels", {}), {"app.kubernetes.io/name": "chorus-engine"}):
            continue
        for rule in p["spec"].get("ingress", []):
            ports = {q["port"] for q in rule.get("ports", [])}
            if ports & links or not ports:
                assert rule.get("from") == [{"podSelector": {"matchLabels": frontends}}], \
                    f"NetworkPolicy {p['metadata']['name']} opens the engine link to {rule.get('from', 'everyone')}"
                opened |= ports & links
    assert opened == links, f"no NetworkPolicy lets the frontends reach the engine link {links - opened}"


# ---- the images ----------------------------------------------------------------------------------

IMAGES = K8S.parent / "images"


@pytest.mark.parametrize("role", ["engine", "vocoder", "gateway", "allinone"])
def test_containerfile_is_pinned_and_non_root(role):
    text = (IMAGES / f"{role}.Containerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    base = next(ln for ln in lines if ln.startswith("ARG BASE="))
    assert lines.index(base) < next(i for i, ln in enumerate(lines) if ln.startswith("FROM")), "ARG BASE before FROM"
    image, _, tag = base.removeprefix("ARG BASE=").rpartition(":")
    assert image and tag and tag != "latest", f"{role}: base {base}"
    assert "FROM ${BASE}" in lines
    assert lines[[ln.split()[0] for ln in lines].index("USER")] == "USER 10001:10001", f"{role} runs as uid 10001"
    assert "-c /tmp/build/constraints.txt" in text, f"{role}: installs under constraints.txt"
    if role != "gateway":
        assert "ARG TORCH_VERSION=" in text and '"torch==${TORCH_VERSION}"' in text, f"{role}: torch pinned"
    else:
        assert not any("torch" in ln for ln in lines), "the gateway needs no torch"
    assert "/models" not in " ".join(ln for ln in lines if ln.startswith(("COPY", "ADD"))), "no checkpoint baked in"


def test_constraints_pin_every_dependency():
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((K8S.parent.parent / "pyproject.toml").read_text())["project"]
    pinned = {canonicalize_name(ln.split("==")[0]) for ln in (IMAGES / "constraints.txt").read_text().splitlines()
              if ln and not ln.startswith("#")}
    wanted = project["dependencies"] + project["optional-dependencies"]["http"]
    missing = {canonicalize_name(Requirement(r).name) for r in wanted} - pinned - {"torch"}
    assert not missing, f"deploy/images/constraints.txt pins no version of {sorted(missing)}"
