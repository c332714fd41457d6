"""The checks: one scenario that calls every public method of the pinned SDK's four clients against a server.

Each check calls one method (or one option of it) as a user would and verifies the answer; a method's
`_async` twin is called too, through an event loop, and verified the same way. Later checks use what
earlier ones made (a run, its checkpoints, samplers); when that is missing they fail saying so. A pass
whose method sent no request (the SDK answered it alone) is marked client-only. What
the scenario creates on the server (runs, checkpoints) is deleted at the end, the session closed.
"""

import asyncio
import dataclasses
import inspect
import urllib.request
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import tinker
import torch
from tinker import types
from tinker.lib.api_future_impl import QueueState
from tinker.lib.public_interfaces.rest_client import RestClient
from tinker.lib.sdk_method import SDK_METHOD_HEADER

from client_compat.conformance.outcomes import CLIENTS, Outcome, classify

RESULT_TIMEOUT_SECONDS = 300
TEXT = "The quick brown fox jumps over the lazy dog."
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo")
_CLASSES = {"ServiceClient": tinker.ServiceClient, "TrainingClient": tinker.TrainingClient,
            "SamplingClient": tinker.SamplingClient, "RestClient": RestClient}


class Missing(Exception):
    """A check needs what an earlier check should have made."""


def need(value: Any, what: str) -> Any:
    if value is None:
        raise Missing(f"needs {what}, which an earlier check did not produce")
    return value


def _result(value: Any) -> Any:
    """A sync call's answer: the future's result, or the value itself."""
    return value.result(timeout=RESULT_TIMEOUT_SECONDS) if hasattr(value, "result") else value


def _await(value: Any) -> Any:
    """An `_async` call's answer: awaited (coroutines may return futures, which are awaited in turn)."""
    async def resolve(value):
        while inspect.isawaitable(value):
            value = await value
        return value

    return asyncio.run(asyncio.wait_for(resolve(value), RESULT_TIMEOUT_SECONDS))


