"""SPrPO: perturbation-robust policies for LLM agents with stable optimisation (Wang et al., 2026).

The policy's RL loss is computed on a *perturbed* forward: Gaussian noise on the hidden states of chosen decoder
layers, scaled per token by the layer's own RMS, with a global scale ``sigma`` that a controller adapts from the
measured sensitivity (the KL between the clean and the perturbed policy on the batch), kept under a trust-region
bound so the perturbed objective stays a lower bound of the clean one's improvement. The formulas are :data:`FORMULA`.

Reconstructed (the paper text was not available; see the docs page): the per-token RMS scale, the k3 estimate of the
sensitivity on the batch's own completion tokens, the multiplicative controller with its step bound, the hard bound
``kl_max`` above which the step trains on the clean forward, and noise as the only training perturbation (pruning
and fake quantisation are evaluation perturbations, :func:`pruned` and :func:`fake_quantized`).

Pure torch: :func:`decoder_layers` finds the layers of any ``nn.Module`` (the longest ``ModuleList`` of blocks of one
class), :func:`hidden_noise` adds the noise with forward hooks and removes them exactly, :func:`pruned` /
:func:`fake_quantized` change weights inside a ``with`` block and restore them bit for bit,
:class:`SensitivityController` is the scale's state machine (``state_dict()`` / ``load_state_dict()``). The registry
record is :data:`distill_plugins.terms.sprpo.SPEC`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from credit_plugins.estimator import param, params_dataclass

__all__ = ["SPrPOParams", "SensitivityController", "decoder_layers", "select_layers", "hidden_noise", "pruned",
           "fake_quantized", "perturbed", "k3_sensitivity", "PERTURBATIONS", "FORMULA"]

#: What SPrPO computes, as ``agentcredit describe sprpo`` and the docs page show it.
FORMULA = """\
perturbed forward (the RL loss's forward only; rollouts and evaluation stay clean):
  h~_l = h_l + sigma_k * rms(h_l) * eps,   eps ~ N(0, I),   rms(h) = sqrt(mean_d h_d^2) per token (no gradient)
sensitivity (k3 estimate of KL(pi || pi~) on the completion tokens, no gradient; TRL: the step's first micro-batch
against one clean forward; verl: every micro-batch against the actor's old log-probs):
  D_k = mean_t [ r_t - 1 - log r_t ],   r_t = pi~(a_t | s_t) / pi(a_t | s_t)
trust-region guard:   D_k > kl_max  ->  step k trains on the clean forward (verl: step k + 1)
controller (once per optimizer step, adaptive):
  sigma_{k+1} = clip( sigma_k * clip((target_kl / D_k)^rate, 1/max_change, max_change), sigma_min, sigma_max )
  (D_k = 0: factor max_change)
loss: the trainer's own RL loss L(pi~_theta) on the perturbed forward
"""

#: perturbation types of :func:`perturbed` (training uses ``noise``; ``agentcredit robustness`` all three)
PERTURBATIONS = ("noise", "prune", "quant")


@params_dataclass(frozen=True)
class SPrPOParams:
    sigma: float = param(0.05, "initial noise scale, relative to each token's hidden-state RMS", low=0.0, high=10.0)
    adaptive: bool = param(True, "adapt sigma once per optimizer step from the measured sensitivity (false: fixed)")
    target_kl: float = param(0.01, "trust-region target of the sensitivity D = KL(pi || pi~) the controller steers to",
                             low=0.0, low_open=True)
    kl_max: float = param(0.05, "hard bound: a step whose measured D exceeds it trains on the clean forward",
                          low=0.0, low_open=True)
    rate: float = param(0.5, "controller exponent: sigma *= (target_kl / D)^rate", low=0.0, high=1.0, low_open=True)
    max_change: float = param(2.0, "largest factor sigma may change by in one step", low=1.0, low_open=True,
                              high=100.0)
    sigma_min: float = param(1e-3, "lower clip of the adapted sigma", low=0.0, high=10.0)
    sigma_max: float = param(1.0, "upper clip of the adapted sigma", low=0.0, high=10.0, low_open=True)
    layers: tuple[int, ...] = param((), "decoder layers to perturb (indices, negative from the end); [] = all")
    measure_every: int = param(1, "measure the sensitivity (one extra no-grad clean forward) every N optimizer steps",
                               low=1)
    seed: int = param(0, "seed of the noise stream (advanced once per step, so a resumed run draws the same noise)",
                      low=0)

    def __post_init__(self):
        if self.kl_max < self.target_kl:
            raise ValueError(f"term 'sprpo': kl_max={self.kl_max} is below target_kl={self.target_kl}; the hard bound "
                             f"must be at least the controller's target (e.g. kl_max = 5 * target_kl)")
        if self.sigma_min > self.sigma_max:
            raise ValueError(f"term 'sprpo': sigma_min={self.sigma_min} exceeds sigma_max={self.sigma_max}")
        if not self.sigma_min <= self.sigma <= self.sigma_max:
            raise ValueError(f"term 'sprpo': sigma={self.sigma} lies outside [sigma_min, sigma_max] = "
                             f"[{self.sigma_min}, {self.sigma_max}]; widen the clip or change sigma")
        if any(isinstance(i, bool) or not isinstance(i, int) for i in self.layers):
            raise ValueError(f"term 'sprpo': layers={self.layers!r} must be integer layer indices")


class SensitivityController:
    """The adaptive noise scale (see :data:`FORMULA`): ``update(D)`` once per optimizer step returns the next
    ``sigma``; ``step`` counts the updates (it also offsets the noise seed)."""

    def __init__(self, params: SPrPOParams):
        self.params = params
        self.sigma = float(params.sigma)
        self.step = 0
        self.last_sensitivity = float("nan")
        self.rejected = 0  #: steps whose D exceeded kl_max (trained clean)

    def factor(self, sensitivity: float) -> float:
        """The multiplicative change of sigma for a measured sensitivity ``D`` (>= 0)."""
        p = self.params
        if not math.isfinite(sensitivity) or sensitivity < 0:
            raise ValueError(f"sprpo: measured sensitivity {sensitivity!r} is not a finite number >= 0")
        if sensitivity == 0.0:
            return p.max_change
        return min(max((p.target_kl / sensitivity) ** p.rate, 1.0 / p.max_change), p.max_change)

    def update(self, sensitivity: float | None) -> float:
        """Advance one optimizer step; ``sensitivity`` None (not measured this step) keeps sigma."""
        p = self.params
        if sensitivity is not None:
            self.last_sensitivity = float(sensitivity)
            if p.adaptive:
                self.sigma = min(max(self.sigma * self.factor(float(sensitivity)), p.sigma_min), p.sigma_max)
        self.step += 1
        return self.sigma

    def over_bound(self, sensitivity: float) -> bool:
        """Whether ``D`` breaks the hard trust-region bound (the step then trains on the clean forward)."""
        return sensitivity > self.params.kl_max

    def state_dict(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "step": self.step, "last_sensitivity": self.last_sensitivity,
                "rejected": self.rejected}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"sigma", "step"} - set(state)
        if missing:
            raise ValueError(f"sprpo state lacks {sorted(missing)}; it is not an SPrPO controller state")
        sigma, step = float(state["sigma"]), int(state["step"])
        if not (math.isfinite(sigma) and sigma >= 0) or step < 0:
            raise ValueError(f"sprpo state has sigma={state['sigma']!r}, step={state['step']!r}; both must be >= 0")
        self.sigma, self.step = sigma, step
        self.last_sensitivity = float(state.get("last_sensitivity", float("nan")))
        self.rejected = int(state.get("rejected", 0))


# ---- layers -------------------------------------------------------------------------------------------------------
def decoder_layers(module: nn.Module) -> nn.ModuleList:
    """The decoder layers of ``module``: its longest ``nn.ModuleList`` whose children are all of one class (a
    transformer's stack of blocks; ``model.model.layers`` for Llama/Qwen, ``transformer.h`` for GPT-2)."""
    best: nn.ModuleList | None = None
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList) and len(sub) and len({type(m) for m in sub}) == 1:
            if best is None or len(sub) > len(best):
                best = sub
    if best is None:
        raise ValueError(f"{type(module).__name__} has no nn.ModuleList of identical blocks to perturb; SPrPO needs "
                         f"a layered model (a transformer's decoder layers)")
    return best


def select_layers(module: nn.Module, layers: Sequence[int] = ()) -> list[nn.Module]:
    """The decoder layers with indices ``layers`` (negative from the end; empty: all); a ``ValueError`` names an
    index out of range."""
    stack = decoder_layers(module)
    if not layers:
        return list(stack)
    n = len(stack)
    bad = [i for i in layers if not -n <= i < n]
    if bad:
        raise ValueError(f"sprpo layers={list(layers)}: {bad} out of range for a model of {n} decoder layers "
                         f"(indices -{n}..{n - 1})")
    return [stack[i] for i in sorted({i % n for i in layers})]


# ---- perturbations ------------------------------------------------------------------------------------------------
def rms(h: torch.Tensor) -> torch.Tensor:
    """Per-token RMS over the last (hidden) dimension, detached, shape ``[..., 1]``."""
    return h.detach().float().pow(2).mean(dim=-1, keepdim=True).sqrt().to(h.dtype)


@contextlib.contextmanager
def hidden_noise(module: nn.Module, sigma: float, layers: Sequence[int] = (),
                 generator: torch.Generator | None = None) -> Iterator[dict[str, int]]:
    """Inside the block every forward of the chosen decoder layers adds ``sigma * rms(h) * eps`` to its output hidden
    states (the first element of a tuple output); the hooks are removed on exit. Yields a counter dict
    (``{"calls": n}``: perturbed layer forwards). ``sigma == 0`` changes nothing."""
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"sprpo: noise sigma={sigma!r} must be a finite number >= 0")
    count = {"calls": 0}

    def hook(mod, args, output):
        h = output[0] if isinstance(output, tuple) else output
        if sigma == 0.0 or not torch.is_tensor(h):
            return None
        count["calls"] += 1
        if generator is None:
            eps = torch.randn(h.shape, device=h.device, dtype=torch.float32)
        else:  # drawn where the generator lives: the same stream whichever device holds the layer
            eps = torch.randn(h.shape, generator=generator, device=generator.device, dtype=torch.float32)
        eps = eps.to(h.device, h.dtype)
        noisy = h + sigma * rms(h) * eps
        return (noisy, *output[1:]) if isinstance(output, tuple) else noisy

    handles = [layer.register_forward_hook(hook) for layer in select_layers(module, layers)]
    try:
        yield count
    finally:
        for handle in handles:
            handle.remove()


def _weights(module: nn.Module, layers: Sequence[int]) -> list[nn.Parameter]:
    """The matrices (2-D parameters) of the chosen decoder layers: the linear maps pruning and quantisation act on."""
    seen, out = set(), []
    for layer in select_layers(module, layers):
        for p in layer.parameters():
            if p.dim() == 2 and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


@contextlib.contextmanager
def _weights_restored(params: list[nn.Parameter]) -> Iterator[None]:
    saved = [p.detach().clone() for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


@contextlib.contextmanager
def pruned(module: nn.Module, fraction: float, mode: str = "magnitude", layers: Sequence[int] = (),
           generator: torch.Generator | None = None) -> Iterator[None]:
    """Zero ``fraction`` of each weight matrix of the chosen layers inside the block (``magnitude``: the smallest
    ``|w|``; ``random``: uniformly drawn entries); the weights are restored bit for bit on exit. Not for a forward
    whose backward runs after the block (autograd would see the restored weights)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"sprpo: prune fraction={fraction!r} must lie in [0, 1)")
    if mode not in ("magnitude", "random"):
        raise ValueError(f"sprpo: prune mode={mode!r} must be 'magnitude' or 'random'")
    params = _weights(module, layers)
    with _weights_restored(params):
        with torch.no_grad():
            for p in params:
                k = int(fraction * p.numel())
                if k == 0:
                    continue
                if mode == "magnitude":
                    idx = p.detach().abs().flatten().argsort(stable=True)[:k]
                else:
                    idx = torch.randperm(p.numel(), generator=generator)[:k].to(p.device)
                p.view(-1)[idx] = 0
        yield


@contextlib.contextmanager
def fake_quantized(module: nn.Module, bits: int, layers: Sequence[int] = ()) -> Iterator[None]:
    """Round each weight matrix of the chosen layers to ``bits``-bit symmetric integers per output row (scale
    ``max|w_row| / (2^(bits-1) - 1)``, round to nearest) inside the block; restored bit for bit on exit."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16:
        raise ValueError(f"sprpo: quantisation bits={bits!r} must be an integer in [2, 16]")
    params = _weights(module, layers)
    levels = 2 ** (bits - 1) - 1
    with _weights_restored(params):
        with torch.no_grad():
            for p in params:
                w = p.detach().float()
                scale = w.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / levels
                p.copy_((torch.round(w / scale).clamp(-levels, levels) * scale).to(p.dtype))
        yield


@contextlib.contextmanager
def perturbed(module: nn.Module, kind: str, scale: float, layers: Sequence[int] = (), seed: int = 0
              ) -> Iterator[None]:
    """One perturbation of :data:`PERTURBATIONS` at ``scale`` (noise: sigma; prune: the fraction, magnitude pruning;
    quant: the bit width) on the chosen layers, for evaluation."""
    if kind == "noise":
        gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
        with hidden_noise(module, float(scale), layers, generator=gen):
            yield
    elif kind == "prune":
        with pruned(module, float(scale), "magnitude", layers):
            yield
    elif kind == "quant":
        if float(scale) != int(scale):
            raise ValueError(f"sprpo: quant scale={scale!r} is a bit width and must be an integer")
        with fake_quantized(module, int(scale), layers):
            yield
    else:
        raise ValueError(f"unknown perturbation type {kind!r}; one of {list(PERTURBATIONS)}")


def k3_sensitivity(lp_clean: torch.Tensor, lp_perturbed: torch.Tensor, mask: torch.Tensor) -> float:
    """``D``: the masked mean of ``r - 1 - log r``, ``r = exp(lp_perturbed - lp_clean)`` (k3 estimate of
    ``KL(pi || pi~)`` on tokens sampled from ``pi``); 0 for an empty mask."""
    m = mask.to(torch.float64)
    if m.sum() == 0:
        return 0.0
    d = (lp_perturbed.detach().double() - lp_clean.detach().double()).clamp(-20.0, 20.0)
    k3 = torch.expm1(d) - d
    return float((k3 * m).sum() / m.sum())
