"""API keys and tenants: every route but healthz and the docs page needs a key an operator issued; a tenant
sees only its own sessions, runs, checkpoints, samplers and futures (another tenant's are not found, 404)."""

import base64
import json
import re
import subprocess
import sys
import time

import httpx
import pytest
import tinker
import torch
from safetensors.torch import save
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from server.store.api_keys import KNOWN_KEY_SECONDS
from support.live_server import BASE_MODEL, REPO_ROOT
from support.sdk import SENTENCES, supervised_datum


@pytest.fixture(scope="module")
def owned(server):
    """Tenant A's resources: a session, a run, both kinds of checkpoint, a sampler and a finished future."""
    key = server.create_key("tenant-a")
    service = server.service_client(api_key=key)
    tc = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=71).result()
    data = [supervised_datum(tc.get_tokenizer(), SENTENCES[0])]
    tc.forward_backward(data, "cross_entropy").result()
    state = tc.save_state("a-state").result().path
    sampler_path = tc.save_weights_for_sampler("a-sampler").result().path
    session = tc.model_id.split(":train:")[0]
    with httpx.Client(base_url=server.url, headers=server.headers(key), timeout=60) as http:
        sampler = http.post("/api/v1/create_sampling_session", json={
            "session_id": session, "sampling_session_seq_id": 40, "model_path": sampler_path}).json()
        request_id = http.post("/api/v1/create_model", json={
            "session_id": session, "model_seq_id": 40, "base_model": BASE_MODEL,
            "lora_config": {"rank": 4}}).json()["request_id"]
        while http.post("/api/v1/retrieve_future", json={"request_id": request_id}).status_code == 408:
            pass
    return dict(key=key, session=session, model=tc.model_id, data=data, state=state,
                sampler_path=sampler_path, sampler=sampler["sampling_session_id"], request=request_id, training=tc,
                adapter=_peft_adapter_body(server.data_dir / "models" / "tiny-qwen3"))


def _peft_adapter_body(model_dir) -> dict:
    """An adapters/import body: a rank-1 PEFT adapter on layer 0's q_proj, shaped from the model's config."""
    config = json.loads((model_dir / "config.json").read_text())
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    weights = save({f"{module}.lora_A.weight": torch.zeros(1, config["hidden_size"]),
                    f"{module}.lora_B.weight": torch.zeros(config["num_attention_heads"] * config["head_dim"], 1)})
    return {"name": "imported", "adapter_model": base64.b64encode(weights).decode(),
            "adapter_config": {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["q_proj"]}}


