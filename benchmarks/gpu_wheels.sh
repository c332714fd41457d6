#!/usr/bin/env bash
# Download, into .whl/, the wheels the server needs that the lent GPU machines' image lacks (it has
# torch 2.11, transformers 5.17, peft, pillow, numpy, httpx, protobuf; Python 3.12, no network).
# Run here, with network; then carry .whl with the device call (see benchmarks/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64
           --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux1_x86_64)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
    fastapi==0.165.0 annotated-doc==0.0.7 starlette==1.10.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 \
    sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3 zstandard==0.25.0 \
    tinker==0.38.0 orjson==3.13.0 pyqwest==0.12.0 distro==1.9.0 sniffio==1.3.1 \
    h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 transformers==5.23.0 psycopg==3.3.9 psycopg-binary==3.3.9
du -sh .whl
