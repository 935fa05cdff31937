"""A writer of a many-writer store on S3 in its own process, for lease and crash tests.

Usage: python s3_parts_child.py ENDPOINT URL WRITER_ID CAPACITY LEASE_S MODE [ROWS]

It waits (a deadline of 60 s) until the id's lease is free (a dead holder's runs out),
then prints ``open <committed> <pid>``. MODE ``loop``: appends :func:`make_rows` blocks of
1..ROWS rows and flushes, printing ``committed <n>`` after each flush returns, until
killed, and ``phase <what>`` before each step (:func:`_trace_phases`). MODE ``stdin``:
one command a line: ``flush <rows>`` (prints ``committed <n>``, or ``fenced <message>``
when another writer took the id over and the flush lost), ``close``.
"""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from parts_child import make_rows
from s3_server import s3_storage_options


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # one write a line: a kill never splits it


def _trace_phases() -> None:
    """Prints ``phase <what>`` before each call on the bucket, so that the parent knows
    what a kill interrupted: ``piece`` (uploading rows), ``commit`` (creating a manifest
    version), ``evict`` (listing or deleting what is superseded), ``lease`` (renewing)."""
    from grain_replay.store.objects import ObjectStore

    def traced(name: str, phase_of: Any) -> None:
        real = getattr(ObjectStore, name)

        def call(self: ObjectStore, key: Any, *args: Any, **kwargs: Any) -> Any:
            _say(f"phase {phase_of(str(key))}")
            return real(self, key, *args, **kwargs)

        setattr(ObjectStore, name, call)

    traced("put", lambda key: "lease" if "/lease/" in key else "piece")
    traced("create", lambda key: "commit" if "/manifests/" in key else "other")
    traced("remove", lambda key: "evict")


def main() -> None:
    endpoint, url, writer_id, capacity, lease_s, mode = sys.argv[1:7]
    rows = int(sys.argv[7]) if len(sys.argv) > 7 else 8
    import grain_replay as gr

    if mode == "loop":
        _trace_phases()

    deadline = time.monotonic() + 60
    while True:
        try:
            w = gr.ReplayWriter(
                url,
                capacity=int(capacity),
                writer_id=writer_id,
                storage_options=s3_storage_options(endpoint),
                lease_s=float(lease_s),
                evict_grace_s=float(os.environ.get("EVICT_GRACE_S", "300")),
            )
            break
        except gr.WriterBusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # polling the lease: the holder's runs out by the server clock
    _say(f"open {w.committed} {os.getpid()}")
    rng = random.Random(os.getpid())
    if mode == "loop":
        while True:
            n = rng.randint(1, rows)
            _say("phase append")
            w.append(make_rows(writer_id, w.committed, n))
            _say(f"committed {w.flush()}")
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "flush":
            w.append(make_rows(writer_id, len(w), int(rest[0])))
            try:
                _say(f"committed {w.flush()}")
            except gr.WriterBusyError as e:
                _say(f"fenced {e}".replace("\n", " "))
                return
        elif cmd == "close":
            w.close()
            _say("closed")
            return


if __name__ == "__main__":
    main()
