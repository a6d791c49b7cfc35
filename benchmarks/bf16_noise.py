"""The bf16 noise floor of a per-token log-prob difference: the same sequence scored alone vs. inside a padded batch,
in bf16 and in fp32, and bf16 against fp32.

The hindsight gap (``logp_teacher - logp_old``), AlignOPSD's ``logp_cross`` and CCM's gate subtract log-probs of two
forward passes; on verl both are bf16 passes over differently packed batches, so part of every gap is this noise,
not the prompt's effect. A small Qwen2 is built in code (random weights, no model hub; a larger
``initializer_range`` than the default gives peaked next-token distributions like a trained model's):

    python benchmarks/bf16_noise.py                      # hidden 256, 4 layers, vocab 8192, 128 tokens, batch 8
    python benchmarks/bf16_noise.py --hidden 512 --layers 8 --threads 2

Prints, per comparison, the max and mean absolute difference of the per-token log-probs of the target sequence.
"""

from __future__ import annotations

import argparse
import json

import torch


def build_model(hidden: int, layers: int, vocab: int, seed: int = 0, init: float = 0.1):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(hidden // 64, 2), num_key_value_heads=max(hidden // 128, 1),
                      max_position_embeddings=4096, initializer_range=init, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).eval()


def token_logprobs(model, ids: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, T-1]`` float32 log-probs of tokens 1.. under ``model`` cast to ``dtype`` (logits upcast to fp32 before
    the log-softmax, as verl does)."""
    m = model.to(dtype)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = m(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1)
    return lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def measure(hidden=256, layers=4, vocab=8192, length=128, batch=8, seed=0) -> dict[str, dict[str, float]]:
    model = build_model(hidden, layers, vocab, seed)
    g = torch.Generator().manual_seed(seed + 1)
    target = torch.randint(0, vocab, (length,), generator=g)
    others = [torch.randint(0, vocab, (int(n),), generator=g)
              for n in torch.randint(length // 2, 2 * length, (batch - 1,), generator=g)]
    width = max(length, *(len(o) for o in others))
    # the target sits in the middle of a left-padded batch (verl's prompt layout) of other lengths
    rows = others[: batch // 2] + [target] + others[batch // 2:]
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    at = batch // 2
    out = {}
    alone, in_batch = {}, {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        alone[name] = token_logprobs(model, target.unsqueeze(0), torch.ones(1, length, dtype=torch.long), dtype)[0]
        in_batch[name] = token_logprobs(model, ids, mask, dtype)[at, width - length:]

    def stats(a, b):
        d = (a.double() - b.double()).abs()
        return {"max_abs": float(d.max()), "mean_abs": float(d.mean())}

    out["fp32: alone vs padded batch"] = stats(alone["fp32"], in_batch["fp32"])
    out["bf16: alone vs padded batch"] = stats(alone["bf16"], in_batch["bf16"])
    out["bf16 vs fp32 (alone)"] = stats(alone["bf16"], alone["fp32"])
    out["bf16 vs fp32 (batch)"] = stats(in_batch["bf16"], in_batch["fp32"])
    out["bf16: alone, scored twice"] = stats(
        alone["bf16"], token_logprobs(model, target.unsqueeze(0), torch.ones(1, length, dtype=torch.long),
                                      torch.bfloat16)[0])
    out["mean |log-prob| (fp32)"] = {"max_abs": float(alone["fp32"].abs().max()),
                                     "mean_abs": float(alone["fp32"].abs().mean())}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = measure(args.hidden, args.layers, args.vocab, args.length, args.batch, args.seed)
    if args.json:
        print(json.dumps(res))
        return
    print(f"Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; target {args.length} tokens in a "
          f"left-padded batch of {args.batch}; per-token log-prob differences")
    for k, v in res.items():
        print(f"  {k:34s} max {v['max_abs']:.3e}  mean {v['mean_abs']:.3e}")


if __name__ == "__main__":
    main()
