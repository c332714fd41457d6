"""Raw vLLM: the rounds sampling_server_vs_vllm.py sends it, through vLLM's own offline API, no server.

    VLLM_PYTHON benchmarks/raw_vllm_sampling.py VLLM_ARGS.json ANSWER_FD

Runs inside vLLM's environment (it imports vLLM, PIL and the standard library only) and stays up
while the benchmark alternates its rounds with the server's: each line on stdin is one round (its
requests and its adapters' directories, JSON), run as one `LLM.generate` call; each answer is a JSON
line on file descriptor ANSWER_FD (vLLM logs to stdout), the first one when the engine is ready. The
engine gets the very command-line flags the server gives its vLLM (parsed by vLLM's own EngineArgs)
and the adapters by path: vLLM at its best. Scoring requests (prompt logprobs) are timed here
although vLLM with lm_head LoRA gets their values wrong (the server sends them to its embedded
engine): they measure what that choice costs.
"""

import json
import os
import sys
import time


def main() -> None:
    from PIL import Image
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    answers = os.fdopen(int(sys.argv[2]), "w", buffering=1)
    # The server's flags; the ones only its HTTP front end knows (host, port, ...) are left over.
    args, _ = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_known_args(json.loads(open(sys.argv[1]).read()))
    started = time.perf_counter()
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    answers.write(json.dumps({"ready": True, "start_seconds": time.perf_counter() - started}) + "\n")
    for line in sys.stdin:
        round_ = json.loads(line)
        # Each round's adapters are new (saved again by the server), with ids of their own: vLLM loads them anew.
        paths = round_["adapters"]
        adapters = [LoRARequest(f"round-{round_['round']}-run-{run}", round_["round"] * len(paths) + run + 1, path)
                    for run, path in enumerate(paths)]
        images = {path: Image.open(path).convert("RGB") for request in round_["requests"] for path in request["images"]}
        prompts, params, loras = [], [], []
        for request in round_["requests"]:
            prompt = {"prompt_token_ids": request["token_ids"]}
            if request["images"]:
                prompt["multi_modal_data"] = {"image": [images[path] for path in request["images"]]}
            prompts.append(prompt)
            # What the server would ask of its vLLM for the same request (server/sampling/vllm.py).
            params.append(SamplingParams(n=request["num_samples"], max_tokens=request["max_tokens"],
                                         temperature=1.0, seed=request["seed"], ignore_eos=True, logprobs=0,
                                         prompt_logprobs=0 if request["prompt_logprobs"] else None,
                                         detokenize=False))
            loras.append(adapters[request["run"]])
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        answers.write(json.dumps({"seconds": time.perf_counter() - start,
                                  "tokens": sum(len(o.token_ids) for out in outputs for o in out.outputs)}) + "\n")


if __name__ == "__main__":
    main()
