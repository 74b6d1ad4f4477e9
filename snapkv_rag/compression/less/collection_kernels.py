"""Which LESS kernels a collection's asks use: the calibration that ``snapkv-rag less calibrate``
(:mod:`snapkv_rag.less_training.collection_fit`) stored beside the collection, looked up at query time
without loading any of the training code."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ...errors import InvalidCompressionError
from ..base import CompressionPolicy
from .kernels import load_kernels, model_signature
from .policy import LESS

REPORT = "calibration.json"


def calibration_dir(store) -> Path:
    """Where a collection's calibrations live: beside a local store, else in the user cache
    (:attr:`~snapkv_rag.rag.store.DocumentStore.local_dir`)."""
    return Path(store.local_dir) / "less-calibration" / store.name


def calibration_key(signature: dict[str, Any], base: CompressionPolicy) -> str:
    """One calibration per model and base policy (its full spec: window, options, budget)."""
    digest = hashlib.sha256(base.spec().encode()).hexdigest()[:8]
    return f"{signature['model_type']}-{signature['num_layers']}l-{base.name}-b{base.max_capacity_prompt}-{digest}"


def calibration_for(store, model, base: CompressionPolicy) -> dict[str, Any] | None:
    """The stored calibration report of ``store``'s collection for this model and base policy
    (the same spec: a calibration measured with another window or budget does not apply); None: none."""
    path = calibration_dir(store) / REPORT
    if not path.exists():
        return None
    return json.loads(path.read_text()).get(calibration_key(model_signature(model), base))


def policy_for_collection(policy: CompressionPolicy | None, store, model) -> CompressionPolicy | None:
    """``policy``, or for a LESS policy with no kernels of its own: LESS with the collection's
    calibrated kernels, or its base policy where calibration measured LESS worse than the base."""
    if not isinstance(policy, LESS) or policy.kernels is not None:
        return policy
    report = calibration_for(store, model, policy.base)
    if report is None:
        return policy
    if report["use"] == "base":
        return policy.base
    kernels = Path(report["kernels"])
    if not kernels.is_file():
        raise InvalidCompressionError(
            f"LESS: the calibration of collection {store.name!r} names {kernels}, which no longer exists; run snapkv-rag less calibrate again"
        )
    load_kernels(kernels).check_model(model_signature(model), str(kernels))
    return LESS(base=policy.base, kernels=str(kernels))


def calibration_note(requested: CompressionPolicy | None, used: CompressionPolicy | None) -> str | None:
    """A line saying how the collection's calibration changed a LESS request (None: it did not)."""
    if not isinstance(requested, LESS) or requested == used:
        return None
    if isinstance(used, LESS):
        return f"LESS uses the kernels calibrated on this collection ({used.kernels})"
    return "LESS measured worse than its base policy on this collection when calibrated, so the base policy answered (snapkv-rag less calibrate)"
