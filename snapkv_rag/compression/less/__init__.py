"""LESS at run time: the policy (``policy.py``, spec ``less:base=snapkv,budget=256``), its kernels
(``kernels.py``; the shipped ones in ``shipped/``), the per-run low-rank state (``state.py``) and
the lookup of a collection's calibrated kernels (``calibration.py``).
Training them is :mod:`snapkv_rag.less_training`."""

from .policy import LESS

__all__ = ["LESS"]
