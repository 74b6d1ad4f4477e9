"""The CUDA path's defects a read of the code found (issue 63), each checked on the CPU where its
logic can be: synchronised timings, memory figures over a baseline, LESS's KL on the model's
device, the fp16 fallback, the attention-kernel option, multi-device loading."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from snapkv_rag.model import device_clock as clock_module
from snapkv_rag.testing import tiny_engine


class SpreadModel:
    """A model's placement under a device_map over two GPUs (no GPU here: only the devices are read)."""

    def parameters(self):
        return iter([SimpleNamespace(device=torch.device("cuda", 0)), SimpleNamespace(device=torch.device("cuda", 1))])


def fake_gpus_with_queued_work(monkeypatch) -> tuple[dict[torch.device, bool], list[dict[torch.device, bool]]]:
    """Two GPUs with kernels queued (True: unfinished) that only a synchronize finishes, and the
    queue's state each time the clock is read."""
    queued = {torch.device("cuda", 0): True, torch.device("cuda", 1): True}
    readings: list[dict[torch.device, bool]] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: queued.__setitem__(torch.device(device), False))
    monkeypatch.setattr(clock_module, "time", SimpleNamespace(perf_counter=lambda: readings.append(dict(queued)) or 0.0))
    return queued, readings


def test_the_device_clock_reads_after_the_queued_work_is_done(monkeypatch):
    queued, readings = fake_gpus_with_queued_work(monkeypatch)
    clock_module.device_clock(torch.device("cuda", 0))
    assert readings[-1][torch.device("cuda", 0)] is False  # read once cuda:0's kernels had finished
    queued[torch.device("cuda", 0)] = True
    clock_module.device_clock(torch.device("cpu"))
    assert readings[-1][torch.device("cuda", 0)] is True  # a CPU's reading waits for no GPU


def test_under_a_device_map_the_clock_waits_for_every_gpu_the_model_spans(monkeypatch):
    """The engine times from its first device; the last layers' kernels queue on the last GPU."""
    from snapkv_rag.model.placement import note_placement

    queued, readings = fake_gpus_with_queued_work(monkeypatch)
    model = SpreadModel()
    note_placement(model)
    clock_module.device_clock(torch.device("cuda", 0))
    assert readings[-1] == {torch.device("cuda", 0): False, torch.device("cuda", 1): False}
    del model  # forgotten with the model


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


def test_under_a_device_map_peaks_add_up_every_gpu_the_model_spans(monkeypatch):
    from snapkv_rag.model.peak_memory import PeakMemory
    from snapkv_rag.model.placement import note_placement

    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    allocated = {gpus[0]: 6 << 30, gpus[1]: 5 << 30}  # the weights, split over two GPUs
    peak = dict(allocated)
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(torch.device(device)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated[torch.device(device)])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak[torch.device(device)])
    model = SpreadModel()
    note_placement(model)
    with PeakMemory(gpus[0]) as measured:
        peak[gpus[0]] += 1 << 30  # the first layers' K/V ...
        peak[gpus[1]] += 2 << 30  # ... and the last layers', on the second GPU
    assert resets == gpus
    assert measured.baseline_bytes == 11 << 30 and measured.peak_bytes == 14 << 30 and measured.added_bytes == 3 << 30


def test_less_kl_runs_on_the_models_device():
    """Saved log-probs are CPU tensors and the model's on its device: CUDA raised a device mismatch
    in less train (stage 2), less distill, less calibrate and less gap. A meta tensor stands in for
    the other device here: mixing it with a CPU tensor raises the same error."""
    from snapkv_rag.less_training.distill import _kl

    saved = torch.randn(3, 7).log_softmax(-1)
    on_device = torch.empty(3, 7, device="meta")
    assert _kl(saved, on_device).device.type == "meta"
    assert abs(float(_kl(saved, saved.clone()))) < 1e-6