class Conformance:
    """Drives the SDK against `base_url` and collects one Outcome per call."""

    def __init__(self, base_url: str, api_key: str, *, base_model: str | None = None, project_id: str = "default"):
        self.base_url, self.api_key, self.base_model, self.project_id = base_url, api_key, base_model, project_id
        self.token = uuid.uuid4().hex[:12]
        self.outcomes: list[Outcome] = []
        self.rest = self.service = self.training = self.sampler = self.tokenizer = None
        self.model_ids: list[str] = []
        self.paths: dict[str, str] = {}

    # -- running checks

    def check(self, client: str, call: str, fn: Callable[[], Any]) -> Any:
        """Run one check: record pass and return fn's value, or record what went wrong and return None."""
        try:
            value = fn()
        except Missing as missing:
            self.outcomes.append(Outcome(client, call, "fail", str(missing)))
            return None
        except Exception as error:  # every failure is a row of the report, never the end of the run
            self.outcomes.append(Outcome(client, call, *classify(error)))
            return None
        self.outcomes.append(Outcome(client, call, "pass"))
        return value

    def both(self, client: str, target: Callable[[], Any], method: str, invoke: Callable[[Callable], Any],
             verify: Callable[[Any], Any] = lambda value: value) -> Any:
        """Check `method` and `method_async` alike; returns the sync call's verified value."""
        first = self.check(client, method, lambda: verify(_result(invoke(getattr(target(), method)))))
        self.check(client, method + "_async", lambda: verify(_await(invoke(getattr(target(), method + "_async")))))
        return first

    def run(self) -> list[Outcome]:
        with warnings.catch_warnings(), _recording_sdk_methods() as sent:
            warnings.simplefilter("ignore")  # deprecated and experimental methods are exactly what we call
            self._bootstrap()
            self._training_calls()
            self._sampling_calls()
            self._service_calls()
            self._rest_calls()
            self._finish()
        self._mark_client_only(sent)
        self._report_unchecked()
        return self.outcomes

    def _mark_client_only(self, sent: set[str]) -> None:
        """Mark the passing methods that never sent a request: their pass says nothing about the server.
        Only methods the SDK attributes its requests to can be told (not static methods or properties)."""
        reached = {(client, method) for sender, _, method in (name.partition(".") for name in sent)
                   for client in CLIENTS if client in sender}  # BackcompatTrainingClientFuture: TrainingClient
        for index, outcome in enumerate(self.outcomes):
            attributed = inspect.isfunction(inspect.getattr_static(_CLASSES[outcome.client], outcome.method, None))
            if outcome.status == "pass" and attributed and (outcome.client, outcome.method) not in reached:
                self.outcomes[index] = dataclasses.replace(outcome, client_only=True)

    # -- scenario

    def _bootstrap(self) -> None:
        self.rest = self.check("RestClient", "get_server_capabilities", self._capabilities)
        self.service = tinker.ServiceClient(
            user_metadata={"conformance": self.token}, project_id=self.project_id,
            display_name=f"tinker conformance {self.token}", base_url=self.base_url, api_key=self.api_key)
        self.training = self.both("ServiceClient", lambda: self.service, "create_lora_training_client",
                                  lambda m: m(need(self.base_model, "a base model"), rank=8, seed=0), self._new_run)
        self.check("ServiceClient", "create_lora_training_client[optimizer=dimuon]", lambda: self._new_run(
            _result(self.service.create_lora_training_client(need(self.base_model, "a base model"), rank=8,
                                                            optimizer=types.DimuonOptimizerConfig()))))

    def _capabilities(self) -> RestClient:
        rest = tinker.RestClient(base_url=self.base_url, api_key=self.api_key)
        models = rest.get_server_capabilities().result(timeout=RESULT_TIMEOUT_SECONDS).supported_models
        _check(models, "supported_models is empty")
        self.base_model = self.base_model or models[0].model_name
        return rest

    def _new_run(self, training: tinker.TrainingClient) -> tinker.TrainingClient:
        _check(training.model_id.count(":train:") == 1, f"model id {training.model_id} is not SESSION:train:N")
        self.model_ids.append(training.model_id)
        return training

    def _datum(self, **extra_inputs) -> types.Datum:
        tokens = need(self.tokens, "the tokenizer")
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": tokens[1:], **extra_inputs})

    @property
    def tokens(self) -> list[int] | None:
        return None if self.tokenizer is None else self.tokenizer.encode(TEXT)

    def _training_calls(self) -> None:
        training = lambda: need(self.training, "a training client")  # noqa: E731
        client = "TrainingClient"
        self.both(client, training, "get_info", lambda m: m(), self._verify_info)
        self.tokenizer = self.check(client, "get_tokenizer", lambda: training().get_tokenizer())
        self.check(client, "get_console_url", lambda: _is(str, training().get_console_url()))
        self.check(client, "get_telemetry", lambda: training().get_telemetry())
        ce = lambda: [self._datum(weights=[1.0] * (len(self.tokens) - 1))]  # noqa: E731
        forward = self.both(client, training, "forward", lambda m: m(ce(), "cross_entropy"), self._verify_output)
        self.both(client, training, "forward_backward", lambda m: m(ce(), "cross_entropy"), self._verify_output)
        logprobs = None if forward is None else forward.loss_fn_outputs[0]["logprobs"].tolist()
        for loss_fn in RL_LOSSES:
            self.check(client, f"forward_backward[loss_fn={loss_fn}]", lambda loss_fn=loss_fn: self._verify_output(
                _result(training().forward_backward([self._policy_datum(logprobs, loss_fn)], loss_fn))))
        self.both(client, training, "forward_backward_custom", lambda m: m(ce(), _custom_loss), self._verify_output)
        handle = self.check("ServiceClient", "create_custom_loss", lambda: _result(self.service.create_custom_loss(
            _per_datum_loss, input_ranks={"logprobs": 1, "weights": 1})))
        self.check(client, "forward_backward_custom[LossHandle]", lambda: self._verify_output(
            _result(training().forward_backward_custom(ce(), need(handle, "a custom loss handle")))))
        self.both(client, training, "optim_step", lambda m: m(types.AdamParams(learning_rate=1e-4)),
                  lambda r: _is(types.OptimStepResponse, r))
        for kind, method, segment in (("state", "save_state", "weights"),
                                      ("sampler", "save_weights_for_sampler", "sampler_weights"),
                                      ("external", "save_weights_external", "external_weights")):
            def verify(response, kind=kind, segment=segment):
                _check(f"/{segment}/" in response.path, f"{response.path} is not a {segment} path")
                self.paths.setdefault(kind, response.path)
                return response

            self.both(client, training, method, lambda m, kind=kind: m(f"conformance-{kind}-{uuid.uuid4().hex[:6]}"),
                      verify)
        state = lambda: need(self.paths.get("state"), "a save_state checkpoint")  # noqa: E731
        self.both(client, training, "load_state", lambda m: m(state()), lambda r: _is(types.LoadWeightsResponse, r))
        self.both(client, training, "load_state_with_optimizer", lambda m: m(state()),
                  lambda r: _is(types.LoadWeightsResponse, r))
        self._rl_stability_loss()

    def _verify_info(self, info: types.GetInfoResponse) -> types.GetInfoResponse:
        _check(info.model_id == self.training.model_id, f"get_info answered for {info.model_id}")
        _check(info.model_data.model_name, "get_info has no model_data.model_name (get_tokenizer needs it)")
        return info

    def _verify_output(self, output: types.ForwardBackwardOutput) -> types.ForwardBackwardOutput:
        _check("loss:sum" in output.metrics, f"metrics lack loss:sum: {sorted(output.metrics)}")
        logprobs = output.loss_fn_outputs[0]["logprobs"].tolist()
        _check(len(logprobs) == len(self.tokens) - 1, f"{len(logprobs)} logprobs for {len(self.tokens) - 1} targets")
        return output

    def _policy_datum(self, logprobs: list[float] | None, loss_fn: str) -> types.Datum:
        logprobs = need(logprobs, "forward's logprobs")
        extra = {"sequence_ratio_mask": [1.0] * len(logprobs)} if loss_fn == "gspo" else {}
        return self._datum(logprobs=logprobs, advantages=[1.0] * len(logprobs), **extra)

    def _rl_stability_loss(self) -> None:
        """stable_reinforce trains on a sequence sampled with record_stability_info, named by provenance spans."""
        def run():
            sampler = _result(need(self.training, "a training client").save_weights_and_get_sampling_client(
                record_stability_info=True))
            prompt = need(self.tokens, "the tokenizer")[:5]
            sample = _result(sampler.sample(types.ModelInput.from_ints(prompt), 1,
                                            types.SamplingParams(max_tokens=3, seed=0, stop=[])))
            sequence = sample.sequences[0]
            full = prompt + sequence.tokens
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "logprobs": [0.0] * (len(prompt) - 1) + sequence.logprobs,
                                "advantages": [0.0] * (len(prompt) - 1) + [1.0] * len(sequence.tokens)},
            ).with_provenance(
                model_input=[types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, length=len(prompt)),
                             types.SampledProvenanceSpan(sequence_id=sequence.sequence_id,
                                                         length=len(sequence.tokens) - 1)],
                loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, offset=1,
                                                           length=len(prompt) - 1),
                                types.SampledProvenanceSpan(sequence_id=sequence.sequence_id,
                                                            length=len(sequence.tokens))])
            output = _result(self.training.forward_backward([datum], "stable_reinforce"))
            _check("loss:sum" in output.metrics, f"metrics lack loss:sum: {sorted(output.metrics)}")

        self.check("TrainingClient", "forward_backward[loss_fn=stable_reinforce]", run)

    def _sampling_calls(self) -> None:
        training = lambda: need(self.training, "a training client")  # noqa: E731
        sampler_path = lambda: need(self.paths.get("sampler"), "a sampler checkpoint")  # noqa: E731
        self.both("TrainingClient", training, "create_sampling_client", lambda m: m(sampler_path()), self._sampler)
        self.sampler = self.both("TrainingClient", training, "save_weights_and_get_sampling_client", lambda m: m(),
                                 self._sampler)
        self.check("TrainingClient", "save_weights_and_get_sampling_client[kind=inflight]", lambda: self._sampler(
            _result(training().save_weights_and_get_sampling_client(kind="inflight"))))
        sampler = lambda: need(self.sampler, "a sampling client")  # noqa: E731
        client = "SamplingClient"
        prompt = lambda: types.ModelInput.from_ints(need(self.tokens, "the tokenizer"))  # noqa: E731
        params = types.SamplingParams(max_tokens=4, seed=1, temperature=1.0)
        self.both(client, sampler, "sample", lambda m: m(prompt(), 2, params), self._verify_sample)
        num_prompt = lambda: len(self.tokens)  # noqa: E731
        options: dict[str, tuple[dict, Callable[[types.SampleResponse], Any]]] = {
            "include_prompt_logprobs": (
                {"include_prompt_logprobs": True},
                lambda r: _check(len(r.prompt_logprobs) == num_prompt() and r.prompt_logprobs[0] is None,
                                 "prompt_logprobs must have one entry per prompt token, None first")),
            "topk_prompt_logprobs": (
                {"include_prompt_logprobs": True, "topk_prompt_logprobs": 2},
                lambda r: _check(len(r.topk_prompt_logprobs) == num_prompt() and len(r.topk_prompt_logprobs[1]) == 2,
                                 "topk_prompt_logprobs must have k entries per prompt position")),
            "prompt_logprobs_last_n": (
                {"include_prompt_logprobs": True, "prompt_logprobs_last_n": 2},
                lambda r: _check(r.prompt_logprobs[:-2] == [None] * (num_prompt() - 2), "earlier positions scored")),
            "topk_sample_logprobs": ({"topk_sample_logprobs": 2}, _verify_topk_sampled),
            "target_prompt_logprobs": (
                {"include_prompt_logprobs": True, "target_prompt_logprobs": _targets_of},
                _verify_targets),
            "target_prompt_logprobs, sparse": (
                {"include_prompt_logprobs": True,
                 "target_prompt_logprobs": lambda tokens: _targets_of(tokens, last_only=True)},
                _verify_targets),
            "prompt_alt_tokens_k": (
                {"prompt_alt_tokens_k": 2},
                lambda r: _check(r.prompt_alt_tokens is not None
                                 and r.prompt_alt_tokens.tokens.shape == [num_prompt() - 1, 2]
                                 and r.prompt_alt_tokens.logprobs.shape == [num_prompt() - 1, 2]
                                 and (r.prompt_alt_tokens.logprobs.to_numpy() <= 0).all(),
                                 "prompt_alt_tokens must hold k draws and their logprobs per prompt position "
                                 "after the first")),
        }
        for option, (kwargs, verify) in options.items():
            def run(kwargs=kwargs, verify=verify):
                values = {k: v(self.tokens) if callable(v) else v for k, v in kwargs.items()}
                response = _result(sampler().sample(prompt(), 1, params, **values))
                verify(response)

            self.check(client, f"sample[{option}]", run)
        self.both(client, sampler, "compute_logprobs", lambda m: m(prompt()),
                  lambda r: _check(len(r) == num_prompt() and r[0] is None, "one logprob per prompt token"))
        self.check(client, "get_tokenizer", lambda: _check(sampler().get_tokenizer().encode(TEXT) == self.tokens,
                                                           "the sampler's tokenizer differs from the trainer's"))
        self.both(client, sampler, "get_base_model", lambda m: m(),
                  lambda r: _check(r == self.base_model, f"base model {r!r}, expected {self.base_model!r}"))
        handle = self.check(client, "get_sampler_handle", lambda: _is(str, sampler().get_sampler_handle()))
        self.check(client, "from_sampler_handle", lambda: self._verify_sample(_result(
            tinker.SamplingClient.from_sampler_handle(need(handle, "a sampler handle"), api_key=self.api_key)
            .sample(prompt(), 2, params))))
        self.check(client, "create", lambda: self._verify_sample(_result(_result(tinker.SamplingClient.create(
            self.service.holder, base_model=self.base_model)).sample(prompt(), 2, params))))
        self.check(client, "on_queue_state_change",
                   lambda: sampler().on_queue_state_change(QueueState.PAUSED_CAPACITY, "conformance"))
        self.check(client, "get_telemetry", lambda: sampler().get_telemetry())

    def _sampler(self, sampler: tinker.SamplingClient) -> tinker.SamplingClient:
        """A sampling client that samples."""
        self._verify_sample(_result(sampler.sample(types.ModelInput.from_ints(self.tokens), 1,
                                                   types.SamplingParams(max_tokens=2))))
        return sampler

    def _verify_sample(self, response: types.SampleResponse) -> types.SampleResponse:
        _check(response.sequences, "no sequences")
        for sequence in response.sequences:
            _check(1 <= len(sequence.tokens) <= 4, f"{len(sequence.tokens)} tokens for max_tokens <= 4")
            _check(sequence.logprobs is not None and len(sequence.logprobs) == len(sequence.tokens),
                   "every sampled token needs its logprob")
        return response

    def _service_calls(self) -> None:
        service, client = lambda: self.service, "ServiceClient"
        state = lambda: need(self.paths.get("state"), "a save_state checkpoint")  # noqa: E731
        self.both(client, service, "create_training_client_from_state", lambda m: m(state()), self._new_run)
        self.both(client, service, "create_training_client_from_state_with_optimizer", lambda m: m(state()),
                  self._new_run)
        sampler_path = lambda: need(self.paths.get("sampler"), "a sampler checkpoint")  # noqa: E731
        self.both(client, service, "create_sampling_client", lambda m: m(model_path=sampler_path()), self._sampler)
        self.check(client, "create_sampling_client[base_model]",
                   lambda: self._sampler(_result(self.service.create_sampling_client(base_model=self.base_model))))
        self.check(client, "copy_weights", lambda: self._verify_copy(_result(self.service.copy_weights(state()))))
        self.both(client, service, "get_server_capabilities", lambda m: m(),
                  lambda r: _check(self.base_model in [m.model_name for m in r.supported_models], "model not listed"))
        self.check(client, "create_rest_client", lambda: _is(RestClient, self.service.create_rest_client()))
        self.check(client, "holder", lambda: _check(self.service.holder is not None, "no holder"))
        self.check(client, "get_console_url", lambda: _is(str, self.service.get_console_url()))
        self.check(client, "get_telemetry", lambda: self.service.get_telemetry())

    def _verify_copy(self, path: str) -> str:
        _check(path.startswith("tinker://") and path != self.paths["state"], f"copy path {path!r}")
        self.model_ids.append(path.removeprefix("tinker://").split("/")[0])
        return path

    def _rest_calls(self) -> None:
        rest, client = lambda: need(self.rest, "a RestClient"), "RestClient"
        model_id = lambda: need(self.training, "a training client").model_id  # noqa: E731
        session_id = lambda: model_id().split(":train:")[0]  # noqa: E731
        path = lambda kind: need(self.paths.get(kind), f"a {kind} checkpoint")  # noqa: E731
        listed = lambda r, kind: _check(path(kind) in [c.tinker_path for c in r.checkpoints],  # noqa: E731
                                        f"{path(kind)} is not listed")
        self.both(client, rest, "list_checkpoints", lambda m: m(model_id()), lambda r: listed(r, "sampler"))
        self.both(client, rest, "list_user_checkpoints", lambda m: m(limit=100), lambda r: listed(r, "state"))
        self.both(client, rest, "get_training_run", lambda m: m(model_id()),
                  lambda r: _check(r.training_run_id == model_id() and r.base_model == self.base_model, "wrong run"))
        self.both(client, rest, "get_training_run_by_tinker_path", lambda m: m(path("state")),
                  lambda r: _check(r.training_run_id == model_id(), "wrong run"))
        self.check(client, "get_weights_info_by_tinker_path", lambda: _check(
            _result(rest().get_weights_info_by_tinker_path(path("state"))).lora_rank == 8, "lora_rank is not 8"))
        self.both(client, rest, "list_training_runs", lambda m: m(limit=100),
                  lambda r: _check(model_id() in [run.training_run_id for run in r.training_runs], "run not listed"))
        self.both(client, rest, "get_session", lambda m: m(session_id()),
                  lambda r: _check(model_id() in r.training_run_ids and r.sampler_ids, "runs or samplers missing"))
        self.both(client, rest, "list_sessions", lambda m: m(limit=100),
                  lambda r: _check(session_id() in r.sessions, "session not listed"))
        sampler_id = lambda: need(_result(rest().get_session(session_id())).sampler_ids, "a sampler id")[0]  # noqa
        self.both(client, rest, "get_sampler", lambda m: m(sampler_id()),
                  lambda r: _check(r.base_model == self.base_model, f"base model {r.base_model!r}"))
        self._checkpoint_lifecycle(rest, path)
        self.both(client, rest, "assign_session_project", lambda m: m(session_id(), f"conformance-{self.token}"))
        self.check(client, "search_sessions", lambda: self._verify_search(session_id()))
        self.both(client, rest, "export_session_trace", lambda m: m(session_id()),
                  lambda url: _check(url.startswith("http"), f"not a URL: {url!r}"))
        self.check(client, "whoami", lambda: self._whoami())
        now = datetime.now(UTC)
        self.both(client, rest, "get_billing_usage", lambda m: m(now - timedelta(days=1), now))
        self.both(client, rest, "get_current_checkpoint_storage_usage", lambda m: m())
        self.both(client, rest, "get_audit_log", lambda m: m())
        self.check(client, "get_telemetry", lambda: rest().get_telemetry())

    def _checkpoint_lifecycle(self, rest: Callable[[], RestClient], path: Callable[[str], str]) -> None:
        client = "RestClient"
        for suffix, resolve in (("", _result), ("_async", _await)):
            self.check(client, "set_checkpoint_ttl_from_tinker_path" + suffix,
                       lambda s=suffix, resolve=resolve: self._verify_ttl(rest(), path("state"), s, resolve))
            for method, public in (("publish_checkpoint_from_tinker_path", True),
                                   ("unpublish_checkpoint_from_tinker_path", False)):
                self.check(client, method + suffix, lambda m=method + suffix, public=public, resolve=resolve:
                           self._verify_publish(rest(), path("sampler"), m, public, resolve))
        self.both(client, rest, "get_external_weights_urls", lambda m: m(path("external")), self._verify_urls)
        self.both(client, rest, "copy_weights", lambda m: m(path("sampler"), self.project_id), self._verify_copy)
        for method in ("delete_checkpoint", "delete_checkpoint_from_tinker_path"):
            for suffix, resolve in (("", _result), ("_async", _await)):
                self.check(client, method + suffix, lambda method=method + suffix, resolve=resolve:
                           self._verify_delete(rest(), method, resolve))

    def _listing(self, rest: RestClient, tinker_path: str) -> types.Checkpoint:
        run_id = tinker_path.removeprefix("tinker://").split("/")[0]
        found = [c for c in _result(rest.list_checkpoints(run_id)).checkpoints if c.tinker_path == tinker_path]
        return need(found[0] if found else None, f"{tinker_path} in its run's listing")

    def _verify_ttl(self, rest: RestClient, tinker_path: str, suffix: str, resolve: Callable[[Any], Any]) -> None:
        """A TTL shows as expires_at (ttl seconds from now); None removes it."""
        resolve(getattr(rest, "set_checkpoint_ttl_from_tinker_path" + suffix)(tinker_path, 7200))
        expires_at = self._listing(rest, tinker_path).expires_at
        left = (expires_at - datetime.now(UTC)).total_seconds() if expires_at else None
        _check(left is not None and 7000 < left <= 7200, f"expires_at {expires_at} after a TTL of 7200 s")
        resolve(getattr(rest, "set_checkpoint_ttl_from_tinker_path" + suffix)(tinker_path, None))
        _check(self._listing(rest, tinker_path).expires_at is None, "a TTL of None did not remove the expiry")

    def _verify_publish(self, rest: RestClient, tinker_path: str, method: str, public: bool,
                        resolve: Callable[[Any], Any]) -> None:
        resolve(getattr(rest, method)(tinker_path))
        _check(self._listing(rest, tinker_path).public == public, f"public is not {public} after {method}")

    def _verify_urls(self, response: types.ExternalWeightsUrlsResponse) -> None:
        _check(response.urls and response.expires > datetime.now(UTC), "no URLs, or already expired")
        name, url = sorted(response.urls.items())[0]
        with urllib.request.urlopen(url, timeout=60) as download:  # plainly, without the API key
            _check(download.read(), f"{name} downloaded empty")

    def _verify_delete(self, rest: RestClient, method: str, resolve: Callable[[Any], Any]) -> None:
        training = need(self.training, "a training client")
        tinker_path = _result(training.save_weights_for_sampler(f"conformance-delete-{uuid.uuid4().hex[:6]}")).path
        run_id, checkpoint_id = tinker_path.removeprefix("tinker://").split("/", 1)
        args = (tinker_path,) if method.startswith("delete_checkpoint_from_tinker_path") else (run_id, checkpoint_id)
        resolve(getattr(rest, method)(*args))
        remaining = [c.tinker_path for c in _result(rest.list_checkpoints(run_id)).checkpoints]
        _check(tinker_path not in remaining, f"{tinker_path} is still listed")

    def _verify_search(self, session_id: str) -> None:
        request = types.SessionSearchRequest(display_name=f"conformance {self.token}",
                                             user_metadata={"conformance": self.token},
                                             project_ids=[f"conformance-{self.token}"], limit=1)
        page = _result(need(self.rest, "a RestClient").search_sessions(request))
        found = [s.session_id for s in page.sessions]
        _check(found == [session_id], f"search found {found}, expected [{session_id}]")

    def _whoami(self) -> None:
        try:
            _result(self.rest.whoami())
        except RuntimeError as error:
            if "JWT" in str(error):  # the SDK's own refusal when the server leaves JWT auth off
                raise RuntimeError(f"not supported without JWT auth: {error}") from None
            raise

    def _finish(self) -> None:
        """Delete what the scenario made, then close the session (ServiceClient.close)."""
        if self.rest is not None:
            for model_id in self.model_ids:
                try:
                    for checkpoint in _result(self.rest.list_checkpoints(model_id)).checkpoints:
                        _result(self.rest.delete_checkpoint_from_tinker_path(checkpoint.tinker_path))
                except Exception:  # cleaning up is best effort; the checks already ran
                    pass
        self.check("ServiceClient", "close", lambda: _result(self.service.close("success")))

    def _report_unchecked(self) -> None:
        checked = {(o.client, o.method) for o in self.outcomes}
        for client in CLIENTS:
            for name, _ in inspect.getmembers(_CLASSES[client]):
                if not name.startswith("_") and (client, name) not in checked:
                    self.outcomes.append(Outcome(client, name, "unchecked", "this checker has no check for it"))


