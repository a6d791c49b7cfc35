"""agentcredit's on-policy-distillation bridge to verl 0.9.1 (spec distill §2.2 estimators; §4, §6, §11 schedules).

:mod:`agentcredit.verl` calls :func:`install` when verl loads its ``verl.plugins`` entry point; that only registers
post-import hooks (``wrapt``); ``import distill_plugins`` never imports verl. When verl imports

* ``verl.trainer.distillation.losses``: the losses below are added to verl's distillation-loss registry
  (``register_distillation_loss``), verl's ``compute_topk_loss`` (the logits-processor stage) and its
  ``ppo_loss`` binding are wrapped (both act only for our loss modes / when our weights are in the batch);
* ``verl.trainer.ppo.v1.trainer_base``: ``PPOTrainer._update_actor`` runs the loss scheduler once per step and
  writes the step and its weights into ``batch.extra_info`` (verl turns that into ``NonTensorData`` of every
  micro-batch the loss sees); ``_save_checkpoint`` / ``_load_checkpoint`` save and restore the scheduler state
  (``agentcredit_distill_scheduler.pt`` in each ``global_step_N`` folder);
* ``verl.trainer.ppo.v1.agent_loop_tq``: ``AgentLoopWorkerTQ._agent_loop_postprocess`` scores every output of a
  multi-output agent loop under the teacher, not only the last one (see "Every turn is scored" below), and
  ``_run_agent_loop`` hands the worker's teacher to the agent loop for Guided-OPD (:mod:`agentcredit.verl.guided`).

Every turn is scored: verl 0.9.1's ``AgentLoopWorkerTQ._agent_loop_postprocess(self, output, validate, **kwargs)``
takes the list of ``AgentLoopOutput`` an agent loop returns (``agentcredit_env``: one per env step), puts each into
the TransferQueue as its own row (``{uid}_{session}_{i}``), but calls ``self._compute_teacher_logprobs`` for
``outputs[-1]`` only ("TODO: Support output:list[AgentLoopOutput]"), so with distillation on only the final step's
row carries ``teacher_ids`` / ``teacher_logprobs``, and the actor update of a batch mixing both kinds of rows fails
(``KeyError: 'key "teacher_logprobs" not found in TensorDict'``; a 2-step CPU run of ``sokoban_opw`` without this
hook, 2026-12-04). The hook wraps that one method: before verl's own code runs,
it calls verl's own ``self._compute_teacher_logprobs(output, prompt_ids, response_ids, validate, sample_kwargs)`` for
each earlier output (concurrently; the teacher routing key, the validation skip and the teacher server are verl's),
which writes the same two ``extra_fields`` verl's code writes for the last one; verl then scores the last output
and stores every row as before. Why there: it is the only place that sees the whole list together with the sample's
kwargs and runs before the rows are stored (wrapping ``_compute_teacher_logprobs`` sees one output; scoring later
in the trainer would need a second teacher pass over TransferQueue rows and their multimodal data). The method is
patched on both the plain class and the class Ray actually instantiates (``ActorClass.__ray_metadata__.
modified_class``, on which Ray sets its own tracing wrapper of every method); the wrap travels inside the class that
Ray pickles for the agent-loop worker process. The trainer hook reports the coverage per step:
``agentcredit_distill/teacher_rows`` (rows whose response tokens carry teacher log-probs) and
``agentcredit_distill/rows`` (non-padding rows of the batch), ``agentcredit_distill/teacher_tokens`` (the prompt and
response tokens those rows sent the teacher's server to score: the step's teacher log-prob traffic); the worker's
wrapped ``_compute_teacher_logprobs``
flags each row (``extra_fields["agentcredit_teacher_scored"]``) while the teacher's tensor is at hand, so the
trainer never reads the teacher log-probs back for the metric.

Registered loss modes (``distillation.distillation_loss.loss_mode``), each returning verl's per-token
``[bsz, resp_len]`` loss multiplied by the scheduler's ``w_opd``:

===============================  =========  ===================================================================
name                             verl mode  per-token loss (lp = log-prob of the sampled token y_t)
===============================  =========  ===================================================================
``agentcredit_k1``               estimator  E1: ``lp_S − lp_T``; with ``use_policy_gradient=true`` verl uses
                                            ``−w_opd·k1 = w_opd·(lp_T − lp_S)`` as the advantage (tinker OPD).
                                            Direct backprop is refused, as verl refuses its own ``k1``
``agentcredit_k3``               estimator  k3: ``(r − 1) − log r``, ``log r = clamp(lp_T − lp_S, ±max_log_ratio)``
``agentcredit_reverse_kl``       top-k      E2: ``Σ_b p_S(b)(log p_S(b) − log p_T(b))`` over the K+1 buckets
                                            "teacher top-K ids + the rest" (exact full-vocabulary RKL when the
                                            teacher's top-K holds all its mass, e.g. K = V; otherwise the RKL of
                                            the coarse-grained distributions, a lower bound by data processing) [R]
``agentcredit_gjsd``             top-k      E3: ``β KL(T‖M) + (1−β) KL(S‖M)``, ``M = β p_T + (1−β) p_S`` on the same
                                            K+1 buckets (TRL convention: β=0 → KL(T‖S), β=1 → KL(S‖T)) [R]
``agentcredit_topk_reverse_kl``  top-k      E5 (LSD SG-RKL): ``Σ_{v∈V} p̄_S(v)(log p̄_S(v) − log p̄_T(v))``, both
                                            renormalised on V = the teacher's top-K ids (verl's teacher returns
                                            no stop-token log-probs, so V has no extra stop tokens)
``agentcredit_top1_ce``          top-k      E7 (OPW): ``−log p_S(argmax_v p_T(v))``, the teacher's argmax taken
                                            over its top-K (= its global argmax)
===============================  =========  ===================================================================

"estimator" modes read ``data["teacher_logprobs"]`` ``[bsz, seq, 1]`` and ``model_output["log_probs"]``; "top-k"
modes compute the loss in verl's logits-processor stage from the full student logits and the teacher's top-K
``teacher_ids`` / ``teacher_logprobs`` ``[bsz, seq, K]`` (FSDP strategies only: Megatron shards the vocabulary).
Every mode checks the teacher at response positions: NaN/inf log-probs, ids outside the student's vocabulary and
shape mismatches are a ``ValueError`` naming the verl field.

RL term: verl's ``distillation_ppo_loss`` computes ``L = L_PPO + coef·L_distill``. ``L_distill`` carries ``w_opd``
(in the per-token loss); ``L_PPO`` (verl's whole ``ppo_loss``: policy-gradient loss plus its KL/entropy terms) is
multiplied by ``w_rl`` (pattern P3, spec distill §11.2 ``combine="loss"``). With ``use_policy_gradient=true`` and
``agentcredit_k1`` the vanilla PG surrogate is linear in the advantage, so this is P2,
``A = w_rl·A_RL + coef·w_opd·(lp_T − lp_old)`` (``combine="advantage"``; exact without ratio clipping).

Configuration: the scheduler lives under ``algorithm.agentcredit_distill`` (verl passes ``algorithm`` on as a raw
DictConfig and never turns it into a dataclass, so extra keys are safe there; ``distillation.distillation_loss.*``
is a dataclass that rejects unknown keys)::

    algorithm:
      agentcredit_distill:
        schedule: opw            # fixed | opw | lsd | tide (distill_plugins.available()); default fixed
        params: {warmup_steps: 40}   # the scheduler's parameters (agentcredit describe opw)
        loss: {}                 # loss hyperparameters: beta (gjsd, 0.5), max_log_ratio (k3, 20.0)

    python -m verl.trainer.main_ppo ... distillation.enabled=true \\
        distillation.distillation_loss.loss_mode=agentcredit_top1_ce \\
        distillation.distillation_loss.use_task_rewards=true \\
        +algorithm.agentcredit_distill.schedule=opw +algorithm.agentcredit_distill.params.warmup_steps=40

The scheduler runs in the trainer process (v1 trainer, ``trainer.use_v1=true``) at ``step = global_steps − 1``
(0-based); ``on_batch`` gets ``gap_abs_mean`` / ``gap_mean`` (mean |lp_T − lp_old| and mean (lp_T − lp_old) over
response tokens; spec distill §2.3) and, for TIDE, the per-row ``lp_teacher`` / ``lp_old`` / ``mask``, all read from the
TransferQueue for estimator modes. Only the global weights reach verl's loss: a scheduler's per-row ``route`` or
``token_weights`` (LSD routing, TIDE's local z/D̃) are not applied (a warning says so once). Without the trainer
hook (legacy trainer, a hand-made batch) the loss uses ``w_opd = w_rl = 1`` and warns once.

Keys written to ``batch.extra_info``: ``agentcredit_step`` (int), ``agentcredit_w_opd``, ``agentcredit_w_rl``
(float), ``agentcredit_loss_params`` (dict).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from distill_plugins import losses as L

from ._compat import (SUPPORTED, VerlInternalsChanged, check_signature, checkpoint_wraps, install_post_import_hooks,
                      wraps_once)
from .guided import wrap_load_checkpoint as guided_wrap_load_checkpoint
from .guided import wrap_run_agent_loop
from .loop_common import CONFIG_KEY, PENDING, SCHEDULER, distill_block, horizon, scheduler_for

logger = logging.getLogger("agentcredit")

STEP_KEY, W_OPD_KEY, W_RL_KEY, PARAMS_KEY = ("agentcredit_step", "agentcredit_w_opd", "agentcredit_w_rl",
                                             "agentcredit_loss_params")
STATE_FILE = "agentcredit_distill_scheduler.pt"
ESTIMATOR_LOSSES = ("agentcredit_k1", "agentcredit_k3")
TOPK_LOSSES = ("agentcredit_reverse_kl", "agentcredit_gjsd", "agentcredit_topk_reverse_kl", "agentcredit_top1_ce")
LOSSES = ESTIMATOR_LOSSES + TOPK_LOSSES
#: loss hyperparameters (``algorithm.agentcredit_distill.loss``) and their defaults
LOSS_PARAMS = {"beta": 0.5, "max_log_ratio": 20.0}
#: which OPW ``estimator`` each loss mode implements (a mismatch is warned about)
OPW_ESTIMATOR = {"agentcredit_top1_ce": "top1_ce", "agentcredit_reverse_kl": "reverse_kl"}
_WARNED: set[str] = set()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(msg, *args)


def _is_ours(loss_mode: Any) -> bool:
    return isinstance(loss_mode, str) and loss_mode in LOSSES


# ---- weights and parameters the trainer hook put into the micro-batch --------------------------------------------
def _nt(data, key: str, default: Any = None) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


def batch_weights(data) -> tuple[float, float, dict[str, Any]]:
    """``(w_opd, w_rl, loss_params)`` from the micro-batch's non-tensor data (1, 1, defaults when absent)."""
    w_opd, w_rl = _nt(data, W_OPD_KEY), _nt(data, W_RL_KEY)
    if w_opd is None:
        _warn_once("no-weights", "agentcredit: no scheduler weights reached the distillation loss (needs the v1 "
                   "trainer and agentcredit.verl.distill loaded in the trainer process); using w_opd = w_rl = 1")
    params = dict(LOSS_PARAMS)
    params.update(_nt(data, PARAMS_KEY, None) or {})
    return (1.0 if w_opd is None else float(w_opd)), (1.0 if w_rl is None else float(w_rl)), params


