"""agentcredit.verl.agent_loop's agent loop against the real verl 0.9.1 on CPU.

Real: verl's agent-loop registry and hydra instantiation (``AgentLoopWorker._run_agent_loop``), the Continuous
Token builder (chat template), ``AgentLoopWorkerTQ._agent_loop_postprocess`` and its scoring / position-id helpers
writing into a real TransferQueue, ``PPOTrainer._compute_advantage`` with ``adv_estimator=gigpo`` (the agentcredit
bridge), verl's batch padding, a real (tiny, random) Qwen2 model and BPE tokenizer built here, MiniGrid.
Stand-in: the rollout server (verl's need CUDA/vLLM): ``HFServer.generate`` has ``LLMServerClient.generate``'s
signature and runs ``model.generate`` (or tokenizes scripted action texts).
"""

import asyncio
import functools
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="the [verl] extra is not installed")
pytest.importorskip("minigrid", reason="the [envs] extra is not installed")

import verl  # noqa: E402,F401  (loads the credit bridge through the verl.plugins entry point)
from omegaconf import OmegaConf  # noqa: E402

import env_adapters  # noqa: E402
from env_adapters.prompting import build_prompt, format_action  # noqa: E402

pytestmark = pytest.mark.verl

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ENV_OPTIONS = {"size": 5}
SEED = 3
PROMPT_LEN, RESPONSE_LEN = 1024, 24
CONTRACT = ("step_idx", "anchor_key", "action_key", "step_reward", "success", "truncated", "reward_extra_info")


# ---- a tiny real model and tokenizer, built locally -------------------------------------------------------
def _corpus():
    env = env_adapters.make("minigrid", **ENV_OPTIONS)
    texts = []
    for seed in range(6):
        obs = env.reset(seed)
        texts.append(build_prompt(env.task, [(obs, "turn left")], obs, env.legal_actions()))
    texts += [format_action(a, think="the goal is ahead") for a in env.legal_actions()] * 4
    return texts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, chat_template=CHATML)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_and_tokenizer(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


class HFServer:
    """The one stand-in: ``LLMServerClient.generate``'s signature, backed by ``model.generate`` (or a script of
    action texts, tokenized, for episodes with valid actions)."""

    def __init__(self, model, tokenizer, script=None, raw=False):
        self.model, self.tokenizer = model, tokenizer
        self.script = None if script is None else iter(script)
        self.raw = raw  # script items are whole response texts, returned verbatim
        self.calls = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None,
                       audio_data=None, mm_processor_kwargs=None, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids),
                           "sampling_params": dict(sampling_params), **kwargs})
        eos = self.tokenizer.eos_token_id
        if self.script is not None:
            action = next(self.script)
            if action == "":  # an empty generation
                return TokenOutput(token_ids=[])
            if self.raw:
                text = action
            else:
                text = "I do not know" if action is None else format_action(action, think="scripted")
            return TokenOutput(token_ids=self.tokenizer.encode(text, add_special_tokens=False) + [eos])
        temperature = float(sampling_params.get("temperature", 1.0))
        gen = dict(max_new_tokens=int(sampling_params.get("max_tokens", RESPONSE_LEN)), eos_token_id=eos,
                   pad_token_id=self.tokenizer.pad_token_id, do_sample=temperature > 0)
        if temperature > 0:
            top_k = int(sampling_params.get("top_k", -1))
            gen.update(temperature=temperature, top_p=float(sampling_params.get("top_p", 1.0)),
                       top_k=top_k if top_k > 0 else 0)
        with torch.no_grad():
            out = self.model.generate(torch.tensor([list(prompt_ids)]), return_dict_in_generate=True,
                                      output_logits=True, **gen)
        token_ids = out.sequences[0, len(prompt_ids):]
        log_probs = None
        if sampling_params.get("logprobs"):  # the logprob of each sampled token under the unwarped logits
            logits = torch.stack(out.logits, dim=1)[0].float()
            log_probs = torch.log_softmax(logits, -1).gather(-1, token_ids[:, None])[:, 0].tolist()
        return TokenOutput(token_ids=token_ids.tolist(), log_probs=log_probs, stop_reason="completed")


def _config(step_weight=0.5, logprobs=False):
    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"n": 2, "prompt_length": PROMPT_LEN, "response_length": RESPONSE_LEN,
                                          "temperature": 1.0, "top_p": 1.0, "top_k": -1, "full_determinism": False,
                                          "calculate_log_probs": logprobs}},
        "data": {"apply_chat_template_kwargs": {}},
        "algorithm": {"adv_estimator": "gigpo", "gamma": 1.0, "lam": 1.0, "use_kl_in_reward": False,
                      "norm_adv_by_std_in_grpo": True, "gigpo": {"step_weight": step_weight}},
    })


def _fake_worker(config, server, tokenizer, teacher=None):
    """An ``AgentLoopWorkerTQ`` without its constructor (which loads the model config and starts ray clients): the
    attributes its methods read, and its real methods ``_run_agent_loop``, ``_agent_loop_postprocess``,
    ``_compute_score`` (no reward workers: the loop scores itself), ``_compute_teacher_logprobs`` (distillation
    off), ``_compute_multi_modal_inputs`` and ``_compute_position_ids`` (no processor: text only)."""
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
    from verl.utils.dataset.rl_dataset import RLHFDataset

    worker_cls = AgentLoopWorkerTQ.__ray_metadata__.modified_class
    fake = types.SimpleNamespace(config=config, llm_client=server, tokenizer=tokenizer, processor=None,
                                 hf_model_type="qwen2", dataset_cls=RLHFDataset, tools=[], mm_processor_kwargs={},
                                 reward_loop_worker_handles=None, distillation_enabled=False,
                                 teacher_client=None if teacher is None else {"teacher": teacher})
    for name in ("_run_agent_loop", "_agent_loop_postprocess", "_compute_score", "_compute_teacher_logprobs",
                 "_compute_multi_modal_inputs", "_compute_position_ids", "_get_mm_processor_kwargs"):
        setattr(fake, name, functools.partial(getattr(worker_cls, name), fake))
    return fake


