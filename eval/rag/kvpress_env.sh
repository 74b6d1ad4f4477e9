#!/usr/bin/env bash
# The environment eval/rag/kvpress_follow_ups.py runs NVIDIA's kvpress in (issue 76): kvpress 0.5.5
# needs transformers<5.3, the project's .venv has a newer one, so kvpress gets its own venv,
# .kvpress-venv (git-ignored), holding kvpress, transformers 5.2 and the few small packages they
# import that .venv lacks or has too new (tokenizers<=0.23.0 and huggingface-hub<2 are checked by
# transformers at import, and .venv's kernels breaks it), pinned to the versions that worked and
# installed without dependencies; a .pth file then puts .venv's
# site-packages AFTER its own, so torch, numpy, accelerate, pyarrow... come from .venv (no second
# torch download). Idempotent: a rerun installs nothing new; .venv is only read.
#   bash eval/rag/kvpress_env.sh && .kvpress-venv/bin/python -c "import kvpress, transformers, torch"
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
MAIN=${MAIN:-$ROOT/.venv}
ENV=${KVPRESS_ENV:-$ROOT/.kvpress-venv}
[ -x "$ENV/bin/python" ] || "$MAIN/bin/python" -m venv "$ENV"
SITE=$("$ENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
MAIN_SITE=$("$MAIN/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# pip without the .pth: it then sees only this venv's packages and installs everything here
rm -f "$SITE/zz-main-venv.pth"
OMP_NUM_THREADS=1 "$ENV/bin/python" -m pip install --quiet --no-deps \
  kvpress==0.5.5 transformers==5.2.0 tokenizers==0.22.2 huggingface-hub==1.33.0 kernels==0.10.5 \
  cachetools==5.5.2 fire==0.6.0 termcolor==3.3.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
echo "$MAIN_SITE" > "$SITE/zz-main-venv.pth"  # .pth entries are appended to sys.path, after this site-packages
OMP_NUM_THREADS=1 "$ENV/bin/python" -c "import kvpress, transformers, torch; from importlib.metadata import version; print('kvpress', version('kvpress'), 'transformers', transformers.__version__, 'torch', torch.__version__)"
