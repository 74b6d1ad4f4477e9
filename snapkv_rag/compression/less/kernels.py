"""LESS feature maps (``phi`` per query head, ``psi`` per KV head) for every layer, on disk as safetensors.

Two kinds of feature map, named by the header's ``features`` (``mlp`` when absent). Per layer,
with ``d`` = head_dim, hidden ``h`` and rank ``R``:

- ``mlp`` (less.md, the paper's): ``phi(q) = |gelu(q W1 + b1) W2 + b2|`` with one MLP per
  *query* head, ``psi(k) = |(gelu(k W1 + b1) W2 + b2) M| * scale`` with one MLP per *KV* head,
  an ``R x R`` interaction ``M`` and a non-negative per-feature ``scale``. The state is
  ``H = sum psi(k)^T v``, ``z = sum psi(k)``. All-zero kernels give zero features, so the
  low-rank term vanishes (the base policy's output).
- ``exp`` (positive exponential features, as in Performer/Hedgehog-style linear attention):
  ``phi(q) = exp(q W + b)`` per query head, ``psi(k) = exp(k W + b)`` per KV head. The kernel
  ``phi(q).psi(k) = sum_r exp(q.w_r + k.u_r + b_r + c_r)`` is a sum of ``R`` softmax-like
  terms, so it can be as peaked as attention is, where ``|mlp|`` features are piecewise
  linear. Kept in the log domain, the state is ``log z_r = logsumexp_i (k_i u_r + c_r)`` and
  the per-feature mean value ``mu_r = sum_i exp(k_i u_r + c_r - log z_r) v_i`` (the same
  ``R x (d + 1)`` numbers as ``H, z``, without overflow); the estimate is
  ``log mass = logsumexp_r(log phi_r(q) + log z_r)`` and ``value = sum_r softmax_r(...) mu_r``.
  On the embedded model, trained on the same data, they cut stage 1's per-layer validation
  error more than the MLPs in 28-30 of 30 layers at each budget (docs/less.md).

A file holds ``layers.{i}.{phi,psi}.{w1,b1,w2,b2}`` plus ``layers.{i}.psi.{mix,scale}``
(``mlp``) or ``layers.{i}.{phi,psi}.{w,b}`` (``exp``), and a JSON header under the metadata key
``less`` naming the model signature, the base policy, its budget, the rank, the feature kind
and how the kernels were trained. :func:`load_kernels` refuses a file made for another model
or shape.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...errors import InvalidCompressionError

SHIPPED_DIR = Path(__file__).with_name("shipped")
FORMAT = "snapkv-rag-less/1"
_SIGNATURE_KEYS = ("model_type", "num_layers", "num_query_heads", "num_kv_heads", "head_dim", "vocab_size", "adapter")
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
        # a LoRA adapter merged at load changes attention but not the embeddings: kernels are per adapter
        "adapter": Path(adapter).name if (adapter := getattr(model, "snapkv_adapter", None)) else None,
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


def low_rank_estimate(features: torch.Tensor, H: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The state's estimate of the evicted entries' attention: ``(log mass [..., t], value [..., t, d])``
    from ``features [..., t, R]``, ``H [..., R, d]``, ``z [..., R]``.

    ``log mass`` stands for ``logsumexp`` of the evicted scores and ``value`` for their
    softmax-weighted mean value; ``log mass`` is -inf where nothing was evicted or the
    features are zero."""
    mass = (features * z.unsqueeze(-2)).sum(-1)  # [..., t]
    value = (features @ H) / mass.clamp_min(torch.finfo(mass.dtype).tiny).unsqueeze(-1)
    return mass.log(), value


FEATURE_KINDS = ("exp", "mlp")
_QUERY_WEIGHT = {"mlp": "w1", "exp": "w"}


