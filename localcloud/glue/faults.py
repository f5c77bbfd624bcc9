"""The endpoint's front door: every API request over HTTP is counted, and can be made to fail.

`LocalCloud.requests` counts each signed request by (service, action) (`localcloud.api_requests`
says which); moto counts nothing. `LocalCloud.throttle(service, seconds)` makes every request to
a service (named as in the request's SigV4 credential scope: dynamodb, s3, events, ...) fail
for that long with what the service answers under load (DynamoDB
ProvisionedThroughputExceededException, S3 503 SlowDown, EventBridge ThrottlingException), over
real HTTP: botocore's retries and the caller's own handling see what they would see on AWS.
moto never throttles, so this wraps its WSGI application (`DomainDispatcherApplication.__call__`).
"""

from __future__ import annotations

import io
import json
import time
from typing import Any

from moto.moto_server.werkzeug_app import DomainDispatcherApplication

from localcloud.api_requests import request_action, signing_service
from localcloud.glue import active_cloud

_JSON_10 = "application/x-amz-json-1.0"
_JSON_11 = "application/x-amz-json-1.1"
ANSWERS: dict[str, tuple[str, str, bytes]] = {
    "dynamodb": ("400 Bad Request", _JSON_10, json.dumps({
        "__type": "com.amazonaws.dynamodb.v20120810#ProvisionedThroughputExceededException",
        "message": "The level of configured provisioned throughput for the table was exceeded."}).encode()),
    "s3": ("503 Slow Down", "application/xml",
           b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
           b"<Message>Please reduce your request rate.</Message></Error>"),
    "events": ("400 Bad Request", _JSON_11, json.dumps({"__type": "ThrottlingException",
                                                        "message": "Rate exceeded"}).encode()),
}
"""Service -> (status, content type, body) of its throttling answer."""

_moto_call = DomainDispatcherApplication.__call__


def _headers(environ: dict[str, Any]) -> dict[str, str]:
    """The request's headers by lower-case name (WSGI keeps them as HTTP_X_AMZ_TARGET ...)."""
    headers = {key[5:].replace("_", "-").lower(): value for key, value in environ.items()
               if key.startswith("HTTP_")}
    for key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
        if environ.get(key):
            headers[key.replace("_", "-").lower()] = environ[key]
    return headers


def _form_body(environ: dict[str, Any]) -> str | None:
    """A form-encoded body (query protocols put Action there), read and put back for moto."""
    if not environ.get("CONTENT_TYPE", "").startswith("application/x-www-form-urlencoded"):
        return None
    try:
        size = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return None
    body = environ["wsgi.input"].read(size) if size else b""
    environ["wsgi.input"] = io.BytesIO(body)
    return body.decode("utf-8", errors="replace")


def _count(cloud: Any, service: str, environ: dict[str, Any]) -> None:
    action = request_action(service, environ.get("REQUEST_METHOD", "GET"), environ.get("PATH_INFO", ""),
                            environ.get("QUERY_STRING", ""), _headers(environ), _form_body(environ))
    cloud.count(cloud.requests, (service, action))


def _call(self: DomainDispatcherApplication, environ: dict[str, Any], start_response: Any) -> Any:
    cloud = active_cloud()
    service = signing_service(environ.get("HTTP_AUTHORIZATION", "")) if cloud is not None else None
    if service is None:
        return _moto_call(self, environ, start_response)
    _count(cloud, service, environ)
    if time.monotonic() >= cloud.throttled.get(service, 0.0):
        return _moto_call(self, environ, start_response)
    cloud.throttled_requests[service] = cloud.throttled_requests.get(service, 0) + 1
    status, content_type, body = ANSWERS[service]
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return [body]


def apply() -> None:
    DomainDispatcherApplication.__call__ = _call
