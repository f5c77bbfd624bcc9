"""S3's request rates per prefix, as S3 documents them: it serves at least 5,500 GET/HEAD and 3,500
PUT/COPY/POST/DELETE requests a second per prefix, and answers 503 SlowDown beyond while it scales.
moto serves any rate.

Here each object request (path-style, /BUCKET/KEY, as the local endpoint is addressed) counts
against its prefix, the key up to its last "/": the folder a layout spreads its load over
(artifacts/07/, a checkpoint's shards-3/step-N/); a listing counts as a read of the prefix it
lists. Over a sliding window of one second of the cloud's time (LocalCloud.scaled), a request
beyond its prefix's rate is answered SlowDown and not counted (LocalCloudConfig.s3_prefix_rates
sets the rates). The most requests each prefix took in a window are kept (`busiest`), so that a
run can show how near it came.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, unquote

__all__ = ["PrefixRates", "request_prefix"]

READS = ("GET", "HEAD")


def request_prefix(environ: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(bucket, prefix, "read" or "write") of an S3 request, or None for one not about a bucket."""
    path = unquote(environ.get("PATH_INFO", "")).lstrip("/")
    bucket, _, key = path.partition("/")
    if not bucket:
        return None
    kind = "read" if environ.get("REQUEST_METHOD", "GET") in READS else "write"
    if not key:  # a bucket-level request: a listing is a read of the prefix it names
        key = parse_qs(environ.get("QUERY_STRING", "")).get("prefix", [""])[0]
    return bucket, key[:key.rfind("/") + 1], kind


class PrefixRates:
    """The requests each prefix took in the last window; whether one more may be served."""

    def __init__(self, reads_per_s: int, writes_per_s: int, window_s: float,
                 clock: Any = time.monotonic):
        self.limits = {"read": reads_per_s, "write": writes_per_s}
        self.window_s, self.clock = window_s, clock
        self._served: dict[tuple[str, str, str], deque[float]] = {}
        self._lock = threading.Lock()
        self.busiest: dict[tuple[str, str], int] = {}
        """(bucket/prefix, kind) -> the most requests it was served within one window."""
        self.refused: dict[tuple[str, str], int] = {}
        """(bucket/prefix, kind) -> requests answered SlowDown."""

    def admit(self, bucket: str, prefix: str, kind: str) -> bool:
        now = self.clock()
        with self._lock:
            served = self._served.setdefault((bucket, prefix, kind), deque())
            while served and served[0] <= now - self.window_s:
                served.popleft()
            where = (f"{bucket}/{prefix}", kind)
            if len(served) >= self.limits[kind]:
                self.refused[where] = self.refused.get(where, 0) + 1
                return False
            served.append(now)
            self.busiest[where] = max(self.busiest.get(where, 0), len(served))
            if len(self._served) > 10_000:  # prefixes no longer asked for
                self._served = {name: times for name, times in self._served.items()
                                if times and times[-1] > now - self.window_s}
            return True
