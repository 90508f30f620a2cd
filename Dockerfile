# Two images from one repository (see docs/commands.md for the commands they run):
#   rank     (the default target): `lockstep rank` and `lockstep serve`, with torch;
#   control  `lockstep coordinator` and `lockstep-operator`, without torch (they never run the model).
# Build:
#   docker build -t ghcr.io/lockstep-dev/lockstep:0.1.0 .
#   docker build --target control -t ghcr.io/lockstep-dev/lockstep-control:0.1.0 .
# TORCH_INDEX picks the torch wheels of the rank image: CUDA for GPU ranks (default), CPU for a small test image.
FROM python:3.11-slim AS build-control
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services ./services
COPY operator ./operator
COPY proto ./proto
RUN pip install --no-cache-dir --prefix=/install .

FROM build-control AS build-rank
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
RUN pip install --no-cache-dir --prefix=/install --extra-index-url "${TORCH_INDEX}" '.[rank]'

FROM python:3.11-slim AS control
RUN useradd --uid 10001 --create-home lockstep
COPY --from=build-control /install /usr/local
USER 10001
ENV PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/cache
# HTTP and gRPC (coordinator), operator health.
EXPOSE 8000 8001 8080
ENTRYPOINT []
CMD ["lockstep", "coordinator"]

FROM python:3.11-slim AS rank
RUN useradd --uid 10001 --create-home lockstep
COPY --from=build-rank /install /usr/local
USER 10001
ENV PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/cache
# gRPC (rank), torch.distributed store (rank 0), HTTP and gRPC (coordinator), operator health.
EXPOSE 50051 29500 8000 8001 8080
ENTRYPOINT []
CMD ["lockstep", "serve"]
