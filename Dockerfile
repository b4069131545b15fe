# The worker image for the docker backend on a GPU machine:
#   docker build -t cmlcluster-worker:latest .
#   cdsw.use_backend("docker")            # image="cmlcluster-worker:latest" is the default
#
# TensorFlow 2.15 with CUDA, sshd for Horovod (cmlcluster's agent starts it on port 2222 with a
# per-session key; nothing here holds a key; libnss-wrapper lets it run as a uid this image does not
# name, as workers run as the notebook user's uid), Horovod 0.28.1 built against the image's TensorFlow
# with NCCL for GPU allreduce and Gloo for the controller, and cmlcluster itself.
# Horovod 0.28.1 does not build against TensorFlow 2.16 or newer.
FROM tensorflow/tensorflow:2.15.0-gpu

ARG HOROVOD_VERSION=0.28.1
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        openssh-server libnss-wrapper cmake g++ libnccl2 libnccl-dev \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /run/sshd \
 && rm -f /etc/ssh/ssh_host_*  # host keys are made per worker at start, and pinned by the session

RUN HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    pip install --no-cache-dir --no-build-isolation "horovod==${HOROVOD_VERSION}" \
 && horovodrun --check-build

COPY pyproject.toml README.md /opt/cmlcluster/
COPY cmlcluster /opt/cmlcluster/cmlcluster
RUN pip install --no-cache-dir "/opt/cmlcluster[docker,horovod]"

# The session starts `python3 -m cmlcluster.agent` with its own command; this is only a default.
CMD ["python3", "-m", "cmlcluster.agent"]
