"""Who holds a writer id of a many-writer store on object storage: a lease with a heartbeat.

``writers/<id>/lease/<epoch:012d>.json`` names the holder (host, pid, start, its
``lease_s``). A writer takes the id by creating epoch ``e + 1`` (a conditional create:
of two takers, one wins) once epoch ``e`` is released or expired: not renewed for more
than its holder's ``lease_s`` by the *server's* clock (its LastModified against the
LastModified of an object written now, so no two hosts' clocks are compared; S3 keeps
whole seconds, hence one second of slack). The holder renews it (rewrites the object)
every ``lease_s / 4`` from a heartbeat thread, and stops renewing once a newer epoch
exists: it was taken over, and its next commit fails (store/objects.py: the manifest
version it would create exists).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from typing import Any

from grain_replay.errors import InvalidArgumentError, WriterBusyError
from grain_replay.store.objects import CLOCK_SLACK_S, ObjectStore

__all__ = ["Lease", "check_seconds"]

logger = logging.getLogger(__name__)


def check_seconds(value: Any, name: str, where: str, *, zero_ok: bool = False) -> float:
    """``value`` as a finite number of seconds (> 0, or >= 0 with ``zero_ok``)."""
    bad = isinstance(value, bool) or not isinstance(value, (int, float))
    seconds = math.nan if bad else float(value)
    if bad or not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero_ok):
        least = ">= 0" if zero_ok else "> 0"
        raise InvalidArgumentError(
            f"{where}: {name} must be a finite number of seconds {least}, got {value!r}. "
            f"Fix: pass e.g. {name}=30.0."
        )
    return seconds


class Lease:
    """The lease on ``writer_id`` held by this process (see the module docstring).

    Args:
      store: the store's objects.
      writer_id: the id to hold.
      lease_s: how long the lease lasts unrenewed; others take the id after that.
      who: the writer as messages name it.
    """

    def __init__(self, store: ObjectStore, writer_id: str, lease_s: float, who: str) -> None:
        self._store, self._id, self.lease_s, self._who = store, writer_id, lease_s, who
        self._folder = store.writer_key(writer_id, "lease")
        self.epoch = -1
        self._body: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.renewed = time.monotonic()  # the last successful renewal (this host's clock)
        self.taken_by: dict[str, Any] | None = None  # the newer holder, once seen

    def _key(self, epoch: int) -> str:
        return f"{self._folder}/{epoch:012d}.json"

    def _epochs(self) -> list[tuple[int, float]]:
        out = []
        for e in self._store.listing(self._folder):
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            if name.endswith(".json") and name[:-5].isdigit():
                out.append((int(name[:-5]), self._store.modified(e)))
        return sorted(out)

    def _read(self, epoch: int) -> dict[str, Any] | None:
        raw = self._store.get(self._key(epoch))
        if raw is None:
            return None
        try:
            found = json.loads(raw)
        except ValueError:
            return None  # a holder killed mid-write of a new object cannot leave one
        return found if isinstance(found, dict) else None

    def acquire(self) -> int:
        """Takes the id (a new epoch); returns the epoch.

        Raises:
          WriterBusyError: a live writer holds it (named by host and pid).
        """
        for _ in range(20):
            epochs = self._epochs()
            nxt = epochs[-1][0] + 1 if epochs else 0
            live = self._live(epochs)
            if live is not None:
                holder, age = live
                raise WriterBusyError(
                    f"{self._who}: writer id {self._id!r} is held by a live writer "
                    f"(host {holder.get('host')!r}, pid {holder.get('pid')}, lease "
                    f"epoch {nxt - 1}, renewed {max(age, 0.0):.0f} s ago, lease "
                    f"{float(holder.get('lease_s', self.lease_s)):g} s). Fix: use another "
                    "writer_id, stop that writer, or wait for its lease to run out if it died."
                )
            body = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "start": time.time(),
                "epoch": nxt,
                "lease_s": self.lease_s,
                "released": False,
            }
            if self._store.create(self._key(nxt), json.dumps(body).encode()):
                self.epoch, self._body = nxt, body
                self.renewed = time.monotonic()
                old = [self._key(e) for e, _ in epochs[:-1]]
                self._store.remove(old)  # the holders before the last: gone for good
                return nxt
        raise WriterBusyError(
            f"{self._who}: writer id {self._id!r}: other writers keep taking its lease. "
            "Fix: start one writer per writer_id."
        )

    def _live(self, epochs: list[tuple[int, float]]) -> tuple[dict[str, Any], float] | None:
        """The newest lease's body and age (server time) while it is live: not released
        and renewed within its ``lease_s``; None when the id is free."""
        if not epochs:
            return None
        last, modified = epochs[-1]
        holder = self._read(last)
        if holder is None or holder.get("released"):
            return None
        held_s = float(holder.get("lease_s", self.lease_s))
        age = self._store.server_now() - modified
        return (holder, age) if age <= held_s + CLOCK_SLACK_S else None

    def live_holder(self) -> dict[str, Any] | None:
        """Who holds the id now (host, pid, epoch: the lease's body), asked of the server
        without taking it; None when it is free."""
        live = self._live(self._epochs())
        return None if live is None else live[0]

    def start(self) -> None:
        """Starts the heartbeat thread (renewing every ``lease_s / 4``)."""
        self._thread = threading.Thread(
            target=self._beat, name=f"grain-replay-lease-{self._id}", daemon=True
        )
        self._thread.start()

    def taken_over(self) -> dict[str, Any] | None:
        """The newer holder of the id (its lease body), or None while this one holds it.
        Asks the server."""
        newer = [e for e, _ in self._epochs() if e > self.epoch]
        if not newer:
            return None
        self.taken_by = self._read(newer[-1]) or {"epoch": newer[-1]}
        return self.taken_by

    def _beat(self) -> None:
        failing = False
        while not self._stop.wait(self.lease_s / 4):
            try:
                if self.taken_over() is not None:
                    logger.warning("%s: writer id taken over: %s", self._who, self.taken_by)
                    return
                self._store.put(self._key(self.epoch), json.dumps(self._body).encode())
                self.renewed = time.monotonic()
                failing = False
            except Exception as e:  # the next beat retries; the commit path fences
                if not failing:
                    logger.warning("%s: cannot renew the writer lease: %s", self._who, e)
                failing = True

    def stale(self) -> bool:
        """Whether the lease went unrenewed for longer than it lasts (this process was
        paused, or the server unreachable): another writer may have taken the id."""
        return time.monotonic() - self.renewed > self.lease_s

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def release(self) -> None:
        """Stops renewing and frees the id at once (unless another writer took it)."""
        self.stop()
        if self.epoch < 0:
            return
        try:
            if self.taken_over() is None:
                body = dict(self._body, released=True)
                self._store.put(self._key(self.epoch), json.dumps(body).encode())
        except Exception as e:  # the lease runs out by itself
            logger.warning("%s: cannot release the writer lease: %s", self._who, e)
        self.epoch = -1
