# shellcheck shell=bash
# Sourced by .ci/run: a Docker engine for tests/test_docker_image.py, which builds the Dockerfile on a
# stand-in base (docker/standin-base.sh) and trains inside the image. CI runs as root on Debian
# bookworm: Debian's docker.io and debootstrap are installed when missing, and dockerd is started
# unless an engine already answers. The dockerd started here is stopped when .ci/run exits. An engine
# that does not start fails CI here, with dockerd's last log lines: the Docker tests are not optional.

export CI=${CI:-true}  # the Docker tests fail rather than skip without an engine
DOCKER_ENGINE_LOG=${DOCKER_ENGINE_LOG:-/tmp/ci-dockerd.log}
DOCKER_ENGINE_PID=

docker_engine_stop() {
    if [[ -n $DOCKER_ENGINE_PID ]] && kill -0 "$DOCKER_ENGINE_PID" 2> /dev/null; then
        kill -TERM "$DOCKER_ENGINE_PID"
        for _ in $(seq 60); do
            kill -0 "$DOCKER_ENGINE_PID" 2> /dev/null || break
            sleep 0.5
        done
        echo "docker engine: dockerd (pid $DOCKER_ENGINE_PID) stopped"
    fi
}

docker_engine_fail() {
    echo "CI: the Docker engine cannot start: $1" >&2
    if [[ -f $DOCKER_ENGINE_LOG ]]; then
        tail -n 20 "$DOCKER_ENGINE_LOG" >&2
    fi
    exit 1
}

docker_engine_start() {
    if command -v docker > /dev/null 2>&1 && docker info > /dev/null 2>&1; then
        echo "docker engine: using the engine that answers already"
        return
    fi
    if ! command -v dockerd > /dev/null 2>&1 || ! command -v debootstrap > /dev/null 2>&1; then
        (( EUID == 0 )) || docker_engine_fail "installing docker.io and debootstrap needs root"
        apt-get update -qq || docker_engine_fail "apt-get update failed"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap > /dev/null \
            || docker_engine_fail "apt-get install docker.io debootstrap failed"
    fi
    dockerd > "$DOCKER_ENGINE_LOG" 2>&1 &
    DOCKER_ENGINE_PID=$!
    trap docker_engine_stop EXIT
    for _ in $(seq 60); do
        if docker info > /dev/null 2>&1; then
            echo "docker engine: dockerd $(docker version --format '{{.Server.Version}}') (pid $DOCKER_ENGINE_PID, log $DOCKER_ENGINE_LOG)"
            return
        fi
        kill -0 "$DOCKER_ENGINE_PID" 2> /dev/null || docker_engine_fail "dockerd exited"
        sleep 1
    done
    docker_engine_fail "dockerd did not answer within 60 s"
}

docker_engine_start
