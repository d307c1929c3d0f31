"""The ingest job queue and the job status store, each behind one small protocol.

`RedisStreamQueue` (a Redis stream read through a consumer group) serves deployments whose workers are separate
processes; `SqliteJobQueue` (`service.jobs.sqlite`) gives the embedded form (gateway and worker in one process)
the same semantics in a file that survives restarts; `InProcessQueue` keeps them in memory (tests, throwaway
runs). Delivery is at least once:

- a consumer reads messages, processes them and acks each one (acked messages are deleted from the stream);
- a message whose consumer died stays pending, and `claim_stale` hands it to a live consumer once it has been idle
  for `min_idle_ms`;
- `fail` puts a message back at the end of the queue for another attempt, or, once it has had `max_attempts`,
  moves it to the dead-letter stream with the error and acks it.

Attempts count deliveries, so a job that kills its worker every time (say, out of memory) ends in the dead-letter
stream too instead of being claimed forever. A payload is one JSON object; anything else found in the stream is
dead-lettered with the reason, never raised to the consumer.

Job statuses live in `service.jobs.status`.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import redis

log = logging.getLogger(__name__)

DEFAULT_STREAM = "kvstitch:ingest"
DEFAULT_GROUP = "kvstitch-workers"
DEFAULT_DEAD_LETTER = "kvstitch:ingest:dead"
DEFAULT_MAX_ATTEMPTS = 3
_PAYLOAD = "payload"
_ATTEMPTS = "attempts"  # deliveries that ended in `fail` before this copy of the message was queued
_LAST_ERROR = "last_error"

# Ack a message, delete it and add an entry (its retry, or its dead letter) in one atomic step; a message that is
# no longer pending (acked meanwhile by a consumer that had claimed it) is left alone, so it is never doubled.
# KEYS: the stream, the stream that gets the new entry; ARGV: the group, the message id, the new entry's fields.
_MOVE_SCRIPT = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
return 1
"""


@dataclass(frozen=True)
class Delivery:
    """One delivery of a message to a consumer; `attempt` is 1 the first time a job is handed out."""

    message_id: str
    payload: dict[str, Any]
    attempt: int
    consumer: str
    last_error: str | None = None


@dataclass(frozen=True)
class DeadLetter:
    """A message given up on: its text as it was found (it may not be JSON) and why."""

    message_id: str
    original_id: str
    payload: str
    error: str
    attempts: int
    failed_at: float


DeadLetterHook = Callable[[str, str], None]


class JobQueue(Protocol):
    """What the gateway (producer) and the ingest worker (consumer) need from a queue.

    `on_dead_letter(payload_text, error)` is called for messages the queue gives up on by itself while reading
    (malformed, or abandoned by workers that died every time), so their jobs can still be marked failed; `fail`
    and `reject` do not call it (their caller knows).
    """

    max_attempts: int
    on_dead_letter: DeadLetterHook | None

    def enqueue(self, payload: Mapping[str, Any]) -> str: ...

    def consume(self, consumer_name: str, block_ms: int = 1000, count: int = 1) -> list[Delivery]: ...

    def ack(self, delivery: Delivery) -> None: ...

    def fail(self, delivery: Delivery, error: str) -> bool: ...

    def reject(self, delivery: Delivery, error: str) -> bool: ...

    def release(self, delivery: Delivery, payload: Mapping[str, Any] | None = None) -> None:
        """Put an unfinished job back at the end of the queue (its worker is stopping, or it gives other jobs a
        turn), as `payload` when given (the rest of the job); the delivery does not count as an attempt."""
        ...

    def waiting_count(self) -> int:
        """Messages enqueued and not yet handed to any consumer (jobs waiting for a turn)."""
        ...

    def keep_alive(self, delivery: Delivery) -> None: ...

    def claim_stale(self, consumer_name: str, min_idle_ms: int, count: int = 16) -> list[Delivery]: ...

    def pending_count(self) -> int: ...

    def dead_letters(self, limit: int = 100) -> list[DeadLetter]: ...

    def close(self) -> None: ...


