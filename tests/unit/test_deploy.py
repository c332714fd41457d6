"""deploy/: the Kubernetes manifests and the compose file, checked offline and kept in step with each other and
with the server (its CLI, vLLM's command line, healthz).

The Kubernetes schemas come with the kubernetes-validate package (strict: unknown fields are errors), the
compose-spec schema with check-jsonschema; nothing is fetched.
"""

import importlib.resources
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from server.config import VLLMConfig, parse_config
from server.sampling.vllm_process import ServedModel, vllm_command

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
KUBERNETES_VERSION = "1.30.0"
"""The oldest Kubernetes the manifests are checked against (1.30: the API fields they use are all GA there)."""
MODEL, MODEL_DIR = "Qwen/Qwen3-VL-4B-Instruct", "/models/Qwen3-VL-4B-Instruct"
# Where vLLM runs beside a trainer on the same GPUs (compose) or on a GPU of its own (Kubernetes).
DEPLOYMENT_ONLY_VLLM_FLAGS = {"--gpu-memory-utilization"}
VLLM_POD_URLS = ("http://tinker-vllm-0.tinker-vllm:8100", "http://tinker-vllm-1.tinker-vllm:8100")


def manifests() -> list[dict]:
    return [doc for path in sorted(KUBERNETES.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in manifests() if doc["kind"] == kind}


def container(workload: str, name: str) -> dict:
    kinds = {**by_kind("StatefulSet"), **by_kind("Deployment")}
    return next(c for c in kinds[workload]["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def compose_schema() -> dict:
    return json.loads((importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor"
                       / "compose-spec.json").read_text())


def flags(args: list[str]) -> dict[str, tuple[str, ...]]:
    """A command line as flag -> its values (JSON values parsed, so formatting does not matter)."""
    parsed, flag = {}, None
    for arg in args:
        if arg.startswith("--"):
            flag = arg
            parsed[flag] = ()
        elif flag is not None:
            value = json.dumps(json.loads(arg), sort_keys=True) if arg.startswith("{") else arg
            parsed[flag] += (value,)
    return parsed


@pytest.mark.parametrize("doc", manifests(), ids=lambda doc: f"{doc['kind']}/{doc['metadata']['name']}")
def test_every_manifest_is_valid_kubernetes(doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_checks_refuse_what_kubernetes_and_compose_would():
    server = by_kind("StatefulSet")["tinker-server"]
    server["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1  # no such field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(server, KUBERNETES_VERSION, strict=True)
    schema = compose_schema()
    document = compose()
    document["services"]["server"]["healthcheck"]["interval"] = ["10s"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validators.validator_for(schema)(schema).validate(document)


def test_the_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    files = {path.name for path in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert {image["name"] for image in kustomization["images"]} == {container("tinker-server", "server")["image"]}


def test_the_server_has_a_gpu_its_data_volume_the_database_secret_and_healthz_probes():
    server = container("tinker-server", "server")
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"/data", "/models"} <= {mount["mountPath"] for mount in server["volumeMounts"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/api/v1/healthz", "port": "http"}
    secret = server["env"][0]["valueFrom"]["secretKeyRef"]
    assert server["env"][0]["name"] == "TINKER_SERVER_DATABASE_URL"
    assert secret["key"] in by_kind("Secret")[secret["name"]]["stringData"]
    assert by_kind("StatefulSet")["tinker-server"]["spec"]["replicas"] == 1  # one server per data directory
    claims = {volume["persistentVolumeClaim"]["claimName"]
              for kind in ("StatefulSet", "Deployment") for workload in by_kind(kind).values()
              for volume in workload["spec"]["template"]["spec"].get("volumes", []) if "persistentVolumeClaim" in volume}
    assert claims <= set(by_kind("PersistentVolumeClaim"))
    for name, service in by_kind("Service").items():
        assert service["spec"]["selector"] == {"app.kubernetes.io/name": name}


def test_the_servers_arguments_are_a_valid_command_line_and_the_same_in_compose():
    entrypoint = json.loads(next(line for line in (DEPLOY / "Dockerfile").read_text().splitlines()
                                 if line.startswith("ENTRYPOINT"))[len("ENTRYPOINT"):])
    args = container("tinker-server", "server")["args"]
    config = parse_config([*entrypoint[3:], *args])
    assert (config.host, config.port, str(config.data_dir), config.sampler.vllm.urls) == \
        ("0.0.0.0", 8000, "/data", VLLM_POD_URLS)
    for service, url in (("server-gpu", "http://vllm:8100"), ("server-split", "http://vllm-split:8100")):
        compose_args = compose()["services"][service]["command"]
        assert flags(compose_args)["--vllm-url"] == (url,)
        assert flags(args) == {**flags(compose_args), "--vllm-url": VLLM_POD_URLS}


def test_the_server_reaches_every_vllm_pod_by_its_own_name():
    vllm = by_kind("StatefulSet")["tinker-vllm"]
    service = by_kind("Service")[vllm["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
    assert VLLM_POD_URLS == tuple(f"http://tinker-vllm-{i}.tinker-vllm:8100" for i in range(vllm["spec"]["replicas"]))
    assert container("tinker-vllm", "vllm")["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_the_split_compose_profile_gives_training_and_vllm_a_gpu_each():
    services = compose()["services"]
    devices = {name: services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
               for name in ("server-split", "vllm-split")}
    assert devices == {"server-split": ["0"], "vllm-split": ["1"]}
    assert flags(services["vllm-split"]["command"])["--gpu-memory-utilization"] == ("0.9",)


def test_vllm_runs_with_the_flags_the_server_would_give_it_in_compose_and_kubernetes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3VLForConditionalGeneration"]}))
    served = ServedModel(directory=tmp_path, name=MODEL, dtype="bfloat16", refused_token_ids=frozenset({151655, 151656}))
    # The manifests run vLLM 0.26, which serves token-in/token-out unasked and refuses --enable-scale-out.
    expected = flags(vllm_command(VLLMConfig(python=Path("python")), served, port=8100, scale_out_flag=False)[3:])
    services = compose()["services"]
    for deployed in (services["vllm"]["command"], services["vllm-split"]["command"],
                     container("tinker-vllm", "vllm")["args"]):
        got = flags(deployed)
        assert got["--model"] == (MODEL_DIR,) and got["--port"] == ("8100",)
        ignore = {"--model", "--host", "--port"}
        assert {k: v for k, v in got.items() if k not in ignore | DEPLOYMENT_ONLY_VLLM_FLAGS} == \
            {k: v for k, v in expected.items() if k not in ignore}


def test_vllm_and_the_server_mount_the_data_volume_at_the_same_path():
    # vLLM loads the adapters by the paths the server writes.
    services = compose()["services"]
    for name in ("vllm", "server-gpu", "vllm-split", "server-split"):
        assert "data:/data" in services[name]["volumes"]
    data_mount = {c: next(m["mountPath"] for m in container(*c)["volumeMounts"] if m["name"] == "data")
                  for c in (("tinker-server", "server"), ("tinker-vllm", "vllm"))}
    assert set(data_mount.values()) == {"/data"}


def test_the_compose_file_is_valid_and_checks_healthz():
    schema = compose_schema()
    document = compose()
    jsonschema.validators.validator_for(schema)(schema).validate(document)
    for name in ("server", "server-gpu", "server-split"):
        assert "/api/v1/healthz" in " ".join(document["services"][name]["healthcheck"]["test"])


def test_the_build_context_leaves_out_what_the_readme_steps_create_and_keeps_what_the_image_copies():
    ignored = {line.strip() for line in (DEPLOY.parent / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    # The tutorial's environment (.venv, about 2 GB with torch), its data directory and its recipe runs.
    assert {".venv*", "data", "runs", ".git"} <= ignored
    copied = [line.split()[1] for line in (DEPLOY / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ")]
    assert copied and not any(path.split("/")[0] in ignored for path in copied)


def test_no_compose_profile_starts_two_services_on_one_host_port():
    services = compose()["services"]
    for profile in (None, "cpu", "gpu", "gpu-split"):
        started = [service for service in services.values()
                   if not service.get("profiles") or profile in service["profiles"]]
        ports = [port.split(":")[0] for service in started for port in service.get("ports", [])]
        assert len(ports) == len(set(ports)), (profile, ports)
    assert any("cpu" in service.get("profiles", []) for service in services.values())


def test_the_model_loader_is_valid_and_writes_the_volume_the_pods_read():
    loader = yaml.safe_load((KUBERNETES / "tools" / "model-loader.yaml").read_text())
    kubernetes_validate.validate(loader, KUBERNETES_VERSION, strict=True)
    (volume,) = loader["spec"]["volumes"]
    assert volume["persistentVolumeClaim"] == {"claimName": "tinker-models"}  # mounted writable
    (claim,) = [doc for doc in by_kind("PersistentVolumeClaim").values() if doc["metadata"]["name"] == "tinker-models"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    mount = loader["spec"]["containers"][0]["volumeMounts"][0]
    assert mount["mountPath"] == "/models" and not mount.get("readOnly")
