#!/usr/bin/env bash
# Build the image and smoke-test it (issue 27): the server answers /health and one chat
# completion, the app answers its health check, and compose brings up the API, the app and a
# Chroma server on one named volume, then takes them down.
#
#   bash docker/test.sh              # about 10 minutes the first time (image build), root or docker group
#   KEEP=1 bash docker/test.sh       # leave compose's named volume behind too (the image always stays)
#
# Uses docker when a daemon answers, else podman (installed with apt when missing and root).
# Where no registry is reachable, python:3.11-slim is replaced by a stand-in built from Debian
# packages (mmdebstrap), tagged with the same name so the Dockerfile's FROM line resolves
# locally. Facts behind each workaround: docs/docker.md, "Building where no registry is reachable".
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
IMAGE=${IMAGE:-snapkv-rag}
BASE=docker.io/library/python:3.11-slim
WORK=$(mktemp -d)
NAME=snapkv-rag-test-$$
PORT=${PORT:-18000}
APP_PORT=${APP_PORT:-18501}

say() { printf '\n== %s\n' "$*" >&2; }
fail() { printf 'docker/test.sh: FAILED: %s\n' "$*" >&2; exit 1; }

# ------------------------------------------------------------------ the container engine
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  CE=docker
else
  if ! command -v podman >/dev/null 2>&1; then
    [ "$(id -u)" -eq 0 ] || fail "neither a docker daemon nor podman; install podman (apt-get install podman runc)"
    say "installing podman"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap netavark aardvark-dns iptables >/dev/null
  fi
  # netavark sets up container networks with iptables, which minimal hosts lack
  if ! command -v iptables >/dev/null 2>&1; then
    [ "$(id -u)" -eq 0 ] || fail "podman's netavark needs iptables: apt-get install iptables"
    say "installing iptables (for podman's netavark)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables >/dev/null
  fi
  CE=podman
  # rootful podman here: runc (crun trips over the cgroup setup) and the host's hard nofile limit
  hard=$(ulimit -Hn)
  [ "$hard" = unlimited ] && hard=65536
  # kept in .podman/ (git-ignored) for running the image by hand afterwards (docs/docker.md)
  mkdir -p "$ROOT/.podman"
  cat >"$ROOT/.podman/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$hard:$hard", "nproc=32768:32768"]
[engine]
runtime = "runc"
[network]
network_backend = "netavark"
EOF
  # compose services find each other by name through aardvark-dns (the CNI default has no DNS here)
  if [ ! -x /usr/lib/podman/aardvark-dns ] && ! command -v aardvark-dns >/dev/null 2>&1; then
    [ "$(id -u)" -eq 0 ] && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq netavark aardvark-dns >/dev/null
  fi
  export CONTAINERS_CONF="$ROOT/.podman/containers.conf"
fi
say "container engine: $CE ($($CE --version))"

