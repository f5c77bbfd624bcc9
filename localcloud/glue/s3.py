"""S3 glue: listings as S3 gives them, and the requests that reach the local S3, heard as they come.

- A listing with a delimiter: moto gave the common prefix of every key, also of a key whose
  current version is a delete marker (in a versioned bucket, an object deleted). S3 lists such a
  key nowhere, neither in Contents nor under a common prefix: a checkpoint step that retention
  pruned is gone from a listing, on S3 and here.
- moto serves S3 without telling anyone what it was asked. `listen(listener)` calls
  `listener(kind, key, body)` on every PutObject ("write", with the body written) and GetObject
  ("read", body None) as it reaches the local S3, before it is served: the chaos cells see a
  checkpoint being written or read from it, and the demo a checkpoint's commit the moment its
  marker is written. The backend is wrapped when the first listener comes, and is inert while
  none listens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["listen", "apply"]

Listener = Callable[[str, str, "bytes | None"], None]
_listeners: list[Listener] = []
_lock = threading.Lock()
_installed = False


@contextmanager
def listen(listener: Listener) -> Iterator[None]:
    """Call `listener(kind, key, body)` on every object written or read while in the block."""
    _install()
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        from moto.s3.models import S3Backend
        put_object, get_object = S3Backend.put_object, S3Backend.get_object

        def put(self: Any, bucket_name: str, key_name: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
            _heard("write", key_name, value)
            return put_object(self, bucket_name, key_name, value, *args, **kwargs)

        def get(self: Any, bucket_name: str, key_name: str, *args: Any, **kwargs: Any) -> Any:
            _heard("read", key_name, None)
            return get_object(self, bucket_name, key_name, *args, **kwargs)

        S3Backend.put_object, S3Backend.get_object = put, get
        _installed = True


def _heard(kind: str, key: str, body: bytes | None) -> None:
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener(kind, key, body)


def apply() -> None:
    from moto.s3.models import FakeDeleteMarker, S3Backend

    list_objects = S3Backend.list_objects

    def without_deleted_prefixes(self: Any, bucket: Any, prefix: str | None, delimiter: str | None, *args: Any,
                                 **kwargs: Any) -> Any:
        keys, folders, truncated, marker = list_objects(self, bucket, prefix, delimiter, *args, **kwargs)
        if delimiter and folders:
            listed = {f"{prefix or ''}{name[len(prefix or ''):].split(delimiter)[0]}{delimiter}"
                      for name, key in bucket.keys.items()
                      if not isinstance(key, FakeDeleteMarker) and name.startswith(prefix or "")
                      and delimiter in name[len(prefix or ""):]}
            folders = [folder for folder in folders if folder in listed]
        return keys, folders, truncated, marker

    S3Backend.list_objects = without_deleted_prefixes
