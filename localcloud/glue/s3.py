"""S3 glue: the requests that reach the local S3, heard as they come.

moto serves S3 without telling anyone what it was asked. `listen(listener)` calls `listener(kind,
key, body)` on every PutObject ("write", with the body written) and GetObject ("read", body None)
as it reaches the local S3, before it is served: the chaos cells see a checkpoint being written or
read from it, and the demo a checkpoint's commit the moment its marker is written. The backend is
wrapped when the first listener comes, and is inert while none listens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["listen"]

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