def loss_params(block: Mapping[str, Any] | None) -> dict[str, Any]:
    """``algorithm.agentcredit_distill.loss`` checked against :data:`LOSS_PARAMS`, defaults filled in."""
    given = dict((block or {}).get("loss", None) or {})
    unknown = sorted(set(given) - set(LOSS_PARAMS))
    if unknown:
        raise ValueError(f"algorithm.{CONFIG_KEY}.loss: unknown parameter(s) {unknown}; valid ones are "
                         f"{sorted(LOSS_PARAMS)}")
    out = dict(LOSS_PARAMS)
    out.update({k: float(v) for k, v in given.items()})
    if not 0.0 <= out["beta"] <= 1.0:
        raise ValueError(f"algorithm.{CONFIG_KEY}.loss.beta must be in [0, 1], got {out['beta']}")
    return out


# ---- validation with verl's field names ----------------------------------------------------------------------------
def _check_teacher(values: torch.Tensor, valid: torch.Tensor, field: str, mode: str) -> None:
    """Non-finite teacher values at response positions are a ValueError naming verl's field."""
    bad = ~torch.isfinite(values)
    if bad.dim() > valid.dim():
        bad = bad.flatten(valid.dim()).any(-1)
    n = int((bad & valid).sum())
    if n:
        raise ValueError(f"{mode}: data[{field!r}] holds NaN/inf at {n} response position(s) of "
                         f"{int(valid.sum())}; the teacher forward pass failed or is misaligned with the student's "
                         f"tokens (check the teacher server's logprobs)")