def _rollout_group(config, servers, tokenizer, uid, max_steps=None, agent_name="agentcredit_env", teacher=None,
                   validate=False, global_steps=1, **fields):
    """``rollout.n`` sessions of one prompt, as ``AgentLoopWorkerTQ._run_prompt`` starts them (each through the
    real ``AgentLoopWorker._run_agent_loop``: registry lookup, hydra instantiation, run, post-processing)."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    import agentcredit.verl.loops  # noqa: F401  (registers agentcredit_env)

    assert agent_name in _agent_loop_registry
    prompt = dict(uid=uid, global_steps=global_steps, index=0, data_source="minigrid", agent_name=agent_name,
                  raw_prompt=[{"role": "system", "content": "You play grid games."}])
    prompt.update(fields or dict(env_name="minigrid", env_options=dict(ENV_OPTIONS), seed=SEED,
                                 extra_info={"max_steps": max_steps}))
    rollout = config.actor_rollout_ref.rollout
    sampling = dict(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                    repetition_penalty=1.0, logprobs=rollout.calculate_log_probs)

    async def run_all():
        tasks = [_fake_worker(config, server, tokenizer, teacher)._run_agent_loop(
            sampling, {"step": 1, "sample_index": 0, "rollout_n": i, "validate": validate}, trace=False,
            session_id=i, **prompt) for i, server in enumerate(servers)]
        await asyncio.gather(*tasks)

    asyncio.run(run_all())


def _run_advantage(tq, keys, tags, config):
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    metrics = {}
    batch = KVBatchMeta(partition_id="train", keys=list(keys), tags=list(tags))
    PPOTrainer._compute_advantage(types.SimpleNamespace(config=config), batch, metrics=metrics)
    adv = tq.kv_batch_get(keys=list(keys), partition_id="train", select_fields=["advantages"])["advantages"]
    return list(adv.unbind(0)), metrics


def _rows(tq, uid, n_sessions, partition="train"):
    """The stored rows of ``uid``: ``{session: [row dict, ...]}`` found by probing the ``{uid}_{s}_{i}`` keys."""
    out = {}
    for s in range(n_sessions):
        rows, i = [], 0
        while True:
            key = f"{uid}_{s}_{i}"
            try:
                data = tq.kv_batch_get(keys=[key], partition_id=partition,
                                       select_fields=["extra_fields", "rm_scores", "responses", "response_mask"])
            except Exception:
                break
            ef = data["extra_fields"]
            ef = ef.tolist() if hasattr(ef, "tolist") else list(ef)
            rows.append({"key": key, "extra": ef[0], "rm_scores": data["rm_scores"][0],
                         "response_mask": data["response_mask"][0], "responses": data["responses"][0]})
            i += 1
            if ef[0]["step_idx"] != i - 1 or i > 50:
                raise AssertionError(f"row {key} has step_idx {ef[0]['step_idx']}")
        out[s] = rows
    return out


def _rows_from_config_file(tq, tmp_path, name, options, servers, tok, uid, config=None, **fields):
    """The stored rows of one group played by the loop that an agent-loop config file entry defines (``name``,
    ``EnvAgentLoop`` on a 5x5 MiniGrid, plus the YAML lines ``options``), registered as ``AgentLoopWorker.__init__``
    registers the entries of ``agent_loop_config_path``."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    path = tmp_path / "agent_loops.yaml"
    path.write_text(f"- name: {name}\n  _target_: agentcredit.verl.agent_loop.EnvAgentLoop\n  env_name: minigrid\n"
                    f"  env_options: {{size: 5}}\n{options}")
    for cfg in OmegaConf.load(path):
        _agent_loop_registry[cfg.name] = cfg
    try:
        _rollout_group(config or _config(), servers, tok, uid=uid, agent_name=name, **fields)
        return _rows(tq, uid, len(servers))
    finally:
        _agent_loop_registry.pop(name, None)


def _bfs_plan(env, seed):
    """Shortest list of legal actions from reset(seed) to the goal (snapshot/restore search)."""
    from collections import deque

    env.reset(seed)
    queue, seen = deque([(env.snapshot(), [])]), {env.state_key()}
    while queue:
        snap, plan = queue.popleft()
        for a in env.legal_actions():
            env.restore(snap)
            r = env.step(a)
            if r.success:
                return plan + [a]
            if not r.done and env.state_key() not in seen:
                seen.add(env.state_key())
                queue.append((env.snapshot(), plan + [a]))
    raise AssertionError("no plan")


# ---- tests -------------------------------------------------------------------------------------------------
def test_import_env_adapters_does_not_need_the_verl_loop_and_verl_can_load_it():
    import subprocess
    import sys

    code = "import sys, env_adapters; print('agentcredit.verl.agent_loop' in sys.modules, 'verl' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.stdout.strip().splitlines()[-1] == "False False"
    # and verl loads it by name from VERL_USE_EXTERNAL_MODULES (the agent-loop workers' route to the registry)
    code = ("import verl\nfrom verl.experimental.agent_loop.agent_loop import _agent_loop_registry as r\n"
            "print(r['agentcredit_env'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=dict(os.environ, VERL_USE_EXTERNAL_MODULES="agentcredit.verl.loops",
                                   PYTHONWARNINGS="ignore"))
    assert proc.stdout.strip().splitlines()[-1] == "{'_target_': 'agentcredit.verl.agent_loop.EnvAgentLoop'}"


def _check_contract(rows, max_steps):
    for s, steps in rows.items():
        assert 1 <= len(steps) <= max_steps
        last = steps[-1]["extra"]
        total = sum(r["extra"]["step_reward"] for r in steps)
        for i, r in enumerate(steps):
            e = r["extra"]
            assert r["key"].endswith(f"_{s}_{i}")
            assert set(CONTRACT) <= set(e), sorted(e)
            assert e["step_idx"] == i and isinstance(e["anchor_key"], str)
            assert e["valid"] == (e["action_key"] is not None)
            assert e["success"] == last["success"] and e["truncated"] == last["truncated"]
            assert e["reward_extra_info"] == last["reward_extra_info"]
            assert e["reward_extra_info"]["episode_steps"] == len(steps)
            # the final reward (the episode return) on the last step; verl copies it to the earlier rows
            assert float(r["rm_scores"].sum()) == pytest.approx(total)
            assert r["responses"].shape == r["response_mask"].shape
        assert last["reward_extra_info"]["episode_return"] == pytest.approx(total)
        assert last["reward_extra_info"]["success"] == float(last["success"])
        assert last["truncated"] == (not last["success"] and len(steps) == max_steps)
    # the same keys on every row (verl's padding copies the first row's extra_fields)
    assert len({frozenset(r["extra"]) for steps in rows.values() for r in steps}) == 1


def _keys(rows):
    return [r["key"] for s in sorted(rows) for r in rows[s]]


