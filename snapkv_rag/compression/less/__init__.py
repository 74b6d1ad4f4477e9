"""LESS at run time: the policy (``policy.py``, spec ``less:base=snapkv,budget=256``), its kernels
(``kernels.py``; the shipped ones in ``shipped/``) and the per-run low-rank state (``state.py``).
Training them is :mod:`snapkv_rag.less`."""

from .policy import LESS

__all__ = ["LESS"]
