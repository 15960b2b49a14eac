#!/usr/bin/env python3
"""Static checks of deploy/: Dockerfiles, Kubernetes manifests (schemas via kubernetes-validate,
offline), and that flags, ports and probes match what the built binaries accept; metric names in
the alert rules and the dashboard exist in the sources; the Gateway API inference extension
objects (custom resources, so checked by structure) point at moelora's HTTP port, its endpoint
picker and metrics that moelora exports.

    check_deploy.py REPO_ROOT CONTROLLER_BIN WORKER_BIN
"""
import glob
import json
import os
import re
import subprocess
import sys

import kubernetes_validate
import yaml

K8S_VERSION = "1.30.0"
# Custom resources (Gateway API and its inference extension): no schema in kubernetes-validate;
# check_inference_gateway checks what they reference.
CUSTOM_KINDS = {"InferencePool", "HTTPRoute", "Gateway", "InferenceObjective"}
failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL:", msg)


def dockerfile_instructions(path):
    """(instruction, argument) pairs, continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in open(path):
        s = line.rstrip("\n")
        if s.strip().startswith("#") and not cur:
            continue
        cur += s.rstrip("\\") + " "
        if not s.endswith("\\"):
            if cur.strip():
                word, _, rest = cur.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            cur = ""
    return out


def check_dockerfile(path, needed_packages):
    text = open(path).read()
    ins = dockerfile_instructions(path)
    stages = [i for i, (w, _) in enumerate(ins) if w == "FROM"]
    if not stages:
        fail(f"{path}: no FROM")
        return
    for w, a in ins:
        if w == "FROM":
            image = a.split()[0]
            if ":" not in image or image.endswith(":latest"):
                fail(f"{path}: base image {image} is not pinned by tag")
    final = ins[stages[-1]:]
    users = [a for w, a in final if w == "USER"]
    if not users or users[-1] in ("root", "0"):
        fail(f"{path}: the run stage does not switch to a non-root USER")
    if not any(w == "HEALTHCHECK" for w, _ in ins) and not re.search(r"(?i)health.*probe|probe.*health", text):
        fail(f"{path}: neither a HEALTHCHECK nor a documented probe")
    for w, a in ins:
        if w in ("ENV", "ARG") and re.search(r"(?i)(password|secret|token|api_?key)\s*=", a):
            fail(f"{path}: {w} {a} looks like a secret")
    if needed_packages is not None:
        run_text = " ".join(a for w, a in final if w == "RUN")
        for p in sorted(needed_packages):
            if p not in run_text:
                fail(f"{path}: the run stage does not install {p} (a library the binaries link)")


def needed_packages(binaries):
    """Debian packages providing the shared libraries the binaries link directly."""
    libs = set()
    for b in binaries:
        out = subprocess.run(["readelf", "-d", b], capture_output=True, text=True).stdout
        libs |= set(re.findall(r"NEEDED.*\[(.+)\]", out))
    if any(lib.startswith(("libasan", "libtsan", "libubsan")) for lib in libs):
        print("sanitizer build: the image's runtime packages are checked against release binaries only")
        return None
    pkgs = set()
    for lib in libs:
        out = subprocess.run(["dpkg", "-S", "*/" + lib], capture_output=True, text=True).stdout
        for line in out.splitlines():
            pkg = line.split(":")[0]
            if pkg.startswith(("lib32", "libx32")) or pkg.endswith("-i386"):
                continue  # multilib copies of the same library
            if pkg not in ("libc6", "libgcc-s1", "libstdc++6"):  # in every Debian image
                pkgs.add(pkg)
            break
    return pkgs


def help_flags(binary):
    out = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    return set(re.findall(r"^\s+--([a-z0-9_]+) ", out, re.M)) | {"flagfile"}


def parse_flags(args):
    """--name[=value] list -> {name_with_underscores: value or True}."""
    flags = {}
    for a in args:
        m = re.match(r"--([A-Za-z0-9_-]+)(?:=(.*))?$", a.strip())
        if m:
            flags[m.group(1).replace("-", "_")] = m.group(2) if m.group(2) is not None else True
    return flags


def check_manifests(root, bins):
    docs = []
    for path in sorted(glob.glob(os.path.join(root, "deploy/k8s/**/*.yaml"), recursive=True)):
        for doc in yaml.safe_load_all(open(path)):
            if doc:
                docs.append((path, doc))
    configmaps = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "ConfigMap"}
    for path, doc in docs:
        where = f"{os.path.relpath(path, root)}: {doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except Exception as e:  # ValidationError or InvalidSchemaError
            fail(f"{where}: schema: {str(e).splitlines()[0]}")
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = doc["spec"]["template"]["spec"]
        grace = spec.get("terminationGracePeriodSeconds", 30)
        annotations = doc["spec"]["template"]["metadata"].get("annotations", {})
        for c in spec["containers"]:
            if not c["image"].startswith("moelora"):  # another project's image (the EPP)
                if "resources" not in c or "limits" not in c.get("resources", {}):
                    fail(f"{where}: container {c['name']} without resource requests and limits")
                continue
            binary = bins["worker"] if "worker" in " ".join(c.get("command", [])) + c["name"] else bins["controller"]
            known = help_flags(binary)
            args = list(c.get("args", []))
            flags = parse_flags(args)
            if "flagfile" in flags:
                cm = next((v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v), None)
                if cm not in configmaps:
                    fail(f"{where}: --flagfile but no ConfigMap volume")
                else:
                    flags.update(parse_flags(configmaps[cm]["data"]["flags"].splitlines()))
            for name in flags:
                if name not in known:
                    fail(f"{where}: container {c['name']}: flag --{name} is not a flag of {os.path.basename(binary)}")
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            if "port" in flags and int(flags["port"]) != ports.get("grpc"):
                fail(f"{where}: --port {flags['port']} != containerPort grpc {ports.get('grpc')}")
            if "http_port" in flags and int(flags["http_port"]) != ports.get("http"):
                fail(f"{where}: --http_port {flags['http_port']} != containerPort http {ports.get('http')}")
            if "metrics_port" in flags and int(flags["metrics_port"]) != ports.get("metrics"):
                fail(f"{where}: --metrics_port {flags['metrics_port']} != containerPort metrics {ports.get('metrics')}")
            if annotations.get("prometheus.io/port") and int(annotations["prometheus.io/port"]) != ports.get("metrics"):
                fail(f"{where}: prometheus.io/port annotation != metrics port")
            # The kubelet's gRPC probe speaks plaintext: a TLS port is probed through
            # --health_port (its container port named "health").
            probed = "grpc"
            if "health_port" in flags:
                probed = "health"
                if int(flags["health_port"]) != ports.get("health"):
                    fail(f"{where}: --health_port {flags['health_port']} != containerPort health {ports.get('health')}")
            elif "tls_cert_file" in flags:
                fail(f"{where}: TLS on the gRPC port but no --health_port for the probes")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe)
                if not p or "grpc" not in p:
                    fail(f"{where}: {probe} is not a gRPC probe")
                elif p["grpc"]["port"] != ports.get(probed):
                    fail(f"{where}: {probe} port {p['grpc']['port']} != {probed} port {ports.get(probed)}")
            # Files the flags name come from mounted volumes (Secrets for keys and tokens).
            mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
            for name in ("tls_cert_file", "tls_key_file", "tls_ca_file", "auth_tokens_file",
                         "worker_tls_ca_file", "worker_tls_cert_file", "worker_tls_key_file"):
                if name in flags and not any(flags[name].startswith(m + "/") for m in mounts):
                    fail(f"{where}: --{name} {flags[name]} is on no mounted volume")
            drain = int(flags.get("drain_timeout_s", 0) or 0)
            if drain and grace <= drain:
                fail(f"{where}: terminationGracePeriodSeconds {grace} <= --drain_timeout_s {drain}")
            if "resources" not in c or "requests" not in c["resources"] or "limits" not in c["resources"]:
                fail(f"{where}: container {c['name']} without resource requests and limits")
    kinds = {d["kind"] for _, d in docs}
    for k in ("PodDisruptionBudget", "Service", "ConfigMap", "StatefulSet", "Deployment",
              "NetworkPolicy"):
        if k not in kinds:
            fail(f"deploy/k8s: no {k}")
    print(f"checked {len(docs)} Kubernetes objects against the v{K8S_VERSION} schemas")
    return docs, configmaps


def exported_metrics(root):
    names = set()
    for src in ("controller/metrics.cc", "worker/metrics.cc"):
        names |= set(re.findall(r'\.Name\("(moelora_[a-z_]+)"\)', open(os.path.join(root, src)).read()))
    return names


def check_inference_gateway(root, docs, configmaps):
    """The InferencePool selects moelora pods serving HTTP on its target port; its endpoint picker
    is a Service in front of an EPP Deployment for this pool whose metric flags name moelora's
    metrics; every HTTPRoute to a pool names one that exists."""
    exported = exported_metrics(root)
    pools = {d["metadata"]["name"]: (p, d) for p, d in docs if d["kind"] == "InferencePool"}
    workloads = [(p, d) for p, d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    services = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Service"}
    for name, (path, pool) in pools.items():
        where = f"{os.path.relpath(path, root)}: InferencePool/{name}"
        spec = pool["spec"]
        labels = spec["selector"]["matchLabels"]
        port = spec["targetPorts"][0]["number"]
        served = False
        for _, w in workloads:
            pod = w["spec"]["template"]
            if not labels.items() <= pod["metadata"].get("labels", {}).items():
                continue
            for c in pod["spec"]["containers"]:
                flags = parse_flags(c.get("args", []))
                if "flagfile" in flags:
                    cm = next((v["configMap"]["name"] for v in pod["spec"]["volumes"] if "configMap" in v), None)
                    flags.update(parse_flags(configmaps.get(cm, {}).get("data", {}).get("flags", "").splitlines()))
                ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
                if c["image"].startswith("moelora") and str(flags.get("http_port")) == str(port) and ports.get("http") == port:
                    served = True
        if not served:
            fail(f"{where}: no moelora pod it selects serves HTTP (--http_port, containerPort http) on {port}")
        ref = spec["endpointPickerRef"]
        svc = services.get(ref["name"])
        if svc is None or ref["port"]["number"] not in [p["port"] for p in svc["spec"]["ports"]]:
            fail(f"{where}: endpointPickerRef {ref} is not a Service port here")
            continue
        epps = [w for _, w in workloads
                if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"].get("labels", {}).items()]
        if not epps:
            fail(f"{where}: the picker's Service selects no Deployment")
            continue
        args = parse_flags(epps[0]["spec"]["template"]["spec"]["containers"][0].get("args", []))
        if args.get("pool_name") != name:
            fail(f"{where}: the picker's --pool-name is {args.get('pool_name')}")
        for flag in ("total_queued_requests_metric", "total_running_requests_metric",
                     "kv_cache_usage_percentage_metric", "lora_info_metric"):
            metric = args.get(flag)
            if not isinstance(metric, str) or metric not in exported:
                fail(f"{where}: the picker's --{flag.replace('_', '-')} {metric!r} is not a metric moelora exports")
        # The LoRA metric in vLLM's form: the labels the picker parses.
        sched = open(os.path.join(root, "controller/scheduler.cc")).read()
        for label in ("running_lora_adapters", "waiting_lora_adapters", "max_lora"):
            if f'"{label}"' not in sched:
                fail(f"moelora_lora_requests_info lacks the label {label} the picker reads")
    for path, d in docs:
        if d["kind"] != "HTTPRoute":
            continue
        for rule in d["spec"]["rules"]:
            for b in rule.get("backendRefs", []):
                if b.get("kind") == "InferencePool" and b["name"] not in pools:
                    fail(f"{os.path.relpath(path, root)}: HTTPRoute/{d['metadata']['name']} routes to "
                         f"unknown InferencePool {b['name']}")
    if not pools:
        fail("deploy/k8s: no InferencePool (the Gateway API inference extension example)")
    print(f"checked {len(pools)} InferencePool(s): pods, endpoint picker, metric names")


def check_metric_names(root):
    exported = exported_metrics(root)
    used = set()
    used |= set(re.findall(r"moelora_[a-z_]+", open(os.path.join(root, "deploy/prometheus/alerts.yml")).read()))
    dash = json.load(open(os.path.join(root, "deploy/grafana/moelora.json")))
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            used |= set(re.findall(r"moelora_[a-z_]+", t["expr"]))
    for name in sorted(used):
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        if base not in exported:
            fail(f"metric {name} (alerts or dashboard) is not exported by the controller or the workers")
    if dash["panels"][0].get("type") != "row" or "adapter load" not in dash["panels"][0]["title"].lower():
        fail("the dashboard's first row is not adapter load latency")
    print(f"{len(used)} metric names in rules and dashboard, all exported")


def main(argv):
    root, controller, worker = argv[1:4]
    bins = {"controller": controller, "worker": worker}
    pkgs = needed_packages([controller, worker])
    check_dockerfile(os.path.join(root, "deploy/docker/Dockerfile"), pkgs)
    check_dockerfile(os.path.join(root, "deploy/docker/Dockerfile.cuda"), None)
    docs, configmaps = check_manifests(root, bins)
    check_inference_gateway(root, docs, configmaps)
    check_metric_names(root)
    if failures:
        print(f"{len(failures)} problem(s)")
        return 1
    print("deploy checks: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
