"""oneDNN-packed linear weights (issue 25): exact in bf16, the loader's default on the CPU, gradients
through :func:`unpacked_linears`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from snapkv_rag.model.packed_linear import (
    FusedLinears,
    FusedMember,
    PackedLinear,
    pack_linear_weights,
    packing_available,
    unpacked_linears,
    weight_layout,
)
from snapkv_rag.model.quantization import parameter_count

DTYPES = [d for d in (torch.float32, torch.bfloat16) if packing_available(d)]
pytestmark = pytest.mark.skipif(not DTYPES, reason="this torch/CPU cannot pack linear weights for oneDNN")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (7,), (2, 300)])
def test_a_packed_layer_computes_what_the_linear_did(dtype, bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias, dtype=dtype)
    packed = PackedLinear(linear)
    x = torch.randn(*shape, 96, dtype=dtype)
    with torch.inference_mode():
        expected, got = linear(x), packed(x)
    assert got.shape == expected.shape
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)  # the same oneDNN kernel, without the per-call reorder
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.weight, linear.weight.detach())  # rebuilt exactly
    plain = packed.to_linear()
    assert type(plain) is nn.Linear and torch.equal(plain.weight, linear.weight.detach())


def test_a_forward_that_needs_gradients_takes_the_plain_weight():
    torch.manual_seed(0)
    dtype = DTYPES[0]
    linear = nn.Linear(32, 16, dtype=dtype).requires_grad_(False)
    packed = PackedLinear(linear)
    x = torch.randn(4, 32, dtype=dtype, requires_grad=True)
    packed(x).square().sum().backward()
    expected = x.grad.clone()
    x.grad = None
    linear(x).square().sum().backward()
    torch.testing.assert_close(expected, x.grad)


def test_packing_refuses_what_onednn_cannot_pack():
    with pytest.raises(ValueError, match="cannot pack"):
        PackedLinear(nn.Linear(8, 8, dtype=torch.float16))
    model = nn.Sequential(nn.Linear(8, 8, dtype=torch.float16))
    assert pack_linear_weights(model) == 0 and weight_layout(model) == "plain"


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])
def test_a_packed_model_decodes_the_same_tokens(family):
    from conftest import build_tokenizer, tiny_model

    from snapkv_rag import Engine
    from snapkv_rag.reuse.segment_store import model_signature

    dtype = torch.bfloat16 if torch.bfloat16 in DTYPES else torch.float32
    tokenizer = build_tokenizer()
    plain_model = tiny_model(family, len(tokenizer), seed=3).to(dtype)
    reference = Engine(plain_model, tokenizer, name="tiny")
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    options = dict(max_new_tokens=8, ignore_eos=True)
    expected = [reference.generate(prompt, **options, compression=c).token_ids for c in (None, "snapkv:budget=24,window=8")]
    count, signature = parameter_count(plain_model), model_signature(plain_model, "tiny")

    model = tiny_model(family, len(tokenizer), seed=3).to(dtype)
    linears = sum(1 for m in model.modules() if type(m) is nn.Linear)
    assert pack_linear_weights(model, fuse=False) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    engine = Engine(model, tokenizer, name="tiny")
    assert engine.info().weight_layout == "onednn-packed" and reference.info().weight_layout == "plain"
    assert engine.info().parameters == count
    assert model_signature(model, "tiny") != signature
    got = [engine.generate(prompt, **options, compression=c).token_ids for c in (None, "snapkv:budget=24,window=8")]
    if dtype == torch.bfloat16:
        assert got == expected
    else:  # another fp32 kernel: logits within rounding, so compare scores rather than near-tied argmaxes
        torch.testing.assert_close(engine.score(prompt, expected[0]), reference.score(prompt, expected[0]), rtol=1e-3, atol=1e-3)


def test_unpacked_linears_gives_plain_layers_for_the_duration():
    from conftest import build_tokenizer, tiny_model

    tokenizer = build_tokenizer()
    model = tiny_model("llama", len(tokenizer)).to(DTYPES[0])
    pack_linear_weights(model)
    before = [id(m) for m in model.modules() if isinstance(m, PackedLinear)]
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    with unpacked_linears(model):
        assert weight_layout(model) == "plain"
        embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        model(inputs_embeds=embeddings).logits.float().logsumexp(-1).sum().backward()
        assert embeddings.grad is not None and embeddings.grad.abs().sum() > 0
    assert [id(m) for m in model.modules() if isinstance(m, PackedLinear)] == before


def test_the_loader_packs_on_the_cpu_unless_told_not_to(tmp_path):
    from conftest import build_tokenizer, tiny_model

    from snapkv_rag import Engine

    tokenizer = build_tokenizer()
    tiny_model("llama", len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    for dtype in DTYPES:
        packed = Engine.from_pretrained(str(tmp_path), device="cpu", dtype=str(dtype).removeprefix("torch."))
        plain = Engine.from_pretrained(str(tmp_path), device="cpu", dtype=str(dtype).removeprefix("torch."), pack_weights=False)
        assert packed.info().weight_layout == "onednn-packed+fused" and plain.info().weight_layout == "plain"
        assert packed.info().parameters == plain.info().parameters
        prompt = "one two three four five six seven eight"
        tokens = plain.generate(prompt, max_new_tokens=5, ignore_eos=True).token_ids
        torch.testing.assert_close(packed.score(prompt, tokens), plain.score(prompt, tokens), rtol=2e-2, atol=2e-2)
    int8 = Engine.from_pretrained(str(tmp_path), device="cpu", weights="int8")
    assert int8.info().weights == "int8" and int8.info().weight_layout == "onednn-packed+fused"  # the float head packed, int8 siblings fused


def test_a_tied_head_is_packed_apart_but_counted_once():
    from conftest import build_tokenizer, tiny_config
    from transformers import AutoModelForCausalLM

    from snapkv_rag.model.packed_linear import packed_weight_bytes

    tokenizer = build_tokenizer()
    config = tiny_config("llama", len(tokenizer))
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval().to(DTYPES[0])
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    count = parameter_count(model)
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
    pack_linear_weights(model)
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.copy_of_tied_weight
    assert parameter_count(model) == count  # the head's copy is memory, not more parameters
    assert packed_weight_bytes(model) >= head.packed_bytes == head.in_features * head.out_features * head.packed.element_size()
    with torch.inference_mode():
        got = model(input_ids=ids).logits
    if DTYPES[0] == torch.bfloat16:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def _siblings(dtype, bias=False):
    torch.manual_seed(0)
    return [nn.Linear(48, out, bias=bias, dtype=dtype) for out in (32, 16, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_siblings_compute_what_each_linear_did(dtype, bias):
    linears = _siblings(dtype, bias)
    group = FusedLinears(linears)
    members = [FusedMember(group, i, m) for i, m in enumerate(linears)]
    x, y = torch.randn(3, 48, dtype=dtype), torch.randn(3, 48, dtype=dtype)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    with torch.inference_mode():
        # in call order on one input, out of order, a member twice, another input midway
        for calls in ([(0, x), (1, x), (2, x)], [(2, x), (0, x), (0, x), (1, y), (1, x), (2, y)]):
            for index, inp in calls:
                torch.testing.assert_close(members[index](inp), linears[index](inp), **tolerance)
    for member, linear in zip(members, linears):
        torch.testing.assert_close(member.weight, linear.weight.detach(), rtol=0, atol=0)
        assert torch.equal(member.to_linear().weight, linear.weight.detach())


def test_fusing_refuses_mixed_widths_and_mixed_biases():
    dtype = DTYPES[0]
    with pytest.raises(ValueError, match="input width"):
        FusedLinears([nn.Linear(8, 4, dtype=dtype), nn.Linear(6, 4, dtype=dtype)])
    with pytest.raises(ValueError, match="bias"):
        FusedLinears([nn.Linear(8, 4, dtype=dtype), nn.Linear(8, 4, bias=False, dtype=dtype)])


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_the_loader_fuses_projections_that_read_one_input(family):
    from conftest import build_tokenizer, tiny_model

    dtype = DTYPES[0]
    tokenizer = build_tokenizer()
    plain = tiny_model(family, len(tokenizer), seed=1).to(dtype)
    model = tiny_model(family, len(tokenizer), seed=1).to(dtype)
    pack_linear_weights(model)
    assert weight_layout(model) == "onednn-packed+fused"
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        assert all(isinstance(getattr(attention, n), FusedMember) for n in ("q_proj", "k_proj", "v_proj"))
        assert all(isinstance(getattr(mlp, n), FusedMember) for n in ("gate_proj", "up_proj"))
        assert attention.q_proj.group is attention.v_proj.group is not mlp.up_proj.group
        assert type(attention.o_proj) is PackedLinear and type(mlp.down_proj) is PackedLinear  # read other inputs
    assert type(model.get_output_embeddings()) is PackedLinear
    ids = torch.tensor([[1, 5, 9, 12, 7, 3, 8]])
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-3, atol=1e-3)
    with unpacked_linears(model):
        assert weight_layout(model) == "plain"
        with torch.inference_mode():
            torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-3, atol=1e-3)
    assert weight_layout(model) == "onednn-packed+fused"

    unfused = tiny_model(family, len(tokenizer), seed=1).to(dtype)
    pack_linear_weights(unfused, fuse=False)
    assert weight_layout(unfused) == "onednn-packed" and not any(isinstance(m, FusedMember) for m in unfused.modules())
