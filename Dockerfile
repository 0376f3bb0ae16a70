# specq: one image for every service (worker, autoscaler, migrations, CLI). Built by docker-compose.yml
# and by the Kubernetes recipes in deploy/k8s/.
#
# The default PyPI torch wheel for Linux x86_64 bundles CUDA: the image runs on GPU hosts (with the
# NVIDIA container toolkit) and on CPU-only hosts alike.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECQ_HOME=/data \
    HF_HOME=/models

WORKDIR /app
# dependencies first (their layer is reused while only specq's code changes), read from pyproject.toml so
# that no second list of them can drift
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
# the build context as a whole, less what .dockerignore leaves out: no hand list of specq's parts to drift.
# specq/ links the top-level folders in as its subpackages (specq/cli -> ../cli, ...); COPY keeps the links
# as links, and copies the folders they point to beside them. setuptools finds the packages itself
# (pyproject.toml), and setup.py refuses a context whose links are broken.
COPY . .
RUN pip install --no-deps .

# Celery refuses to be root without complaint; workers need no privileges
# /data and /models are the group 0's too (OpenShift's convention): a container run as another uid with
# group 0 (the compose `cli` service, as the host user, to write its bind mount) can write them
RUN useradd --create-home --uid 1000 --gid 0 specq && mkdir -p /data /models /jobs \
    && chown specq:0 /data /models /jobs && chmod g+rwX /data /models /jobs
USER specq
VOLUME ["/data", "/models"]

# the worker's Prometheus metrics (specq worker --metrics-port 9100; the autoscaler's workers 9100 + i)
EXPOSE 9100
ENTRYPOINT ["specq"]
CMD ["worker"]
