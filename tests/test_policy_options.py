"""The options every sparse policy takes (decode_budget, decode_interval, rolling, kv_bits) are
declared once, on :class:`SparsePolicy`, and behave the same on each policy."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from snapkv_rag.compression import H2O, POLICIES, RandomKeep, SnapKV, SparsePolicy, StreamingLLM, parse_compression
from snapkv_rag.errors import InvalidCompressionError

SHARED = ("decode_budget", "decode_interval", "rolling", "kv_bits")
COMPRESSION = Path(__file__).resolve().parents[1] / "snapkv_rag" / "compression"


def declared_fields(path: Path) -> dict[str, set[str]]:
    """Class name -> the annotated names its body declares."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            out[node.name] = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return out


@pytest.mark.parametrize("policy", [SnapKV, H2O, StreamingLLM, RandomKeep])
def test_each_sparse_policy_takes_the_shared_options_from_one_declaration(policy):
    assert issubclass(policy, SparsePolicy)
    own = {name for fields in declared_fields(COMPRESSION / f"{policy.__module__.rsplit('.', 1)[-1]}.py").values() for name in fields}
    assert not own & set(SHARED), f"{policy.__name__} declares {sorted(own & set(SHARED))} again"
    names = [f.name for f in dataclasses.fields(policy)]
    assert set(SHARED) <= set(names)
    assert all(f.kw_only for f in dataclasses.fields(policy) if f.name in SHARED)


def test_shared_options_are_declared_only_in_base():
    """Fields on SparsePolicy; CompressionPolicy's class defaults are what the other policies
    (FullCache, LESS) read; FullCache keeps kv_bits as its own field (the full cache in fewer bits)."""
    declaring = {
        name: {f"{path.name}:{cls}" for path in COMPRESSION.rglob("*.py") for cls, fields in declared_fields(path).items() if name in fields} for name in SHARED
    }
    for name in ("decode_budget", "decode_interval", "rolling"):
        assert declaring[name] == {"base.py:SparsePolicy", "base.py:CompressionPolicy"}, name
    assert declaring["kv_bits"] == {"base.py:SparsePolicy", "base.py:CompressionPolicy", "full.py:FullCache"}


def test_spec_lists_the_policy_fields_first_and_only_the_shared_options_set():
    policy = SnapKV(max_capacity_prompt=256, window_size="question", kv_bits=8, decode_budget=128)
    spec = policy.spec()
    assert spec.startswith("snapkv:window_size=question,max_capacity_prompt=256") and spec.endswith("decode_budget=128,kv_bits=8") and "rolling" not in spec
    assert parse_compression(spec) == policy
    for name in ("h2o", "streamingllm", "random"):
        rolled = parse_compression(f"{name}:budget=512,rolling=512")
        assert rolled.rolling == 512 and parse_compression(rolled.spec()) == rolled


def test_the_policy_fields_keep_their_positions():
    assert StreamingLLM(2, 64).sink_tokens == 2 and StreamingLLM(2, 64).max_capacity_prompt == 64
    with pytest.raises(InvalidCompressionError, match="decode_interval applies only together with decode_budget"):
        H2O(max_capacity_prompt=64, decode_interval=8)
    assert set(POLICIES) >= {"snapkv", "h2o", "streamingllm", "random"}
