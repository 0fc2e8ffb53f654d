# The worker: CPU-only, no torch. Build from the repository root:
#   docker build -f deploy/worker.Dockerfile -t diffusion-worker .
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos protos
COPY serving_common serving_common
COPY clients clients
COPY worker_service worker_service
RUN pip install --no-cache-dir . && useradd --uid 10001 --no-create-home worker
USER 10001
EXPOSE 50051 9090 8000
ENTRYPOINT ["diffusion-worker"]
CMD ["--listen", "0.0.0.0:50051"]
