"""LESS feature maps (``phi`` per query head, ``psi`` per KV head) for every layer, on disk as safetensors.

Per layer, with ``d`` = head_dim, hidden ``h`` and rank ``R``:

- ``phi(q) = |gelu(q W1 + b1) W2 + b2|`` with one MLP per *query* head,
- ``psi(k) = |(gelu(k W1 + b1) W2 + b2) M| * scale`` with one MLP per *KV* head, an ``R x R``
  interaction ``M`` and a non-negative per-feature ``scale`` (less.md).

All-zero kernels give zero features, so the low-rank term vanishes (the base policy's output).
A file holds the tensors ``layers.{i}.{phi,psi}.{w1,b1,w2,b2}``, ``layers.{i}.psi.{mix,scale}``
and a JSON header under the metadata key ``less`` naming the model signature, the base policy,
its budget, the rank and how the kernels were trained. :func:`load_kernels` refuses a file made
for another model or shape.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import InvalidCompressionError

SHIPPED_DIR = Path(__file__).with_name("shipped")
FORMAT = "snapkv-rag-less/1"
_SIGNATURE_KEYS = ("model_type", "num_layers", "num_query_heads", "num_kv_heads", "head_dim", "vocab_size")
_DIGEST_RTOL = 1e-3


def model_signature(model) -> dict[str, Any]:
    """Shape of ``model``'s attention plus a weight digest (mean |embedding|), to tell models apart."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    weight = model.get_input_embeddings().weight
    return {
        "model_type": config.model_type,
        "num_layers": config.num_hidden_layers,
        "num_query_heads": heads,
        "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "vocab_size": config.vocab_size,
        "embedding_digest": float(weight.detach().float().abs().mean()),
    }


def signature_mismatch(stored: dict[str, Any], actual: dict[str, Any]) -> str | None:
    """Why kernels made for ``stored`` do not fit ``actual`` (None when they do)."""
    for key in _SIGNATURE_KEYS:
        if stored.get(key) != actual.get(key):
            return f"{key} is {stored.get(key)!r} in the kernels but {actual.get(key)!r} in the model"
    a, b = float(stored.get("embedding_digest", 0.0)), float(actual["embedding_digest"])
    if abs(a - b) > _DIGEST_RTOL * max(abs(a), abs(b)):
        return f"the kernels were trained for other weights (embedding digest {a:.6g} vs {b:.6g})"
    return None


def _mlp(x: torch.Tensor, w1, b1, w2, b2) -> torch.Tensor:
    """Per-head MLP: ``x [b, heads, n, d] -> [b, heads, n, R]`` (no final absolute value)."""
    hidden = F.gelu(torch.einsum("bhnd,hdk->bhnk", x, w1) + b1[:, None, :])
    return torch.einsum("bhnk,hkr->bhnr", hidden, w2) + b2[:, None, :]


@dataclass(eq=False)
class LayerKernels:
    """One layer's ``phi`` (query heads) and ``psi`` (KV heads) parameters, fp32."""

    phi: dict[str, torch.Tensor]  # w1 [hq, d, h], b1 [hq, h], w2 [hq, h, R], b2 [hq, R]
    psi: dict[str, torch.Tensor]  # the same per KV head, plus mix [hkv, R, R], scale [hkv, R]

    @property
    def rank(self) -> int:
        return int(self.phi["w2"].shape[-1])

    def query_features(self, queries: torch.Tensor) -> torch.Tensor:
        """``phi``: ``[b, q_heads, t, d] -> [b, q_heads, t, R]``, non-negative, fp32."""
        p = self.phi
        return _mlp(queries.float(), p["w1"], p["b1"], p["w2"], p["b2"]).abs()

    def key_features(self, keys: torch.Tensor) -> torch.Tensor:
        """``psi``: ``[b, kv_heads, n, d] -> [b, kv_heads, n, R]``, non-negative, fp32."""
        p = self.psi
        mixed = torch.einsum("bhnr,hrs->bhns", _mlp(keys.float(), p["w1"], p["b1"], p["w2"], p["b2"]), p["mix"])
        return mixed.abs() * p["scale"].abs()[None, :, None, :]

    def to(self, device: torch.device) -> "LayerKernels":
        return LayerKernels({k: v.to(device) for k, v in self.phi.items()}, {k: v.to(device) for k, v in self.psi.items()})


