#!/usr/bin/env bash
# There, on the lent GPU machine, after every part of benchmarks/vllm_stage.sh is in /tmp/stage: the server's
# wheels into /tmp/site-srv (transformers 5.24 among them), vLLM 0.26.0 with its dependencies and the plugin
# into /tmp/site (beside the image's transformers 5.17, which vLLM 0.26 needs), and /tmp/vllm-python, the
# interpreter to pass as --vllm-python. Run the server with PYTHONPATH=/tmp/site-srv:/tmp/site.
set -euo pipefail
cat /tmp/stage/pack.part* > /tmp/pack.tar
[ "$(sha256sum /tmp/pack.tar | cut -c1-64)" = "$(cat /tmp/stage/pack.sha)" ] || { echo "a part is missing or damaged"; exit 2; }
tar xf /tmp/pack.tar -C /tmp && rm /tmp/pack.tar
pip=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
"${pip[@]}" --target /tmp/site-srv /tmp/pack/whl/*.whl
"${pip[@]}" --target /tmp/site /tmp/pack/deps/*.whl /tmp/pack/whl/tinker_server_vllm_plugin-*.whl
tar xJf /tmp/pack/vllm026.tar.xz -C /tmp/site
printf '#!/bin/sh\nPYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 exec python3 "$@"\n' > /tmp/vllm-python
chmod +x /tmp/vllm-python
/tmp/vllm-python -c "import vllm, transformers; print('vLLM', vllm.__version__, 'with transformers', transformers.__version__)"
PYTHONPATH=/tmp/site-srv:/tmp/site python3 -c "import transformers; print('server: transformers', transformers.__version__)"