@dataclass(eq=False)
class LayerKernels:
    """One layer's ``phi`` (query heads) and ``psi`` (KV heads) parameters, fp32."""

    # mlp: w1 [heads, d, h], b1 [heads, h], w2 [heads, h, R], b2 [heads, R]; psi also mix [hkv, R, R], scale [hkv, R]
    # exp: w [heads, d, R], b [heads, R]; optionally mass-only features wm [heads, d, Rm], bm [heads, Rm]
    phi: dict[str, torch.Tensor]
    psi: dict[str, torch.Tensor]
    kind: str = "mlp"

    @property
    def rank(self) -> int:
        return int(self.phi["w"].shape[-1] if self.kind == "exp" else self.phi["w2"].shape[-1])

    @property
    def mass_rank(self) -> int:
        """Features that estimate only the evicted mass (0: the ``rank`` features estimate both)."""
        return int(self.phi["wm"].shape[-1]) if "wm" in self.phi else 0

    def state_numbers(self, head_dim: int) -> int:
        """fp32 numbers of state per KV head: ``R x (d + 1)``, plus ``Rm`` for mass-only features."""
        return self.rank * (head_dim + 1) + self.mass_rank

    def input_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``((query heads, d), (KV heads, d))`` the maps take."""
        name = _QUERY_WEIGHT[self.kind]
        return tuple(self.phi[name].shape[:2]), tuple(self.psi[name].shape[:2])

    def _logits(self, params: dict[str, torch.Tensor], x: torch.Tensor, w: str = "w", b: str = "b") -> torch.Tensor:
        return torch.matmul(x.float(), params[w]) + params[b][:, None, :]  # [b, h, n, d] @ [h, d, r]; einsum costs ~4x at decode sizes

    def query_features(self, queries: torch.Tensor) -> torch.Tensor:
        """``phi``: ``[b, q_heads, t, d] -> [b, q_heads, t, R]``, non-negative, fp32."""
        p = self.phi
        if self.kind == "exp":
            return self._logits(p, queries).exp()
        return _mlp(queries.float(), p["w1"], p["b1"], p["w2"], p["b2"]).abs()

    def key_features(self, keys: torch.Tensor) -> torch.Tensor:
        """``psi``: ``[b, kv_heads, n, d] -> [b, kv_heads, n, R]``, non-negative, fp32."""
        p = self.psi
        if self.kind == "exp":
            return self._logits(p, keys).exp()
        mixed = torch.einsum("bhnr,hrs->bhns", _mlp(keys.float(), p["w1"], p["b1"], p["w2"], p["b2"]), p["mix"])
        return mixed.abs() * p["scale"].abs()[None, :, None, :]

    def fold(self, keys: torch.Tensor, values: torch.Tensor, evicted: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The state of the entries where ``evicted [b, kv_heads, n]``: ``mlp``: ``(H [b, kv_heads, R, d],
        z [b, kv_heads, R])``; ``exp``: ``(mu [b, kv_heads, R, d], log z [b, kv_heads, R])``, and with
        mass-only features also their ``log z [b, kv_heads, Rm]``."""
        if self.kind == "exp":
            kept = ~evicted.unsqueeze(-1)
            logits = self._logits(self.psi, keys).masked_fill(kept, float("-inf"))
            log_z = logits.logsumexp(dim=2)
            weights = (logits - log_z.unsqueeze(2)).exp().nan_to_num(0.0)  # 0 for a row with nothing evicted
            state: tuple[torch.Tensor, ...] = (torch.einsum("bhnr,bhnd->bhrd", weights, values.float()), log_z)
            if self.mass_rank:
                state += (self._logits(self.psi, keys, "wm", "bm").masked_fill(kept, float("-inf")).logsumexp(dim=2),)
            return state
        features = self.key_features(keys) * evicted.unsqueeze(-1).to(torch.float32)
        return torch.einsum("bhnr,bhnd->bhrd", features, values.float()), features.sum(dim=2)

    def merge_states(self, a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The state of two disjoint sets of evicted entries (a decode-time eviction after prefill's)."""
        if self.kind == "exp":
            (mu_a, log_a), (mu_b, log_b) = a[:2], b[:2]
            log_z = torch.logaddexp(log_a, log_b)
            wa, wb = ((log - log_z).exp().nan_to_num(0.0).unsqueeze(-1) for log in (log_a, log_b))
            return (wa * mu_a + wb * mu_b, log_z) + tuple(torch.logaddexp(x, y) for x, y in zip(a[2:], b[2:]))
        return a[0] + b[0], a[1] + b[1]

    def estimate(self, queries: torch.Tensor, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log mass [b, kv_heads, g, t], value [b, kv_heads, g, t, d])`` of the evicted entries for
        ``queries [b, q_heads, t, d]``: the estimates of ``logsumexp`` of their scores and of their
        softmax-weighted mean value. With mass-only features the mass is theirs: the value
        features then need not also get the evicted part's weight right."""
        b, hq, t, _ = queries.shape
        A, B = state[:2]
        hkv = A.shape[1]
        if self.kind == "exp":

            def grouped_logits(w: str, b_: str, log_z: torch.Tensor) -> torch.Tensor:  # [b, kv_heads, g, t, features]
                return self._logits(self.phi, queries, w, b_).reshape(b, hkv, hq // hkv, t, -1) + log_z[:, :, None, None, :]

            logits = grouped_logits("w", "b", B)
            value = (logits.softmax(-1) @ A[:, :, None]).nan_to_num(0.0)
            mass_logits = grouped_logits("wm", "bm", state[2]) if self.mass_rank else logits
            return mass_logits.logsumexp(-1), value
        features = self.query_features(queries).reshape(b, hkv, hq // hkv, t, -1)
        return low_rank_estimate(features, A[:, :, None], B[:, :, None])

    def to(self, device: torch.device) -> LayerKernels:
        return LayerKernels({k: v.to(device) for k, v in self.phi.items()}, {k: v.to(device) for k, v in self.psi.items()}, self.kind)


@dataclass(eq=False)
class LessKernels:
    """Per-layer kernels plus the header that says what they were made for."""

    layers: dict[int, LayerKernels]
    header: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return next(iter(self.layers.values())).rank

    def to(self, device: torch.device) -> LessKernels:
        return LessKernels({i: k.to(device) for i, k in self.layers.items()}, self.header)

    @classmethod
    def zeros(
        cls,
        signature: dict[str, Any],
        *,
        rank: int = 8,
        hidden: int = 16,
        layers: list[int] | None = None,
        features: str = "mlp",
        mass_rank: int = 0,
        **header: Any,
    ) -> LessKernels:
        """Kernels with no low-rank contribution (zero ``mlp`` features; ``exp`` key biases of -inf),
        for tests and as a shape reference. ``mass_rank`` (``exp`` only): mass-only features."""
        if features not in FEATURE_KINDS:
            raise InvalidCompressionError(f"LESS: unknown feature kind {features!r}; choose from {', '.join(FEATURE_KINDS)}")
        if mass_rank and features != "exp":
            raise InvalidCompressionError("LESS: mass-only features need exponential features (features='exp')")
        hq, hkv, d = signature["num_query_heads"], signature["num_kv_heads"], signature["head_dim"]

        def mlp(heads: int) -> dict[str, torch.Tensor]:
            if features == "exp":
                return {"w": torch.zeros(heads, d, rank), "b": torch.zeros(heads, rank)}
            return {
                "w1": torch.zeros(heads, d, hidden),
                "b1": torch.zeros(heads, hidden),
                "w2": torch.zeros(heads, hidden, rank),
                "b2": torch.zeros(heads, rank),
            }

        def layer() -> LayerKernels:
            if features == "exp":
                phi, psi = mlp(hq), mlp(hkv)
                psi["b"].fill_(float("-inf"))
                if mass_rank:
                    phi.update(wm=torch.zeros(hq, d, mass_rank), bm=torch.zeros(hq, mass_rank))
                    psi.update(wm=torch.zeros(hkv, d, mass_rank), bm=torch.full((hkv, mass_rank), float("-inf")))
                return LayerKernels(phi, psi, "exp")
            return LayerKernels(mlp(hq), {**mlp(hkv), "mix": torch.zeros(hkv, rank, rank), "scale": torch.zeros(hkv, rank)})

        indices = range(signature["num_layers"]) if layers is None else layers
        built = {i: layer() for i in indices}
        return cls(
            built,
            {
                "format": FORMAT,
                "model": signature,
                "rank": rank,
                "hidden": hidden,
                "features": features,
                **({"mass_rank": mass_rank} if mass_rank else {}),
                **header,
            },
        )

    @classmethod
    def initial(
        cls,
        signature: dict[str, Any],
        *,
        rank: int = 8,
        hidden: int = 16,
        seed: int = 0,
        scale: float = 1e-4,
        layers: list[int] | None = None,
        features: str = "mlp",
        mass_rank: int = 0,
        **header: Any,
    ) -> LessKernels:
        """Random kernels as training starts them, with the low-rank term near zero so the output
        starts near the base policy's: ``mlp``: Gaussian MLPs, identity ``mix``, ``scale``
        everywhere; ``exp``: Gaussian ``W`` (half the ``1/sqrt(d)`` scale), query biases 0, key
        biases ``log(scale)`` (mass-only features: ``log(scale * R / Rm)``, the same total mass)."""
        kernels = cls.zeros(signature, rank=rank, hidden=hidden, layers=layers, features=features, mass_rank=mass_rank, **header)
        generator = torch.Generator().manual_seed(seed)
        for layer in kernels.layers.values():
            if features == "exp":
                for params in (layer.phi, layer.psi):
                    params["w"].normal_(0.0, 0.5 * params["w"].shape[1] ** -0.5, generator=generator)
                layer.psi["b"].fill_(math.log(scale))
                if mass_rank:
                    for params in (layer.phi, layer.psi):
                        params["wm"].normal_(0.0, 0.5 * params["wm"].shape[1] ** -0.5, generator=generator)
                    layer.psi["bm"].fill_(math.log(scale * rank / mass_rank))
                continue
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
                    dtype = torch.float32 if name in ("scale", "b", "bm") else torch.float16  # exp: the biases set log mass
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
            if layer.input_shapes() != ((hq, d), (hkv, d)):
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
        kind = header.get("features", "mlp")
        if kind not in FEATURE_KINDS:
            raise InvalidCompressionError(f"LESS: {path} has feature kind {kind!r}, expected one of {', '.join(FEATURE_KINDS)}")
        kernels = LessKernels({i: LayerKernels(p["phi"], p["psi"], kind) for i, p in sorted(layers.items())}, header)
        _LOADED[key] = kernels
        return kernels


def shipped_kernels() -> list[tuple[Path, dict[str, Any]]]:
    """``(path, header)`` of every kernel file shipped with the package."""
    return [(p, read_header(p)) for p in sorted(SHIPPED_DIR.glob("*.safetensors"))]


def describe(header: dict[str, Any]) -> str:
    model = header.get("model", {})
    shape = f"{model.get('num_layers')}x{model.get('num_query_heads')}/{model.get('num_kv_heads')}"
    return f"{model.get('model_type')} {shape} base={header.get('base')} budget={header.get('budget')}"


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