def every_route(owned: dict, own_session: str) -> list[tuple[str, str, dict]]:
    """One request per route of the API, each naming tenant A's resources (method, path, keyword args)."""
    a = owned
    fwdbwd = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=a["data"], loss_fn="cross_entropy"),
        model_id=a["model"], seq_id=90)).SerializeToString()
    state_id, sampler_id = a["state"].split("/", 3)[3], a["sampler_path"].split("/", 3)[3]
    return [
        ("POST", "/api/v1/client/config", dict(json={})),
        ("POST", "/api/v1/telemetry", dict(json={"events": []})),
        ("GET", "/api/v1/get_server_capabilities", {}),
        ("POST", "/api/v1/create_session", dict(json={})),
        ("POST", "/api/v1/session_heartbeat", dict(json={"session_id": a["session"]})),
        ("POST", f"/api/v1/sessions/{a['session']}/finish", dict(json={"reason": {"type": "success"}})),
        ("GET", "/api/v1/sessions", {}),
        ("GET", f"/api/v1/sessions/{a['session']}", {}),
        ("DELETE", f"/api/v1/sessions/{a['session']}", {}),
        ("POST", "/api/v1/create_model", dict(json={"session_id": a["session"], "model_seq_id": 50,
                                                    "base_model": BASE_MODEL, "lora_config": {"rank": 4}})),
        ("POST", "/api/v1/get_info", dict(json={"model_id": a["model"]})),
        ("POST", "/api/v1/forward_backward", dict(content=fwdbwd, headers={"Content-Type": "application/x-protobuf"})),
        ("POST", "/api/v1/optim_step", dict(json={"model_id": a["model"], "seq_id": 90, "adam_params": {}})),
        ("POST", "/api/v1/save_weights", dict(json={"model_id": a["model"], "seq_id": 90, "path": "x"})),
        ("POST", "/api/v1/save_weights_for_sampler", dict(json={"model_id": a["model"], "seq_id": 90, "path": "x"})),
        ("POST", "/api/v1/load_weights", dict(json={"model_id": a["model"], "seq_id": 90, "path": a["state"]})),
        ("POST", "/api/v1/load_weights", dict(json={"session_id": own_session, "model_seq_id": 50,
                                                    "path": a["state"]})),
        ("POST", "/api/v1/weights_info", dict(json={"tinker_path": a["state"]})),
        ("POST", "/api/v1/create_sampling_session", dict(json={"session_id": a["session"],
                                                               "sampling_session_seq_id": 50,
                                                               "base_model": BASE_MODEL})),
        ("POST", "/api/v1/create_sampling_session", dict(json={"session_id": own_session,
                                                               "sampling_session_seq_id": 50,
                                                               "model_path": a["sampler_path"]})),
        ("GET", f"/api/v1/samplers/{a['sampler']}", {}),
        ("POST", "/api/v1/asample", dict(json={"sampling_session_id": a["sampler"], "seq_id": 90,
                                               "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                                               "sampling_params": {"max_tokens": 1}})),
        ("POST", "/api/v1/asample", dict(json={"base_model": BASE_MODEL, "model_path": a["sampler_path"],
                                               "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                                               "sampling_params": {"max_tokens": 1}})),
        ("POST", "/api/v1/retrieve_future", dict(json={"request_id": a["request"]})),
        ("GET", "/api/v1/training_runs", {}),
        ("GET", f"/api/v1/training_runs/{a['model']}", {}),
        ("GET", f"/api/v1/training_runs/{a['model']}/checkpoints", {}),
        ("GET", "/api/v1/checkpoints", {}),
        ("DELETE", f"/api/v1/training_runs/{a['model']}/checkpoints/{state_id}", {}),
        ("PUT", f"/api/v1/training_runs/{a['model']}/checkpoints/{sampler_id}/ttl", dict(json={"ttl_seconds": 3600})),
        ("POST", f"/api/v1/training_runs/{a['model']}/checkpoints/{sampler_id}/publish", {}),
        ("DELETE", f"/api/v1/training_runs/{a['model']}/checkpoints/{sampler_id}/publish", {}),
        ("POST", f"/api/v1/training_runs/{a['model']}/checkpoints/{state_id}/access_token", {}),
        ("GET", f"/api/v1/training_runs/{a['model']}/checkpoints/{sampler_id}/external_weights_urls", {}),
        ("GET", f"/api/v1/external_weights/{a['model']}/x/adapter_config.json",
         dict(params={"expires": 4102444800, "signature": "0" * 64})),
        ("POST", "/api/v1/save_weights_external", dict(json={"model_id": a["model"], "seq_id": 90, "path": "x"})),
        ("POST", "/api/v1/copy_weights", dict(json={"source_path": a["state"], "destination_project_id": "p"})),
        ("PUT", f"/api/v1/sessions/{a['session']}/project", dict(json={"project_id": "p"})),
        ("POST", "/api/v1/sessions/search", dict(json={})),
        ("GET", "/api/v1/dashboard/overview", {}),
        ("POST", "/api/v1/adapters/import", dict(json=a["adapter"])),
        ("GET", "/oai/api/v1/models", {}),
        ("POST", "/oai/api/v1/chat/completions", dict(json={"model": a["sampler_path"], "max_tokens": 1,
                                                            "messages": [{"role": "user", "content": "Hi"}]})),
        ("POST", "/oai/api/v1/completions", dict(json={"model": a["sampler_path"], "prompt": [1, 2],
                                                       "max_tokens": 1})),
        ("GET", f"/api/v1/dashboard/runs/{a['model']}/curves", {}),
        ("GET", "/metrics", {}),
        ("GET", "/openapi.json", {}),
    ]


# Routes that name no resource of anyone's answer a second tenant normally (listings show its own only).
NAMES_NO_RESOURCE = {"/api/v1/client/config", "/api/v1/telemetry", "/api/v1/get_server_capabilities",
                     "/api/v1/create_session", "/api/v1/sessions", "/api/v1/training_runs", "/api/v1/checkpoints",
                     "/api/v1/sessions/search", "/api/v1/dashboard/overview", "/openapi.json", "/oai/api/v1/models",
                     "/api/v1/adapters/import"}
# Signed download URLs take no key: the signature is the permission (a forged one is a 403).
SIGNED = "/api/v1/external_weights/"


def test_the_walk_covers_every_route_of_the_api(server, owned):
    schema = httpx.get(f"{server.url}/openapi.json", headers=server.headers()).json()
    documented = {(method.upper(), path) for path, item in schema["paths"].items() for method in item}
    walked = {(method, template) for method, path, _ in every_route(owned, "s") for m, template in documented
              if m == method and _matches(template, path)}
    assert documented - walked == {("GET", "/api/v1/healthz")}


def _matches(template: str, path: str) -> bool:
    pattern = re.sub(r"\\{(\w+)\\}", lambda m: ".+" if m.group(1).startswith("checkpoint_") else "[^/]+",
                     re.escape(template))
    return re.fullmatch(pattern, path) is not None


def test_without_a_valid_key_every_route_but_healthz_and_the_docs_page_is_a_401(server, owned):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for key in (None, "tml-made-up", "x", "a" * 8192):
            headers = {} if key is None else {"X-API-Key": key}
            for method, path, kwargs in every_route(owned, "s"):
                kwargs = dict(kwargs, headers={**kwargs.get("headers", {}), **headers})
                response = http.request(method, path, **kwargs)
                assert response.status_code == (403 if path.startswith(SIGNED) else 401), \
                    (key and key[:12], method, path, response.text)
            assert http.get("/api/v1/healthz", headers=headers).status_code == 200
            # The docs page holds nothing: it asks the browser for the key and sends it with each call.
            page = http.get("/docs", headers=headers)
            assert page.status_code == 200 and 'request.headers["X-API-Key"]' in page.text
            assert 'url: "/openapi.json"' in page.text


def test_a_second_tenant_finds_none_of_the_first_ones_resources(server, owned):
    key_b = server.create_key("tenant-b")
    own_session = httpx.post(f"{server.url}/api/v1/create_session", json={}, headers=server.headers(key_b)).json()
    with httpx.Client(base_url=server.url, headers=server.headers(key_b), timeout=30) as http:
        for method, path, kwargs in every_route(owned, own_session["session_id"]):
            response = http.request(method, path, **kwargs)
            if path == "/metrics" or path.startswith(SIGNED):
                assert response.status_code == 403, (method, path, response.text)  # admin key; signature
            elif path in NAMES_NO_RESOURCE:
                assert response.status_code == 200, (method, path, response.text)
                for resource in ("session", "model", "state", "sampler_path", "request"):
                    assert owned[resource] not in response.text, (path, resource)
            else:
                assert response.status_code == 404, (method, path, response.text)
    # Tenant A lost nothing and its run goes on.
    rest = tinker.RestClient(base_url=server.url, api_key=owned["key"])
    listed = [c.tinker_path for c in rest.list_checkpoints(owned["model"]).result().checkpoints]
    assert sorted(listed) == sorted([owned["state"], owned["sampler_path"]])
    assert owned["training"].forward(owned["data"], "cross_entropy").result().metrics["loss:sum"] > 0


def test_a_revoked_key_is_refused_once_the_server_stops_trusting_what_it_found(server):
    key = server.create_key("short-lived")
    service = server.service_client(api_key=key)
    service.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    key_id = next(line.split()[0] for line in server.keys_command("list", "--tenant", "short-lived").stdout
                  .splitlines() if line.startswith("key-"))
    server.keys_command("revoke", key_id)
    time.sleep(KNOWN_KEY_SECONDS)  # the server trusts a key it found valid this long without asking again
    with pytest.raises(tinker.AuthenticationError):
        tinker.RestClient(base_url=server.url, api_key=key).list_training_runs().result()
    assert "short-lived" in server.keys_command("list").stdout  # listed, as revoked


def test_an_admin_key_reads_the_metrics(server, owned):
    assert server.metric("tinker_http_requests_total", method="POST", route="/api/v1/forward_backward",
                         status="200") > 0
    assert server.metric("tinker_request_seconds_count", request_type="ForwardBackward", outcome="complete") > 0
    assert server.metric("tinker_tokens_total", kind="trained") > 0
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.api_key}"}).text
    assert f'tinker_run_queue_depth{{model_id="{owned["model"]}"}} 0.0' in text  # present, and idle


def test_auth_none_is_refused_on_a_host_others_can_reach(tmp_path):
    started = subprocess.run([sys.executable, "-m", "server", "--base-model", BASE_MODEL, "--auth", "none",
                              "--host", "0.0.0.0", "--data-dir", str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=120)
    assert started.returncode == 2 and "only allowed on a loopback --host" in started.stderr