def _check_padding(tq, keys, config, adv, eos, n_pad=3):
    """verl's batch balancing on these rows: padding rows (the first row as template) get advantage 0, the real
    rows keep theirs."""
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size

    batch = KVBatchMeta(partition_id="train", keys=keys, tags=[{"status": "success"}] * len(keys))
    batch = upsample_batch_to_divisible_size(batch, batch_multiple=len(keys) + n_pad, eos_token_id=eos)
    assert len(batch.keys) == len(keys) + n_pad and all(t["is_padding"] for t in batch.tags[len(keys):])
    adv_p, metrics = _run_advantage(tq, batch.keys, batch.tags, config)
    per_row = torch.stack([a[0] for a in adv_p])
    assert torch.all(per_row[len(keys):] == 0) and metrics["agentcredit/padding_rows"] == n_pad
    assert torch.allclose(per_row[: len(keys)], torch.stack([a[0] for a in adv]), atol=1e-6)


def test_random_model_rollouts_through_verl_postprocess_and_gigpo(transfer_queue, model_and_tokenizer):
    model, tok = model_and_tokenizer
    torch.manual_seed(1)
    config = _config(logprobs=True)
    servers = [HFServer(model, tok) for _ in range(2)]
    _rollout_group(config, servers, tok, uid="rand", max_steps=3)
    rows = _rows(transfer_queue, "rand", 2)
    _check_contract(rows, max_steps=3)
    for s, steps in rows.items():
        assert len(servers[s].calls) == len(steps)  # one model call per step
        for call, r in zip(servers[s].calls, steps):
            assert 1 <= int(r["response_mask"].sum()) <= RESPONSE_LEN  # the model's own tokens
            # the prompt of the turn went through the chat template, with the system message
            text = tok.decode(call["prompt_ids"])
            assert text.startswith("<|im_start|>system\nYou play grid games.<|im_end|>\n<|im_start|>user\n")
            assert text.endswith("<|im_start|>assistant\n")
            assert f"You are now at step {r['extra']['step_idx'] + 1} " in text
        assert len({c["request_id"] for c in servers[s].calls}) == 1  # one sticky request id per episode
    # first rows: the reset state, the same in both sessions (one GiGPO step group)
    assert rows[0][0]["extra"]["anchor_key"] == rows[1][0]["extra"]["anchor_key"]
    # rollout logprobs (rollout.calculate_log_probs) reach TransferQueue, one per response token
    keys = _keys(rows)
    lp = transfer_queue.kv_batch_get(keys=keys, partition_id="train", select_fields=["rollout_log_probs"])
    for r, row_lp in zip([r for s in sorted(rows) for r in rows[s]], lp["rollout_log_probs"].unbind(0)):
        assert row_lp.shape == r["responses"].shape and torch.all(row_lp <= 0)

    adv, metrics = _run_advantage(transfer_queue, keys, [{"status": "success"}] * len(keys), config)
    assert len(adv) == len(keys) and all(torch.isfinite(a).all() for a in adv)
    assert metrics["agentcredit/steps"] == len(keys) and metrics["agentcredit/trajectories"] == 2
    _check_padding(transfer_queue, keys, config, adv, tok.eos_token_id)


def test_scripted_valid_rollouts_give_step_level_advantages(transfer_queue, model_and_tokenizer):
    model, tok = model_and_tokenizer
    env = env_adapters.make("minigrid", **ENV_OPTIONS)
    plan = _bfs_plan(env, SEED)
    max_steps = len(plan) + 2
    assert len(plan) >= 2
    # session 0 solves the room; session 1 starts with an invalid answer, then turns in place until the limit
    config = _config()
    servers = [HFServer(model, tok, plan), HFServer(model, tok, [None] + ["turn left"] * (max_steps - 1))]
    _rollout_group(config, servers, tok, uid="script", max_steps=max_steps)
    rows = _rows(transfer_queue, "script", 2)
    _check_contract(rows, max_steps)
    win, lose = rows[0], rows[1]
    assert len(win) == len(plan) and win[-1]["extra"]["success"] and not win[-1]["extra"]["truncated"]
    assert [r["extra"]["action_key"] for r in win] == plan
    assert [r["extra"]["step_reward"] for r in win] == [0.0] * (len(plan) - 1) + [10.0]
    assert len(lose) == max_steps and lose[-1]["extra"]["truncated"] and not lose[-1]["extra"]["success"]
    assert lose[0]["extra"]["action_key"] is None and lose[0]["extra"]["step_reward"] == pytest.approx(-0.1)
    assert lose[1]["extra"]["anchor_key"] == lose[0]["extra"]["anchor_key"]  # an invalid step leaves the state
    assert float(win[0]["rm_scores"].sum()) == 10.0
    # the response tokens are the scripted text, all of them the model's (mask 1)
    assert bool(win[0]["response_mask"].all())
    assert tok.decode(win[0]["responses"], skip_special_tokens=True) == format_action(plan[0], think="scripted")

    keys = _keys(rows)
    adv, metrics = _run_advantage(transfer_queue, keys, [{"status": "success"}] * len(keys), config)
    per_row = torch.stack([a[0] for a in adv])
    assert torch.isfinite(per_row).all()
    n_win = len(win)
    assert (per_row[:n_win] > 0).all() and (per_row[n_win:] < 0).all()
    # step level: rows of one trajectory differ
    assert len(set(per_row[:n_win].tolist())) > 1 and len(set(per_row[n_win:].tolist())) > 1
    # one value per row, broadcast over the row's response tokens (all of them the model's here)
    masks = transfer_queue.kv_batch_get(keys=keys, partition_id="train", select_fields=["response_mask"])
    for a, m in zip(adv, masks["response_mask"].unbind(0)):
        assert a.shape == m.shape and torch.equal(a, a[0] * m)
    _check_padding(transfer_queue, keys, config, adv, tok.eos_token_id)


