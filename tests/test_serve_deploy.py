"""The fleet recipe in deploy/: the Kubernetes manifest against the Kubernetes API schema (kubernetes-validate),
probes on the server's endpoints, and every command line (k8s, Dockerfile, systemd) accepted by the server."""
import argparse
import configparser
import json
import re
import shlex
from pathlib import Path

import pytest

from nxdi_voxtral.serve.cli import add_arguments

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def serve_args(argv: list[str]) -> argparse.Namespace:
    """What `python -m nxdi_voxtral serve ARGV` would run with (SystemExit on an unknown flag)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def docs():
    yaml = pytest.importorskip("yaml")
    return {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "k8s.yaml").read_text())}


def test_k8s_manifest_is_valid_against_the_api_schema(docs):
    kv = pytest.importorskip("kubernetes_validate")
    for doc in docs.values():
        kv.validate(doc, kv.latest_version(), strict=True)  # raises ValidationError naming the field
    broken = json.loads(json.dumps(docs["Deployment"]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = ["http"]
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, kv.latest_version(), strict=True)


def test_k8s_deployment_probes_neuron_resource_and_rolling_update(docs):
    dep = docs["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = serve_args(c["args"])
    assert c["resources"]["limits"]["aws.amazon.com/neuron"] >= 1
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports[c["readinessProbe"]["httpGet"]["port"]] == args.port and args.host == "0.0.0.0"
    assert dep["spec"]["strategy"]["type"] == "RollingUpdate"
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + args.grace
    assert args.artifacts == c["volumeMounts"][0]["mountPath"] + "/current"
    assert docs["Service"]["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_dockerfile_and_systemd_unit():
    text = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"ARG BASE_IMAGE=(\S+)", text).group(1)
    assert base.startswith("public.ecr.aws/neuron/pytorch-inference-neuronx:") and "FROM ${BASE_IMAGE}" in text
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))  # exec form: PID 1 gets SIGTERM
    assert entry[:4] == ["python", "-m", "nxdi_voxtral", "serve"] and serve_args(entry[4:]).artifacts
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string((DEPLOY / "nxdi-voxtral.service").read_text())
    service = unit["Service"]
    cmd = shlex.split(service["ExecStart"])
    assert cmd[1:4] == ["-m", "nxdi_voxtral", "serve"]
    args = serve_args(cmd[4:])
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID" and service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) > args.grace and service["KillMode"] == "mixed"
