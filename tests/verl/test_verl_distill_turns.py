"""Every output of a multi-output agent loop is scored by the teacher (agentcredit.verl.distill's hook on verl
0.9.1's ``AgentLoopWorkerTQ._agent_loop_postprocess``), the ``hfcpu`` backend answers verl's teacher request in
vLLM's layout, and the trainer hook counts the rows that carry teacher log-probs. Real verl classes and methods;
the worker is a stand-in object, the teacher server and the TransferQueue are fakes."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

pytest.importorskip("verl", reason="the [verl] extra is not installed")
pytest.importorskip("ray")

import verl  # noqa: F401  (the entry point installs the bridge)
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopMetrics,
    AgentLoopOutput,
    AgentLoopWorker,
)
from verl.trainer.ppo.v1 import agent_loop_tq

from agentcredit.verl import _compat
from agentcredit.verl import distill as bridge

pytestmark = pytest.mark.verl


def _output(i: int) -> AgentLoopOutput:
    return AgentLoopOutput(prompt_ids=[1, 2, 3 + i], response_ids=[4, 5 + i], response_mask=[1, 1], num_turns=2,
                           metrics=AgentLoopMetrics(), extra_fields={"step_idx": i})


class FakeTeacher:
    """``AsyncTeacherLLMServerManager.compute_teacher_logprobs_single``: log-prob -(token id) / 10 per position."""

    def __init__(self):
        self.calls = []

    async def compute_teacher_logprobs_single(self, sequence_ids, routing_key=None, **kwargs):
        self.calls.append(list(sequence_ids))
        ids = torch.tensor(sequence_ids, dtype=torch.int32).unsqueeze(-1)
        return ids, -ids.float() / 10.0


def _worker(enabled: bool = True):
    """A stand-in AgentLoopWorkerTQ self with verl's real ``_compute_teacher_logprobs``."""
    w = types.SimpleNamespace(distillation_enabled=enabled, teacher_key="data_source",
                              teacher_server_manager=FakeTeacher())
    w._compute_teacher_logprobs = types.MethodType(AgentLoopWorker._compute_teacher_logprobs, w)

    async def _compute_score(outputs, kwargs):
        return None

    w._compute_score = _compute_score
    w._compute_multi_modal_inputs = lambda output, input_ids: {}
    w._compute_position_ids = lambda input_ids, attention_mask, mm: torch.arange(input_ids.shape[-1]).unsqueeze(0)
    return w


def _ray_class():
    return agent_loop_tq.AgentLoopWorkerTQ.__ray_metadata__.modified_class


def test_the_class_ray_instantiates_carries_the_wrap_also_after_cloudpickle():
    import cloudpickle

    cls = _ray_class()
    assert _compat.is_wrapped(cls.__dict__["_agent_loop_postprocess"], "distill")
    assert _compat.is_wrapped(cls.__ray_actor_class__.__dict__["_agent_loop_postprocess"], "distill")
    again = cloudpickle.loads(cloudpickle.dumps(cls))  # how Ray ships the actor class to the worker process
    assert _compat.is_wrapped(again.__dict__["_agent_loop_postprocess"], "distill")
    bridge._patch_agent_loop_tq(agent_loop_tq)  # installing again does not wrap twice
    assert cls.__dict__["_agent_loop_postprocess"].__wrapped__.__module__ != bridge.__name__