@pytest.mark.parametrize("case", ["train", "validation"])
def test_evoke_rows_carry_each_training_turns_goal_rankings(transfer_queue, model_and_tokenizer, case):
    """EVOKE on verl (``algorithm.agentcredit_evoke``): each training turn's row carries the env solver's rankings at
    that decision state as groups (the turn's own prompt rewritten per goal, ``<action>a</action>`` candidates, the
    values), the goals drawn from the term's seed, the row, the session, the step and the turn (replayed here on a
    fresh env); validation turns carry ``[]``. After verl's batch balancing the driver never draws a padding row
    (a copy of the first row's fields)."""
    import random

    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size

    from agentcredit.verl import evoke

    model, tok = model_and_tokenizer
    config = _config()
    config.algorithm.agentcredit_evoke = {"goals": 2, "seed": 4}
    plays = [["turn left", "forward", "turn left"], ["turn right", "turn right", "forward"]]
    servers = [HFServer(model, tok, list(p)) for p in plays]
    uid = f"evoke_{case}"
    validation = case == "validation"
    _rollout_group(config, servers, tok, uid=uid, max_steps=3, validate=validation)
    rows = _rows(transfer_queue, uid, 2, partition="val" if validation else "train")
    _check_contract(rows, 3)
    for s, steps in rows.items():
        env = env_adapters.make("minigrid", **ENV_OPTIONS)
        env.reset(SEED)
        for t, r in enumerate(steps):
            groups = r["extra"][evoke.FIELD]
            if validation:
                assert groups == []
            else:
                rankings = env.goal_rankings(2, random.Random(evoke.goal_seed(4, 0, s, 1, t)))
                want = evoke.turn_groups(tok, servers[s].calls[t]["prompt_ids"], rankings)
                assert len(want) == 2 and [evoke.check_group(g, "row") for g in groups] == want
                assert all(tok.decode(g["prompt"]) != tok.decode(servers[s].calls[t]["prompt_ids"]) for g in want)
            env.step(plays[s][t])
    if validation:
        return
    keys = _keys(rows)
    batch = KVBatchMeta(partition_id="train", keys=keys, tags=[{"status": "success"}] * len(keys))
    batch = upsample_batch_to_divisible_size(batch, batch_multiple=len(keys) + 3, eos_token_id=tok.eos_token_id)
    fields = transfer_queue.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["extra_fields"])
    padded = list(fields["extra_fields"])
    padding = [bool(t.get("is_padding", False)) for t in batch.tags]
    assert padding[-3:] == [True] * 3 and padded[-1][evoke.FIELD]  # the copies carry the first row's groups
    groups, states = evoke.round_groups(padded, padding, 100, seed=0, step=1)
    assert states == len(keys) and len(groups) == 2 * len(keys)  # every real row once, no padding copy


def test_evoke_refuses_the_memory_context_and_an_env_that_cannot_rank(transfer_queue, model_and_tokenizer, tmp_path):
    """Configuration errors raise (they are not env faults): CCM's memory context (its answers start inside
    ``<memory>``), and MiniGrid's DoorKey, whose goal_rankings refuses (rank_goals reports it instead of raising
    inside the env executor, which would break the env and count as a fault)."""
    model, tok = model_and_tokenizer
    config = _config()
    config.algorithm.agentcredit_evoke = {"goals": 2}
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match="transcript context"):  # hydra builds the loop: its wrap
        _rows_from_config_file(transfer_queue, tmp_path, "evoke_memory", "  max_steps: 1\n  context: memory\n",
                               [HFServer(model, tok, ["turn left"])], tok, "evoke_memory", config=config, seed=SEED)
    with pytest.raises(ValueError, match=r"algorithm.agentcredit_evoke: .*goal_rankings refused.*task='goal'"):
        _rollout_group(config, [HFServer(model, tok, ["turn left"])], tok, uid="evoke_doorkey", env_name="minigrid",
                       env_options={"size": 5, "task": "doorkey"}, seed=SEED, extra_info={"max_steps": 1})


def test_evoke_a_failing_generation_waits_for_the_turns_ranking_and_raises(transfer_queue, model_and_tokenizer):
    """The goals are ranked while the policy generates: when the generation fails, the session still waits for
    the env call to end before the env goes back to the pool, then raises the generation's error."""
    model, tok = model_and_tokenizer
    config = _config()
    config.algorithm.agentcredit_evoke = {"goals": 2}

    class Broken(HFServer):
        async def generate(self, request_id, **kwargs):
            await asyncio.sleep(0)
            raise RuntimeError("rollout server gone")

    with pytest.raises(RuntimeError, match="rollout server gone"):
        _rollout_group(config, [Broken(model, tok)], tok, uid="evoke_broken", max_steps=2)


def test_agent_loop_config_file_options_and_an_empty_generation(transfer_queue, model_and_tokenizer, tmp_path):
    """The loop selected through rollout.agent.agent_loop_config_path (hydra _target_, options as constructor
    arguments), a sample with only a seed, and a server that returns no tokens."""
    model, tok = model_and_tokenizer
    servers = [HFServer(model, tok, ["", "turn right"])]
    rows = _rows_from_config_file(transfer_queue, tmp_path, "minigrid_h0", "  max_steps: 2\n  history_length: 0\n",
                                  servers, tok, "cfgfile", seed=SEED)
    _check_contract(rows, max_steps=2)
    steps = rows[0]
    assert len(steps) == 2 and steps[-1]["extra"]["truncated"]  # max_steps from the config file
    assert steps[0]["extra"]["action_key"] is None and int(steps[0]["response_mask"].sum()) == 0
    assert steps[1]["extra"]["action_key"] == "turn right"
    assert "Prior to this step" not in tok.decode(servers[0].calls[1]["prompt_ids"])  # history_length 0
    env = env_adapters.make("minigrid", **ENV_OPTIONS)
    env.reset(SEED)
    assert steps[0]["extra"]["anchor_key"] == env.state_key()  # the sample's seed


