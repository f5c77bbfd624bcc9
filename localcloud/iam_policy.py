"""IAM policy evaluation as AWS documents it, as pure functions over policy documents.

moto 5.2.5's evaluator (moto/iam/access_control.py) differs from AWS in three ways that matter
to the template: it matches a statement's Resource only for S3, SQS, IAM and STS requests
(every other request is checked against `*`, which no ARN pattern matches); it knows one
condition operator (StringEquals) and fills one context key (sts:ExternalId); and an Allow
statement whose condition fails denies the whole request instead of not applying. The glue
(localcloud/glue/iam.py) asks this module instead, with the resource and the condition keys it
derives from the request.

    evaluate(policies, action, resource, context)   "Allow", "ExplicitDeny" or "ImplicitDeny"

AWS's logic for identity policies in one account: an explicit Deny wins, then any Allow,
otherwise the request is implicitly denied. A statement applies when its Action (or NotAction)
matches the action (case-insensitive, `*` and `?` wildcards), its Resource (or NotResource)
matches the resource (case-sensitive wildcards) and every condition holds. `resource=None`
means the local cloud does not know the request's resource (see the glue): every Resource
element then matches, so only actions and conditions are evaluated.

Policy variables (`${aws:userid}`, `${ec2:SourceInstanceARN}`, ...) in a Resource or a condition's
values are the request's values of those keys, in policies of Version 2012-10-17 (in older ones
they are plain text); one naming a key the request lacks matches nothing.

A condition key in `unevaluated_keys` is one the local cloud cannot derive from a request; its
condition is not evaluated locally (holds). Any other key missing from the context makes its
condition false, except for the negated operators (StringNotEquals, ...) and ForAllValues, which
hold, and Null,
which tests for exactly that; `...IfExists` operators hold when the key is missing.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

ALLOW, EXPLICIT_DENY, IMPLICIT_DENY = "Allow", "ExplicitDeny", "ImplicitDeny"


@lru_cache(maxsize=4096)
def _pattern(glob: str, ignore_case: bool) -> re.Pattern:
    # fnmatch.translate would also read [...] as a character class; IAM knows only * and ?.
    body = "".join(".*" if char == "*" else "." if char == "?" else re.escape(char) for char in glob)
    return re.compile(rf"\A{body}\Z", re.IGNORECASE | re.DOTALL if ignore_case else re.DOTALL)


def matches(glob: str, value: str, ignore_case: bool = False) -> bool:
    """IAM's wildcard match: `*` any run of characters, `?` any one character."""
    return _pattern(glob, ignore_case).match(value) is not None


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


_VARIABLE = re.compile(r"\$\{([^}]*)\}")


def resolve(text: Any, context: Mapping[str, Any]) -> Any:
    """`text` with each policy variable `${KEY}` replaced by the request's value of KEY; None
    when the request lacks one (AWS: the element then matches nothing). Not strings: as they are."""
    if not isinstance(text, str) or "${" not in text:
        return text
    missing = False

    def value(match: re.Match) -> str:
        nonlocal missing
        key = match.group(1)
        if key in ("*", "?", "$") or "," in key:
            raise ValueError(f"policy variable ${{{key}}} is not evaluated by the local cloud")
        found = next((value for name, value in context.items() if name.lower() == key.lower()), None)
        missing = missing or found is None
        return str(found or "")

    resolved = _VARIABLE.sub(value, text)
    return None if missing else resolved


def _resolved(values: Any, context: Mapping[str, Any]) -> list[Any]:
    return [value for value in (resolve(value, context) for value in _listed(values)) if value is not None]


VARIABLES_VERSION = "2012-10-17"
"""The policy language version that has policy variables."""


def _with_variables(statement: Mapping[str, Any], context: Mapping[str, Any]) -> Mapping[str, Any]:
    """The statement with the policy variables of its resources and condition values resolved."""
    resolved = dict(statement)
    for element in ("Resource", "NotResource"):
        if element in statement:
            resolved[element] = _resolved(statement[element], context)
    if "Condition" in statement:
        resolved["Condition"] = {operator: {key: _resolved(expected, context) for key, expected in keys.items()}
                                 for operator, keys in statement["Condition"].items()}
    return resolved


def _string_like(expected: str, actual: str) -> bool:
    return matches(expected, actual)


def _bool(expected: str, actual: str) -> bool:
    return str(expected).lower() == str(actual).lower()


def _numeric(compare: Any) -> Any:
    return lambda expected, actual: compare(float(actual), float(expected))


