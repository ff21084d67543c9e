#!/usr/bin/env bash
# Build (once) and smoke-test a Redis image from Debian's redis-server package, for
# machines whose Docker engine cannot pull from a registry.
#
#   .ci/redis-image.sh [IMAGE]          default IMAGE: quorumlock/redis:7-debian
#
# The image holds only the real redis-server binary (copied dereferenced: Debian's
# /usr/bin/redis-server is a symlink to redis-check-rdb and the binary picks its mode from
# its own name), every library `ldd` lists, the dynamic loader, /tmp (1777) and /data.
# There is no shell in it. Its default command listens on 0.0.0.0 with protected mode off
# and no persistence; the test harness passes the same command explicitly:
#   redis-server --bind 0.0.0.0 --protected-mode no --save "" --appendonly no
#
# Idempotent: an existing image that passes the smoke test is kept. Exit status 0 means
# the image exists AND a container of it answered PING through a host-mapped port.
set -euo pipefail

IMAGE="${1:-quorumlock/redis:7-debian}"
SRC_BIN="${REDIS_SERVER_BIN:-$(command -v redis-server || echo /usr/bin/redis-server)}"

log() { printf '[redis-image] %s\n' "$*" >&2; }

smoke_test() {
    local cid port i out
    cid="$(docker run -d --rm -p 127.0.0.1::6379 "$IMAGE")" || return 1
    # shellcheck disable=SC2064
    trap "docker rm -f $cid >/dev/null 2>&1 || true; trap - RETURN" RETURN
    for i in $(seq 1 100); do
        if docker logs "$cid" 2>&1 | grep -q 'Ready to accept connections'; then
            break
        fi
        sleep 0.1
    done
    if ! docker logs "$cid" 2>&1 | grep -q 'Ready to accept connections'; then
        log "container never printed 'Ready to accept connections'; its log:"
        docker logs "$cid" >&2 2>&1 || true
        return 1
    fi
    port="$(docker port "$cid" 6379/tcp | head -n1 | sed 's/.*://')"
    for i in $(seq 1 50); do
        out="$(redis-cli -h 127.0.0.1 -p "$port" PING 2>/dev/null || true)"
        [ "$out" = PONG ] && break
        sleep 0.1
    done
    if [ "$out" != PONG ]; then
        log "no PONG from 127.0.0.1:$port (got '$out')"
        return 1
    fi
    out="$(redis-cli -h 127.0.0.1 -p "$port" CONFIG GET protected-mode | tail -n1)"
    [ "$out" = no ] || { log "protected-mode is '$out', expected no"; return 1; }
    out="$(redis-cli -h 127.0.0.1 -p "$port" CONFIG GET save | tail -n1)"
    [ -z "$out" ] || { log "save is '$out', expected empty"; return 1; }
    log "smoke test passed: $IMAGE answered PONG on 127.0.0.1:$port"
}

build() {
    if [ ! -e "$SRC_BIN" ]; then
        log "redis-server not found (apt-get install redis-server)"
        return 1
    fi
    local work rootfs real lib
    work="$(mktemp -d)"
    # shellcheck disable=SC2064
    trap "rm -rf '$work'; trap - RETURN" RETURN
    rootfs="$work/rootfs"
    mkdir -p "$rootfs/usr/bin" "$rootfs/data" "$rootfs/tmp"
    chmod 1777 "$rootfs/tmp"
    real="$(readlink -f "$SRC_BIN")"
    cp -L "$real" "$rootfs/usr/bin/redis-server"
    # Every absolute path ldd prints: libraries and the loader (linux-vdso has none).
    for lib in $(ldd "$real" | grep -o '/[^ )]*'); do
        cp -L --parents "$lib" "$rootfs/"
    done
    # glibc dlopens libgcc_s for thread cancellation / unwinding; copy it if ldd did not.
    for lib in /lib/x86_64-linux-gnu/libgcc_s.so.1 /usr/lib/x86_64-linux-gnu/libgcc_s.so.1; do
        if [ -e "$lib" ] && [ ! -e "$rootfs$lib" ]; then cp -L --parents "$lib" "$rootfs/"; fi
    done
    log "rootfs: $(du -sh "$rootfs" | cut -f1), importing as $IMAGE"
    tar -C "$rootfs" -c . | docker import \
        -c 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
        -c 'WORKDIR /data' \
        -c 'EXPOSE 6379' \
        -c 'CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no"]' \
        - "$IMAGE" >/dev/null
}

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    log "$IMAGE already exists; checking it"
    if smoke_test; then exit 0; fi
    log "existing $IMAGE failed the smoke test; rebuilding"
    docker rmi -f "$IMAGE" >/dev/null 2>&1 || true
fi
build
if smoke_test; then exit 0; fi
log "freshly built $IMAGE failed the smoke test; removing it"
docker rmi -f "$IMAGE" >/dev/null 2>&1 || true
exit 1
