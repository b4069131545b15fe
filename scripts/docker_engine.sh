#!/usr/bin/env bash
# Make sure a Docker engine answers, and that the test image exists.
#
# There is no image registry here, so the test image is a minimal root folder made with
# `docker import`; the docker backend bind-mounts the host's /usr and Python environment into
# it read-only (DockerBackend(host_python=True)), so containers run the session's own
# interpreter and packages, as CML workers share the session's image. Users build the real
# image from the repository's Dockerfile instead.
set -euo pipefail
IMAGE="${CMLCLUSTER_TEST_IMAGE:-cmlcluster-test:latest}"
RECIPE=2  # bump when the root folder below changes, to remake the image

if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || { echo "docker_engine.sh: dockerd is missing (apt-get install docker.io)" >&2; exit 1; }
    echo "starting dockerd in the background (log: /var/log/cmlcluster-dockerd.log)"
    # Every Docker session makes a network of its own, and the default pools hold about 30: give it
    # 256 ranges of /24, so that a test run's sessions, the stand-in cluster and SSH hosts all fit.
    # setsid: a session and process group of its own, so that nothing that signals the group of whatever
    # ran this script (timeout(1) on expiry, a shell's job control) takes the engine down with it.
    nohup setsid dockerd --default-address-pool base=10.200.0.0/16,size=24 >/var/log/cmlcluster-dockerd.log 2>&1 &
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && break
        sleep 0.5
    done
    docker info >/dev/null 2>&1 || { echo "dockerd did not start:" >&2; tail -20 /var/log/cmlcluster-dockerd.log >&2; exit 1; }
fi

made=$(docker image inspect -f '{{ index .Config.Labels "cmlcluster.recipe" }}' "$IMAGE" 2>/dev/null || true)
if [ "$made" != "$RECIPE" ]; then
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    # Debian's merged /usr: the top-level program and library folders are links into /usr,
    # which the backend mounts from the host.
    # /sbin stays a real folder: Docker mounts its init there (--init).
    mkdir -p "$root"/{usr,etc,root,home,run,var/empty,proc,sys,dev,sbin}
    install -d -m 1777 "$root/tmp"
    for link in bin lib lib64; do ln -s "usr/$link" "$root/$link"; done
    cat > "$root/etc/passwd" <<'PASSWD'
root:x:0:0:root:/root:/bin/bash
sshd:x:100:65534::/run/sshd:/usr/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
PASSWD
    printf 'root:x:0:\nnogroup:x:65534:\n' > "$root/etc/group"
    printf 'root:*:19000:0:99999:7:::\nsshd:*:19000:0:99999:7:::\n' > "$root/etc/shadow"
    chmod 600 "$root/etc/shadow"
    printf 'passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n' > "$root/etc/nsswitch.conf"
    tar -C "$root" -c . | docker import --change "LABEL cmlcluster.recipe=$RECIPE" \
        --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin" \
        --message "cmlcluster test image" - "$IMAGE" >/dev/null
    echo "made $IMAGE"
fi
