"""Fixtures over the tiny random models of :mod:`snapkv_rag.testing` (no weights to fetch), the embedded model, and test servers."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from snapkv_rag.testing import CHAT_TEMPLATE, CORPUS, TINY_SIZES, build_tokenizer, tiny_config, tiny_engine, tiny_model  # noqa: F401  (tests import them from here)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"]


@pytest.fixture(scope="session")
def engine(tokenizer):
    return tiny_engine("llama", tokenizer)


@pytest.fixture(scope="session")
def embedded_engine():
    from snapkv_rag import Engine

    return Engine.default()


@pytest.fixture(scope="session")
def smollm_tokenizer():
    return load_smollm_tokenizer()


def load_smollm_tokenizer():
    """The real SmolLM2 tokenizer (49K byte-level BPE), loaded offline from the embedded model
    (skips the test when the embedded model is not installed)."""
    from transformers import AutoTokenizer

    from snapkv_rag.errors import ModelNotFoundError
    from snapkv_rag.model.loading import converted_gguf_dir, embedded_gguf_path

    try:
        path = converted_gguf_dir(embedded_gguf_path())
    except ModelNotFoundError as exc:
        pytest.skip(f"the embedded model is not installed: {exc}")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def terse_bias(tokenizer, strength: float = 6.0) -> torch.Tensor:
    """A logits bias toward tokens that close JSON (quotes, braces, brackets, commas) and EOS.

    A random model under a grammar otherwise writes endless strings and numbers; with this
    bias its constrained outputs end within a few dozen tokens while sampling still varies.
    """
    bias = torch.zeros(len(tokenizer))
    for token_id in range(len(tokenizer)):
        piece = tokenizer.decode([token_id])
        if any(ch in piece for ch in '"}],') and len(piece) <= 3:
            bias[token_id] = strength
    bias[tokenizer.eos_token_id] = strength
    return bias


def tiny_tool_engine(tokenizer, *, family: str = "llama", seed: int = 0, bias: torch.Tensor | None = None):
    """A tiny random model over the real SmolLM2 tokenizer, its EOS/BOS/PAD ids aligned to it."""
    from snapkv_rag import Engine

    model = tiny_model(family, len(tokenizer), seed=seed, context=2048)
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.bos_token_id = tokenizer.bos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id
    if bias is not None:
        model.get_output_embeddings().register_forward_hook(lambda _m, _i, out: out + bias.to(out.dtype))
    return Engine(model, tokenizer, name=f"tiny-{family}-smollm2-tokenizer")


def gemma3_engine(tokenizer, sliding_window=256, context=512):
    """A tiny Gemma 3: one sliding-window layer, then one full-attention layer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from snapkv_rag import Engine

    config = AutoConfig.for_model(
        "gemma3_text",
        vocab_size=len(tokenizer),
        head_dim=16,
        max_position_embeddings=context,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        **TINY_SIZES,
    )
    torch.manual_seed(0)
    return Engine(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval(), tokenizer, name="tiny-gemma3")


@contextlib.contextmanager
def running(config):
    """The OpenAI-compatible app for ``config`` (a ``ServerConfig``) under a real uvicorn server
    on a free port, in a thread; yields its base URL."""
    import uvicorn

    from snapkv_rag.server import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


class ForwardProbe:
    """Counts model forwards and the most that ever ran at once (with a short sleep inside)."""

    def __init__(self, model, sleep_s: float = 0.0):
        self.model = model
        self.original = model.forward
        self.calls = 0
        self.active = 0
        self.max_active = 0
        self.sleep_s = sleep_s
        self._guard = threading.Lock()

    def __enter__(self):
        def forward(*args, **kwargs):
            with self._guard:
                self.calls += 1
                self.active += 1
                self.max_active = max(self.max_active, self.active)
            try:
                if self.sleep_s:
                    time.sleep(self.sleep_s)
                return self.original(*args, **kwargs)
            finally:
                with self._guard:
                    self.active -= 1

        self.model.forward = forward
        return self

    def __exit__(self, *exc):
        del self.model.forward


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def chroma_server(tmp_path):
    chroma = Path(sys.executable).parent / "chroma"
    port = free_port()
    log = open(tmp_path / "chroma.log", "wb")
    proc = subprocess.Popen(
        [str(chroma), "run", "--path", str(tmp_path / "server-data"), "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/v2/heartbeat", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"chroma run did not start: {(tmp_path / 'chroma.log').read_text()[-2000:]}") from None
            time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()