@contextmanager
def _recording_sdk_methods() -> Iterator[set[str]]:
    """The `x-sdk-method` header of every request the SDK sends meanwhile: the public method that sent it,
    as the SDK itself attributes its requests (its background loops send none)."""
    sent: set[str] = set()
    send = httpx.AsyncClient.send

    async def recording_send(client: httpx.AsyncClient, request: httpx.Request, **kwargs) -> httpx.Response:
        if method := request.headers.get(SDK_METHOD_HEADER):
            sent.add(method)
        return await send(client, request, **kwargs)

    httpx.AsyncClient.send = recording_send
    try:
        yield sent
    finally:
        httpx.AsyncClient.send = send


def _custom_loss(data: list[types.Datum], logprobs_list: list[torch.Tensor]):
    loss = sum(-(logprobs * datum.loss_fn_inputs["weights"].to_torch()).sum()
               for datum, logprobs in zip(data, logprobs_list))
    return loss, {"custom_nll": float(loss)}


def _per_datum_loss(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss}


def _targets_of(tokens: list[int], last_only: bool = False) -> types.TensorData:
    """target_prompt_logprobs asking at each prompt position (or the last only, as a sparse tensor) for the
    logprob of the prompt's own token there, and of token 0 beside it."""
    ids = torch.stack([torch.tensor(tokens[1:], dtype=torch.int64), torch.zeros(len(tokens) - 1, dtype=torch.int64)],
                      dim=1)
    if not last_only:
        return types.TensorData.from_torch(ids)
    ids[:-1] = -1
    return types.TensorData.from_torch_sparse(ids, pad_value=-1)


