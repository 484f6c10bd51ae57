# syntax=docker/dockerfile:1
# Two images from one file:
#   --target api     the FastAPI service (aotc[server]); no torch in it (the API never imports torch)
#   --target worker  a compile worker with torch (its PyPI Linux wheel is the CUDA build) and a C++ toolchain,
#                    which AOTInductor needs for both CPU and GPU packages. Run it with --gpus for cuda:N.

FROM python:3.11-slim-bookworm AS base
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY requirements-api.lock ./
RUN pip install -r requirements-api.lock
COPY pyproject.toml README.md ./
COPY service ./service
COPY compiler ./compiler
COPY worker ./worker
COPY client ./client
RUN pip install --no-deps .

FROM base AS api
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz')"]
# aotc-server runs uvicorn with the API's own HTTP protocol (a deadline on request headers); it needs AOTC_REDIS_URL
# and AOTC_ADMIN_KEY(_FILE) to serve 0.0.0.0.
CMD ["aotc-server", "--workers", "0", "--api-workers", "1", "--host", "0.0.0.0", "--port", "8000"]

FROM base AS worker
RUN apt-get update && apt-get install -y --no-install-recommends g++ libgomp1 bubblewrap libseccomp2 && rm -rf /var/lib/apt/lists/*
COPY requirements-worker.lock ./
# aotc[worker] pins torch 2.13.0; on Linux its PyPI wheel is the CUDA build and pulls triton and the CUDA libraries.
RUN pip install -r requirements-worker.lock
ENV AOTC_WORK_DIR=/work AOTC_DEVICE=auto
VOLUME ["/work"]
CMD ["aotc-worker"]
