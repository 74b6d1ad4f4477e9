"""The eval's synthetic prompts are a function of the seed alone, in any process.

A set's iteration order follows per-process string hashing (PYTHONHASHSEED); a generator that
let it leak gave other prompts for the same seed in another process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import json
from snapkv_rag.harness.citation import build_questions
from snapkv_rag.harness.runner import fidelity_prompt
out = {
    "questions": [[q.messages, list(q.gold), list(q.answers)] for q in build_questions(40, 5, seed=3)],
    "fidelity": [fidelity_prompt(n, s) for n in (500, 2000) for s in (0, 1, 2)],
}
print(json.dumps(out))
"""


def _prompts(hash_seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout)


def test_same_seed_same_prompts_under_any_hash_seed():
    first, second, third = _prompts("1"), _prompts("2"), _prompts("12345")
    assert first == second == third


def test_different_seeds_give_different_prompts():
    from snapkv_rag.harness.runner import fidelity_prompt

    assert fidelity_prompt(2000, 0) != fidelity_prompt(2000, 1)
