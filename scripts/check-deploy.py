#!/usr/bin/env python3
"""Checks what this machine can check of the deployment files, with no
Docker engine and no Kubernetes cluster (CI runs it; so can you):

- docker-compose.yml parses (`docker-compose config`, Debian's client);
- deploy/prometheus/alerts.yml passes `promtool check rules`, and its unit
  tests `promtool test rules alerts.test.yml` (Debian's `prometheus`);
- every query of deploy/grafana/readstates.json is valid PromQL (promtool
  checks them as recording rules, Grafana's variables filled in);
- deploy/k8s/*.yaml validate against the Kubernetes schemas
  (`kubernetes-validate` from PyPI, in a virtualenv under the cache), and the
  canary's pod is the fleet's but for its name, component and image;
- the image's health check: the Dockerfile's HEALTHCHECK command, with the
  grpc-health-probe version the Dockerfile installs, says SERVING for a
  locally started server and fails for a stopped one; the Kubernetes
  readiness probe's service is the one the server reports.

Whatever it needs and lacks, it installs (apt-get, pip, go install).
That every metric these files name is exported is a cargo test
(`src/metrics.rs`).
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "readstates"
KUBERNETES_VERSION = "1.30.0"


def run(*command, **kwargs):
    print("+", " ".join(str(c) for c in command), flush=True)
    return subprocess.run([str(c) for c in command], check=True, **kwargs)


def need_debian(command, package):
    if shutil.which(command):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run("apt-get", "update", "-qq", env=env)
    run("apt-get", "install", "-y", "-qq", "--no-install-recommends", package, env=env)


def compose():
    need_debian("docker-compose", "docker-compose")
    run("docker-compose", "-f", ROOT / "docker-compose.yml", "config", "-q")


def alerts():
    need_debian("promtool", "prometheus")
    run("promtool", "check", "rules", ROOT / "deploy/prometheus/alerts.yml")
    run("promtool", "test", "rules", "alerts.test.yml", cwd=ROOT / "deploy/prometheus")


def dashboard():
    """Each target's expression as a recording rule, so that promtool
    parses it."""
    panels = json.loads((ROOT / "deploy/grafana/readstates.json").read_text())["panels"]
    expressions = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert len(expressions) >= 15, f"only {len(expressions)} queries"
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expression in enumerate(expressions):
        filled = expression.replace("$__rate_interval", "5m").replace("$instance", ".*")
        assert "$" not in filled, f"an unfilled variable: {expression}"
        lines.append(f"      - record: dashboard_query_{i}")
        lines.append(f"        expr: {json.dumps(filled)}")
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as rules:
        rules.write("\n".join(lines) + "\n")
        rules.flush()
        run("promtool", "check", "rules", rules.name)


def kubernetes():
    venv = CACHE / "venv"
    validate = venv / "bin/kubernetes-validate"
    if not validate.exists():
        run(sys.executable, "-m", "venv", venv)
        run(venv / "bin/pip", "install", "-q", "kubernetes-validate")
    manifests = sorted((ROOT / "deploy/k8s").glob("*.yaml"))
    run(validate, "--strict", "--kubernetes-version", KUBERNETES_VERSION, *manifests)
    # The canary's pod is the fleet's but for what makes it the canary.
    script = """
import sys, yaml
fleet, canary = (yaml.safe_load(open(p)) for p in sys.argv[1:])
def pod(s):
    spec = s["spec"]["template"]["spec"]
    for c in spec["containers"]:
        c.pop("image")
    return spec
assert fleet["spec"]["template"]["metadata"]["annotations"] == canary["spec"]["template"]["metadata"]["annotations"]
assert pod(fleet) == pod(canary), "canary.yaml's pod differs from statefulset.yaml's"
assert canary["spec"]["serviceName"] == fleet["spec"]["serviceName"]
print("the canary's pod is the fleet's")
"""
    k8s = ROOT / "deploy/k8s"
    run(venv / "bin/python", "-c", script, k8s / "statefulset.yaml", k8s / "canary.yaml")


def health_check():
    dockerfile = (ROOT / "Dockerfile").read_text()
    version = re.search(r"grpc-health-probe@(v[0-9.]+)", dockerfile).group(1)
    healthcheck = re.search(r"HEALTHCHECK .*?CMD (\[.*?\])", dockerfile, re.S).group(1)
    command = json.loads(healthcheck)
    image_listen = re.search(r"READSTATES_LISTEN=0\.0\.0\.0:(\d+)", dockerfile).group(1)
    probe = CACHE / "bin" / f"grpc-health-probe-{version}"
    if not probe.exists():
        need_debian("go", "golang-go")
        gobin = CACHE / "go-bin"
        # The module proxy serves the module; its checksum database is not
        # reachable from every build machine.
        env = dict(os.environ, GOBIN=str(gobin), GOPATH=str(CACHE / "go"), GOSUMDB="off")
        run("go", "install", f"github.com/grpc-ecosystem/grpc-health-probe@{version}", env=env)
        probe.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(gobin / "grpc-health-probe", probe)
    k8s = (ROOT / "deploy/k8s/statefulset.yaml").read_text()
    readiness = re.search(r"readinessProbe:\s*grpc:\s*port: (\d+)\s*service: (\S+)", k8s)
    assert readiness.group(1) == image_listen, "the readiness probe's port is not the image's"

    run("cargo", "build", "--quiet", "--bin", "readstates", cwd=ROOT)
    port = free_port()
    address = f"127.0.0.1:{port}"
    # The image's probe, pointed at this server's port instead of the image's.
    probe_command = [str(probe)] + [
        arg.replace(f":{image_listen}", f":{port}") for arg in command[1:]
    ]
    k8s_probe = [str(probe), f"-addr={address}", f"-service={readiness.group(2)}"]
    with tempfile.TemporaryDirectory() as data:
        server = subprocess.Popen(
            [ROOT / "target/debug/readstates", "serve", "--store", "memory",
             "--listen", address, "--metrics-listen", "127.0.0.1:0", "--data-dir", data],
        )
        try:
            wait_serving(probe_command)
            run(*k8s_probe)
        finally:
            server.terminate()
            server.wait(timeout=60)
    stopped = subprocess.run(probe_command, capture_output=True)
    assert stopped.returncode != 0, "the health check passed with no server"
    print("health check: SERVING while up, failing once stopped")


def wait_serving(command):
    deadline = time.monotonic() + 60
    while True:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode == 0:
            print("+", " ".join(command), "->", result.stdout.strip())
            return
        if time.monotonic() > deadline:
            sys.exit(f"the health check never passed: {result.stdout}{result.stderr}")
        time.sleep(0.5)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    for check in (compose, alerts, dashboard, kubernetes, health_check):
        print(f"== {check.__name__}", flush=True)
        check()
    print("deployment files: every check passed")