cleanup() {
  $CE rm -f -v "$NAME" >/dev/null 2>&1 || true  # -v: the image's anonymous /data volume too
  if [ -n "${COMPOSE:-}" ]; then
    (cd docker && SNAPKV_RAG_PORT=$PORT SNAPKV_RAG_APP_PORT=$APP_PORT $COMPOSE -p "$NAME" down -v >/dev/null 2>&1) || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# ------------------------------------------------------------------ the base image
standin_base() {
  say "no registry: building a stand-in $BASE from Debian packages"
  command -v mmdebstrap >/dev/null 2>&1 || { [ "$(id -u)" -eq 0 ] && apt-get install -y -qq mmdebstrap >/dev/null; } || fail "mmdebstrap is needed for the stand-in base"
  local suite
  suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr "$suite" "$WORK/rootfs.tar"
  $CE import "$WORK/rootfs.tar" snapkv-rag-debian-python:latest >/dev/null
  # a venv first on PATH, so `pip` and `python` behave as in the official image
  cat >"$WORK/Containerfile.base" <<'EOF'
FROM localhost/snapkv-rag-debian-python:latest
RUN python3 -m venv /usr/local/python && /usr/local/python/bin/pip --version
ENV PATH=/usr/local/python/bin:$PATH LANG=C.UTF-8
CMD ["python3"]
EOF
  $CE build --pull=never -t "$BASE" -f "$WORK/Containerfile.base" "$WORK" >/dev/null
}

if ! $CE image exists "$BASE" 2>/dev/null && ! $CE image inspect "$BASE" >/dev/null 2>&1; then
  timeout 60 $CE pull "$BASE" >/dev/null 2>&1 || standin_base
fi

# ------------------------------------------------------------------ the project image
say "building $IMAGE"
build_args=()
mounts=()
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  # outbound HTTPS may be re-signed by a CA only the host trusts: lend it to the build, keep it out of the image
  mounts+=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
fi
local_torch=$(ls /opt/wheels/torch-*+cpu-cp311-*.whl 2>/dev/null | head -1 || true)
if [ -n "$local_torch" ]; then
  # the CPU wheel this machine's pip finds locally (PyPI's default torch is the CUDA build, 7 GB)
  mounts+=(-v "$(dirname "$local_torch"):/opt/wheels:ro")
  build_args+=(--build-arg "TORCH_SPEC=/opt/wheels/$(basename "$local_torch")" --build-arg "TORCH_INDEX=https://pypi.org/simple")
elif ! timeout 20 python3 -c "import urllib.request; urllib.request.urlopen('https://download.pytorch.org/whl/cpu/', timeout=15)" 2>/dev/null; then
  build_args+=(--build-arg "TORCH_INDEX=https://pypi.org/simple")
fi
if [ "$CE" = podman ]; then
  podman build --pull=never "${mounts[@]}" "${build_args[@]}" -t "$IMAGE" -f docker/Dockerfile .
else
  [ ${#mounts[@]} -eq 0 ] || say "note: docker build cannot mount the CA bundle or local wheels; building with defaults"
  docker build -t "$IMAGE" -f docker/Dockerfile .
fi
$CE image inspect "$IMAGE" --format 'image size: {{.Size}} bytes' >&2

wait_for() {  # URL, seconds
  local deadline=$((SECONDS + $2))
  until curl -fsS "$1" >/dev/null 2>&1; do
    [ $SECONDS -lt "$deadline" ] || return 1
    sleep 1
  done
}

# ------------------------------------------------------------------ the server alone
say "server: start, /health, one chat completion"
volumes_before=$($CE volume ls -q | wc -l)
$CE run -d --name "$NAME" -p "127.0.0.1:$PORT:8000" "$IMAGE" >/dev/null
wait_for "http://127.0.0.1:$PORT/health" 120 || { $CE logs "$NAME" >&2; fail "the server did not answer /health"; }
curl -fsS "http://127.0.0.1:$PORT/health" >&2; echo >&2
answer=$(curl -fsS "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "default", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16}')
echo "$answer" | python3 -c "import json, sys; r = json.load(sys.stdin); print('chat answer:', repr(r['choices'][0]['message']['content'])); assert r['usage']['completion_tokens'] > 0" >&2 \
  || fail "no chat completion: $answer"
$CE stop -t 10 "$NAME" >/dev/null
code=$($CE inspect "$NAME" --format '{{.State.ExitCode}}')
[ "$code" = 0 ] || fail "the server exited with $code on SIGTERM (docker stop), not 0"
echo "docker stop: the server exited 0" >&2
$CE rm -f -v "$NAME" >/dev/null
[ "$($CE volume ls -q | wc -l)" -eq "$volumes_before" ] || fail "the server's container left a volume behind"

# ------------------------------------------------------------------ compose: API, app, Chroma server
if [ "$CE" = docker ] && docker compose version >/dev/null 2>&1; then
  COMPOSE="docker compose"
else
  # Debian's podman-compose 1.0 mishandles ${VAR:-} defaults; 1.6 from PyPI works
  python3 -m venv "$WORK/compose-venv" && "$WORK/compose-venv/bin/pip" install -q "podman-compose>=1.6" >/dev/null
  COMPOSE="$WORK/compose-venv/bin/podman-compose"
fi
say "compose ($COMPOSE): API, app and Chroma server on one volume"
(cd docker && SNAPKV_RAG_PORT=$PORT SNAPKV_RAG_APP_PORT=$APP_PORT $COMPOSE -p "$NAME" up -d) >/dev/null
wait_for "http://127.0.0.1:$PORT/health" 180 || fail "compose: the API did not answer /health"
wait_for "http://127.0.0.1:$APP_PORT/_stcore/health" 180 || fail "compose: the app did not answer its health check"
echo "app: $(curl -fsS "http://127.0.0.1:$APP_PORT/_stcore/health")" >&2
# the API and the app read the same Chroma server: a document ingested through the CLI inside the
# API container is listed by the Chroma server, which the app queries
api=$($CE ps --filter "label=com.docker.compose.project=$NAME" --filter "label=com.docker.compose.service=api" --format '{{.Names}}' | head -1)
[ -n "$api" ] || api=$($CE ps --format '{{.Names}}' | grep "${NAME}.*api" | head -1)
$CE exec "$api" sh -c 'mkdir -p /tmp/docs && echo "The Marrowick ferry leaves at 06:40 on weekdays." > /tmp/docs/ferry.txt && snapkv-rag ingest /tmp/docs --collection smoke --chroma-url http://chroma:8000' >&2 \
  || fail "compose: ingest into the Chroma server failed"
$CE exec "$api" python -c "from snapkv_rag.rag.store import make_client; names = [c if isinstance(c, str) else c.name for c in make_client(url='http://chroma:8000').list_collections()]; print('collections on the Chroma server:', names); assert 'smoke' in names" >&2 \
  || fail "compose: the Chroma server does not list the ingested collection"
if [ "$CE" = podman ]; then
  for service in api chroma; do
    container=$($CE ps --format '{{.Names}}' | grep "${NAME}.*${service}" | head -1)
    podman healthcheck run "$container" >/dev/null 2>&1 && echo "healthcheck $service: healthy" >&2 || fail "compose: $service healthcheck failed"
  done
fi
if [ -n "${KEEP:-}" ]; then
  (cd docker && SNAPKV_RAG_PORT=$PORT SNAPKV_RAG_APP_PORT=$APP_PORT $COMPOSE -p "$NAME" down) >/dev/null
  $CE volume ls --format '{{.Name}}' | grep -qx "${NAME}_snapkv-data" || fail "KEEP=1: the named volume ${NAME}_snapkv-data is gone"
  say "KEEP=1: the named volume ${NAME}_snapkv-data stays; remove it with: $CE volume rm ${NAME}_snapkv-data"
else
  (cd docker && SNAPKV_RAG_PORT=$PORT SNAPKV_RAG_APP_PORT=$APP_PORT $COMPOSE -p "$NAME" down -v) >/dev/null
  $CE volume ls --format '{{.Name}}' | grep -qx "${NAME}_snapkv-data" && fail "compose down -v left the named volume behind"
fi
COMPOSE=""
say "docker/test.sh: all checks passed"
