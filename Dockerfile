# One image for every task of every strategy: chief, workers, ps, evaluator.
# GPU-capable: TensorFlow's pip wheels bring CUDA and cuDNN along
# (tensorflow[and-cuda]), so a GPU host needs only the NVIDIA driver and the
# NVIDIA container toolkit. ps tasks run this same image: train.py hides the
# GPUs from them, and the Kubernetes manifests give them none.
#
#   docker build -t tf-distribute-showcase:0.1.0 .
#   docker run --rm tf-distribute-showcase:0.1.0 --strategy=auto --dry-run
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TF_CPP_MIN_LOG_LEVEL=2

WORKDIR /app
COPY pyproject.toml README.md ./
COPY strategies/ strategies/
COPY models/ models/
COPY training/ training/
COPY *.py ./
# pyproject.toml is the one list of dependencies, here as everywhere else.
RUN pip install ".[gpu]" \
    && useradd --create-home --uid 1000 trainer

# A TensorFlow server runs whatever graph it is sent: the process it lives
# in should be able to do as little as possible.
USER 1000
# The port every TF_CONFIG in k8s/ and slurm/ uses (also Kubeflow's default).
EXPOSE 2222
ENTRYPOINT ["python", "/app/train.py"]
CMD ["--help"]
