"""Which AWS service and action an HTTP request to the endpoint is, from the request alone.

Pure functions over the request's parts (method, path, query, header names, form body), as
AWS's own front door routes them:

- the service is the one named in the SigV4 credential scope of the Authorization header
  (dynamodb, s3, events, lambda, ec2, states, ...);
- JSON protocols (DynamoDB, EventBridge, Step Functions, SQS, CloudWatch Logs ...) name the
  action in X-Amz-Target ("DynamoDB_20120810.PutItem" -> "PutItem");
- query protocols (EC2, IAM, STS, CloudWatch) name it in the `Action` parameter of the query
  string or the form body;
- REST protocols (S3, Lambda) name it by method and path: matched against the request URIs of
  botocore's model of the service, so `PUT /bucket/key` is PutObject, the same with an
  x-amz-copy-source header CopyObject, and `POST /2015-03-31/functions/f/invocations` Invoke.
  S3 is addressed path-style, as SDKs address an IP endpoint.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Set
from dataclasses import dataclass
from urllib.parse import parse_qs

import botocore.session

__all__ = ["signing_service", "request_action"]

_SCOPE = re.compile(r"Credential=[^/]+/\d{8}/[^/]+/([^/]+)/aws4_request")


def signing_service(authorization: str) -> str | None:
    """The service named in a SigV4 Authorization header's credential scope, None if unsigned."""
    scope = _SCOPE.search(authorization)
    return scope.group(1) if scope else None


@dataclass(frozen=True)
class _Route:
    operation: str
    method: str
    path: re.Pattern[str]
    query_keys: frozenset[str]
    """Query parameters the request URI or a required member puts in every request."""
    headers: frozenset[str]
    """Header names (lower case) of required members."""

    @property
    def specificity(self) -> int:
        return len(self.query_keys) + len(self.headers)


def _path_pattern(template: str) -> re.Pattern[str]:
    """`/{Bucket}/{Key+}` -> a regex; `{Name}` is one path segment, `{Name+}` any rest."""
    parts = re.split(r"(\{[^}]+\})", template)
    regex = "".join(("(.+)" if part.endswith("+}") else "([^/]+)") if part.startswith("{")
                    else re.escape(part) for part in parts)
    return re.compile(f"^{regex}/?$")


@functools.lru_cache(maxsize=None)
def _routes(service: str) -> tuple[_Route, ...]:
    """The REST routes of a service, most specific first; empty if botocore has no REST
    model under that name."""
    try:
        model = botocore.session.get_session().get_service_model(service)
    except Exception:  # botocore raises UnknownServiceError and data errors alike
        return ()
    if model.protocol not in {"rest-json", "rest-xml"}:
        return ()
    routes = []
    for name in model.operation_names:
        operation = model.operation_model(name)
        path, _, query = operation.http["requestUri"].partition("?")
        query_keys = {pair.split("=", 1)[0] for pair in query.split("&") if pair}
        headers: set[str] = set()
        shape = operation.input_shape
        for member in (shape.required_members if shape is not None else ()):
            serialization = shape.members[member].serialization
            if serialization.get("location") == "querystring":
                query_keys.add(serialization["name"])
            elif serialization.get("location") == "header":
                headers.add(serialization["name"].lower())
        routes.append(_Route(name, operation.http["method"], _path_pattern(path),
                             frozenset(query_keys), frozenset(headers)))
    return tuple(sorted(routes, key=lambda route: -route.specificity))


def _rest_action(service: str, method: str, path: str, query_keys: Set[str],
                 header_names: Set[str]) -> str | None:
    for route in _routes(service):
        if (route.method == method and route.path.match(path)
                and route.query_keys <= query_keys and route.headers <= header_names):
            return route.operation
    return None


def request_action(service: str, method: str, path: str, query: str, headers: Mapping[str, str],
                   form_body: str | None = None) -> str:
    """The API action a request calls; `METHOD` alone when nothing names one.

    `headers` are the request's headers with lower-case names; `form_body` the body when it is
    application/x-www-form-urlencoded."""
    target = headers.get("x-amz-target")
    if target:
        return target.rsplit(".", 1)[-1]
    parameters = parse_qs(query, keep_blank_values=True)
    if form_body:
        parameters |= parse_qs(form_body, keep_blank_values=True)
    if parameters.get("Action"):
        return parameters["Action"][0]
    model_name = {"states": "stepfunctions", "monitoring": "cloudwatch"}.get(service, service)
    return (_rest_action(model_name, method, path, set(parameters), set(headers))
            or method)