def test_an_older_gpu_gets_fp16_not_bf16(monkeypatch):
    """The dtype follows the compute capability of the GPU asked for: PyTorch's is_bf16_supported()
    says yes on a V100 or T4 (it emulates bf16) and answers for the current device, not cuda:N."""
    from snapkv_rag.model import loading

    monkeypatch.setattr(loading, "_check_device", lambda device: None)  # no GPU here: pretend four are there
    capabilities = {0: (8, 0), 1: (7, 0), 2: (7, 5), 3: (9, 0)}  # the current one an A100, then a V100, a T4, an H100

    def capability(device=None):
        index = None if device is None else torch.device(device).index if not isinstance(device, int) else device
        return capabilities[0 if index is None else index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # what PyTorch says on all four
    expected = {"cuda": torch.bfloat16, "cuda:0": torch.bfloat16, "cuda:1": torch.float16, "cuda:2": torch.float16, "cuda:3": torch.bfloat16}
    assert {device: loading.choose_device(device).dtype for device in expected} == expected
    assert loading.choose_device("cuda:1", "bf16").dtype == torch.bfloat16  # an explicit dtype is kept


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


def test_metrics_carry_gpu_memory_gauges_for_a_cuda_engine(monkeypatch):
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from snapkv_rag.server.metrics import gpu_memory_gauges

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 << 30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 << 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=80 << 30))
    registry = CollectorRegistry()
    gpu_memory_gauges(registry, torch.device("cuda", 0))
    values = {
        name: registry.get_sample_value(name)
        for name in ("snapkv_gpu_memory_allocated_bytes", "snapkv_gpu_memory_reserved_bytes", "snapkv_gpu_memory_total_bytes")
    }
    assert values == {"snapkv_gpu_memory_allocated_bytes": 3 << 30, "snapkv_gpu_memory_reserved_bytes": 4 << 30, "snapkv_gpu_memory_total_bytes": 80 << 30}
    assert "snapkv_gpu_memory_allocated_bytes" in generate_latest(registry).decode()


def test_a_device_map_loads_and_generates_and_refuses_one_device_paths(tokenizer, tmp_path, monkeypatch):
    """device_map goes to transformers' loader (here every module on the CPU); a model spread
    over several devices refuses rolling and blended chunk reuse with one clear error or note,
    and prefix reuse puts each layer's K/V on that layer's device."""
    import pytest

    from snapkv_rag import Engine
    from snapkv_rag.engine import preparation
    from snapkv_rag.errors import InvalidCompressionError
    from snapkv_rag.model.placement import layer_devices
    from snapkv_rag.testing import tiny_model

    model = tiny_model("llama", len(tokenizer))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = Engine.from_pretrained(str(tmp_path), device_map={"": "cpu"}, dtype="float32", adapter=None)
    assert set(layer_devices(engine.model).values()) == {torch.device("cpu")}
    plain = tiny_engine("llama", tokenizer)
    prompt = "The ferry leaves at nine and returns at noon. " * 4
    assert engine.generate(prompt, max_new_tokens=5, ignore_eos=True).token_ids == plain.generate(prompt, max_new_tokens=5, ignore_eos=True).token_ids
    follow_up = prompt + "When does it come back?"  # opens with the stored prompt: its K/V come back layer by layer
    reused = engine.generate(follow_up, max_new_tokens=5, ignore_eos=True)
    assert reused.stats.reused_prompt_tokens > 0
    assert reused.token_ids == plain.generate(follow_up, max_new_tokens=5, ignore_eos=True, prefix_cache=False).token_ids

    monkeypatch.setattr(preparation, "spans_devices", lambda model: True)  # as if its layers sat on two GPUs
    with pytest.raises(InvalidCompressionError, match="device_map"):
        engine.generate(prompt, max_new_tokens=2, compression="snapkv:budget=16,window=4,rolling=16")
    request = engine._prepare_kwargs(prompt + "When?", reuse_segments=[prompt.strip()], max_new_tokens=2)
    assert request.segments is None and "device_map" in request.segment_note


def test_stored_chunk_kv_is_page_locked_where_a_gpu_reads_it(monkeypatch):
    """Chunk K/V were pageable CPU tensors copied to the GPU per layer per prompt."""
    from snapkv_rag.reuse.blending import host_copy

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.shape) or self)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    host_copy(torch.ones(2, 3))
    assert pinned == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert host_copy(torch.ones(2, 3)).device.type == "cpu" and pinned == [torch.Size([2, 3])]
