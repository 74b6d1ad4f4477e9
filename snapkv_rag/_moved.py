"""Old module paths from before the package was grouped into subpackages (issue 45).

``import snapkv_rag.generation`` and the like keep working for one release: the old name is
an alias of the module at its new path (the same module object, so patching one patches the
other), and importing it warns with :class:`DeprecationWarning` naming the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# old path -> new path; the old ones go in the release after 0.1
MOVED: dict[str, str] = {
    "snapkv_rag.scheduler": "snapkv_rag.engine.scheduler",
    "snapkv_rag.streams": "snapkv_rag.engine.streams",
    "snapkv_rag.requests": "snapkv_rag.engine.requests",
    "snapkv_rag.results": "snapkv_rag.engine.results",
    "snapkv_rag.generation": "snapkv_rag.engine.generation",
    "snapkv_rag.sampling": "snapkv_rag.engine.sampling",
    "snapkv_rag.detokenize": "snapkv_rag.engine.detokenize",
    "snapkv_rag.prompts": "snapkv_rag.engine.prompts",
    "snapkv_rag.engine_cache": "snapkv_rag.engine.shared",
    "snapkv_rag.loading": "snapkv_rag.model.loading",
    "snapkv_rag.packed_linear": "snapkv_rag.model.packed_linear",
    "snapkv_rag.quantization": "snapkv_rag.model.quantization",
    "snapkv_rag.openmp": "snapkv_rag.model.openmp",
    "snapkv_rag.memory": "snapkv_rag.model.memory",
    "snapkv_rag.prefix_cache": "snapkv_rag.reuse.prefix_cache",
    "snapkv_rag.segment_store": "snapkv_rag.reuse.segment_store",
    "snapkv_rag.blending": "snapkv_rag.reuse.blending",
    "snapkv_rag.offered": "snapkv_rag.reuse.offered",
    "snapkv_rag.constraints": "snapkv_rag.tools.constraints",
    "snapkv_rag.call_gate": "snapkv_rag.tools.call_gate",
    "snapkv_rag.span_attention": "snapkv_rag.compression.span_attention",
    "snapkv_rag.metrics": "snapkv_rag.evaluation.metrics",
    "snapkv_rag.less.kernels": "snapkv_rag.compression.less.kernels",
    "snapkv_rag.less.state": "snapkv_rag.compression.less.state",
}


def _caller_stacklevel() -> int:
    """The stack level of the first frame outside the import machinery and this module."""
    level = 1
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib") or frame.f_code.co_filename == __file__):
        level, frame = level + 1, frame.f_back
    return level


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} has moved to {new}; import it from there (the old path goes in the next release)",
            DeprecationWarning,
            stacklevel=_caller_stacklevel(),
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """The module at the new path is already executed."""


def install() -> None:
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())
