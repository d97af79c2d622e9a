# syntax=docker/dockerfile:1
# The operator image: phasewise (its spec and profile models, used to validate pools) plus
# kopf and the phasewise_operator package. Also runs an LLMRouterJob's result reporter.
#
#   docker build -f docker/operator.Dockerfile -t phasewise/operator:0.1.0 .
#
# Runs as UID 65532 with a read-only root file system; `python -m phasewise_operator`.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
RUN pip install --no-cache-dir build==1.6.1
COPY pyproject.toml hatch_build.py README.md ./
COPY proto ./proto
COPY routerd ./routerd
RUN python -m build --wheel --outdir /dist .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HOME=/tmp \
    PYTHONPATH=/opt/phasewise-operator
COPY --from=build /dist /dist
RUN set -eux; \
    pip install --no-cache-dir /dist/phasewise-*.whl "kopf==1.45.2"; \
    rm -rf /dist; \
    groupadd --system --gid 65532 phasewise; \
    useradd --system --uid 65532 --gid 65532 --home-dir /tmp --shell /usr/sbin/nologin phasewise
COPY operator/phasewise_operator /opt/phasewise-operator/phasewise_operator
RUN python -m compileall -q /opt/phasewise-operator && python -c "import phasewise_operator.handlers"
USER 65532:65532
EXPOSE 8080
CMD ["python", "-m", "phasewise_operator"]