@pytest.mark.parametrize("validate", [False, True])
def test_every_output_of_the_loop_reaches_the_transfer_queue_with_teacher_logprobs(monkeypatch, validate):
    stored = {}

    async def kv_batch_put(keys, fields, tags, partition_id):
        stored.update(keys=keys, fields=fields, partition_id=partition_id)

    monkeypatch.setattr(agent_loop_tq.tq, "async_kv_batch_put", kv_batch_put)
    w = _worker()
    outputs = [_output(i) for i in range(3)]
    asyncio.run(_ray_class()._agent_loop_postprocess(w, outputs, validate, uid="u", session_id=0, global_steps=1,
                                                     data_source="sokoban"))
    assert stored["keys"] == ["u_0_0", "u_0_1", "u_0_2"]
    if validate:  # verl skips the teacher in validation, and so does the hook
        assert w.teacher_server_manager.calls == []
        assert "teacher_logprobs" not in stored["fields"]
        return
    # each output scored once, on its own prompt + response (the last by verl's code, the others by the hook)
    assert sorted(w.teacher_server_manager.calls) == sorted(o.prompt_ids + o.response_ids for o in outputs)
    got = stored["fields"]["teacher_logprobs"]
    for i, o in enumerate(outputs):
        want = -torch.tensor(o.prompt_ids + o.response_ids, dtype=torch.float32).unsqueeze(-1) / 10.0
        torch.testing.assert_close(got[i], want)


def test_without_distillation_the_hook_scores_nothing_and_a_single_output_is_verls_alone():
    w = _worker(enabled=False)
    assert asyncio.run(bridge.score_earlier_outputs(w, [_output(0), _output(1)], False, {})) == 0
    w = _worker()
    assert asyncio.run(bridge.score_earlier_outputs(w, _output(0), False, {})) == 0
    assert asyncio.run(bridge.score_earlier_outputs(w, [_output(0)], False, {})) == 0
    assert asyncio.run(bridge.score_earlier_outputs(w, [_output(0), _output(1), _output(2)], False, {})) == 2
    assert len(w.teacher_server_manager.calls) == 2


def test_a_changed_verl_worker_fails_loudly():
    fake = types.SimpleNamespace(AgentLoopWorker=types.SimpleNamespace(_compute_teacher_logprobs=lambda self, x: 0),
                                 AgentLoopWorkerTQ=type("W", (), {}))
    with pytest.raises(_compat.VerlInternalsChanged):
        bridge._patch_agent_loop_tq(fake)


# ---- the hfcpu teacher ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("k", [0, 5])
def test_hfcpu_teacher_answers_in_vllms_prompt_logprobs_layout(tiny, k):
    from agentcredit.verl.cpu.rollout import score_prompt

    seq = [3, 7, 1, 9, 4]
    tok, lp, extra = score_prompt(tiny, seq, k)
    ids, lps = torch.tensor(extra["prompt_ids"]), torch.tensor(extra["prompt_logprobs"])
    width = max(k, 1)
    assert ids.shape == lps.shape == (len(seq), width)  # verl asserts one row per sequence token
    with torch.no_grad():
        full = torch.log_softmax(tiny(input_ids=torch.tensor([seq])).logits[0].float(), -1)
    if k == 0:  # row j: log p(token j+1 | tokens 0..j)
        assert ids[:-1, 0].tolist() == seq[1:]
        torch.testing.assert_close(lps[:-1, 0], full[torch.arange(len(seq) - 1), torch.tensor(seq[1:])])
    else:  # the top-K by rank
        torch.testing.assert_close(lps[:-1], full[:-1].topk(k, -1).values)
        assert (ids[:-1] == full[:-1].topk(k, -1).indices).all()
    assert (ids[-1] == 0).all() and (lps[-1] == 0).all()  # vLLM's dummy last row
    assert tok == [int(full[-1].argmax())] and lp[0] == pytest.approx(float(full[-1].max()))


# ---- the coverage metric -------------------------------------------------------------------------------------------
def _nested(ts):
    return torch.nested.as_nested_tensor(list(ts), layout=torch.jagged)


