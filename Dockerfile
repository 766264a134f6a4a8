# The otel-hicache demo image (docker-compose.yml's `demo` service): CPU torch plus the package.
# Build: docker build -t otel-hicache-demo .    Run: docker run --rm otel-hicache-demo demo --requests 200
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

# CPU wheel from the PyTorch CPU index first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
# The demo extra brings click, tqdm and numpy (torch warns "Failed to initialize NumPy" at import without it).
RUN pip install '.[demo]' && python -c "import numpy, torch" && useradd --create-home --uid 10001 demo

USER demo
WORKDIR /home/demo
ENTRYPOINT ["otel-hicache"]
CMD ["demo", "--seconds", "600"]
