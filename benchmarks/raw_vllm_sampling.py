"""Raw vLLM: the workloads written by sampling_server_vs_vllm.py, through vLLM's own offline API, no server.

    VLLM_PYTHON benchmarks/raw_vllm_sampling.py SPEC.json OUT.json

Runs inside vLLM's environment (it imports vLLM, PIL and the standard library only). The engine
gets the very command-line flags the server gives its vLLM (parsed by vLLM's own EngineArgs), the
adapters by path, and each round's requests in one `LLM.generate` call: vLLM at its best. Scoring
requests (prompt logprobs) are timed here although vLLM with lm_head LoRA gets their values wrong
(the server sends them to its embedded engine): they measure what that choice costs.
"""

import json
import sys
import time


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    from PIL import Image
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # The server's flags; the ones only its HTTP front end knows (host, port, ...) are left over.
    args, _ = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_known_args(spec["vllm_args"])
    started = time.perf_counter()
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    start_seconds = time.perf_counter() - started
    # Each round's adapters are new (saved again by the server), with ids of their own: vLLM loads them anew.
    adapters = [[LoRARequest(f"round-{round_index}-run-{run}", round_index * len(paths) + run + 1, path)
                 for run, path in enumerate(paths)] for round_index, paths in enumerate(spec["adapters"])]
    images = {path: Image.open(path).convert("RGB") for path in spec["images"]}
    results = {}
    for workload, rounds in spec["workloads"].items():
        results[workload] = []
        for round_index, requests in enumerate(rounds):
            prompts, params, loras = [], [], []
            for request in requests:
                prompt = {"prompt_token_ids": request["token_ids"]}
                if request["images"]:
                    prompt["multi_modal_data"] = {"image": [images[path] for path in request["images"]]}
                prompts.append(prompt)
                # What the server would ask of its vLLM for the same request (server/sampling/vllm.py).
                params.append(SamplingParams(n=request["num_samples"], max_tokens=request["max_tokens"],
                                             temperature=1.0, seed=request["seed"], ignore_eos=True, logprobs=0,
                                             prompt_logprobs=0 if request["prompt_logprobs"] else None,
                                             detokenize=False))
                loras.append(adapters[round_index][request["run"]])
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            results[workload].append({"seconds": time.perf_counter() - start,
                                      "tokens": sum(len(o.token_ids) for out in outputs for o in out.outputs)})
    memory = None
    try:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info(0)
            memory = (total - free) / 2**30
    except ImportError:
        pass
    with open(sys.argv[2], "w") as out:
        json.dump({"start_seconds": start_seconds, "workloads": results, "gpu_memory_in_use_gib": memory}, out)


if __name__ == "__main__":
    main()
