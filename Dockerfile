# One image for the web (granian, under shop.serve), worker and beat (Celery) services of
# docker-compose.yml.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=shop.settings \
    DJANGO_STATIC_ROOT=/app/staticfiles

WORKDIR /app

# Dependencies first, so editing the code does not reinstall them.
COPY requirements.txt ./
RUN pip install -r requirements.txt

COPY . .

# /run/flashsale: where compose's web serves its unix socket (a volume shared with the proxy
# starts with this directory's owner). Static files are collected at build time; settings need a DATABASE_URL to load but collectstatic
# never connects to it.
RUN DATABASE_URL=postgres://build@localhost/build python manage.py collectstatic --noinput \
    && useradd --create-home --uid 10001 --user-group flashsale \
    && mkdir -p /app/.data /run/flashsale \
    && chown -R flashsale:flashsale /app/.data /run/flashsale

USER flashsale

EXPOSE 8000
# The web server under its supervisor, as compose's web runs it (on a port here): it migrates,
# and starts granian again if its main process dies while the workers answer what they hold;
# `docker run --init` (compose: `init: true`) reaps the workers such a death leaves.
CMD ["python", "-m", "shop.serve", "--web-only", "--host", "0.0.0.0", "--port", "8000"]