def encode_payload(payload: Mapping[str, Any]) -> str:
    """A payload as one JSON object; refused early so a bad job fails at enqueue, not in a worker."""
    if not isinstance(payload, Mapping):
        raise TypeError(f"a job payload must be a mapping (a JSON object), got {type(payload).__name__}")
    try:
        return json.dumps(dict(payload), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as err:
        raise ValueError(f"job payload is not JSON-serializable: {err}") from err


def reencode_payload(payload: Mapping[str, Any]) -> str:
    """A delivered payload as text again, for a retry or a dead letter. It came from JSON, so it always encodes;
    NaN or Infinity read from a hand-written message are kept as such (the worker's error names the field)
    rather than making the retry or dead letter itself fail."""
    try:
        return encode_payload(payload)
    except ValueError:
        return json.dumps(dict(payload), ensure_ascii=False, separators=(",", ":"))


def decode_payload(data: str) -> dict[str, Any]:
    """The payload of a message; ValueError naming what is wrong with a malformed one."""
    try:
        payload = json.loads(data)
    except ValueError as err:
        raise ValueError(f"malformed message: payload is not valid JSON ({err})") from err
    if not isinstance(payload, dict):
        raise ValueError(f"malformed message: payload is a JSON {type(payload).__name__}, not an object")
    return payload


def _check_count(count: int) -> None:
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")


def _check_max_attempts(max_attempts: int) -> int:
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
    return max_attempts


# ---- Redis Streams -------------------------------------------------------------------------------------------


class RedisStreamQueue:
    """The queue as a Redis stream with one consumer group; the dead letters go to a second stream."""

    def __init__(
        self,
        url: str,
        stream: str = DEFAULT_STREAM,
        group: str = DEFAULT_GROUP,
        dead_letter: str = DEFAULT_DEAD_LETTER,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> None:
        self.stream, self.group, self.dead_letter = stream, group, dead_letter
        self.max_attempts = _check_max_attempts(max_attempts)
        self.on_dead_letter: DeadLetterHook | None = None
        # Raw bytes, decoded here: a field that is not UTF-8 must become a dead letter, not a crash in the reader.
        self._redis: Any = redis.Redis.from_url(url, decode_responses=False)
        self._move = self._redis.register_script(_MOVE_SCRIPT)
        self._ensure_group()

    def enqueue(self, payload: Mapping[str, Any]) -> str:
        return _text(self._redis.xadd(self.stream, {_PAYLOAD: encode_payload(payload), _ATTEMPTS: 0}))

    def consume(self, consumer_name: str, block_ms: int = 1000, count: int = 1) -> list[Delivery]:
        """Up to `count` new messages, waiting at most `block_ms` for one (no wait when block_ms <= 0)."""
        _check_count(count)
        block = block_ms if block_ms > 0 else None  # Redis reads BLOCK 0 as "forever"
        reply = self._in_group(lambda: self._read(consumer_name, count, block))
        entries = [entry for _, stream_entries in reply or [] for entry in stream_entries]
        return self._deliveries(entries, consumer_name, times_delivered=dict.fromkeys(_ids(entries), 1))

    def ack(self, delivery: Delivery) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.xack(self.stream, self.group, delivery.message_id)
        pipe.xdel(self.stream, delivery.message_id)  # the stream holds only unfinished jobs
        pipe.execute()

    def fail(self, delivery: Delivery, error: str) -> bool:
        """Re-queue for another attempt, or dead-letter after `max_attempts`; True when it was dead-lettered."""
        data = reencode_payload(delivery.payload)
        if delivery.attempt >= self.max_attempts:
            return self._bury(delivery.message_id, data, error, delivery.attempt)
        retry: dict[str, str | int] = {_PAYLOAD: data, _ATTEMPTS: delivery.attempt, _LAST_ERROR: error}
        self._move_to(self.stream, delivery.message_id, retry)
        return False

    def reject(self, delivery: Delivery, error: str) -> bool:
        """Dead-letter now, whatever the attempt: the job can never succeed (a malformed document, say)."""
        return self._bury(delivery.message_id, reencode_payload(delivery.payload), error, delivery.attempt)

    def release(self, delivery: Delivery, payload: Mapping[str, Any] | None = None) -> None:
        """Re-queue with this delivery uncounted (the stream has no "undeliver": a new entry, the old one acked)."""
        data = reencode_payload(delivery.payload if payload is None else payload)
        fields: dict[str, str | int] = {_PAYLOAD: data, _ATTEMPTS: delivery.attempt - 1}
        if delivery.last_error is not None:
            fields[_LAST_ERROR] = delivery.last_error
        self._move_to(self.stream, delivery.message_id, fields)

    def keep_alive(self, delivery: Delivery) -> None:
        """Reset the message's idle time, so a long job is not claimed from its live worker."""
        self._redis.xclaim(
            self.stream, self.group, delivery.consumer, min_idle_time=0, message_ids=[delivery.message_id], justid=True
        )

    def claim_stale(self, consumer_name: str, min_idle_ms: int, count: int = 16) -> list[Delivery]:
        """Take over messages other consumers read but have not acked for `min_idle_ms` (they likely died)."""
        _check_count(count)
        entries: list[tuple[Any, Any]] = []
        start: Any = "0-0"
        while len(entries) < count:
            claim = functools.partial(
                self._redis.xautoclaim,
                self.stream,
                self.group,
                consumer_name,
                max(0, min_idle_ms),
                start,
                count=count - len(entries),
            )
            start, claimed, *_ = self._in_group(claim)
            entries.extend((entry_id, fields) for entry_id, fields in claimed if fields)
            if _text(start) == "0-0":
                break
        return self._deliveries(entries, consumer_name, times_delivered=self._times_delivered(_ids(entries)))

    def pending_count(self) -> int:
        """Messages enqueued and not yet acked or dead-lettered: waiting ones and those being processed."""
        return int(self._redis.xlen(self.stream))

    def waiting_count(self) -> int:
        """Acked entries are deleted, so what the stream holds beyond the group's pending list is undelivered."""
        pending = self._in_group(lambda: self._redis.xpending(self.stream, self.group))
        return max(0, int(self._redis.xlen(self.stream)) - int(pending["pending"]))

    def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        entries = self._redis.xrange(self.dead_letter, count=limit)
        return [_dead_letter(_text(entry_id), _fields(fields)) for entry_id, fields in entries]

    def close(self) -> None:
        self._redis.close()

    # ---- internals -----------------------------------------------------------------------------------------

    def _ensure_group(self) -> None:
        try:
            # From id 0, so jobs enqueued before the first worker started are still delivered.
            self._redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    def _in_group(self, call: Callable[[], Any]) -> Any:
        """Run a consumer-group command; when Redis lost the stream and its group (a restart without persistence,
        a flush) re-create the group and run it once more, so every consumer command recovers the same way."""
        try:
            return call()
        except redis.ResponseError as err:
            if "NOGROUP" not in str(err):
                raise
            self._ensure_group()
            return call()

    def _read(self, consumer_name: str, count: int, block: int | None) -> Any:
        return self._redis.xreadgroup(self.group, consumer_name, {self.stream: ">"}, count=count, block=block)

    def _times_delivered(self, message_ids: list[str]) -> dict[str, int]:
        pipe = self._redis.pipeline(transaction=False)
        for message_id in message_ids:
            pipe.xpending_range(self.stream, self.group, min=message_id, max=message_id, count=1)
        replies = pipe.execute()
        return {mid: int(r[0]["times_delivered"]) if r else 1 for mid, r in zip(message_ids, replies, strict=True)}

    def _deliveries(
        self, entries: list[tuple[Any, Any]], consumer: str, times_delivered: dict[str, int]
    ) -> list[Delivery]:
        """Deliveries of well-formed entries; malformed or exhausted ones go to the dead letters instead."""
        deliveries: list[Delivery] = []
        for entry_id, raw_fields in entries:
            message_id, fields = _text(entry_id), _fields(raw_fields)
            data = fields.get(_PAYLOAD, "")
            attempt = _int(fields.get(_ATTEMPTS)) + times_delivered.get(message_id, 1)
            try:
                if _PAYLOAD not in fields:
                    raise ValueError("malformed message: it has no payload field")
                _check_utf8(raw_fields, _PAYLOAD)
                payload = decode_payload(data)
            except ValueError as err:
                if self._bury(message_id, data, str(err), attempt):
                    _notify(self.on_dead_letter, data, str(err))
                continue
            if attempt > self.max_attempts:
                error = _abandoned(attempt, fields.get(_LAST_ERROR))
                if self._bury(message_id, data, error, attempt - 1):
                    _notify(self.on_dead_letter, data, error)
                continue
            deliveries.append(Delivery(message_id, payload, attempt, consumer, fields.get(_LAST_ERROR)))
        return deliveries

    def _bury(self, message_id: str, data: str, error: str, attempts: int) -> bool:
        """Move a message to the dead-letter stream, acking it; False when it was no longer pending."""
        record: dict[str, str | int] = {
            _PAYLOAD: data,
            "error": error,
            _ATTEMPTS: attempts,
            "original_id": message_id,
            "failed_at": repr(time.time()),
        }
        return self._move_to(self.dead_letter, message_id, record)

    def _move_to(self, target: str, message_id: str, fields: Mapping[str, str | int]) -> bool:
        args: list[str | int] = [self.group, message_id]
        for name, value in fields.items():
            args += [name, value]
        return bool(self._move(keys=[self.stream, target], args=args))


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _fields(raw: Mapping[Any, Any]) -> dict[str, str]:
    """Entry fields as text; bytes that are not UTF-8 keep a readable form for the dead letter."""
    return {_text(k): _text(v) for k, v in raw.items()}


def _check_utf8(raw: Mapping[Any, Any], name: str) -> None:
    """ValueError when a field's bytes are not UTF-8: replacement characters must not be ingested as text."""
    for key, value in raw.items():
        if _text(key) == name and isinstance(value, bytes):
            try:
                value.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"malformed message: {name} is not UTF-8 text ({err.reason} at byte {err.start})"
                ) from err


def _int(value: str | None) -> int:
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0


def _ids(entries: list[tuple[Any, Any]]) -> list[str]:
    return [_text(entry_id) for entry_id, _ in entries]


def _notify(hook: DeadLetterHook | None, data: str, error: str) -> None:
    """Tell the hook; its failure must not stop the queue from handing out the other messages."""
    if hook is None:
        return
    try:
        hook(data, error)
    except Exception:
        log.exception("dead-letter hook failed")


def _abandoned(attempt: int, last_error: str | None) -> str:
    reason = f"delivered {attempt - 1} times without an ack (its worker stopped each time)"
    return f"{reason}; last error: {last_error}" if last_error else reason


def _dead_letter(message_id: str, fields: dict[str, str]) -> DeadLetter:
    return DeadLetter(
        message_id=message_id,
        original_id=fields.get("original_id", ""),
        payload=fields.get(_PAYLOAD, ""),
        error=fields.get("error", ""),
        attempts=_int(fields.get(_ATTEMPTS)),
        failed_at=float(fields.get("failed_at") or 0.0),
    )


# ---- in process ----------------------------------------------------------------------------------------------


@dataclass
class _Message:
    message_id: str
    data: str  # JSON text, as in Redis: every delivery decodes its own copy
    prior_attempts: int = 0
    last_error: str | None = None
    deliveries: int = 0
    consumer: str | None = None
    delivered_at: float = 0.0


class InProcessQueue:
    """The same queue in memory; safe across threads, lost on restart (the embedded form uses `SqliteJobQueue`)."""

    def __init__(self, max_attempts: int = DEFAULT_MAX_ATTEMPTS, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_attempts = _check_max_attempts(max_attempts)
        self.on_dead_letter: DeadLetterHook | None = None
        self._clock = clock
        self._changed = threading.Condition(threading.RLock())  # re-entrant: fail() re-queues under the lock
        self._ready: deque[str] = deque()
        self._messages: dict[str, _Message] = {}  # every message not yet acked or dead-lettered, oldest first
        self._dead: list[DeadLetter] = []
        self._ids = itertools.count(1)
        self._closed = False

    def enqueue(self, payload: Mapping[str, Any]) -> str:
        return self._add(encode_payload(payload), prior_attempts=0, last_error=None)

    def consume(self, consumer_name: str, block_ms: int = 1000, count: int = 1) -> list[Delivery]:
        _check_count(count)
        with self._changed:
            if block_ms > 0:
                self._changed.wait_for(lambda: bool(self._ready) or self._closed, timeout=block_ms / 1000)
            taken = [self._messages[self._ready.popleft()] for _ in range(min(count, len(self._ready)))]
            return [self._deliver(message, consumer_name) for message in taken]

    def ack(self, delivery: Delivery) -> None:
        with self._changed:
            self._messages.pop(delivery.message_id, None)

    def fail(self, delivery: Delivery, error: str) -> bool:
        data = reencode_payload(delivery.payload)
        with self._changed:
            if self._messages.pop(delivery.message_id, None) is None:
                return False  # acked meanwhile by a consumer that had claimed it: nothing to retry, as in Redis
            if delivery.attempt >= self.max_attempts:
                self._bury(delivery.message_id, data, error, delivery.attempt)
                return True
            self._add(data, prior_attempts=delivery.attempt, last_error=error)
            return False

    def reject(self, delivery: Delivery, error: str) -> bool:
        with self._changed:
            if self._messages.pop(delivery.message_id, None) is None:
                return False
            self._bury(delivery.message_id, reencode_payload(delivery.payload), error, delivery.attempt)
            return True

    def release(self, delivery: Delivery, payload: Mapping[str, Any] | None = None) -> None:
        data = reencode_payload(delivery.payload if payload is None else payload)
        with self._changed:
            if self._messages.pop(delivery.message_id, None) is not None:
                self._add(data, delivery.attempt - 1, delivery.last_error)

    def keep_alive(self, delivery: Delivery) -> None:
        with self._changed:
            message = self._messages.get(delivery.message_id)
            if message is not None and message.consumer == delivery.consumer:
                message.delivered_at = self._clock()

    def claim_stale(self, consumer_name: str, min_idle_ms: int, count: int = 16) -> list[Delivery]:
        _check_count(count)
        now = self._clock()
        with self._changed:
            in_flight = (m for m in self._messages.values() if m.consumer is not None)
            stale = [m for m in in_flight if (now - m.delivered_at) * 1000 >= min_idle_ms][:count]
            deliveries = []
            for message in stale:
                delivered = message.prior_attempts + message.deliveries
                if delivered >= self.max_attempts:  # this would be one attempt too many
                    del self._messages[message.message_id]
                    error = _abandoned(delivered + 1, message.last_error)
                    self._bury(message.message_id, message.data, error, delivered)
                    _notify(self.on_dead_letter, message.data, error)
                else:
                    deliveries.append(self._deliver(message, consumer_name))
            return deliveries

    def pending_count(self) -> int:
        with self._changed:
            return len(self._messages)

    def waiting_count(self) -> int:
        with self._changed:
            return len(self._ready)

    def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        with self._changed:
            return self._dead[:limit]

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()  # blocked consumers return at once

    def _add(self, data: str, prior_attempts: int, last_error: str | None) -> str:
        with self._changed:
            message_id = f"{next(self._ids)}-0"
            self._messages[message_id] = _Message(message_id, data, prior_attempts, last_error)
            self._ready.append(message_id)
            self._changed.notify()
            return message_id

    def _deliver(self, message: _Message, consumer: str) -> Delivery:
        message.deliveries += 1
        message.consumer, message.delivered_at = consumer, self._clock()
        attempt = message.prior_attempts + message.deliveries
        return Delivery(message.message_id, decode_payload(message.data), attempt, consumer, message.last_error)

    def _bury(self, message_id: str, data: str, error: str, attempts: int) -> None:
        self._dead.append(DeadLetter(f"dead-{message_id}", message_id, data, error, attempts, time.time()))