def test_memory_context_keeps_a_memory_instead_of_the_transcript(transfer_queue, model_and_tokenizer, tmp_path):
    """CCM's ``context: memory`` (an agent-loop config file option): each prompt is task + retained memory + newest
    observation with the reply pre-filled by ``<memory>``; a malformed memory keeps the previous one and costs -0.1;
    the bridge logs the input saving over the full transcript."""
    from env_adapters.memory_context import MEMORY_OPEN

    model, tok = model_and_tokenizer
    replies = ["goal ahead</memory><action>turn left</action>",   # well formed
               "<action>turn right</action>",                     # malformed memory: "<memory><action>..."
               "turned back</memory><action>turn left</action>"]
    servers = [HFServer(model, tok, list(replies), raw=True), HFServer(model, tok, list(replies), raw=True)]
    rows = _rows_from_config_file(transfer_queue, tmp_path, "minigrid_ccm", "  max_steps: 3\n  context: memory\n",
                                  servers, tok, "ccm", seed=SEED)
    _check_contract(rows, max_steps=3)
    steps = rows[0]
    assert [r["extra"]["memory_malformed"] for r in steps] == [False, True, False]
    assert [r["extra"]["action_key"] for r in steps] == ["turn left", "turn right", "turn left"]
    env = env_adapters.make("minigrid", **ENV_OPTIONS)
    env.reset(SEED)
    rewards = [env.step(a).reward for a in ("turn left", "turn right", "turn left")]
    assert [r["extra"]["step_reward"] for r in steps] == pytest.approx([rewards[0], rewards[1] - 0.1, rewards[2]])
    prompts = [tok.decode(c["prompt_ids"]) for c in servers[0].calls]
    prefill = tok.encode(MEMORY_OPEN, add_special_tokens=False)
    assert all(c["prompt_ids"][-len(prefill):] == prefill for c in servers[0].calls)
    assert "Memory: (empty)" in prompts[0]
    assert "Memory: goal ahead" in prompts[1] and "Memory: goal ahead" in prompts[2]  # kept after the malformed one
    assert all("Prior to this step" not in p for p in prompts)                         # never the transcript
    assert tok.decode(steps[0]["responses"], skip_special_tokens=True) == replies[0]  # "<memory>" is in the prompt
    assert [r["extra"]["prompt_tokens"] for r in steps] == [len(c["prompt_ids"]) for c in servers[0].calls]
    full, short = [r["extra"]["full_prompt_tokens"] for r in steps], [r["extra"]["prompt_tokens"] for r in steps]
    assert full[2] > full[1] > full[0] and full[2] > short[2]  # the transcript grows, the memory prompt does not
    # what CCM's privileged teacher reads: the full history (never a memory) ending with "<action>", and where the
    # action tokens start (-1: the malformed turn is not distilled)
    starts = [r["extra"]["ccm_action_start"] for r in steps]
    assert starts[1] == -1 and starts[0] > 0 and starts[2] > 0
    assert tok.decode(steps[0]["responses"][starts[0]:], skip_special_tokens=True) == "turn left</action>"
    teacher = [tok.decode(r["extra"]["ccm_teacher_prompt_ids"]) for r in steps]
    assert all(t.endswith("<action>") for t in teacher)
    assert "Prior to this step" in teacher[2] and "goal ahead" not in teacher[2]  # history, not the memory

    keys = _keys(rows)
    _, metrics = _run_advantage(transfer_queue, keys, [{"status": "success"}] * len(keys), _config())
    every = [r["extra"] for s in sorted(rows) for r in rows[s]]
    expected = 1 - sum(e["prompt_tokens"] for e in every) / sum(e["full_prompt_tokens"] for e in every)
    assert metrics["agentcredit/ccm_input_saving"] == pytest.approx(expected)
    assert metrics["agentcredit/ccm_malformed_memory"] == pytest.approx(2 / 6)


@pytest.mark.parametrize("case", ["guided", "decayed", "validation"])
def test_guided_schedule_lets_the_distillation_teacher_write_turns(transfer_queue, model_and_tokenizer, case):
    """Guided-OPD on verl (agentcredit.verl.guided): with the guided schedule at p = 1 every turn comes from the
    worker's teacher client and none of its tokens is trained; once p has decayed to 0, and in validation, the
    policy writes every turn."""
    model, tok = model_and_tokenizer
    config = _config()
    decay = {"guided": 10**6, "decayed": 1, "validation": 10**6}[case]  # global step 1 = schedule step 0
    # p0 just below 1 (1 itself is refused: verl cannot train a batch of teacher turns only): these draws all pass
    config.algorithm.agentcredit_distill = {"schedule": "guided", "params": {"p0": 1 - 1e-9, "decay_steps": decay}}
    teacher, student = HFServer(model, tok, ["turn left"] * 3), HFServer(model, tok, ["turn right"] * 3)
    uid = f"guided_{case}"
    step = {"guided": 1, "decayed": 2, "validation": 1}[case]
    _rollout_group(config, [student], tok, uid=uid, max_steps=3, teacher=teacher, validate=case == "validation",
                   global_steps=step)
    steps = _rows(transfer_queue, uid, 1, partition="val" if case == "validation" else "train")[0]
    guided = case == "guided"
    assert len(teacher.calls) == (3 if guided else 0) and len(student.calls) == (0 if guided else 3)
    # a teacher turn gets the policy's turn budget (verl's teacher servers alone allow one token); the policy's own
    # requests leave it to their server
    assert all(c["sampling_params"]["max_tokens"] == RESPONSE_LEN for c in teacher.calls)
    assert all("max_tokens" not in c["sampling_params"] for c in student.calls)
    assert [r["extra"]["by_teacher"] for r in steps] == [guided] * 3
    assert [r["extra"]["action_key"] for r in steps] == ["turn left" if guided else "turn right"] * 3
    assert all(bool(r["response_mask"].any()) != guided for r in steps)  # teacher turns: nothing trained
    if guided:
        keys = _keys({0: steps})
        _, metrics = _run_advantage(transfer_queue, keys, [{"status": "success"}] * len(keys), config)
        assert metrics["agentcredit/guided_teacher_turns"] == 1.0


def test_guided_schedule_needs_one_teacher_and_p0_below_one(transfer_queue, model_and_tokenizer):
    model, tok = model_and_tokenizer
    config = _config()
    config.algorithm.agentcredit_distill = {"schedule": "guided", "params": {"p0": 0.5, "decay_steps": 10}}
    with pytest.raises(ValueError, match=r"0 teacher client\(s\).*exactly one distillation teacher"):
        _rollout_group(config, [HFServer(model, tok, ["turn left"])], tok, uid="guided_none", max_steps=1,
                       global_steps=1)
    config.algorithm.agentcredit_distill = {"schedule": "guided", "params": {"p0": 1.0, "decay_steps": 10}}
    teacher = HFServer(model, tok, ["turn left"])
    with pytest.raises(ValueError, match=r"p0=1.0 makes every turn of step 1 the teacher's.*p0 < 1"):
        _rollout_group(config, [HFServer(model, tok, ["turn left"])], tok, uid="guided_all", max_steps=1,
                       teacher=teacher, global_steps=1)


def test_an_unknown_context_is_refused_naming_the_choices():
    from agentcredit.verl.agent_loop import EnvAgentLoop

    loop = EnvAgentLoop.__new__(EnvAgentLoop)
    with pytest.raises(ValueError, match=r"context='summary'.*transcript.*memory"):
        EnvAgentLoop.__init__(loop, context="summary")


