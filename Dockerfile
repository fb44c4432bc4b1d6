# One image for every payhook process; compose.yaml runs it with different
# commands (`payhook migrate`, `ingress`, `consumer`, `outbox-worker`, `dashboard`).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY payhook payhook
COPY ingress ingress
COPY consumer consumer
COPY outbox_worker outbox_worker
COPY control control
COPY sql sql
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --no-create-home payhook
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER payhook
WORKDIR /tmp
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
EXPOSE 8000 9181
ENTRYPOINT ["payhook"]
CMD ["--help"]
