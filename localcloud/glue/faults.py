"""The endpoint's front door: every API request over HTTP is counted, and can be made to fail.

`LocalCloud.requests` counts each signed request by (service, action) (`localcloud.api_requests`
says which); moto counts nothing. `LocalCloud.fail_requests(service, seconds, answer)` makes
every request to a service (named as in the request's SigV4 credential scope: dynamodb, s3,
events, lambda, ec2, states) fail for that long with what the service answers under load
("throttle": DynamoDB ProvisionedThroughputExceededException, S3 503 SlowDown, Lambda 429
TooManyRequestsException, EC2 503 RequestLimitExceeded, EventBridge and Step Functions
ThrottlingException) or in an outage ("error": its documented 500), over real HTTP:
botocore's retries and the caller's own handling see what they would see on AWS. moto never
fails so, so this wraps its WSGI application (`DomainDispatcherApplication.__call__`).

An S3 request past its prefix's documented rate is answered 503 SlowDown (glue/s3_rates.py),
counted under ("s3", "slowdown").

A request from an instance whose subnet's network has no way to the service never reaches it
(glue/routes.py, LocalCloud.routes): it is answered as unreachable, counted in `failed_requests` under
(service, "unreachable").

The wrapper also serves the chaos control route (`localcloud.chaos_route`), through which
`trainfleet chaos` injects faults from another process.

What an outage of a service hits here is what it hits on AWS: whoever calls its API over
HTTP. That includes the state machine's own service integrations (a lambda:invoke Task calls
Invoke over HTTP, so it fails with Lambda.TooManyRequestsException / Lambda.ServiceException as
on AWS), but not EventBridge's delivery to its targets, which runs in-process as AWS's runs
inside the service.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from moto.moto_server.werkzeug_app import DomainDispatcherApplication

from localcloud.api_requests import request_action, signing_service
from localcloud.chaos_route import CHAOS_PATH, ChaosError, inject
from localcloud.account import INTERNAL_HEADER
from localcloud.glue import active_cloud
from localcloud.glue.routes import UNREACHABLE_HEADER, UNREACHABLE_STATUS
from localcloud.glue.s3_rates import request_prefix

if TYPE_CHECKING:
    from localcloud.parts import FrontDoorCloud

INTERNAL_ENVIRON = "HTTP_" + INTERNAL_HEADER.upper().replace("-", "_")
"""The WSGI name of the header LocalCloud.internal_client sets: such requests pass untouched."""
_JSON_10 = "application/x-amz-json-1.0"
_JSON_11 = "application/x-amz-json-1.1"

Answer = tuple[str, list[tuple[str, str]], bytes]
"""An HTTP answer: status line, headers, body."""


def _json(status: str, version: str, error_type: str, message: str) -> Answer:
    """An error of a JSON-protocol service: the code in __type."""
    return status, [("Content-Type", version)], json.dumps({"__type": error_type, "message": message}).encode()


def _rest_json(status: str, error_type: str, body: dict[str, str]) -> Answer:
    """An error of a REST-JSON service (Lambda): the code in the X-Amzn-ErrorType header."""
    return (status, [("Content-Type", "application/json"), ("X-Amzn-ErrorType", error_type)],
            json.dumps(body).encode())


def _s3_xml(status: str, code: str, message: str) -> Answer:
    return status, [("Content-Type", "application/xml")], (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>{message}</Message></Error>").encode()


def _ec2_xml(status: str, code: str, message: str) -> Answer:
    """The EC2 query API's error document (Response/Errors/Error, RequestID)."""
    return status, [("Content-Type", "text/xml;charset=UTF-8")], (
        f'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>{code}</Code>'
        f"<Message>{message}</Message></Error></Errors>"
        f"<RequestID>{uuid.uuid4()}</RequestID></Response>").encode()