def _verify_targets(response: types.SampleResponse) -> None:
    """The logprob of each prompt token asked for equals its prompt logprob; unasked cells are 0."""
    targets = _is(types.TensorData, response.target_prompt_logprobs)
    logprobs = targets.to_torch()
    prompt_logprobs = torch.tensor(response.prompt_logprobs[1:], dtype=torch.float32)
    asked = logprobs[:, 0] != 0
    _check(logprobs.shape == (len(prompt_logprobs), 2) and asked[-1], "one row per prompt position after the first")
    _check(torch.allclose(logprobs[asked, 0], prompt_logprobs[asked], atol=1e-4),
           "target logprobs of the prompt's tokens differ from its prompt_logprobs")
    _check((logprobs[asked, 1] <= 0).all(), "a logprob above 0")


def _verify_topk_sampled(response: types.SampleResponse) -> None:
    """k (token, logprob) per sampled token, best first, holding the sampled token where it ranks among them."""
    for sequence in response.sequences:
        _check(sequence.topk_logprobs is not None and len(sequence.topk_logprobs) == len(sequence.tokens),
               "topk_logprobs must have one row per sampled token")
        for token, logprob, best in zip(sequence.tokens, sequence.logprobs, sequence.topk_logprobs):
            values = [value for _, value in best]
            _check(len(best) == 2 and values == sorted(values, reverse=True), "k entries per token, best first")
            _check(logprob <= values[0] + 1e-4, "the sampled token is above the best")
            if logprob >= values[-1] + 1e-4:
                _check(abs(dict(best).get(token, float("inf")) - logprob) < 1e-4, "the sampled token is missing")


def _check(condition: Any, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _is(kind: type, value: Any) -> Any:
    _check(isinstance(value, kind), f"expected a {kind.__name__}, got {type(value).__name__}")
    return value