def test_teacher_coverage_counts_the_rows_the_worker_flagged_without_reading_teacher_logprobs():
    """The worker flags each row while the teacher's tensor is at hand (``teacher_scored``: finite, non-zero
    log-probs on the response positions, verl's one-token shift); the trainer's metric reads the rows'
    ``extra_fields`` only, never ``teacher_logprobs`` (gigabytes per step at top-k scale)."""
    prompts, responses = [3, 2, 4, 2], [2, 3, 2, 1]
    teacher = [-torch.rand(p + r, 4) - 0.1 for p, r in zip(prompts, responses)]
    teacher[1] = torch.zeros(prompts[1] + responses[1], 4)  # an unscored row: verl's 0.0 padding
    teacher[2][prompts[2] - 1] = float("nan")                # a broken response position
    outs = [AgentLoopOutput(prompt_ids=[1] * p, response_ids=[2] * r, response_mask=[1] * r, num_turns=2,
                            metrics=AgentLoopMetrics(), extra_fields={"teacher_logprobs": t})
            for p, r, t in zip(prompts, responses, teacher)]
    assert [bridge.teacher_scored(o) for o in outs] == [True, False, False, True]
    prompt_only = teacher[3].clone()
    prompt_only[prompts[3] - 1:] = 0  # non-zero on the prompt only: not scored on its response
    outs[3].extra_fields["teacher_logprobs"] = prompt_only
    assert not bridge.teacher_scored(outs[3])

    extra = [{bridge.SCORED_KEY: flag, bridge.TOKENS_KEY: 10 + i, "step_idx": i}
             for i, flag in enumerate([True, False, True, True])]
    asked = []

    class TQ:
        def kv_batch_get(self, keys, partition_id, select_fields):
            asked.append(list(select_fields))
            return {"extra_fields": extra}

    batch = types.SimpleNamespace(keys=["a_0_0", "a_0_1", "b_0_0", "pad"], partition_id="train",
                                  tags=[{}, {}, {}, {"is_padding": True}])
    # traffic: every non-padding row's request counts, scored or not (10 + 11 + 12; the padding row's 13 does not)
    assert bridge.teacher_coverage(TQ(), batch) == {"teacher_rows": 2, "rows": 3, "teacher_tokens": 33}
    assert asked == [["extra_fields"]]
    extra[0] = {"step_idx": 0}  # a row stored without the worker's hook counts as unscored and sent nothing
    assert bridge.teacher_coverage(TQ(), batch) == {"teacher_rows": 1, "rows": 3, "teacher_tokens": 23}


def test_the_workers_teacher_call_flags_every_row():
    w = _worker()
    w._compute_teacher_logprobs = types.MethodType(
        bridge.wrap_compute_teacher_logprobs(AgentLoopWorker._compute_teacher_logprobs), w)
    outs = [_output(0), _output(1), _output(2)]
    asyncio.run(bridge.score_earlier_outputs(w, outs, False, {}))
    for o in outs[:-1]:
        asyncio.run(w._compute_teacher_logprobs(o, prompt_ids=o.prompt_ids, response_ids=o.response_ids,
                                                validate=False, sample_kwargs={}))
    asyncio.run(w._compute_teacher_logprobs(outs[-1], prompt_ids=outs[-1].prompt_ids,
                                            response_ids=outs[-1].response_ids, validate=True, sample_kwargs={}))
    assert [o.extra_fields[bridge.SCORED_KEY] for o in outs] == [True, True, False]  # validation: no teacher
    assert [o.extra_fields[bridge.TOKENS_KEY] for o in outs] == [len(o.prompt_ids) + len(o.response_ids)
                                                                 for o in outs[:-1]] + [0]
    worker_cls = agent_loop_tq.AgentLoopWorkerTQ.__ray_metadata__.modified_class
    assert _compat.is_wrapped(worker_cls._compute_teacher_logprobs, "distill_coverage")


def test_verls_teacher_config_accepts_an_hfcpu_top_k_teacher_and_still_checks_the_others():
    from verl.workers.config import distillation as D

    import agentcredit.verl.cpu  # noqa: F401  (hooks verl's teacher config)

    check = D.DistillationTeacherModelConfig._validate_topk_logprobs
    assert _compat.is_wrapped(check, "cpu")
    hfcpu = types.SimpleNamespace(inference=types.SimpleNamespace(name="hfcpu"))
    assert check(hfcpu, True, 8) is None
    with pytest.raises(ValueError, match="topk must be specified"):
        check(hfcpu, True, None)
    other = types.SimpleNamespace(inference=types.SimpleNamespace(name="trtllm", engine_kwargs={}))
    with pytest.raises(NotImplementedError, match="trtllm"):
        check(other, True, 8)
