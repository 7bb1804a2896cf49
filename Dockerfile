# kiln serving image (CPU). Build stage: install kiln, fetch the model and
# compile it into a bundle; runtime stage: the bundle and the virtual
# environment only (no compiler, no network), a non-root user, a read-only root
# filesystem with one tmpfs at /tmp.
#
#   docker build -t kiln-cpu .                                # the demo model
#   docker build -t kiln-cpu --build-arg MODEL=org/name .     # from the build's Hugging Face cache
#   docker run --read-only --tmpfs /tmp:rw,size=1g -p 8000:8000 kiln-cpu
#
# The bundle's compiled kernels are for the CPU (or GPU) of the build machine:
# build on the kind of machine that serves, or the server refuses the bundle and
# says which factor differs. Pass TORCH_SPEC and PIP_EXTRA_INDEX_URL to choose a
# torch wheel (a CPU build, say); a CUDA variant changes BASE to a CUDA runtime
# image and TORCH_SPEC to a CUDA wheel, and is run with --gpus all.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ARG TORCH_SPEC="torch==2.13.0"
ARG PIP_EXTRA_INDEX_URL=""
ARG MODEL=demo
ARG LEVEL=2
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/kiln/venv
COPY pyproject.toml README.md /src/
COPY kiln /src/kiln
RUN PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL}" /opt/kiln/venv/bin/pip install --no-cache-dir "${TORCH_SPEC}" \
    && /opt/kiln/venv/bin/pip install --no-cache-dir /src
ENV KILN_CACHE_DIR=/tmp/kiln-build
RUN if [ "${MODEL}" = demo ]; then /opt/kiln/venv/bin/kiln fetch-demo; fi \
    && /opt/kiln/venv/bin/kiln compile "${MODEL}" --out /opt/kiln/bundle -O "${LEVEL}" --include-weights \
    && rm -rf /tmp/kiln-build

FROM ${BASE}
COPY --from=build /opt/kiln /opt/kiln
RUN useradd --system --uid 10001 --home-dir /tmp/home kiln
USER kiln
# Everything the server writes goes under /tmp (a tmpfs when run --read-only):
# the private copy of the bundle's kernel cache Inductor writes into when it
# loads, Python's and Triton's caches, and a compile cache used only when the
# bundle does not match this machine (kiln says so in a warning).
ENV HOME=/tmp/home TMPDIR=/tmp XDG_CACHE_HOME=/tmp/cache KILN_CACHE_DIR=/tmp/kiln \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor TRITON_CACHE_DIR=/tmp/triton PYTHONDONTWRITEBYTECODE=1
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s CMD ["/opt/kiln/venv/bin/python", "-c", \
    "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health').status != 200)"]
ENTRYPOINT ["/opt/kiln/venv/bin/kiln", "serve", "/opt/kiln/bundle", "--host", "0.0.0.0", "--port", "8000"]
