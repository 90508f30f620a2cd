# One image for every Lockstep container the chart names: `lockstep rank`, `lockstep coordinator`
# and `lockstep-operator` (see docs/commands.md). Build: docker build -t ghcr.io/lockstep-dev/lockstep:0.1.0 .
# TORCH_INDEX picks the torch wheels: CUDA for GPU ranks (default), CPU for a small test image.
FROM python:3.11-slim AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services ./services
COPY operator ./operator
COPY proto ./proto
RUN pip install --no-cache-dir --prefix=/install --extra-index-url "${TORCH_INDEX}" .

FROM python:3.11-slim
RUN useradd --uid 10001 --create-home lockstep
COPY --from=build /install /usr/local
USER 10001
ENV PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/cache
# gRPC (rank), torch.distributed store (rank 0), HTTP and gRPC (coordinator), operator health.
EXPOSE 50051 29500 8000 8001 8080
ENTRYPOINT []
CMD ["lockstep", "serve"]