def test_verl_knows_the_agent_loop_by_name_through_the_entry_point():
    code = ("import sys, verl\nassert 'agentcredit.verl.agent_loop' not in sys.modules\n"
            "from verl.experimental.agent_loop import agent_loop as al\n"
            "print(al._agent_loop_registry['agentcredit_env'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONWARNINGS="ignore")).stdout
    assert "agentcredit.verl.agent_loop" in out


# ---- the search loops (agentcredit.verl.search_loops) ------------------------------------------------------------
def _search_config(estimator, n=2, **params):
    config = _config(logprobs=True)
    config.actor_rollout_ref.rollout.n = n
    config.algorithm.adv_estimator = estimator
    config.algorithm[estimator] = params
    return config


def test_counterfactual_loop_rows_carry_asct_tables_and_verl_computes_asct(transfer_queue, model_and_tokenizer):
    import agentcredit.verl.loops  # noqa: F401  (registers agentcredit_counterfactual)

    model, tok = model_and_tokenizer
    env = env_adapters.make("minigrid", **ENV_OPTIONS)
    plan = _bfs_plan(env, SEED)
    config = _search_config("asct")
    servers = [HFServer(model, tok, plan), HFServer(model, tok, [None] + ["turn left"] * 3)]
    _rollout_group(config, servers, tok, uid="cf", max_steps=4, agent_name="agentcredit_counterfactual")
    rows = _rows(transfer_queue, "cf", 2)
    legal = env.legal_actions()
    n = len(legal)
    expected_raw = []
    for s, steps in rows.items():
        env.reset(SEED)
        for r in steps:
            e = r["extra"]
            assert e["anchor_key"] == env.state_key()  # the search never moved the actor
            assert e["legal_p"] == pytest.approx([1.0 / n] * n + [0.0])  # verl: the uniform baseline
            assert sum(e["visits"][:n]) == 12 and min(e["visits"][:n]) >= 1
            if e["action_key"] is None:
                assert e["chosen"] == n and e["legal_mask"] == [True] * (n + 1)
                assert e["q"][n] == pytest.approx(min(e["q"][:n]) - 0.1)
            else:
                assert legal[e["chosen"]] == e["action_key"] and e["legal_mask"] == [True] * n + [False]
            expected_raw.append(e["q"][e["chosen"]] - sum(e["q"][:n]) / n)
            env.step(e["action_key"])
    keys = _keys(rows)
    adv, metrics = _run_advantage(transfer_queue, keys, [{"status": "success"}] * len(keys), config)
    per_row = torch.stack([a[0] for a in adv]).double()
    raw = torch.tensor(expected_raw, dtype=torch.float64)
    assert torch.allclose(per_row, ((raw - raw.mean()) / (raw.std() + 1e-6)), atol=1e-5)
    assert metrics["agentcredit/steps"] == len(keys)


def _tree_rows(tq, uid):
    rows, i = [], 0
    while True:
        try:
            data = tq.kv_batch_get(keys=[f"{uid}_0_{i}"], partition_id="train",
                                   select_fields=["extra_fields", "response_mask"])
        except Exception:
            return rows
        ef = data["extra_fields"]
        rows.append({"key": f"{uid}_0_{i}", "extra": (ef.tolist() if hasattr(ef, "tolist") else list(ef))[0]})
        i += 1


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_tree_loop_grows_one_tree_per_sample_and_verl_computes_tree_credit(transfer_queue, model_and_tokenizer,
                                                                           tmp_path, backend):
    """On the process backend the forks restore snapshots that another worker process took."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    import credit_plugins as cp

    model, tok = model_and_tokenizer
    path = tmp_path / "tree.yaml"
    path.write_text("- name: tree_small\n  _target_: agentcredit.verl.search_loops.TreeAgentLoop\n  env_name: minigrid\n"
                    "  env_options: {size: 5}\n  max_steps: 3\n  initial: 2\n  iterations: 1\n  beam: 2\n"
                    f"  branches: 1\n  criterion: host\n  env_backend: {backend}\n")
    for cfg in OmegaConf.load(path):
        _agent_loop_registry[cfg.name] = cfg
    torch.manual_seed(3)
    config = _search_config("at2po", n=1)
    uid = f"tree_{backend}"
    try:
        _rollout_group(config, [HFServer(model, tok)], tok, uid=uid, agent_name="tree_small", seed=SEED)
        with pytest.raises(Exception, match=r"rollout\.n=1"):  # hydra wraps the ValueError
            _rollout_group(_search_config("at2po", n=2), [HFServer(model, tok)] * 2, tok, uid=f"tree2_{backend}",
                           agent_name="tree_small", seed=SEED)
    finally:
        _agent_loop_registry.pop("tree_small", None)
    rows = _tree_rows(transfer_queue, uid)
    assert all(not r["extra"]["env_error"] for r in rows)
    ex = [r["extra"] for r in rows]
    ids = {e["traj_uid"] for e in ex}
    assert len(ids) == len(rows) and all(e["step_idx"] == 0 for e in ex)
    assert all(e["parent"] is None or e["parent"] in ids for e in ex)
    parents = {e["parent"] for e in ex}
    leaves = [e for e in ex if e["traj_uid"] not in parents]
    assert len(leaves) == 4 and sum(e["fresh"] for e in ex) == 2
    assert all(e["surprisal"] > 0 for e in ex)  # -mean sampled log-prob, from the server's log-probs
    assert all(e["step_reward"] == 0.0 for e in ex if e["traj_uid"] in parents)
    keys = [r["key"] for r in rows]
    adv, _ = _run_advantage(transfer_queue, keys, [{"status": "success"}] * len(keys), config)
    per_row = torch.stack([a[0] for a in adv])
    steps = cp.StepTable(group=["tree"] * len(ex), traj=[e["traj_uid"] for e in ex], t=[0] * len(ex),
                         reward=[e["step_reward"] for e in ex],
                         extras={"parent": np.asarray([-1 if e["parent"] is None else cp.stable_hash(e["parent"])
                                                       for e in ex]),
                                 "surprisal": np.asarray([e["surprisal"] for e in ex])})
    assert torch.allclose(per_row, cp.get("at2po")(steps), atol=1e-6)


def test_the_wrapped_agent_loop_worker_method_pickles_for_ray():
    """Ray ships the agent-loop worker class to its process by value: agentcredit's wrap of its postprocessing must
    pickle (a wrap whose closure reaches an unpicklable global, e.g. a ContextVar, breaks every verl run at start-up;
    found by a CPU smoke run of a later wrap)."""
    import ray.cloudpickle as cloudpickle
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    from agentcredit.verl._compat import is_wrapped

    worker_cls = AgentLoopWorkerTQ.__ray_metadata__.modified_class
    for name, tag in (("_agent_loop_postprocess", "distill"), ("_run_agent_loop", "guided")):
        method = getattr(worker_cls, name)
        assert is_wrapped(method, tag)
        cloudpickle.loads(cloudpickle.dumps(method))
    cloudpickle.loads(cloudpickle.dumps(worker_cls))


def test_distillation_loss_range_of_a_micro_batch_without_response_tokens():
    """verl 0.9.1 takes .min() of the selected losses, which fails when a micro-batch has no response token (all
    Guided-OPD teacher turns, or padding rows); agentcredit's wrap gives the MIN/MAX identities there and verl's own
    values elsewhere."""
    import agentcredit.verl  # noqa: F401  (installs the post-import hooks)
    from verl.trainer.distillation import losses

    from agentcredit.verl._compat import is_wrapped

    assert is_wrapped(losses.compute_distillation_loss_range, "distill_range")
    x = torch.tensor([[0.5, -1.0, 3.0], [2.0, 7.0, -4.0]])
    empty = losses.compute_distillation_loss_range(distillation_losses=x, response_mask=torch.zeros(2, 3))
    assert empty["distillation/loss_min"].aggregate() == math.inf
    assert empty["distillation/loss_max"].aggregate() == -math.inf
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    some = losses.compute_distillation_loss_range(distillation_losses=x, response_mask=mask)
    assert some["distillation/loss_min"].aggregate() == -1.0 and some["distillation/loss_max"].aggregate() == 7.0


@pytest.mark.parametrize("params, distillation, match", [
    ({"p0": 1.0, "decay_steps": 4}, True, r"p0=1.0 makes every turn of step 1 the teacher's"),
    ({"p0": 0.5}, True, r"set algorithm.agentcredit_distill.params.decay_steps \(or trainer.total_training_steps\)"),
    ({"p0": 0.5, "decay_steps": 4}, False, r"exactly one distillation teacher .*found 0"),
    ({"p0": 0.5, "decay_steps": 4}, True, None),
])
def test_guided_schedule_is_checked_in_the_trainer_before_any_rollout(params, distillation, match):
    """An error inside a rollout session only fails its group (verl logs it in the worker), so the trainer process
    refuses an unrunnable guided schedule first (its wrapped ``_load_checkpoint`` runs before step 1)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import trainer_base

    from agentcredit.verl import guided
    from agentcredit.verl._compat import is_wrapped

    assert is_wrapped(trainer_base.PPOTrainer._load_checkpoint, "guided")
    config = OmegaConf.create({
        "trainer": {"total_training_steps": None},
        "algorithm": {"agentcredit_distill": {"schedule": "guided", "params": params}},
        "distillation": {"enabled": distillation, "teacher_models": {"teacher_model": {"model_path": "t"}}},
    })
    if match is None:
        guided.check_config(config)
    else:
        with pytest.raises(ValueError, match=match):
            guided.check_config(config)
    config.algorithm.agentcredit_distill = {"schedule": "opw", "params": {}}
    guided.check_config(config)  # other schedules: nothing to check


# ---- env faults and concurrency (env_adapters.executor) ----------------------------------------------------------
def _faulty_fields(seed, faults, max_steps=3):
    return dict(env_name="faulty", seed=seed, extra_info={"max_steps": max_steps},
                env_options={"env": "minigrid", "env_options": dict(ENV_OPTIONS), "faults": faults, "hang_s": 3.0})


def test_env_faults_are_contained_marked_and_counted_and_a_limit_stops_the_step(transfer_queue, model_and_tokenizer):
    """Three groups of the ``faulty`` MiniGrid: one whose env raises at turn 1 (the episodes keep their turn-0 rows,
    end truncated and failed, marked ``env_error``), one whose env raises at its first step (a masked-out placeholder
    row each, dropped like padding) and a clean one whose rows are those of a plain run. The bridge counts the
    faulted episodes; over ``algorithm.agentcredit_max_env_error_rate`` the step stops with the env, seed and
    traceback."""
    model, tok = model_and_tokenizer
    faults = {3: "raise@1", 5: "raise@0"}
    config = _config()
    script = ["turn left", "turn right", "turn left"]
    groups = {"late": 3, "early": 5, "clean": 4}
    for uid, seed in groups.items():
        _rollout_group(config, [HFServer(model, tok, script) for _ in range(2)], tok, uid=uid,
                       **_faulty_fields(seed, faults))
    _rollout_group(config, [HFServer(model, tok, script) for _ in range(2)], tok, uid="plain",
                   env_name="minigrid", env_options=dict(ENV_OPTIONS), seed=4, extra_info={"max_steps": 3})
    rows = {uid: _rows(transfer_queue, uid, 2) for uid in (*groups, "plain")}

    for steps in rows["late"].values():
        assert len(steps) == 1  # turn 0 played; turn 1's step raised
        e = steps[0]["extra"]
        assert e["env_error"] == "error"
        assert "InjectedFault" in e["env_error_detail"] and "seed=3" in e["env_error_detail"]
        assert e["truncated"] and not e["success"] and not e["env_fault_row"]
        assert int(steps[0]["response_mask"].sum()) > 0 and e["action_key"] == "turn left"
    for steps in rows["early"].values():
        assert len(steps) == 1 and steps[0]["extra"]["env_fault_row"] and steps[0]["extra"]["env_error"] == "error"
        assert int(steps[0]["response_mask"].sum()) == 0  # nothing of it is trained
    for s in (0, 1):  # the clean group is exactly a plain run of the same seed and script
        clean, plain = rows["clean"][s], rows["plain"][s]
        assert len(clean) == 3 and all(r["extra"]["env_error"] == "" for r in clean)
        assert [r["extra"]["anchor_key"] for r in clean] == [r["extra"]["anchor_key"] for r in plain]
        assert [r["extra"]["step_reward"] for r in clean] == [r["extra"]["step_reward"] for r in plain]

    keys = [k for uid in groups for k in _keys(rows[uid])]
    tags = [{"status": "success"}] * len(keys)
    config.algorithm.agentcredit_max_env_error_rate = 1.0
    adv, metrics = _run_advantage(transfer_queue, keys, tags, config)
    assert metrics["agentcredit/env_errors"] == 4 and metrics["agentcredit/env_timeouts"] == 0
    assert metrics["agentcredit/env_error_rate"] == pytest.approx(4 / 6)
    assert metrics["agentcredit/env_fault_rows"] == 2 and metrics["agentcredit/padding_rows"] == 0
    assert metrics["agentcredit/trajectories"] == 4 and metrics["agentcredit/steps"] == 2 + 6
    placeholder = [i for i, k in enumerate(keys) if k.startswith("early_")]
    assert all(torch.all(adv[i] == 0) for i in placeholder)

    config.algorithm.agentcredit_max_env_error_rate = 0.5
    with pytest.raises(RuntimeError, match=r"4 of 6 episodes .* env 'faulty' seed=(3|5).*InjectedFault"):
        _run_advantage(transfer_queue, keys, tags, config)


def test_a_hanging_env_ends_its_episode_as_a_timeout(transfer_queue, model_and_tokenizer, tmp_path):
    """``env_timeout_s`` from the agent-loop config file: a step that hangs ends its episode as ``timeout``; the
    loop goes on with the next session (the barrier test below shows the sessions do not wait for each other)."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    model, tok = model_and_tokenizer
    path = tmp_path / "agent_loops.yaml"
    path.write_text("- name: faulty_timeout\n  _target_: agentcredit.verl.agent_loop.EnvAgentLoop\n"
                    "  env_name: faulty\n  env_timeout_s: 0.5\n  env_workers: 8\n")
    for cfg in OmegaConf.load(path):
        _agent_loop_registry[cfg.name] = cfg
    servers = [HFServer(model, tok, ["turn left"] * 3) for _ in range(2)]
    try:
        _rollout_group(_config(), servers, tok, uid="hang", agent_name="faulty_timeout",
                       **_faulty_fields(3, {3: "hang@1"}))
    finally:
        _agent_loop_registry.pop("faulty_timeout", None)
    rows = _rows(transfer_queue, "hang", 2)
    for steps in rows.values():
        assert len(steps) == 1 and steps[0]["extra"]["env_error"] == "timeout"
        assert "env_timeout_s=0.5" in steps[0]["extra"]["env_error_detail"]


class _BarrierMiniGrid:
    """MiniGrid whose steps return only when two steps are in flight at once (see the test below)."""

    barrier = None

    def __init__(self, **options):
        self.inner = env_adapters.make("minigrid", **options)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, action_text):
        type(self).barrier.wait()
        return self.inner.step(action_text)


def test_the_sessions_of_a_worker_step_their_envs_at_once(transfer_queue, model_and_tokenizer):
    """Two sessions on verl's event loop, each env step waiting for the other session's step: both episodes finish
    only when env calls run off the loop (a step called on the loop blocks it, the other session never reaches its
    step, and the barrier breaks)."""
    import threading

    from credit_plugins import registry
    from credit_plugins.hookspecs import hookimpl
    from env_adapters.base import EnvSpec

    class Plugin:
        @hookimpl
        def agentcredit_envs(self):
            return [EnvSpec("barrier_minigrid", _BarrierMiniGrid, "test: steps meet at a barrier")]

    _BarrierMiniGrid.barrier = threading.Barrier(2, timeout=60)
    name = registry.register_plugin(Plugin(), "agentcredit-test-barrier-minigrid")
    try:
        model, tok = model_and_tokenizer
        servers = [HFServer(model, tok, ["turn left"] * 2) for _ in range(2)]
        _rollout_group(_config(), servers, tok, uid="barrier", env_name="barrier_minigrid",
                       env_options=dict(ENV_OPTIONS), seed=SEED, extra_info={"max_steps": 2})
        rows = _rows(transfer_queue, "barrier", 2)
        assert [len(rows[s]) for s in (0, 1)] == [2, 2]
        assert all(r["extra"]["env_error"] == "" for s in rows for r in rows[s])
    finally:
        registry.unregister_plugin(name)


def test_the_ray_backend_plays_reuses_and_contains_faults(transfer_queue):
    """Env instances as Ray actors (the local ray the TransferQueue runs on): a reused actor replays a seed as a new
    one does; a raise, a hang past the timeout and a crashed actor process are the three fault kinds, and a faulted
    actor is replaced."""
    from agentcredit.verl import env_actors  # noqa: F401  (registers the backend)
    from env_adapters import turns
    from env_adapters.executor import EnvExecutor, EnvFault

    ex = EnvExecutor("ray", workers=4, timeout_s=2.0, backend_options={"num_cpus": 0})
    options = {"env": "synthetic", "faults": {1: "raise@0", 2: "hang@0", 3: "exit@0"}, "hang_s": 30.0}
    try:
        h = ex.acquire_sync("faulty", options)
        first = h.apply_sync(turns.start, 0), h.apply_sync(turns.act, "look around").result.observation
        ex.release(h)
        again = ex.acquire_sync("faulty", options)
        assert again is h
        assert (h.apply_sync(turns.start, 0), h.apply_sync(turns.act, "look around").result.observation) == first
        kinds = []
        for seed in (1, 2, 3):
            h = ex.acquire_sync("faulty", options)
            h.apply_sync(turns.start, seed)
            with pytest.raises(EnvFault) as info:
                h.apply_sync(turns.act, "look around")
            kinds.append(info.value.kind)
            ex.release(h)
            assert ex.acquire_sync("faulty", options) is not h
        assert kinds == ["error", "timeout", "dead"]
        assert ex.counts["error"] == ex.counts["timeout"] == ex.counts["dead"] == 1
    finally:
        ex.close()


def test_full_determinism_gives_each_session_its_own_request_id_and_seed(transfer_queue, model_and_tokenizer):
    """With ``rollout.full_determinism`` verl's server seeds every request alike unless it names a seed: each session
    gets its own request id and seed (from the dataset row, the session and the step), the same on a rerun, so a
    group's sessions differ and a rerun repeats them."""
    model, tok = model_and_tokenizer
    config = _config()
    config.actor_rollout_ref.rollout.full_determinism = True

    def play(uid):
        servers = [HFServer(model, tok, ["turn left"] * 2) for _ in range(2)]
        _rollout_group(config, servers, tok, uid=uid, max_steps=2)
        return [(c["request_id"], c["sampling_params"].get("seed")) for srv in servers for c in srv.calls]

    first, rerun = play("det_a"), play("det_b")  # verl's uid differs per step; the dataset row is the same
    assert first == rerun
    (id0, seed0), (id1, seed1) = first[0], first[2]
    assert first[0] == first[1] and first[2] == first[3]  # one sticky request id per episode
    assert id0 != id1 and seed0 != seed1 and isinstance(seed0, int)