ANSWERS: dict[tuple[str, str], Answer] = {
    # Each service's documented throttling error ...
    ("dynamodb", "throttle"): _json(
        "400 Bad Request", _JSON_10, "com.amazonaws.dynamodb.v20120810#ProvisionedThroughputExceededException",
        "The level of configured provisioned throughput for the table was exceeded."),
    ("s3", "throttle"): _s3_xml("503 Slow Down", "SlowDown", "Please reduce your request rate."),
    ("events", "throttle"): _json("400 Bad Request", _JSON_11, "ThrottlingException", "Rate exceeded"),
    ("lambda", "throttle"): _rest_json("429 Too Many Requests", "TooManyRequestsException", {
        "Type": "User", "message": "Rate Exceeded.", "Reason": "CallerRateLimitExceeded"}),
    ("ec2", "throttle"): _ec2_xml("503 Service Unavailable", "RequestLimitExceeded", "Request limit exceeded."),
    ("states", "throttle"): _json("400 Bad Request", _JSON_10, "ThrottlingException", "Rate exceeded"),
    ("logs", "throttle"): _json("400 Bad Request", _JSON_11, "ThrottlingException", "Rate exceeded"),
    # ... and its documented internal error (5xx).
    ("dynamodb", "error"): _json("500 Internal Server Error", _JSON_10,
                                 "com.amazonaws.dynamodb.v20120810#InternalServerError",
                                 "Internal server error"),
    ("s3", "error"): _s3_xml("500 Internal Server Error", "InternalError",
                             "We encountered an internal error. Please try again."),
    ("events", "error"): _json("500 Internal Server Error", _JSON_11, "InternalException",
                               "An internal error occurred."),
    ("lambda", "error"): _rest_json("500 Internal Server Error", "ServiceException", {
        "Type": "Service", "message": "The Lambda service encountered an internal error."}),
    ("ec2", "error"): _ec2_xml("500 Internal Server Error", "InternalError", "An internal error has occurred."),
    ("states", "error"): _json("500 Internal Server Error", _JSON_10, "InternalFailure",
                               "The request processing has failed because of an unknown error."),
    ("logs", "error"): _json("500 Internal Server Error", _JSON_11, "ServiceUnavailableException",
                             "The service cannot complete the request."),
}
"""(service, answer) -> what the service answers: "throttle" its throttling error, "error"
its internal error. The codes and statuses are those of each service's API reference
(Common Errors and the actions' Errors sections); botocore retries every one of them, as it
does on AWS."""

SERVICES = sorted({service for service, _ in ANSWERS})
FAULT_ANSWERS = ("throttle", "error")


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


def _count(cloud: FrontDoorCloud, service: str, environ: dict[str, Any]) -> None:
    action = request_action(service, environ.get("REQUEST_METHOD", "GET"), environ.get("PATH_INFO", ""),
                            environ.get("QUERY_STRING", ""), _headers(environ), _form_body(environ))
    cloud.count(cloud.requests, (service, action))


def _chaos(cloud: FrontDoorCloud, environ: dict[str, Any], start_response: Any) -> list[bytes]:
    """The control route: a fault request in, what was done (200) or why not (400) out."""
    if environ.get("REQUEST_METHOD") != "POST":
        status, answer = "405 Method Not Allowed", {"error": f"POST a fault request to {CHAOS_PATH}"}
    else:
        try:
            size = int(environ.get("CONTENT_LENGTH") or 0)
            request = json.loads(environ["wsgi.input"].read(size) or b"null")
            if not isinstance(request, dict):
                raise ChaosError("the request must be a JSON object")
            status, answer = "200 OK", inject(cloud, request)
        except ValueError as error:  # a ChaosError, or JSON that does not parse
            status, answer = "400 Bad Request", {"error": str(error)}
    body = json.dumps(answer).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


def _call(self: DomainDispatcherApplication, environ: dict[str, Any], start_response: Any) -> Any:
    cloud = active_cloud()
    if cloud is not None and environ.get("PATH_INFO") == CHAOS_PATH:
        return _chaos(cloud, environ, start_response)
    service = signing_service(environ.get("HTTP_AUTHORIZATION", "")) if cloud is not None else None
    if service is None or environ.get(INTERNAL_ENVIRON):
        return _moto_call(self, environ, start_response)
    why = cloud.routes.blocked(environ.get("REMOTE_ADDR"), service)
    if why is not None:  # never reaches the service: a packet its sender's network drops
        cloud.count(cloud.failed_requests, (service, "unreachable"))
        body = f"no route to {service} from this instance: {why}".encode()
        start_response(UNREACHABLE_STATUS, [(UNREACHABLE_HEADER, why.encode("ascii", "replace").decode()),
                                            ("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]
    _count(cloud, service, environ)
    fault = cloud.request_faults.get(service)
    if fault is not None and time.monotonic() < fault.until:
        answer, counted = fault.answer, fault.answer
    elif service == "s3" and (prefix := request_prefix(environ)) and not cloud.s3_rates.admit(*prefix):
        answer, counted = "throttle", "slowdown"  # past the prefix's documented rate (glue/s3_rates.py)
    else:
        return _moto_call(self, environ, start_response)
    cloud.count(cloud.failed_requests, (service, counted))
    status, headers, body = ANSWERS[(service, answer)]
    # Every AWS answer carries its request id; callers report it (Step Functions reads it).
    request_id = ("x-amz-request-id" if service == "s3" else "x-amzn-RequestId", str(uuid.uuid4()))
    start_response(status, [*headers, request_id, ("Content-Length", str(len(body)))])
    return [body]


def apply() -> None:
    DomainDispatcherApplication.__call__ = _call
