"""Where the services are: database and broker URLs from flags or the environment, masked for output."""

from __future__ import annotations

import os

from specq.errors import ServiceUnavailableError
from specq.masking import mask_url
from specq.queue import BROKER_ENV


def broker_url(url: str | None = None) -> str | None:
    """`url`, else `SPECQ_BROKER_URL`; None means no broker: work runs in-process."""
    return url or os.environ.get(BROKER_ENV) or None


def broker_unavailable(url: str, exc: BaseException) -> ServiceUnavailableError:
    """The one-sentence error for a broker that does not answer, its password masked."""
    return ServiceUnavailableError(f"cannot reach the broker at {mask_url(url)}: {exc}")


def check_broker(url: str) -> None:
    """Raise ServiceUnavailableError unless the Redis broker at `url` answers."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
        client.ping()
        client.close()
    except (redis.RedisError, OSError, ValueError) as exc:
        raise broker_unavailable(url, exc) from None
