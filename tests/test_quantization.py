"""Weight-only int8 linear layers (issue 25): the kernel path, the dequantized path, the choice of
format per device, and an engine that runs on them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from snapkv_rag.errors import InvalidDeviceError
from snapkv_rag.model.quantization import (
    INT8_KERNEL_MAX_ROWS,
    Int8Linear,
    choose_weights,
    int8_kernel_available,
    parameter_count,
    quantize_linear_weights,
    weight_format,
)

pytestmark = pytest.mark.skipif(not int8_kernel_available(), reason="this torch has no aten._weight_int8pack_mm")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, INT8_KERNEL_MAX_ROWS, INT8_KERNEL_MAX_ROWS + 1, 200])
def test_int8_linear_matches_the_float_layer(dtype, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True).to(dtype)
    quantized = Int8Linear(linear)
    x = torch.randn(2, rows, 96, dtype=dtype)
    out = quantized(x)
    assert out.shape == (2, rows, 40) and out.dtype == dtype
    # int8 per-channel rounding moves each weight by at most half a step: a few 1e-3 relative
    assert relative_error(out, linear(x)) < 0.02
    # and it is exactly the dequantized weight the layer reports
    tolerance = 0.02 if dtype == torch.bfloat16 else 1e-4
    assert relative_error(out, nn.functional.linear(x, quantized.weight, quantized.bias)) < tolerance


def test_kernel_and_dequantized_paths_agree():
    torch.manual_seed(1)
    quantized = Int8Linear(nn.Linear(64, 48, bias=False))
    x = torch.randn(INT8_KERNEL_MAX_ROWS + 8, 64)
    few = torch.cat([quantized(x[i : i + 1]) for i in range(len(x))])  # each row alone: the kernel
    many = quantized(x)  # more rows than the kernel takes: the dequantized product
    assert relative_error(few, many) < 1e-4
    assert quantized.qweight.dtype == torch.int8 and quantized.qweight.abs().max() <= 127


def test_layers_the_kernel_cannot_take_keep_their_weights():
    model = nn.Sequential(nn.Linear(32, 24), nn.Linear(24, 16), nn.Linear(16, 8))
    assert quantize_linear_weights(model) == 2  # 24 inputs: not a multiple of 16
    assert [type(m).__name__ for m in model] == ["Int8Linear", "Linear", "Int8Linear"]
    assert model(torch.randn(1, 32)).shape == (1, 8)


def test_choose_weights():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_weights(None, cpu) == "native"  # an option: it costs the embedded model answers
    assert choose_weights(None, cuda) == "native"
    assert choose_weights("NATIVE", cpu) == "native"
    assert choose_weights("int8", cpu) == "int8"
    with pytest.raises(InvalidDeviceError, match="CPU"):
        choose_weights("int8", cuda)
    with pytest.raises(InvalidDeviceError, match="unknown weights format 'int4'"):
        choose_weights("int4", cpu)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_a_quantized_model_decodes_like_the_float_one(family):
    from conftest import build_tokenizer, tiny_model

    from snapkv_rag import Engine
    from snapkv_rag.reuse.segment_store import model_signature

    tokenizer = build_tokenizer()
    native = tiny_model(family, len(tokenizer), seed=2)
    reference = Engine(native, tokenizer, name="tiny")
    signature = model_signature(native, "tiny")
    prompt = "the quick brown fox jumps over the lazy dog " * 6
    expected = reference.score(prompt, reference.generate(prompt, max_new_tokens=6, ignore_eos=True).token_ids)
    count = parameter_count(native)

    quantized = tiny_model(family, len(tokenizer), seed=2)
    replaced = quantize_linear_weights(quantized)
    assert replaced == sum(1 for m in quantized.modules() if isinstance(m, Int8Linear)) > 0
    assert type(quantized.get_output_embeddings()) is nn.Linear  # the head keeps its dtype by default
    assert isinstance(quantized.get_input_embeddings(), nn.Embedding)  # lookups stay exact
    engine = Engine(quantized, tokenizer, name="tiny")
    assert engine.info().weights == "int8" and reference.info().weights == "native"
    assert engine.info().parameters == count
    assert engine.vocab_size == reference.vocab_size
    assert model_signature(quantized, "tiny") != signature  # stored segment K/V are not shared across formats

    result = engine.generate(prompt, max_new_tokens=6, ignore_eos=True, compression="snapkv:budget=32,window=8")
    assert result.usage.completion_tokens == 6
    got = engine.score(prompt, reference.generate(prompt, max_new_tokens=6, ignore_eos=True).token_ids)
    p, q = torch.log_softmax(expected.float(), -1), torch.log_softmax(got.float(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert float(kl.max()) < 0.05
    assert weight_format(quantized) == "int8"


def test_the_output_head_can_be_quantized_too():
    from conftest import build_tokenizer, tiny_model

    tokenizer = build_tokenizer()
    model = tiny_model("llama", len(tokenizer))
    model.config.tie_word_embeddings = True
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert quantize_linear_weights(model, output_head=True) == before
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    assert type(model.get_input_embeddings()) is nn.Embedding
    assert model.config.tie_word_embeddings is False  # a later tie_weights() keeps the int8 head


def test_from_pretrained_loads_int8_when_asked(tmp_path):
    from conftest import build_tokenizer, tiny_model

    from snapkv_rag import Engine

    tokenizer = build_tokenizer()
    tiny_model("llama", len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert Engine.from_pretrained(str(tmp_path), device="cpu", weights="int8").info().weights == "int8"
    native = Engine.from_pretrained(str(tmp_path), device="cpu")
    assert native.info().weights == "native"
    assert not any(isinstance(m, Int8Linear) for m in native.model.modules())
    with pytest.raises(InvalidDeviceError):
        Engine.from_pretrained(str(tmp_path), device="cpu", weights="fp4")


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biases on q/k/v
def test_int8_siblings_share_one_weight_and_give_the_same_logits(family):
    from conftest import build_tokenizer, tiny_model

    from snapkv_rag import Engine
    from snapkv_rag.engine.compiled_decode import unavailable_reason
    from snapkv_rag.model.packed_linear import FusedMember
    from snapkv_rag.model.quantization import fuse_int8_siblings

    tokenizer = build_tokenizer()
    separate = tiny_model(family, len(tokenizer), seed=4)
    quantize_linear_weights(separate)
    fused = tiny_model(family, len(tokenizer), seed=4)
    quantize_linear_weights(fused)
    count = parameter_count(fused)
    assert fuse_int8_siblings(fused) == 2 * fused.config.num_hidden_layers  # q/k/v and gate/up of every layer
    members = [m for m in fused.modules() if isinstance(m, FusedMember)]
    assert len(members) == 5 * fused.config.num_hidden_layers and weight_format(fused) == "int8" and parameter_count(fused) == count
    prompt = "the quick brown fox jumps over the lazy dog " * 4
    a, b = Engine(separate, tokenizer), Engine(fused, tokenizer, compile_decode=unavailable_reason(fused) is None)
    tokens = a.generate(prompt, max_new_tokens=8, ignore_eos=True).token_ids
    # the same int8 values and scales; a wider product may sum in another order
    torch.testing.assert_close(a.score(prompt, tokens), b.score(prompt, tokens), atol=1e-5, rtol=1e-4)
    decoded = b.generate(prompt, max_new_tokens=8, ignore_eos=True)
    assert decoded.token_ids == tokens
    assert decoded.stats.decode_step == ("compiled" if unavailable_reason(fused) is None else "eager (compile_decode is off)")
