"""Every Redis key and queue name specq uses, in one place, under the `specq:` prefix."""

KEY_PREFIX = "specq:"  # kombu's global_keyprefix: every key the broker writes starts with it
CHUNK_QUEUE = "chunks"  # Celery queue name; its Redis list is KEY_PREFIX + CHUNK_QUEUE
CHUNK_QUEUE_KEY = KEY_PREFIX + CHUNK_QUEUE  # LLEN of this is the backlog, in chunk tasks
UNACKED_KEY = "unacked"  # kombu's hash of delivered, not yet acknowledged messages (prefixed too)
UNACKED_INDEX_KEY = "unacked_index"
UNACKED_MUTEX_KEY = "unacked_mutex"
PROCESS_CHUNK_TASK = "specq.process_chunk"  # the task name, so senders need not import the worker

BROKER_ENV = "SPECQ_BROKER_URL"
