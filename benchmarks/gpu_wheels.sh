#!/usr/bin/env bash
# Download, into .whl/, the wheels the server needs that the lent GPU machines' image lacks (it has
# torch 2.11, transformers 5.17, peft, pillow, numpy, httpx, protobuf; Python 3.12, no network).
# Run here, with network; then carry .whl with the device call (see benchmarks/README.md).
#
#   bash benchmarks/gpu_wheels.sh [PACKAGE ...]     more packages to fetch beside the server's
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64
           --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux1_x86_64)
# The versions the suite passed with: requirements/test.lock's.
packages=(pydantic pydantic-core annotated-types typing-inspection fastapi annotated-doc starlette opentelemetry-api
          uvicorn httptools uvloop sqlalchemy alembic mako zstandard tinker orjson pyqwest distro sniffio h2 hpack
          hyperframe
          transformers psycopg psycopg-binary "$@")
pins=()
for package in "${packages[@]}"; do
    pins+=("$(grep -h -m 1 -oE "^$package==[^ ;]+" requirements/test.lock requirements/cookbook.lock)")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${pins[@]}"
du -sh .whl
