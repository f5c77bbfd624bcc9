"""moto's server finds each request's backend afresh: `get_backend_for_host` lists moto's package
folder (a directory read and a stat per service, about 200) and then tries every service's URL
patterns against the host, on every request. A host's backend is fixed for the life of the
process, so the answer is remembered per host (the hosts are a handful: one per service and
region). Behaviour is moto's own; only the repeated work goes.
"""

from __future__ import annotations

from typing import Any

from moto.moto_server.werkzeug_app import DomainDispatcherApplication

_moto_backend_for_host = DomainDispatcherApplication.get_backend_for_host
_UNSET = object()


def _backend_for_host(self: DomainDispatcherApplication, host: str | None) -> Any:
    # Called under self.lock (get_application), so the dict needs no lock of its own.
    known: dict[str | None, Any] = self.__dict__.setdefault("_localcloud_backend_by_host", {})
    backend = known.get(host, _UNSET)
    if backend is _UNSET:
        backend = known[host] = _moto_backend_for_host(self, host)
    return backend


def apply() -> None:
    DomainDispatcherApplication.get_backend_for_host = _backend_for_host
