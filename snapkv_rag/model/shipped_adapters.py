"""The adapter shipped for the embedded model, and when the engine uses it.

``snapkv_rag/adapter_training/shipped/<name>/`` holds an adapter trained by ``snapkv-rag tune train`` and
its manifest. Where the embedded model loads with it (merged) is the adapter rule's
(:mod:`.adapter_rule`): the manifest's ``applies_to`` names the uses whose held-out measures the
adapter improves beyond their noise. ``"auto"`` (the server, chat, agents: any use) loads it
when it applies to every use; ``"auto:documents"`` (``ask``, the app) and ``"auto:tools"`` when
it applies to that use. ``"none"`` (or
``--base-model``) loads the bare model.
"""

from __future__ import annotations

from pathlib import Path

from .adapter_rule import AUTO as AUTO
from .adapter_rule import AUTO_DOCUMENTS as AUTO_DOCUMENTS
from .adapter_rule import AUTO_TOOLS as AUTO_TOOLS
from .adapter_rule import AUTOS as AUTOS
from .adapter_rule import NONE, USES, applies_to
from .adapter_rule import gates_passed as gates_passed  # re-exported: snapkv_rag.adapter_training.gates_passed
from .adapters import AdapterError, read_manifest

SHIPPED_DIR = Path(__file__).parents[1] / "adapter_training" / "shipped"  # package data, beside the tune command
EMBEDDED_ADAPTER = "smollm2-135m-instruct"


def shipped_adapter_dir(name: str = EMBEDDED_ADAPTER) -> Path:
    return SHIPPED_DIR / name


def adapter_option(adapter: str | None, *, base_model: bool = False) -> str | None:
    """What ``--adapter``/``--base-model`` ask for: None (``--base-model``, ``none``), an ``"auto"``
    value, or the directory as an absolute path (it may travel to another process: Ray replicas)."""
    import os

    if base_model or adapter is None or adapter == NONE:
        return None
    return adapter if adapter in AUTOS else os.path.abspath(os.path.expanduser(adapter))


def uses_of(adapter: str) -> list[str]:
    """The uses an ``"auto"`` value asks the adapter to apply to: every use, or the one it names."""
    return list(USES) if adapter == AUTO else [adapter.split(":", 1)[1]]


def resolve_adapter(adapter: str | Path | None, *, embedded: bool) -> Path | None:
    """The adapter directory to merge: an ``"auto"`` value picks the shipped one for the ``embedded``
    model where the adapter rule puts it on for that use (None for other models), None or ``"none"``
    means none, and anything else is a directory given by the caller."""
    if adapter is None or str(adapter) == NONE:
        return None
    if str(adapter) not in AUTOS:
        return Path(adapter).expanduser()
    if not embedded:
        return None
    directory = shipped_adapter_dir()
    on = applies_to(read_manifest(directory))
    return directory if on and all(use in on for use in uses_of(str(adapter))) else None


def adapter_note(adapter: str | Path | None, *, embedded: bool) -> str:
    """Why a model loaded without an adapter, in words (``snapkv-rag info``)."""
    if adapter is None:
        return "none (--base-model)"
    if not embedded:
        return "none"
    manifest = read_manifest(shipped_adapter_dir())
    if not manifest:
        return "none (no adapter is shipped for the embedded model)"
    if isinstance(manifest.get("applies_to"), list):
        on = manifest["applies_to"]
        where = f"on only for {', '.join(on)} (--adapter {', '.join('auto:' + u for u in on)})" if on else "off for every use"
        return f"none here (the shipped adapter is {where}: {rule_summary(manifest)}; --adapter {shipped_adapter_dir()} loads it anyway)"
    gates = manifest.get("gates") or {}
    failed = sorted(name for name, gate in gates.items() if gate.get("passed") is not True)
    if not gates:
        return f"none (the shipped adapter's gates are not measured yet; --adapter {shipped_adapter_dir()} loads it anyway)"
    return f"none (the shipped adapter missed its gates: {', '.join(failed)}; --adapter {shipped_adapter_dir()} loads it anyway)"


def rule_summary(manifest: dict) -> str:
    """The adapter rule's reasons per use, in one line."""
    return "; ".join(f"{use}: {reason}" for use, reason in (manifest.get("rule") or {}).items()) or "no rule recorded"


def ship_adapter(source: str | Path, name: str = EMBEDDED_ADAPTER) -> Path:
    """Copy the adapter in ``source`` into the package as ``name``'s shipped adapter, its
    weights in float16 (half the bytes; the merge computes in float32). Its manifest comes
    along with ``gates`` reset: the copy is measured again (eval/tune/tune_gates.py) before the
    engine loads it by default. Written beside the target and swapped in whole."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from .adapters import CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE, read_adapter

    config, weights = read_adapter(source)
    target = shipped_adapter_dir(name)
    staging = target.with_name(target.name + ".tmp")
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        save_file({k: v.to(torch.float16).contiguous() for k, v in weights.items()}, str(staging / WEIGHTS_FILE))
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=1))
        manifest = read_manifest(source)
        (staging / MANIFEST_FILE).write_text(json.dumps({**manifest, "gates": None, "shipped_from": str(source)}, indent=1))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    except PermissionError as exc:
        raise AdapterError(f"cannot write the shipped adapter under {target.parent}: {exc.strerror} (ship from a source checkout)") from None
    return target