_OPERATORS: dict[str, Any] = {
    "StringEquals": lambda expected, actual: expected == actual,
    "StringEqualsIgnoreCase": lambda expected, actual: expected.lower() == actual.lower(),
    "StringLike": _string_like,
    "ArnEquals": lambda expected, actual: expected == actual,
    "ArnLike": _string_like,
    "Bool": _bool,
    "NumericEquals": _numeric(lambda a, e: a == e),
    "NumericLessThan": _numeric(lambda a, e: a < e),
    "NumericLessThanEquals": _numeric(lambda a, e: a <= e),
    "NumericGreaterThan": _numeric(lambda a, e: a > e),
    "NumericGreaterThanEquals": _numeric(lambda a, e: a >= e),
}
_NEGATED = {"StringNotEquals": "StringEquals", "StringNotEqualsIgnoreCase": "StringEqualsIgnoreCase",
            "StringNotLike": "StringLike", "ArnNotEquals": "ArnEquals", "ArnNotLike": "ArnLike",
            "NumericNotEquals": "NumericEquals"}


def _key_unevaluated(key: str, unevaluated_keys: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(key.lower(), pattern.lower()) for pattern in unevaluated_keys)


def _condition_holds(operator: str, key: str, expected: Any, context: Mapping[str, Any]) -> bool:
    """One operator on one key (AWS: a key's listed values are ORed, its keys ANDed)."""
    qualifier, _, name = operator.rpartition(":")
    if_exists = name.endswith("IfExists") and name != "IfExists"
    name = name.removesuffix("IfExists") if if_exists else name
    present = key in context
    if name == "Null":  # "true": the key must be absent; "false": present
        return _bool(_listed(expected)[0], "true") != present
    if not present:  # ForAllValues holds over no values at all (AWS: pair it with Null to refuse)
        return if_exists or name in _NEGATED or qualifier == "ForAllValues"
    negated = name in _NEGATED
    compare = _OPERATORS.get(_NEGATED.get(name, name))
    if compare is None:
        raise ValueError(f"condition operator {operator} is not evaluated by the local cloud")
    actual_values = [str(value) for value in _listed(context[key])]
    expected_values = [str(value) for value in _listed(expected)]

    def one(actual: str) -> bool:
        hit = any(compare(value, actual) for value in expected_values)
        return not hit if negated else hit

    if qualifier == "ForAllValues":
        return all(one(actual) for actual in actual_values)
    if qualifier == "ForAnyValue" or len(actual_values) > 1:
        return any(one(actual) for actual in actual_values)
    return one(actual_values[0])


def conditions_hold(conditions: Mapping[str, Mapping[str, Any]], context: Mapping[str, Any],
                    unevaluated_keys: Iterable[str] = ()) -> bool:
    """Whether every condition of a statement holds for the request's context."""
    return all(_key_unevaluated(key, unevaluated_keys) or _condition_holds(operator, key, expected, context)
               for operator, keys in conditions.items() for key, expected in keys.items())


def statement_applies(statement: Mapping[str, Any], action: str, resource: str | None,
                      context: Mapping[str, Any], unevaluated_keys: Iterable[str] = ()) -> bool:
    """Whether one statement concerns this request (whatever its Effect)."""
    if "Action" in statement:
        if not any(matches(pattern, action, ignore_case=True) for pattern in _listed(statement["Action"])):
            return False
    elif any(matches(pattern, action, ignore_case=True) for pattern in _listed(statement.get("NotAction", []))):
        return False
    if resource is not None:
        if "Resource" in statement:
            if not any(matches(pattern, resource) for pattern in _listed(statement["Resource"])):
                return False
        elif any(matches(pattern, resource) for pattern in _listed(statement.get("NotResource", []))):
            return False
    return conditions_hold(statement.get("Condition", {}), context, unevaluated_keys)


def evaluate(policies: Iterable[Mapping[str, Any]], action: str, resource: str | None,
             context: Mapping[str, Any] | None = None, unevaluated_keys: Iterable[str] = ()) -> str:
    """ALLOW, EXPLICIT_DENY or IMPLICIT_DENY for one action on one resource."""
    context = context or {}
    unevaluated_keys = tuple(unevaluated_keys)
    decision = IMPLICIT_DENY
    for policy in policies:
        variables = policy.get("Version") == VARIABLES_VERSION
        for statement in _listed(policy.get("Statement", [])):
            if variables:
                statement = _with_variables(statement, context)
            if not statement_applies(statement, action, resource, context, unevaluated_keys):
                continue
            if statement.get("Effect") == "Deny":
                return EXPLICIT_DENY
            decision = ALLOW
    return decision
