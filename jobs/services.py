"""Where the services are: database and broker URLs from flags or the environment, masked for output."""

from __future__ import annotations

import os
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from specq.errors import ConfigError, ServiceUnavailableError
from specq.masking import mask_url
from specq.queue import BROKER_ENV


def broker_url(url: str | None = None) -> str | None:
    """`url`, else `SPECQ_BROKER_URL`; None means no broker: work runs in-process. A password given as
    `?password=` (redis-py reads it so) is moved into the URL's userinfo, where kombu reads it (given
    both ways, kombu and redis-py crashed on it); ConfigError when the URL has a password both ways."""
    given = url or os.environ.get(BROKER_ENV) or None
    return None if given is None else _password_in_userinfo(given)


def _password_in_userinfo(url: str) -> str:
    try:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
        password = parts.password
    except ValueError:
        return url  # not a URL: the broker check says so, in one line
    given = [value for name, value in query if name == "password"]
    if not given:
        return url
    if password is not None or len(given) > 1:
        raise ConfigError(
            f"{mask_url(url)}: the broker password is given twice (in the userinfo and as ?password=); give it once"
        )
    user = quote(parts.username or "", safe="")
    host = parts.netloc.rpartition("@")[2]
    rest = urlencode([(name, value) for name, value in query if name != "password"])
    return urlunsplit((parts.scheme, f"{user}:{quote(given[0], safe='')}@{host}", parts.path, rest, parts.fragment))


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
