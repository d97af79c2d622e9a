# syntax=docker/dockerfile:1
# The data-plane image: phasewise (routerd, sidecar, emulator, profiler) on Python 3.12.
#
#   docker build -f docker/routerd.Dockerfile -t phasewise/routerd:0.1.0 .
#   docker build -f docker/routerd.Dockerfile --build-arg EXTRAS=rl -t phasewise/routerd:0.1.0-rl .
#
# EXTRAS=rl adds torch for `phasewise train` (LLMRouterJob task train; about 5 GB);
# EXTRAS=predictor adds the transformer length predictor. Runs as UID 65532 and works with a
# read-only root file system (HOME=/tmp, a writable emptyDir in the operator's pods).
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
RUN pip install --no-cache-dir build==1.6.1
COPY pyproject.toml hatch_build.py README.md ./
COPY proto ./proto
COPY routerd ./routerd
# The build hook regenerates the gRPC stubs from proto/ (grpcio-tools is a build requirement).
RUN python -m build --wheel --outdir /dist .

FROM ${PYTHON_IMAGE}
ARG EXTRAS=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HOME=/tmp
COPY --from=build /dist /dist
RUN set -eux; \
    wheel="$(ls /dist/phasewise-*.whl)"; \
    if [ -n "$EXTRAS" ]; then wheel="${wheel}[${EXTRAS}]"; fi; \
    pip install --no-cache-dir "$wheel"; \
    rm -rf /dist; \
    groupadd --system --gid 65532 phasewise; \
    useradd --system --uid 65532 --gid 65532 --home-dir /tmp --shell /usr/sbin/nologin phasewise; \
    phasewise --version
USER 65532:65532
# routerd 8000 (OpenAI API) and 50051 (gRPC); the sidecar and emulator pick theirs by flag.
EXPOSE 8000 50051
CMD ["phasewise", "--help"]