def _check_ids(ids: torch.Tensor, valid: torch.Tensor, vocab: int, mode: str) -> None:
    bad = ((ids < 0) | (ids >= vocab)).any(-1) & valid
    n = int(bad.sum())
    if n:
        raise ValueError(f"{mode}: data['teacher_ids'] holds ids outside the student's vocabulary [0, {vocab}) at "
                         f"{n} response position(s) (max id {int(ids[valid].max())}); the teacher and the student "
                         f"must share a tokenizer/vocabulary (spec distill §1.2)")


# ---- estimator modes (sampled-token teacher log-probs) ----------------------------------------------------------
def sampled_token_losses(mode: str, student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor,
                         params: Mapping[str, Any]) -> torch.Tensor:
    """``[B, T]`` per-token loss of an estimator mode (unweighted), via :mod:`distill_plugins.losses`."""
    if tuple(teacher_logp.shape) != tuple(student_logp.shape):
        raise ValueError(f"{mode}: data['teacher_logprobs'] gives {tuple(teacher_logp.shape)} response positions "
                         f"but model_output['log_probs'] gives {tuple(student_logp.shape)}; the estimator modes need "
                         f"one teacher log-prob per token (teacher topk=1), the same tokens as the student")
    m = mask.bool()
    _check_teacher(teacher_logp, m, "teacher_logprobs", mode)
    if mode == "agentcredit_k1":
        return L.k1(student_logp, teacher_logp, m)
    if mode == "agentcredit_k3":
        return L.k3(student_logp, teacher_logp, m, max_log_ratio=float(params["max_log_ratio"]))
    raise ValueError(f"{mode} is not an estimator mode; estimator modes are {list(ESTIMATOR_LOSSES)}")


def _estimator_loss(config, distillation_config, model_output, data):
    """verl ``DistillationLossFn``: ``(actor_config, distillation_config, model_output, micro_batch)`` ->
    ``([bsz, resp_len] per-token losses, metrics)``; the loss is ``w_opd`` times the estimator of ``loss_mode``."""
    from verl.workers.utils.padding import no_padding_2_padding

    loss_cfg = distillation_config.distillation_loss
    mode = loss_cfg.loss_mode
    if mode == "agentcredit_k1" and not loss_cfg.use_policy_gradient:
        raise ValueError("agentcredit_k1 needs distillation.distillation_loss.use_policy_gradient=true: the gradient "
                         "of k1 (lp_S - lp_T) does not depend on the teacher (verl refuses its own k1 the same way)")
    w_opd, _, params = batch_weights(data)
    student = no_padding_2_padding(model_output["log_probs"], data)
    teacher = no_padding_2_padding(data["teacher_logprobs"], data)
    if teacher.dim() == 3:
        if teacher.shape[-1] != 1:
            raise ValueError(f"{mode}: data['teacher_logprobs'] has {teacher.shape[-1]} log-probs per token; the "
                             f"estimator modes need the sampled token's only (top-k teacher output belongs to the "
                             f"top-k modes {list(TOPK_LOSSES)})")
        teacher = teacher.squeeze(-1)
    mask = data["response_mask"]
    mask = (mask.to_padded_tensor(0) if mask.is_nested else mask).bool()
    per_token = sampled_token_losses(mode, student, teacher.to(student.dtype), mask, params)
    return per_token * w_opd, _metrics(per_token, mask, w_opd)


def _metrics(per_token: torch.Tensor, mask: torch.Tensor, w_opd: float) -> dict[str, Any]:
    n = mask.sum().clamp_min(1)
    return {"distillation/agentcredit_w_opd": float(w_opd),
            "distillation/agentcredit_loss_unweighted": float((per_token.detach() * mask).sum() / n)}


