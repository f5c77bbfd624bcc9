"""Fault injection at the endpoint: the answers AWS gives a caller that asks too often.

`LocalCloud.throttle(service, seconds)` makes every request to a service (named as in the
request's SigV4 credential scope: dynamodb, s3, events, ...) fail for that long with what the
service answers under load (DynamoDB ProvisionedThroughputExceededException, S3 503 SlowDown,
EventBridge ThrottlingException), over real HTTP: botocore's retries and the caller's own
handling see what they would see on AWS. moto never throttles, so this wraps its WSGI
application (`DomainDispatcherApplication.__call__`); inert while nothing is throttled.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from moto.moto_server.werkzeug_app import DomainDispatcherApplication

from localcloud.glue import active_cloud

_SCOPE = re.compile(r"Credential=[^/]+/\d{8}/[^/]+/([^/]+)/aws4_request")

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


def _call(self: DomainDispatcherApplication, environ: dict[str, Any], start_response: Any) -> Any:
    cloud = active_cloud()
    scope = _SCOPE.search(environ.get("HTTP_AUTHORIZATION", "")) if cloud is not None else None
    until = cloud.throttled.get(scope.group(1), 0.0) if scope else 0.0
    if time.monotonic() >= until:
        return _moto_call(self, environ, start_response)
    cloud.throttled_requests[scope.group(1)] = cloud.throttled_requests.get(scope.group(1), 0) + 1
    status, content_type, body = ANSWERS[scope.group(1)]
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return [body]


def apply() -> None:
    DomainDispatcherApplication.__call__ = _call
