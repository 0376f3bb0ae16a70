"""kombu's Redis transport with one fix: a failed acknowledgement still frees the prefetch slot.

kombu's Redis `QoS.ack` first removes the message from Redis' unacknowledged hash, and only then frees
the consumer's prefetch slot. When Redis restarts while a task runs, that removal raises ("Couldn't
ack"), the slot stays taken for good, and with one prefetched task per worker the consumer never polls
the queue again: the worker looks alive and takes nothing. Here the slot is freed whatever Redis says,
and a removal that fails on the connection is one warning line (the consumer then notices the lost
connection itself, and reconnects). The entry left in Redis' hash, if any (a restart leaves none),
would make Redis deliver the finished chunk again after the visibility timeout, which is harmless: the
copy finds nothing left to claim.

`install()` points the `redis://` and `rediss://` URL schemes at this transport, for this process.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import QoS as VirtualQoS
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

_LOST = (RedisConnectionError, RedisTimeoutError, OSError)


class QoS(kombu_redis.QoS):
    def ack(self, delivery_tag: Any) -> None:
        try:
            self._remove_from_indices(delivery_tag).execute()
        except _LOST as exc:
            log.warning("acknowledged %s, but Redis did not answer (%s); it may be delivered again", delivery_tag, exc)
        finally:
            VirtualQoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        try:
            if requeue:
                self.restore_by_tag(delivery_tag, leftmost=True)
            else:
                self._remove_from_indices(delivery_tag).execute()
        except _LOST as exc:
            log.warning("rejected %s, but Redis did not answer (%s)", delivery_tag, exc)
        finally:
            VirtualQoS.ack(self, delivery_tag)


class Channel(kombu_redis.Channel):
    QoS = QoS


class Transport(kombu_redis.Transport):
    Channel = Channel


def install() -> None:
    TRANSPORT_ALIASES["redis"] = f"{__name__}:Transport"
    TRANSPORT_ALIASES["rediss"] = f"{__name__}:Transport"