@dataclass(eq=False)
class LessKernels:
    """Per-layer kernels plus the header that says what they were made for."""

    layers: dict[int, LayerKernels]
    header: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return next(iter(self.layers.values())).rank

    def to(self, device: torch.device) -> "LessKernels":
        return LessKernels({i: k.to(device) for i, k in self.layers.items()}, self.header)

    @classmethod
    def zeros(cls, signature: dict[str, Any], *, rank: int = 8, hidden: int = 16, layers: list[int] | None = None, **header: Any) -> "LessKernels":
        """All-zero kernels (no low-rank contribution), for tests and as a shape reference."""
        hq, hkv, d = signature["num_query_heads"], signature["num_kv_heads"], signature["head_dim"]

        def mlp(heads: int) -> dict[str, torch.Tensor]:
            return {
                "w1": torch.zeros(heads, d, hidden),
                "b1": torch.zeros(heads, hidden),
                "w2": torch.zeros(heads, hidden, rank),
                "b2": torch.zeros(heads, rank),
            }

        indices = range(signature["num_layers"]) if layers is None else layers
        built = {i: LayerKernels(mlp(hq), {**mlp(hkv), "mix": torch.zeros(hkv, rank, rank), "scale": torch.zeros(hkv, rank)}) for i in indices}
        return cls(built, {"format": FORMAT, "model": signature, "rank": rank, "hidden": hidden, **header})

    @classmethod
    def initial(
        cls, signature: dict[str, Any], *, rank: int = 8, hidden: int = 16, seed: int = 0, scale: float = 1e-4, layers: list[int] | None = None, **header: Any
    ) -> "LessKernels":
        """Random kernels as training starts them: Gaussian MLPs, identity ``mix``, ``scale`` everywhere
        (small, so the low-rank term starts near zero and the output near the base policy's)."""
        kernels = cls.zeros(signature, rank=rank, hidden=hidden, layers=layers, **header)
        generator = torch.Generator().manual_seed(seed)
        for layer in kernels.layers.values():
            for params in (layer.phi, layer.psi):
                d, h = params["w1"].shape[1:]
                params["w1"].normal_(0.0, d**-0.5, generator=generator)
                params["w2"].normal_(0.0, h**-0.5, generator=generator)
                params["b2"].fill_(0.1)
            layer.psi["mix"].copy_(torch.eye(rank).expand_as(layer.psi["mix"]))
            layer.psi["scale"].fill_(scale)
        return kernels

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as stored: fp16 (files stay small), except the fp32 ``psi`` scales."""
        out = {}
        for i, layer in self.layers.items():
            for part, params in (("phi", layer.phi), ("psi", layer.psi)):
                for name, tensor in params.items():
                    dtype = torch.float32 if name == "scale" else torch.float16
                    out[f"layers.{i}.{part}.{name}"] = tensor.detach().to(dtype).contiguous().cpu()
        return out

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors(), str(path), metadata={"less": json.dumps(self.header, sort_keys=True)})
        return path

    def check_model(self, signature: dict[str, Any], source: str = "these kernels") -> None:
        why = signature_mismatch(self.header.get("model", {}), signature)
        if why:
            raise InvalidCompressionError(f"LESS: {source} do not fit this model: {why}")
        missing = [i for i in range(signature["num_layers"]) if i not in self.layers]
        if missing and not self.header.get("partial_layers_ok"):
            raise InvalidCompressionError(f"LESS: {source} have no kernels for layers {missing[:8]}")
        hq, hkv, d = signature["num_query_heads"], signature["num_kv_heads"], signature["head_dim"]
        for i, layer in self.layers.items():
            if layer.phi["w1"].shape[:2] != (hq, d) or layer.psi["w1"].shape[:2] != (hkv, d):
                raise InvalidCompressionError(f"LESS: {source}, layer {i}: kernels shaped for other heads than {hq}x{d} / {hkv}x{d}")


def read_header(path: str | Path) -> dict[str, Any]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error type for unreadable files
        raise InvalidCompressionError(f"LESS: {path} is not a readable safetensors file ({exc})") from exc
    if "less" not in meta:
        raise InvalidCompressionError(f"LESS: {path} has no 'less' header; not a LESS kernel file")
    return json.loads(meta["less"])


_LOADED: dict[tuple[str, float], LessKernels] = {}
_LOCK = threading.Lock()


def load_kernels(path: str | Path) -> LessKernels:
    """Read a kernel file (cached per path and modification time)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise InvalidCompressionError(f"LESS: kernel file {path} does not exist")
    key = (str(path.resolve()), path.stat().st_mtime)
    with _LOCK:
        if key in _LOADED:
            return _LOADED[key]
        header = read_header(path)
        if header.get("format") != FORMAT:
            raise InvalidCompressionError(f"LESS: {path} has format {header.get('format')!r}, expected {FORMAT!r}")
        layers: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        for name, tensor in load_file(str(path)).items():
            _, index, part, param = name.split(".")
            layers.setdefault(int(index), {"phi": {}, "psi": {}})[part][param] = tensor.float()
        kernels = LessKernels({i: LayerKernels(p["phi"], p["psi"]) for i, p in sorted(layers.items())}, header)
        _LOADED[key] = kernels
        return kernels


def shipped_kernels() -> list[tuple[Path, dict[str, Any]]]:
    """``(path, header)`` of every kernel file shipped with the package."""
    return [(p, read_header(p)) for p in sorted(SHIPPED_DIR.glob("*.safetensors"))]


def describe(header: dict[str, Any]) -> str:
    model = header.get("model", {})
    return f"{model.get('model_type')} {model.get('num_layers')}x{model.get('num_query_heads')}/{model.get('num_kv_heads')} base={header.get('base')} budget={header.get('budget')}"


def find_shipped(signature: dict[str, Any], base: str, budget: int) -> Path:
    """The shipped kernel file for this model, base policy and budget; a clear error if none."""
    available = shipped_kernels()
    for path, header in available:
        if header.get("base") == base and header.get("budget") == budget and signature_mismatch(header.get("model", {}), signature) is None:
            return path
    listing = "; ".join(f"{p.name} ({describe(h)})" for p, h in available) or "none"
    raise InvalidCompressionError(
        f"LESS: no shipped kernels for base={base} budget={budget} on this model "
        f"({signature['model_type']}, {signature['num_layers']} layers); shipped: {listing}. "
        "Train some with `snapkv-rag less train` and pass kernels=PATH."
    )
