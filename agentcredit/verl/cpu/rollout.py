"""The ``hfcpu`` rollout backend: Hugging Face ``transformers`` sampling on the CPU behind verl's server API.

Three parts, as verl's own backends (vllm, sglang, trtllm) have them:

* :class:`HFCPUReplica` (``RolloutReplicaRegistry``, name ``hfcpu``): in hybrid mode (the sync trainer's) it starts
  one :class:`HFCPUServer` Ray actor per replica, named ``agentcredit_hfcpu_server_<rank>``, with no resource request
  of its own (it shares the CPU with the trainer).
* :class:`HFCPUServer`: the async ``generate(request_id, prompt_ids, sampling_params, ...)`` that verl's
  ``LLMServerClient`` calls; it samples with the model's KV cache, one request at a time (a lock), and returns a
  ``TokenOutput`` with the token ids and their log-probs under ``log_softmax(logits / temperature)`` (what verl's
  trainer recomputes, so ``training/rollout_probs_diff_*`` measures weight sync); ``extra_fields["global_steps"]`` is
  the weight version. ``top_k`` / ``top_p`` restrict sampling only.
* the distillation teacher: a replica with ``is_teacher_model`` (verl's ``TeacherModelManager`` builds it from
  ``distillation.teacher_models.<key>.inference.name=hfcpu``) starts a server named ``..._teacher<suffix>`` that
  answers verl's ``prompt_logprobs`` request (:func:`score_prompt`, vLLM's layout); it never gets weight updates.
* :class:`HFCPUServerAdapter` (the worker side, ``_ROLLOUT_REGISTRY[("hfcpu", "async")]``): ``update_weights`` pushes
  the trainer's full tensors to the server after every step (``load_state_dict``; an unknown name is an error).

Limits: one sequence at a time (no batching, no paged KV cache), fp32, text only (no multimodal inputs, no LoRA
adapters, no prefix caching, no partial rollout / abort beyond returning what was generated); a tiny model makes it
fast enough for 2-step smoke runs and CI, a 135M model for a laptop demo, nothing larger.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

logger = logging.getLogger("agentcredit")

NAME = "hfcpu"
SERVER_PREFIX = "agentcredit_hfcpu_server_"


def server_name(replica_rank: int) -> str:
    return f"{SERVER_PREFIX}{int(replica_rank)}"


def _eos_ids(model) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def sample_tokens(model, prompt_ids: list[int], max_tokens: int, temperature: float = 1.0, top_k: int = -1,
                  top_p: float = 1.0, eos_ids: set[int] | None = None, ignore_eos: bool = False,
                  generator: torch.Generator | None = None) -> tuple[list[int], list[float], str]:
    """Sample up to ``max_tokens`` tokens after ``prompt_ids``; returns ``(token_ids, log_probs, stop_reason)``.

    ``log_probs[i]`` is ``log_softmax(logits / T)[token_i]`` (``T = 1`` for greedy ``temperature <= 0``), the
    quantity verl's actor recomputes; ``top_k`` (``-1``/``0``: off) and ``top_p`` only restrict where it samples.
    """
    eos_ids = set() if eos_ids is None else eos_ids
    greedy = temperature is None or float(temperature) <= 0.0
    scale = 1.0 if greedy else float(temperature)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    past = None
    out_ids: list[int] = []
    out_lp: list[float] = []
    with torch.no_grad():
        for _ in range(int(max_tokens)):
            res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1].float() / scale
            logp = torch.log_softmax(logits, dim=-1)
            if greedy:
                tok = int(torch.argmax(logits))
            else:
                probs = logp.exp()
                if top_k is not None and 0 < int(top_k) < probs.numel():
                    kth = torch.topk(probs, int(top_k)).values[-1]
                    probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
                if top_p is not None and float(top_p) < 1.0:
                    sorted_p, order = torch.sort(probs, descending=True)
                    keep = torch.cumsum(sorted_p, 0) - sorted_p < float(top_p)
                    mask = torch.zeros_like(probs, dtype=torch.bool)
                    mask[order[keep]] = True
                    probs = torch.where(mask, probs, torch.zeros_like(probs))
                tok = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
            out_ids.append(tok)
            out_lp.append(float(logp[tok]))
            if tok in eos_ids and not ignore_eos:
                return out_ids, out_lp, "completed"
            ids = torch.tensor([[tok]], dtype=torch.long)
    return out_ids, out_lp, "length"


def score_prompt(model, prompt_ids: list[int], num_logprobs: int) -> tuple[list[int], list[float], dict[str, Any]]:
    """The teacher's answer to verl's ``prompt_logprobs`` request, in vLLM's layout (verl's
    ``extract_prompt_logprobs``): ``extra["prompt_ids"]`` / ``extra["prompt_logprobs"]`` are ``[S, max(K, 1)]`` for
    the ``S`` prompt tokens, row ``j`` the log-prob(s) of token ``j + 1`` given tokens ``0..j`` under
    ``log_softmax(logits)`` (temperature 1): with ``K = 0`` the actual next token's, with ``K > 0`` the model's top-K
    (ids and log-probs, by rank); the last row is vLLM's dummy ``0``. Also returns one greedy token after the prompt
    (verl asks for ``max_tokens=1``) and its log-prob."""
    k = int(num_logprobs)
    with torch.no_grad():
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # [S, V]
    nxt = ids[0, 1:]
    if k == 0:
        top_ids = nxt.unsqueeze(-1)
        top_lp = logp[:-1].gather(-1, top_ids)
    else:
        top = torch.topk(logp[:-1], min(k, logp.shape[-1]), dim=-1)
        top_ids, top_lp = top.indices, top.values
    width = top_ids.shape[-1]
    top_ids = torch.cat([top_ids, torch.zeros(1, width, dtype=top_ids.dtype)]).tolist()
    top_lp = torch.cat([top_lp, torch.zeros(1, width, dtype=top_lp.dtype)]).tolist()
    tok = int(torch.argmax(logp[-1]))
    return [tok], [float(logp[-1, tok])], {"prompt_ids": top_ids, "prompt_logprobs": top_lp}


class HFCPUServer:
    """One CPU generation server (a Ray actor; see the module doc)."""

    def __init__(self, config, model_config, replica_rank: int = 0):
        from transformers import AutoModelForCausalLM

        self.config = config
        self.replica_rank = int(replica_rank)
        path = getattr(model_config, "local_path", None) or model_config.path
        trust = bool(getattr(model_config, "trust_remote_code", False))
        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=trust)
        self.model.eval()
        self.eos_ids = _eos_ids(self.model)
        self.global_steps: int | None = None
        self.generator = torch.Generator().manual_seed(int(getattr(config, "seed", 0) or 0) + self.replica_rank)
        self.lock = asyncio.Lock()
        self.updates = 0

    def _max_model_len(self) -> int:
        """verl's ``max_model_len`` rule: the configured one, else the model's ``max_position_embeddings`` (else
        ``prompt_length + response_length``)."""
        cfg = self.config
        configured = getattr(cfg, "max_model_len", None)
        if configured is not None:
            return int(configured)
        positions = getattr(self.model.config, "max_position_embeddings", None)
        return int(positions) if positions else int(cfg.prompt_length) + int(cfg.response_length)

    def _max_tokens(self, sampling_params: dict[str, Any], prompt_len: int) -> int:
        """How many tokens a request may generate, as verl's vLLM server decides it (``vLLMHttpServer.generate``):
        the request's ``max_tokens`` (or ``max_new_tokens``) when given, **not** capped by this replica's
        ``response_length`` (Guided-OPD's teacher, whose replica verl gives ``response_length = 1``, asks for a
        policy turn's budget); else ``min(response_length, prompt_length + response_length - prompt_len)``; then
        clamped to ``[1, max_model_len - prompt_len]``."""
        cfg = self.config
        room = self._max_model_len() - prompt_len
        if room < 1:
            raise ValueError(f"hfcpu: prompt length ({prompt_len}) leaves no room to generate within the model's "
                             f"maximum context length ({self._max_model_len()})")
        if sampling_params.get("max_tokens") is not None:
            wanted = int(sampling_params.pop("max_tokens"))
        elif sampling_params.get("max_new_tokens") is not None:
            wanted = int(sampling_params.pop("max_new_tokens"))
        else:
            wanted = min(int(cfg.response_length), int(cfg.prompt_length) + int(cfg.response_length) - prompt_len)
        sampling_params.pop("max_tokens", None)
        sampling_params.pop("max_new_tokens", None)
        return max(1, min(wanted, room))

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, **kwargs: Any) -> TokenOutput:
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise NotImplementedError("the hfcpu rollout backend is text only")
        params = dict(sampling_params or {})
        if params.get("prompt_logprobs") is not None:  # the distillation teacher's request (one forward pass)
            async with self.lock:
                ids, lps, extra = await asyncio.to_thread(score_prompt, self.model, list(prompt_ids),
                                                          int(params["prompt_logprobs"]))
            extra["global_steps"] = self.global_steps
            return TokenOutput(token_ids=ids, log_probs=lps, stop_reason="length", num_preempted=0,
                               extra_fields=extra)
        max_tokens = self._max_tokens(params, len(prompt_ids))
        want_logprobs = params.get("logprobs") not in (None, False)
        async with self.lock:
            ids, lps, stop = await asyncio.to_thread(
                sample_tokens, self.model, list(prompt_ids), max_tokens, params.get("temperature", 1.0),
                params.get("top_k", -1), params.get("top_p", 1.0), self.eos_ids,
                bool(params.get("ignore_eos", False)), self.generator)
        return TokenOutput(token_ids=ids, log_probs=lps if want_logprobs else None, stop_reason=stop,
                           num_preempted=0, extra_fields={"global_steps": self.global_steps})

    async def update_weights(self, state: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Load the trainer's full tensors; returns how many were loaded."""
        async with self.lock:
            result = self.model.load_state_dict(state, strict=False)
            if result.unexpected_keys:
                raise KeyError(f"hfcpu: the trainer sent weights the rollout model does not have: "
                               f"{result.unexpected_keys[:5]}")
            if global_steps is not None:
                self.global_steps = int(global_steps)
            self.updates += 1
        return len(state)

    async def state(self) -> dict[str, Any]:
        return {"global_steps": self.global_steps, "updates": self.updates}

    # control methods verl's replica / checkpoint manager call; nothing to free or restore on the CPU
    async def wake_up(self, *args, **kwargs):
        return None

    async def sleep(self, *args, **kwargs):
        return None

    async def clear_kv_cache(self, *args, **kwargs):
        return None

    async def release_kv_cache(self, *args, **kwargs):
        return None

    async def resume_kv_cache(self, *args, **kwargs):
        return None

    async def abort_all_requests(self, *args, **kwargs):
        return None

    async def resume_generation(self, *args, **kwargs):
        return None

    async def start_profile(self, *args, **kwargs):
        return None

    async def stop_profile(self, *args, **kwargs):
        return None


class HFCPUReplica(RolloutReplica):
    """Replica of the ``hfcpu`` backend: one :class:`HFCPUServer` actor (see the module doc)."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self):
        if self.is_reward_model:
            raise NotImplementedError("hfcpu serves the policy (and a teacher) only, not a generative reward model")
        kind = "teacher" if self.is_teacher_model else "policy"
        name = server_name(self.replica_rank) + ("_teacher" if self.is_teacher_model else "") + self.name_suffix
        actor_cls = ray.remote(HFCPUServer)
        server = actor_cls.options(name=name, num_cpus=0, max_concurrency=self.max_concurrency,
                                   get_if_exists=True).remote(self.config, self.model_config, self.replica_rank)
        await server.state.remote()  # wait for the model to load
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"hfcpu://{name}"
        logger.warning("agentcredit: hfcpu %s rollout server %s is up", kind, name)


class HFCPUServerAdapter(BaseRollout):
    """Worker-side ``hfcpu`` rollout: pushes the trainer's weights to its replica's server."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        self.sleep_level = 2
        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.replica_rank = rank // world
        self.is_leader = rank % world == 0
        self._server = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"hfcpu takes full named tensors, not wire_format={wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("hfcpu does not serve LoRA adapters; set model.lora.merge=true")
        state = {name: t.detach().to("cpu", torch.float32).clone() for name, t in weights}
        if self.is_leader:
            await self._server_handle().update_weights.remote(state, kwargs.get("global_steps"))
