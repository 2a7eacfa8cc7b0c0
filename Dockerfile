# One image for every task of every strategy: chief, workers, ps, evaluator.
# GPU-capable: TensorFlow's pip wheels bring CUDA and cuDNN along
# (tensorflow[and-cuda]), so a GPU host needs only the NVIDIA driver and the
# NVIDIA container toolkit. ps tasks run this same image: train.py hides the
# GPUs from them, and the Kubernetes manifests give them none.
#
#   docker build -t tf-distribute-showcase:0.1.0 .
#   docker run --rm tf-distribute-showcase:0.1.0 --strategy=auto --dry-run
#
# CPU only (the same pins without the CUDA wheels), and another base (a mirror,
# or a local stand-in where no registry is reachable):
#   docker build --build-arg REQUIREMENTS=requirements-cpu.lock \
#                --build-arg BASE=registry.example.com/python:3.11-slim-bookworm -t ...:cpu .
# (docs/deployment.md; tests/image/ builds it with podman and runs jobs of it.)
#
# Layers, from the least to the most often changed: the OS packages, the
# dependencies (several GB, from requirements.lock: pinned and hashed), then
# the sources. Editing a source file rebuilds only the last two layers, in
# seconds; only a changed requirements.lock reinstalls the dependencies.
# Any Debian bookworm image with CPython 3.11 as `python` and `pip` on PATH:
# the locks are made for that Python (their wheels are cp311, manylinux_2_28).
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TF_CPP_MIN_LOG_LEVEL=2 \
    # What the NVIDIA container toolkit mounts into the container: CUDA
    # compute and nvidia-smi; nothing for graphics or video.
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# tini as PID 1: it forwards SIGTERM (preemption: checkpoint, exit 42) to
# train.py and reaps the zombies TensorFlow's subprocesses may leave; Python
# as PID 1 would get no default signal handling from the kernel.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 trainer \
    && install -d -o 1000 -g 1000 /workspace

WORKDIR /app
# The dependencies alone: the lock is all this layer depends on.
# requirements.lock: GPU-capable (tensorflow[and-cuda]: CUDA and cuDNN wheels);
# requirements-cpu.lock: the same pins without the CUDA wheels.
ARG REQUIREMENTS=requirements.lock
COPY ${REQUIREMENTS} requirements.lock
RUN pip install --require-hashes --no-deps -r requirements.lock

COPY pyproject.toml README.md LICENSE ./
COPY tfdist/ tfdist/
COPY strategies/ strategies/
COPY models/ models/
COPY *.py ./
# The package only: its dependencies are in the layer above, and the build
# backend (setuptools) comes from the lock too, not from the internet.
RUN pip install --no-deps --no-build-isolation .

# A TensorFlow server runs whatever graph it is sent: the process it lives
# in should be able to do as little as possible.
USER 1000
# train.py's default --model-dir (runs/<strategy>) is relative: /workspace is the
# trainer's, so a run without a volume still has somewhere to write.
WORKDIR /workspace
# The port every TF_CONFIG in k8s/ uses (also Kubeflow's default); slurm/
# derives one per job.
EXPOSE 2222
ENTRYPOINT ["tini", "--", "python", "/app/train.py"]
CMD ["--help"]
