"""Tiny random models for tests and benchmarks: a 400-token byte-level tokenizer with a chat
template, trained in memory, and 2-layer models of the common families built from configs, so
nothing is fetched and a forward takes milliseconds. The package's own tests, its benchmarks
and integrations' tests build their engines from these::

    from snapkv_rag.testing import tiny_engine

    engine = tiny_engine("llama", context=4096)  # random weights: the text is noise, the shapes and paths are real
    print(engine.generate("Hello", max_new_tokens=4, compression="snapkv:budget=64").stats.kept_tokens_per_layer)
"""

from __future__ import annotations

from typing import Any

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris.",
    "Long documents need compressed caches; SnapKV keeps what the question looks at.",
    "Numbers like 1234 and 5678 appear in passkeys. Hello world, hello engine!",
] * 20

# Sizes and special ids every tiny model shares (the tiny tokenizer's BOS, EOS and PAD).
TINY_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=8,
    pad_token_id=3,
)


def build_tokenizer():
    """A 400-token byte-level BPE tokenizer with a chat template (BOS 1, PAD 3, EOS 8)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|system|>", "<|assistant|>", "<|tool|>", "<|end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>", unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(family: str, vocab_size: int, *, context: int = 512):
    """The config of a tiny ``family`` model (llama, mistral, qwen2, qwen3, gemma, phi3, ...)."""
    from transformers import AutoConfig

    common: dict[str, Any] = dict(vocab_size=vocab_size, max_position_embeddings=context, tie_word_embeddings=False, **TINY_SIZES)
    if family in ("llama", "mistral", "qwen2", "qwen3", "gemma"):
        common["head_dim"] = 16
    if family in ("mistral", "qwen2", "qwen3"):
        common["sliding_window"] = None
    return AutoConfig.for_model(family, **common)


def tiny_model(family: str, vocab_size: int, *, seed: int = 0, context: int = 512):
    """A random tiny ``family`` model in eval mode, its weights drawn from ``seed``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, vocab_size, context=context), attn_implementation="sdpa")
    return model.eval()


def tiny_engine(family: str = "llama", tokenizer=None, **kwargs):
    """An :class:`~snapkv_rag.Engine` over :func:`tiny_model` and :func:`build_tokenizer` (``kwargs``: ``seed``, ``context``)."""
    from .engine.engine import Engine

    tokenizer = tokenizer or build_tokenizer()
    return Engine(tiny_model(family, len(tokenizer), **kwargs), tokenizer, name=f"tiny-{family}")