# ---- top-k modes (student logits, teacher top-K) ------------------------------------------------------------------
def _buckets(logp_k: torch.Tensor) -> torch.Tensor:
    """``[..., K] -> [..., K+1]`` log-probs: the K entries and the log of the remaining mass ``1 − Σ p_k``.

    The tail is floored at ``1e-12`` of probability (a teacher whose top-K holds all its mass, K = V, gives an exact
    full-vocabulary divergence up to that floor)."""
    tail = torch.log((1.0 - logp_k.exp().sum(-1, keepdim=True)).clamp_min(1e-12))
    return torch.cat([logp_k, tail], dim=-1)


#: float32 elements of one chunk of the top-k losses' student log-softmax (rows per chunk: this over the vocabulary)
TOPK_CHUNK_ELEMENTS = 1 << 26


class _SupportLogProbs(torch.autograd.Function):
    """``log_softmax(logits[rows])`` at ``ids``, ``[N, K]`` float32 (float64 for float64 logits), computed over
    chunks of ``chunk`` rows: never a float32 copy of ``logits[rows]`` ``[N, V]`` (verl's bf16 logits of a 16k-token
    micro-batch at a 152k vocabulary are 5 GB, an fp32 copy 10 GB). Backward recomputes each chunk's softmax from
    the saved logits and the per-row log-normaliser: ``d/dx = onehot(ids) g - softmax(x) sum(g)``."""

    @staticmethod
    def forward(ctx, logits, rows, ids, chunk):
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        out = torch.empty(ids.shape, dtype=dtype, device=logits.device)
        lse = torch.empty(rows.shape[0], dtype=dtype, device=logits.device)
        for a in range(0, rows.shape[0], chunk):
            x = logits.index_select(0, rows[a:a + chunk]).to(dtype)
            norm = torch.logsumexp(x, dim=-1)
            out[a:a + chunk] = x.gather(-1, ids[a:a + chunk]) - norm.unsqueeze(-1)
            lse[a:a + chunk] = norm
            del x
        ctx.save_for_backward(logits, rows, ids, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, rows, ids, lse = ctx.saved_tensors
        g_logits = torch.zeros_like(logits)
        chunk = ctx.chunk
        for a in range(0, rows.shape[0], chunk):
            g = grad[a:a + chunk].to(lse.dtype)
            x = logits.index_select(0, rows[a:a + chunk]).to(lse.dtype)
            x.sub_(lse[a:a + chunk].unsqueeze(-1)).exp_().mul_(-g.sum(-1, keepdim=True))  # -softmax * sum(g)
            x.scatter_add_(-1, ids[a:a + chunk], g)
            g_logits.index_add_(0, rows[a:a + chunk], x.to(logits.dtype))
            del x
        return g_logits, None, None, None


def support_logprobs(student_logits: torch.Tensor, valid: torch.Tensor, ids: torch.Tensor,
                     chunk_elements: int | None = None) -> torch.Tensor:
    """``[N, K]`` student log-probs (full-vocabulary ``log_softmax``) of ``ids`` ``[N, K]`` at the ``N`` positions
    where ``valid`` ``[B, T]`` is True (row-major order), differentiable in ``student_logits`` ``[B, T, V]``; in
    chunks of ``chunk_elements // V`` positions (:class:`_SupportLogProbs`), only over the valid positions."""
    vocab = student_logits.shape[-1]
    flat = student_logits.reshape(-1, vocab)
    rows = valid.reshape(-1).nonzero().squeeze(-1)
    chunk = max(1, int(chunk_elements or TOPK_CHUNK_ELEMENTS) // max(vocab, 1))
    return _SupportLogProbs.apply(flat, rows, ids.long(), chunk)


def _first_positions(ids: torch.Tensor) -> torch.Tensor:
    """``[N, K]``: for each entry, the position of the first entry of its row with the same id."""
    if not ids.numel():
        return ids
    return (ids.unsqueeze(-1) == ids.unsqueeze(-2)).int().argmax(-1)


def topk_token_losses(mode: str, student_logits: torch.Tensor, teacher_ids: torch.Tensor,
                      teacher_logp: torch.Tensor, valid: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    """``[B, N]`` per-token loss of a top-k mode (unweighted) from student logits ``[B, N, V]`` and the teacher's
    top-K ``teacher_ids`` / ``teacher_logp`` ``[B, N, K]``; 0 where ``valid`` is False.

    Only the ``valid`` (response) positions are computed, and the student's log-softmax is taken at the K teacher ids
    only, in chunks (:func:`support_logprobs`): no float32 ``[positions, V]`` tensor, forward or backward. Every mode
    needs no more: E2/E3 use the K+1 buckets, E5 renormalises the student on the K ids, E7 reads one of them."""
    if teacher_ids.shape != teacher_logp.shape or teacher_ids.shape[:2] != student_logits.shape[:2]:
        raise ValueError(f"{mode}: data['teacher_ids'] {tuple(teacher_ids.shape)} and data['teacher_logprobs'] "
                         f"{tuple(teacher_logp.shape)} must both be [B, N, K] over the student's "
                         f"{tuple(student_logits.shape[:2])} positions")
    if mode not in TOPK_LOSSES:
        raise ValueError(f"{mode} is not a top-k mode; top-k modes are {list(TOPK_LOSSES)}")
    vocab = student_logits.shape[-1]
    valid = valid.bool()
    _check_teacher(teacher_logp, valid, "teacher_logprobs", mode)
    _check_ids(teacher_ids, valid, vocab, mode)
    ids = teacher_ids[valid].long()                                     # [N, K]
    t_logp = L._f(teacher_logp[valid].detach())                         # [N, K]
    lp_v = support_logprobs(student_logits, valid, ids)                 # [N, K], full-vocabulary student log-probs
    every = torch.ones(1, ids.shape[0], dtype=torch.bool, device=ids.device)
    if mode == "agentcredit_topk_reverse_kl":
        # renormalised on the ids, so the full-vocabulary normaliser cancels; a repeated id is counted once (its first
        # occurrence), as L.topk_reverse_kl does on the full logits
        local = _first_positions(ids)
        per = L.topk_reverse_kl(lp_v.unsqueeze(0), mask=every, k=None, teacher_ids=local.unsqueeze(0),
                                teacher_logp=t_logp.unsqueeze(0))[0]
    elif mode == "agentcredit_top1_ce":
        target = lp_v.gather(-1, t_logp.argmax(-1, keepdim=True)).squeeze(-1)
        L._check_support((target.detach() == -math.inf).unsqueeze(-1), "student_logits", "teacher_top1_ce",
                         "is the teacher's top-1")
        per = -target
    else:  # E2/E3 on the K+1 buckets "teacher top-K + rest", as log-probs (log_softmax of them is the identity)
        s_b, t_b = _buckets(lp_v).unsqueeze(0), _buckets(t_logp).unsqueeze(0)
        if mode == "agentcredit_reverse_kl":
            per = L.reverse_kl(s_b, t_b, every)[0]
        else:
            per = L.generalized_jsd(s_b, t_b, every, beta=float(params["beta"]))[0]
    out = per.new_zeros(valid.shape)
    return out.masked_scatter(valid, per) if per.numel() else out


def response_positions(data, n_tokens: int, device) -> torch.Tensor:
    """``[1, total_nnz]`` bool: the packed positions whose logits predict a response token (verl's one-token shift:
    response token t of a sequence with prompt length p sits at packed offset + p − 1 + t)."""
    prompts, responses = data["prompts"], data["responses"]
    if not (prompts.is_nested and responses.is_nested):
        raise ValueError("agentcredit top-k losses need verl's no-padding (nested) micro-batches: data['prompts'] "
                         "and data['responses'] must be jagged tensors")
    p = prompts.offsets().diff().to(device)
    r = responses.offsets().diff().to(device)
    start = torch.cumsum(p + r, 0) - (p + r) + p - 1
    idx = torch.arange(n_tokens, device=device)
    seq = torch.bucketize(idx, torch.cumsum(p + r, 0), right=True).clamp_max(len(p) - 1)
    return ((idx >= start[seq]) & (idx < start[seq] + r[seq])).unsqueeze(0)


def _topk_logits_stage(config, distillation_config, data, student_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our replacement of verl's ``compute_topk_loss`` for our top-k modes: ``{"distillation_losses": [1, N]}``."""
    mode = distillation_config.distillation_loss.loss_mode
    if config.strategy not in ("fsdp", "fsdp2", "veomni"):
        raise NotImplementedError(f"{mode}: actor_rollout_ref.actor.strategy={config.strategy!r} is not supported; "
                                  f"the top-k agentcredit losses need full-vocabulary student logits (FSDP)")
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

    t_logp, t_ids = data["teacher_logprobs"], data["teacher_ids"]
    if not (t_logp.is_nested and t_ids.is_nested):
        raise ValueError(f"{mode}: data['teacher_logprobs'] and data['teacher_ids'] must be jagged [bsz, seq, K]")
    t_logp, t_ids = t_logp.values().unsqueeze(0), t_ids.values().unsqueeze(0)
    valid = response_positions(data, t_logp.shape[1], t_logp.device)
    if get_ulysses_sequence_parallel_world_size() > 1:
        t_logp, t_ids = slice_input_tensor(t_logp, dim=1), slice_input_tensor(t_ids, dim=1)
        valid = slice_input_tensor(valid, dim=1)
    n = student_logits.shape[1]
    if t_logp.shape[1] != n:
        raise ValueError(f"{mode}: data['teacher_logprobs'] covers {t_logp.shape[1]} tokens but the student logits "
                         f"{n}; teacher and student must score the same sequence")
    _, _, params = batch_weights(data)
    losses = topk_token_losses(mode, student_logits, t_ids, t_logp, valid, params)
    # the marker proves to the final stage that these losses are ours (a fused-kernel path would bypass this stage
    # and hand over verl's forward-KL top-k losses under the same key)
    return {"distillation_losses": losses.float(), "agentcredit_topk": torch.ones_like(losses, dtype=torch.float32)}


def _topk_loss(config, distillation_config, model_output, data):
    """verl ``DistillationLossFn`` for the top-k modes: the per-token loss the logits-processor stage computed,
    ``[bsz, resp_len]``, times ``w_opd``."""
    from verl.workers.utils.padding import no_padding_2_padding

    if "agentcredit_topk" not in model_output:
        raise ValueError(f"{distillation_config.distillation_loss.loss_mode}: model_output has no agentcredit top-k "
                         f"losses; the logits-processor stage was bypassed (use_fused_kernels?); set "
                         f"actor_rollout_ref.model.use_fused_kernels=false")
    w_opd, _, _ = batch_weights(data)
    per_token = no_padding_2_padding(model_output["distillation_losses"], data)
    mask = data["response_mask"]
    mask = (mask.to_padded_tensor(0) if mask.is_nested else mask).bool()
    return per_token * w_opd, _metrics(per_token, mask, w_opd)


# ---- wraps of verl's distillation module ----------------------------------------------------------------------------
@wraps_once("distill", "compute_topk_loss",
            ("config", "distillation_config", "data", "student_logits", "data_format"))
def _wrap_compute_topk_loss(orig):
    def compute_topk_loss(config, distillation_config, data, student_logits, data_format):
        if _is_ours(distillation_config.distillation_loss.loss_mode):
            return _topk_logits_stage(config, distillation_config, data, student_logits)
        return orig(config, distillation_config, data, student_logits, data_format)

    return compute_topk_loss


@wraps_once("distill", "ppo_loss", ("config", "model_output", "data"))
def _wrap_ppo_loss(orig):
    """verl's ``ppo_loss`` as ``distillation_ppo_loss`` sees it: scaled by ``w_rl`` when our weights are present."""

    def ppo_loss(config, model_output, data, dp_group=None):
        loss, metrics = orig(config, model_output, data, dp_group)
        w_rl = _nt(data, W_RL_KEY)
        if w_rl is None:
            return loss, metrics
        metrics["distillation/agentcredit_w_rl"] = float(w_rl)
        return loss * float(w_rl), metrics

    return ppo_loss


def register_losses(module) -> list[str]:
    """Register our loss modes with verl's registry in ``module`` (``verl.trainer.distillation.losses``) and wrap
    its ``compute_topk_loss`` / ``ppo_loss``; names already registered to our functions are kept. Returns the names
    registered now."""
    check_signature(module.compute_topk_loss, "compute_topk_loss",
                    ("config", "distillation_config", "data", "student_logits", "data_format"))
    check_signature(module.ppo_loss, "ppo_loss", ("config", "model_output", "data"))
    new = []
    for names, fn, flags in ((ESTIMATOR_LOSSES, _estimator_loss, {"use_estimator": True}),
                             (TOPK_LOSSES, _topk_loss, {"use_topk": True})):
        todo = [n for n in names if n not in module.DISTILLATION_LOSS_REGISTRY]
        if todo:
            module.register_distillation_loss(module.DistillationLossSettings(names=todo, **flags))(fn)
            new += todo
    module.compute_topk_loss = _wrap_compute_topk_loss(module.compute_topk_loss)
    module.ppo_loss = _wrap_ppo_loss(module.ppo_loss)
    module.compute_distillation_loss_range = _wrap_loss_range(module.compute_distillation_loss_range)
    if new:
        logger.warning("agentcredit: registered verl distillation losses %s", new)
    return new


@wraps_once("distill_range", "compute_distillation_loss_range(distillation_losses, response_mask)",
            ("distillation_losses", "response_mask"))
def _wrap_loss_range(orig):
    """verl's min/max distillation-loss metrics over a micro-batch's response tokens, made safe for a micro-batch
    without any (verl 0.9.1 takes ``.min()`` of an empty tensor and fails): there they are +inf / -inf, the identity
    of their MIN / MAX aggregation over micro-batches. Such micro-batches are real: Guided-OPD's teacher turns and
    the bridge's padding rows have ``response_mask`` 0."""

    def compute_distillation_loss_range(distillation_losses, response_mask):
        mask = response_mask.bool().to_padded_tensor(False) if response_mask.is_nested else response_mask.bool()
        if bool(mask.any()):
            return orig(distillation_losses=distillation_losses, response_mask=response_mask)
        from verl.utils.metric import AggregationType, Metric

        return {"distillation/loss_min": Metric(AggregationType.MIN, math.inf),
                "distillation/loss_max": Metric(AggregationType.MAX, -math.inf)}

    return compute_distillation_loss_range


# ---- the scheduler, in the trainer process (SCHEDULER, PENDING, scheduler_for: agentcredit.verl.loop_common) --------


def gap_statistics(lp_teacher: torch.Tensor, lp_old: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """spec distill §2.3 logs: ``gap_abs_mean = mean|lp_T − lp_old|`` (TIDE's G_k over tokens) and
    ``gap_mean = mean(lp_T − lp_old)`` (= −tinker ``teacher_kl``) over valid tokens."""
    m = mask.bool()
    d = (lp_teacher.double() - lp_old.double())[m]
    if not d.numel():
        return {"gap_abs_mean": 0.0, "gap_mean": 0.0}
    return {"gap_abs_mean": float(d.abs().mean()), "gap_mean": float(d.mean())}


def _batch_view(tq, batch) -> dict[str, torch.Tensor] | None:
    """Per-row ``lp_teacher``, ``lp_old``, ``mask`` ``[B, R]`` of a v1 batch from the TransferQueue (padding rows
    masked out); None when the rows have no sampled-token teacher log-probs."""
    from verl.workers.utils.padding import no_padding_2_padding

    fields = ["teacher_logprobs", "old_log_probs", "response_mask", "prompts", "responses"]
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    teacher = no_padding_2_padding(data["teacher_logprobs"], data)
    if teacher.dim() == 3:
        if teacher.shape[-1] != 1:
            return None
        teacher = teacher.squeeze(-1)
    old = data["old_log_probs"]
    old = old.to_padded_tensor(0.0) if old.is_nested else old
    mask = data["response_mask"]
    mask = (mask.to_padded_tensor(0) if mask.is_nested else mask).bool()
    if batch.tags is not None:
        pad = torch.tensor([bool((t or {}).get("is_padding", False)) for t in batch.tags])
        mask = mask & ~pad.unsqueeze(-1)
    return {"lp_teacher": teacher.float(), "lp_old": old.float(), "mask": mask}


def schedule_step(trainer, batch, metrics: dict, tq=None) -> dict[str, Any] | None:
    """Run the scheduler for this step and return the ``extra_info`` entries (None: not an agentcredit loss)."""
    cfg = trainer.config
    dist = cfg.get("distillation", None)
    if dist is None or not dist.get("enabled", False):
        return None
    mode = dist.distillation_loss.loss_mode
    if not _is_ours(mode):
        return None
    block = distill_block(cfg)
    params = loss_params(block)
    sched = scheduler_for(block)
    step = int(trainer.global_steps) - 1
    view, stats = None, {}
    if mode in ESTIMATOR_LOSSES and tq is not None:
        view = _batch_view(tq, batch)
        if view is not None:
            stats = gap_statistics(view["lp_teacher"], view["lp_old"], view["mask"])
    # the decay horizon the agent loops use (Guided-OPD; other schedules ignore it)
    out = sched.on_batch(step, {**stats, "total_steps": horizon(cfg)}, view)
    if out.route is not None or out.token_weights is not None or out.token_weights_rl is not None:
        _warn_once("local", "agentcredit: scheduler %r returned per-row route/token weights; the verl distillation "
                   "bridge applies only its global w_opd/w_rl", sched.name)
    want = (out.params or {}).get("estimator")
    if want and mode in OPW_ESTIMATOR and OPW_ESTIMATOR[mode] != want:
        _warn_once("estimator", "agentcredit: scheduler %r asks for estimator %r but loss_mode is %r", sched.name,
                   want, mode)
    metrics.update({f"agentcredit_distill/{k}": v for k, v in stats.items()})
    if tq is not None:
        metrics.update({f"agentcredit_distill/{k}": float(v) for k, v in teacher_coverage(tq, batch).items()})
    metrics.update({"agentcredit_distill/w_opd": float(out.w_opd), "agentcredit_distill/w_rl": float(out.w_rl),
                    "agentcredit_distill/step": float(step)})
    metrics.update({k if "/" in k else f"agentcredit_distill/{k}": float(v) for k, v in (out.logs or {}).items()})
    return {STEP_KEY: step, W_OPD_KEY: float(out.w_opd), W_RL_KEY: float(out.w_rl), PARAMS_KEY: params}


#: the per-row extra field the agent-loop worker sets when the teacher scored a row (:func:`teacher_scored`)
SCORED_KEY = "agentcredit_teacher_scored"
#: extra field: the prompt + response tokens the teacher's server scored for the row (0 in validation)
TOKENS_KEY = "agentcredit_teacher_tokens"


def teacher_scored(output, prompt_len: int | None = None, response_len: int | None = None) -> bool:
    """Whether ``output``'s response tokens carry finite, non-zero teacher log-probs (``extra_fields
    ["teacher_logprobs"]`` ``[S, K]``, verl's one-token shift: row ``j`` holds the log-prob(s) of token ``j + 1``);
    verl pads a missing teacher with 0.0. Read in the agent-loop worker, where the tensor is at hand."""
    t = (output.extra_fields or {}).get("teacher_logprobs")
    if t is None:
        return False
    t = torch.as_tensor(t)
    p = len(output.prompt_ids) if prompt_len is None else int(prompt_len)
    r = len(output.response_ids) if response_len is None else int(response_len)
    t = t[max(p - 1, 0): p - 1 + r]
    return bool(t.numel()) and bool(torch.isfinite(t).all()) and bool((t != 0).any())


@wraps_once("distill_coverage",
            "AgentLoopWorker._compute_teacher_logprobs(self, output, prompt_ids, response_ids, validate, sample_kwargs)",
            ("self", "output", "prompt_ids", "response_ids", "validate", "sample_kwargs"))
def wrap_compute_teacher_logprobs(orig):
    """``_compute_teacher_logprobs``: verl's code, then the row's :data:`SCORED_KEY` extra field (with distillation
    on), so the trainer's coverage metric reads one bool per row instead of every row's teacher log-probs, and
    :data:`TOKENS_KEY`, the tokens that request sent the teacher to score (its traffic)."""

    async def _compute_teacher_logprobs(self, output, prompt_ids, response_ids, validate, sample_kwargs=None):
        result = await orig(self, output, prompt_ids=prompt_ids, response_ids=response_ids, validate=validate,
                            sample_kwargs=sample_kwargs)
        if getattr(self, "distillation_enabled", False):
            output.extra_fields[SCORED_KEY] = teacher_scored(output, len(prompt_ids), len(response_ids))
            # the traffic to the teacher's server: one request scoring the row's prompt and response tokens
            output.extra_fields[TOKENS_KEY] = len(prompt_ids) + len(response_ids) if not validate else 0
        return result

    return _compute_teacher_logprobs


def teacher_coverage(tq, batch) -> dict[str, int]:
    """``{"teacher_rows", "rows", "teacher_tokens"}`` of a v1 batch: non-padding rows whose response tokens carry
    finite, non-zero teacher log-probs (the :data:`SCORED_KEY` flag the agent-loop worker set,
    :func:`wrap_compute_teacher_logprobs`), all non-padding rows, and the tokens the teacher's server scored for
    the non-padding rows (:data:`TOKENS_KEY`: the step's teacher log-prob traffic). Reads the rows'
    ``extra_fields`` only (what the credit bridge reads anyway), never the teacher log-probs themselves (``[S, K]``
    per row: gigabytes per step at top-k scale); rows without the flag (written without the hook) count as
    unscored."""
    pad = [bool((t or {}).get("is_padding", False)) for t in batch.tags] if batch.tags is not None else None
    rows = len(batch.keys) - (sum(pad) if pad else 0)
    try:
        extra = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                select_fields=["extra_fields"])["extra_fields"]
        extra = extra.tolist() if hasattr(extra, "tolist") else list(extra)
    except Exception as e:  # noqa: BLE001  (a metric never stops the step; bad teacher data fails in the loss)
        _warn_once("coverage", "agentcredit: could not read the rows' extra_fields for "
                   "agentcredit_distill/teacher_rows: %r", e)
        return {"teacher_rows": 0, "rows": rows, "teacher_tokens": 0}
    kept = [e for i, e in enumerate(extra) if not (pad and pad[i]) and isinstance(e, Mapping)]
    scored = sum(1 for e in kept if bool(e.get(SCORED_KEY, False)))
    tokens = sum(int(e.get(TOKENS_KEY, 0) or 0) for e in kept)
    return {"teacher_rows": scored, "rows": rows, "teacher_tokens": tokens}


# ---- every output of a multi-output agent loop goes to the teacher (see the module doc) -----------------------------
async def score_earlier_outputs(worker, output, validate, kwargs: Mapping[str, Any]) -> int:
    """Teacher log-probs for every output but the last (verl scores that one); returns how many were scored."""
    if not getattr(worker, "distillation_enabled", False) or validate or not isinstance(output, list):
        return 0
    earlier = output[:-1]
    if not earlier:
        return 0
    await asyncio.gather(*(worker._compute_teacher_logprobs(o, prompt_ids=o.prompt_ids, response_ids=o.response_ids,
                                                            validate=validate, sample_kwargs=dict(kwargs))
                           for o in earlier))
    return len(earlier)


@wraps_once("distill", "AgentLoopWorkerTQ._agent_loop_postprocess(self, output, validate, **kwargs)",
            ("self", "output", "validate"))
def wrap_agent_loop_postprocess(orig):
    """``AgentLoopWorkerTQ._agent_loop_postprocess``: score the earlier outputs, then verl's code (the last one)."""

    async def _agent_loop_postprocess(self, output, validate, **kwargs):
        await score_earlier_outputs(self, output, validate, kwargs)
        return await orig(self, output, validate, **kwargs)

    return _agent_loop_postprocess


def _patch_agent_loop_tq(module) -> None:
    check_signature(getattr(module.AgentLoopWorker, "_compute_teacher_logprobs", None),
                    "AgentLoopWorker._compute_teacher_logprobs(self, output, prompt_ids, response_ids, validate, "
                    "sample_kwargs)", ("self", "output", "prompt_ids", "response_ids", "validate", "sample_kwargs"))
    actor = module.AgentLoopWorkerTQ
    meta = getattr(actor, "__ray_metadata__", None)
    classes = [actor] if meta is None else [meta.modified_class, meta.modified_class.__ray_actor_class__]
    name = "_agent_loop_postprocess"
    if not any(name in cls.__dict__ for cls in classes):
        raise VerlInternalsChanged(f"agentcredit: verl's AgentLoopWorkerTQ has no {name}; this bridge supports "
                                   f"{SUPPORTED}")
    for cls in classes:
        if name in cls.__dict__:
            setattr(cls, name, wrap_agent_loop_postprocess(cls.__dict__[name]))
    for cls in classes:  # the coverage flag of each row (teacher_coverage)
        setattr(cls, "_compute_teacher_logprobs", wrap_compute_teacher_logprobs(cls._compute_teacher_logprobs))
    for cls in classes:  # Guided-OPD: the session's teacher, for the agent loop
        if getattr(cls, "_run_agent_loop", None) is None:
            raise VerlInternalsChanged(f"agentcredit: verl's AgentLoopWorkerTQ has no _run_agent_loop; this bridge "
                                       f"supports {SUPPORTED}")
        setattr(cls, "_run_agent_loop", wrap_run_agent_loop(cls._run_agent_loop))


@wraps_once("distill", "PPOTrainer._update_actor(self, batch, metrics)", ("self", "batch", "metrics"))
def wrap_update_actor(orig):
    """``PPOTrainer._update_actor(self, batch, metrics)``: schedule, then write step and weights to extra_info."""

    def _update_actor(self, batch, metrics):
        import transfer_queue as tq

        info = schedule_step(self, batch, metrics, tq)
        if info is not None:
            batch.extra_info.update(copy.deepcopy(info))
        return orig(self, batch, metrics)

    return _update_actor


def _scheduler_state():
    sched = SCHEDULER.get("instance")
    return None if sched is None else sched.state_dict()


def _restore(state, path: str) -> None:
    if SCHEDULER.get("instance") is not None:
        SCHEDULER["instance"].load_state_dict(state)
    else:
        PENDING["state"] = state
    logger.warning("agentcredit: restored the %r scheduler state from %s", state.get("scheduler"), path)


#: after verl saves / resumes a checkpoint, the scheduler's ``state_dict()`` is saved / restored beside it
wrap_save_checkpoint, wrap_load_checkpoint = checkpoint_wraps("distill", STATE_FILE, _scheduler_state, _restore)


def _patch_v1_trainer(module) -> None:
    cls = module.PPOTrainer
    cls._update_actor = wrap_update_actor(cls.__dict__.get("_update_actor"))
    cls._save_checkpoint = wrap_save_checkpoint(cls.__dict__.get("_save_checkpoint"))
    cls._load_checkpoint = wrap_load_checkpoint(cls.__dict__.get("_load_checkpoint"))
    # refuse an unrunnable guided schedule before rollouts
    cls._load_checkpoint = guided_wrap_load_checkpoint(cls._load_checkpoint)


TARGETS = {
    "verl.trainer.distillation.losses": register_losses,
    "verl.trainer.ppo.v1.trainer_base": _patch_v1_trainer,
    "verl.trainer.ppo.v1.agent_loop_tq": _patch_agent_loop_tq,
}


def install() -> None:
    """Register the post-import hooks (they run at once for modules already imported)."""
    install_post_import_hooks(TARGETS, "the agentcredit distillation losses and schedules are not available")
