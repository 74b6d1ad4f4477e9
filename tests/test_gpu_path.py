"""The CUDA path's defects a read of the code found (issue 63), each checked on the CPU where its
logic can be: synchronised timings, memory figures over a baseline, LESS's KL on the model's
device, the fp16 fallback, the attention-kernel option, multi-device loading."""

from __future__ import annotations

import torch

from snapkv_rag.model import device_clock as clock_module
from snapkv_rag.testing import tiny_engine


def test_the_device_clock_synchronises_cuda_before_reading(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    clock_module.device_clock(torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 0)]
    clock_module.device_clock(torch.device("cpu"))
    assert len(calls) == 1  # nothing to wait for on a CPU


def test_prefill_and_decode_times_are_read_through_the_device_clock(tokenizer, monkeypatch):
    """Timings read with perf_counter alone measured kernel launches on CUDA."""
    engine = tiny_engine("llama", tokenizer)
    synced = []
    real = clock_module.synchronize
    monkeypatch.setattr(clock_module, "synchronize", lambda device: synced.append(device.type) or real(device))
    result = engine.generate("Count the ships in the harbour.", max_new_tokens=5, ignore_eos=True, compression="snapkv:budget=16,window=4")
    assert result.stats.decode_steps == 4
    # the prefill's two readings and two per decode step (the step's start and end)
    assert synced.count("cpu") >= 2 + 2 * result.stats.decode_steps


def fake_cuda_allocator(monkeypatch, allocated: list[int], peak: list[int]):
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated[0])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak[0])
    return resets


def test_cuda_peak_memory_is_reported_over_its_baseline(monkeypatch):
    """The weights and the prefix cache's contents were inside the CUDA peak figure."""
    from snapkv_rag.model.peak_memory import PeakMemory

    allocated, peak = [16 << 30], [16 << 30]  # 16 GiB of weights before the call
    resets = fake_cuda_allocator(monkeypatch, allocated, peak)
    with PeakMemory(torch.device("cuda", 0)) as measured:
        peak[0] = (16 << 30) + (3 << 30)
    assert measured.kind == "cuda_max_allocated" and measured.peak_bytes == 19 << 30
    assert measured.added_bytes == 3 << 30 and not measured.shared and len(resets) == 1


def test_concurrent_cuda_measurements_do_not_reset_each_other(monkeypatch):
    from snapkv_rag.model.peak_memory import PeakMemory

    allocated, peak = [1 << 30], [1 << 30]
    resets = fake_cuda_allocator(monkeypatch, allocated, peak)
    device = torch.device("cuda", 0)
    first = PeakMemory(device).__enter__()
    peak[0] = 5 << 30  # the first request's prefill peaks ...
    second = PeakMemory(device).__enter__()  # ... and a second request starts: no reset that would lose it
    assert len(resets) == 1
    second.__exit__(None, None, None)
    first.__exit__(None, None, None)
    assert first.peak_bytes == 5 << 30 and first.shared and second.shared
    PeakMemory(device).__enter__().__exit__(None, None, None)
    assert len(resets) == 2  # alone again: reset


def test_less_kl_runs_on_the_models_device():
    """Saved log-probs are CPU tensors and the model's on its device: CUDA raised a device mismatch
    in less train (stage 2), less distill, less calibrate and less gap. A meta tensor stands in for
    the other device here: mixing it with a CPU tensor raises the same error."""
    from snapkv_rag.training.distill import _kl

    saved = torch.randn(3, 7).log_softmax(-1)
    on_device = torch.empty(3, 7, device="meta")
    assert _kl(saved, on_device).device.type == "meta"
    assert abs(float(_kl(saved, saved.clone()))) < 1e-6


def test_an_older_gpu_gets_fp16_not_bf16(monkeypatch):
    from snapkv_rag.model import loading

    monkeypatch.setattr(loading, "_check_device", lambda device: None)  # no GPU here: pretend one is there
    for supported, expected in ((True, torch.bfloat16), (False, torch.float16)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda supported=supported: supported)
        assert loading.choose_device("cuda").dtype == expected
    assert loading.choose_device("cuda", "fp32").dtype == torch.float32  # an explicit dtype is kept


def test_the_attention_kernel_is_an_option_of_every_command():
    from snapkv_rag.cli import build_parser
    from snapkv_rag.cli_common import ATTENTION_KERNELS
    from snapkv_rag.compression.runtime import WRAPPED_IMPLEMENTATIONS

    assert ATTENTION_KERNELS == WRAPPED_IMPLEMENTATIONS
    parser = build_parser()
    for command in (["info"], ["serve"], ["ask", "q", "--collection", "c"], ["tune", "train"], ["less", "distill", "k.safetensors"]):
        args = parser.parse_known_args([*command, "--attn-implementation", "flash_attention_2"])[0]
        assert args.attn_implementation == "flash_attention_2", command


def test_flash_attention_where_it_cannot_run_is_one_clear_error():
    import pytest

    from snapkv_rag.errors import InvalidDeviceError
    from snapkv_rag.model.loading import DeviceChoice, check_attention_kernel

    with pytest.raises(InvalidDeviceError, match="CUDA only"):
        check_attention_kernel("flash_attention_2", DeviceChoice(torch.device("cpu"), torch.bfloat16))
    with pytest.raises(InvalidDeviceError, match="fp16 or bf16"):
        check_attention_kernel("flash_attention_2", DeviceChoice(torch.device("cuda"), torch.float32))
    check_attention_kernel("sdpa", DeviceChoice(torch.device("cpu"), torch.float32))


def test_blended_chunk_reuse_is_refused_under_flash_attention(tokenizer):
    """It passes a 4-D mask, which flash_attention_2 cannot take: prefilled whole, with the reason."""
    engine = tiny_engine("llama", tokenizer)
    doc = "The ferry leaves at nine and returns at noon. " * 4
    engine.model.config._attn_implementation = "snapkv_flash_attention_2"  # what a CUDA load with the option sets
    try:
        request = engine._prepare_kwargs(f"{doc}\nWhen does it leave?", reuse_segments=[doc], max_new_tokens=2)
    finally:
        engine.model.config._attn_implementation = "snapkv_sdpa"
    assert request.segments is None and "flash_attention_2" in request.segment_note
