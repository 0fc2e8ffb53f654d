# The runner sidecar, with torch for its accelerator. Build from the repository root:
#   CPU:  docker build -f deploy/runner.Dockerfile -t diffusion-runner .
#   CUDA: docker build -f deploy/runner.Dockerfile \
#           --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#           --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t diffusion-runner:cuda .
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_SPEC=torch
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN command -v pip || (apt-get update && apt-get install -y --no-install-recommends python3-pip python3-venv \
      && rm -rf /var/lib/apt/lists/*)
WORKDIR /app
RUN python3 -m venv /venv
ENV PATH=/venv/bin:$PATH
# torch first, from the index for this accelerator, so the project never pulls another build.
RUN pip install --no-cache-dir "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY protos protos
COPY serving_common serving_common
COPY runner_service runner_service
RUN pip install --no-cache-dir ".[runner]" && useradd --uid 10001 --create-home runner
USER 10001
ENV DIFFUSION_MODEL_CACHE=/models
EXPOSE 50052
ENTRYPOINT ["diffusion-runner"]
CMD ["--listen", "unix:/run/diffusion/runner.sock"]
