"""Tiny random models (no weights to fetch) and a small byte-level tokenizer built in memory."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris.",
    "Long documents need compressed caches; SnapKV keeps what the question looks at.",
    "Numbers like 1234 and 5678 appear in passkeys. Hello world, hello engine!",
] * 20


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|system|>", "<|assistant|>", "<|tool|>", "<|end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|end|>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"]


def tiny_config(family: str, vocab_size: int, *, context: int = 512):
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=1,
        eos_token_id=8,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    if family in ("llama", "mistral", "qwen2", "qwen3", "gemma"):
        common["head_dim"] = 16
    if family in ("mistral", "qwen2", "qwen3"):
        common["sliding_window"] = None
    if family == "phi3":
        common["pad_token_id"] = 3
    return AutoConfig.for_model(family, **common)


def tiny_model(family: str, vocab_size: int, *, seed: int = 0, context: int = 512):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, vocab_size, context=context), attn_implementation="sdpa")
    return model.eval()


def tiny_engine(family: str = "llama", tokenizer=None, **kwargs):
    from snapkv_rag import Engine

    tokenizer = tokenizer or build_tokenizer()
    return Engine(tiny_model(family, len(tokenizer), **kwargs), tokenizer, name=f"tiny-{family}")


@pytest.fixture(scope="session")
def engine(tokenizer):
    return tiny_engine("llama", tokenizer)


@pytest.fixture(scope="session")
def embedded_engine():
    from snapkv_rag import Engine

    return Engine.default()
