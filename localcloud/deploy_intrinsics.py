"""CloudFormation template semantics as pure functions: parameters, conditions, intrinsic
functions and the dependency order of resources. No AWS calls here; `localcloud.deploy`
feeds these with the physical ids of what it has created so far.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "NO_VALUE",
    "TemplateError",
    "Resolver",
    "creation_order",
    "check_rules",
    "evaluate_conditions",
    "parameter_values",
    "references",
]


class TemplateError(ValueError):
    """The template cannot be deployed as written; the message names the place and the value."""


class _NoValue:
    """What `Ref: AWS::NoValue` evaluates to: the enclosing property is removed."""

    def __repr__(self) -> str:
        return "AWS::NoValue"


NO_VALUE = _NoValue()

_SUB_VARIABLE = re.compile(r"\$\{([^}]*)\}")
_LIST_PARAMETER_TYPES = ("CommaDelimitedList", "List<")


def parameter_values(declared: Mapping[str, Any], overrides: Mapping[str, str]) -> dict[str, Any]:
    """Each declared parameter's value: the override, else its Default; lists split on commas.

    Refuses overrides of undeclared parameters, missing values and values outside AllowedValues,
    as CloudFormation does before creating anything.
    """
    unknown = sorted(set(overrides) - set(declared))
    if unknown:
        raise TemplateError(f"parameter override(s) {unknown} not declared in the template's Parameters "
                            f"(declared: {sorted(declared)})")
    values: dict[str, Any] = {}
    for name, spec in declared.items():
        if name in overrides:
            raw = overrides[name]
        elif "Default" in spec:
            raw = spec["Default"]
        else:
            raise TemplateError(f"parameter {name!r} has no Default and no value was given (--param {name}=...)")
        raw = ",".join(map(str, raw)) if isinstance(raw, list) else str(raw)
        allowed = [str(v) for v in spec.get("AllowedValues", [])]
        if allowed and raw not in allowed:
            raise TemplateError(f"parameter {name!r}={raw!r} is not one of AllowedValues {allowed}")
        pattern = spec.get("AllowedPattern")
        if pattern is not None and not re.fullmatch(pattern, raw):
            raise TemplateError(f"parameter {name!r}={raw!r} does not match AllowedPattern {pattern!r}")
        is_list = str(spec.get("Type", "String")).startswith(_LIST_PARAMETER_TYPES)
        values[name] = [item.strip() for item in raw.split(",")] if is_list else raw
    return values


def evaluate_conditions(conditions: Mapping[str, Any], resolver: Resolver) -> dict[str, bool]:
    """The truth value of every named condition (conditions may refer to one another)."""
    results: dict[str, bool] = {}
    in_progress: set[str] = set()

    def condition(name: str) -> bool:
        if name in results:
            return results[name]
        if name not in conditions:
            raise TemplateError(f"condition {name!r} is not declared in Conditions")
        if name in in_progress:
            raise TemplateError(f"condition {name!r} refers to itself")
        in_progress.add(name)
        results[name] = evaluate(conditions[name], f"Conditions.{name}")
        return results[name]

    def evaluate(expression: Any, where: str) -> bool:
        if not isinstance(expression, dict) or len(expression) != 1:
            raise TemplateError(f"{where}: a condition must be one Fn::Equals/And/Or/Not or Condition, "
                                f"got {expression!r}")
        (function, argument), = expression.items()
        if function == "Condition":
            return condition(argument)
        if function == "Fn::Equals":
            left, right = (resolver.resolve(value, where) for value in argument)
            return str(left) == str(right)
        if function == "Fn::Not":
            return not evaluate(argument[0], where)
        if function == "Fn::And":
            return all(evaluate(item, where) for item in argument)
        if function == "Fn::Or":
            return any(evaluate(item, where) for item in argument)
        raise TemplateError(f"{where}: {function} is not a condition function")

    for name in conditions:
        condition(name)
    return results


def check_rules(rules: Mapping[str, Any], resolver: Resolver) -> None:
    """TemplateError with each failed assertion's AssertDescription, for the template's Rules whose
    RuleCondition holds (or that have none), as CloudFormation checks them before creating anything.
    Rules use the condition functions here."""
    failed = []
    for name, rule in rules.items():
        expressions = {"condition": rule.get("RuleCondition", {"Fn::Equals": ["", ""]})}
        expressions |= {f"assertion {index}": assertion["Assert"]
                        for index, assertion in enumerate(rule.get("Assertions", []))}
        truth = evaluate_conditions(expressions, resolver)
        if truth["condition"]:
            failed += [f"Rules.{name}: {assertion.get('AssertDescription', 'assertion failed')}"
                       for index, assertion in enumerate(rule.get("Assertions", []))
                       if not truth[f"assertion {index}"]]
    if failed:
        raise TemplateError("; ".join(failed))


def references(value: Any) -> set[str]:
    """Names that `value` refers to through Ref, Fn::GetAtt and Fn::Sub (not yet filtered
    down to resources: parameters and pseudo parameters are included)."""
    found: set[str] = set()
    if isinstance(value, list):
        for item in value:
            found |= references(item)
    elif isinstance(value, dict):
        if len(value) == 1 and "Ref" in value and isinstance(value["Ref"], str):
            found.add(value["Ref"])
        elif len(value) == 1 and "Fn::GetAtt" in value:
            found.add(_split_get_att(value["Fn::GetAtt"])[0])
        elif len(value) == 1 and "Fn::Sub" in value:
            text, variables = _split_sub(value["Fn::Sub"])
            for name in _SUB_VARIABLE.findall(text):
                if not name.startswith("!") and name.split(".")[0] not in variables:
                    found.add(name.split(".")[0])
            found |= references(list(variables.values()))
        else:
            for item in value.values():
                found |= references(item)
    return found


def creation_order(resources: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Logical ids ordered so that each comes after every resource it refers to or DependsOn."""
    needs: dict[str, set[str]] = {}
    for logical_id, resource in resources.items():
        depends_on = resource.get("DependsOn", [])
        depends_on = [depends_on] if isinstance(depends_on, str) else list(depends_on)
        missing = [name for name in depends_on if name not in resources]
        if missing:
            raise TemplateError(f"resource {logical_id}: DependsOn names unknown resource(s) {missing}")
        refs = references(resource.get("Properties", {})) & set(resources)
        needs[logical_id] = (refs | set(depends_on)) - {logical_id}

    order: list[str] = []
    placed: set[str] = set()
    while len(order) < len(resources):
        ready = sorted(name for name in resources if name not in placed and needs[name] <= placed)
        if not ready:
            stuck = sorted(set(resources) - placed)
            raise TemplateError(f"circular dependency between resources {stuck}")
        order.extend(ready)
        placed.update(ready)
    return order


@dataclass
class Resolver:
    """Evaluates intrinsic functions against parameters, pseudo parameters, conditions and the
    resources created so far."""

    parameters: dict[str, Any]
    """Parameter and pseudo parameter values by name (AWS::Region, AWS::AccountId, ...)."""
    mappings: Mapping[str, Any] = field(default_factory=dict)
    """The template's Mappings section, for Fn::FindInMap."""
    conditions: dict[str, bool] = field(default_factory=dict)
    """Evaluated Conditions, for Fn::If."""
    ref_of: dict[str, Any] = field(default_factory=dict)
    """What Ref returns for each created resource (its physical id)."""
    attributes_of: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    """What Fn::GetAtt can return for each created resource, by attribute name."""
    availability_zones: Callable[[str], list[str]] = lambda region: [f"{region}{z}" for z in "abc"]
    """Fn::GetAZs: the zones of a region (`deploy` asks EC2; this default serves pure use)."""

    def resolve(self, value: Any, where: str) -> Any:
        """`value` with every intrinsic function evaluated and AWS::NoValue properties removed."""
        if isinstance(value, list):
            items = [self.resolve(item, f"{where}[{index}]") for index, item in enumerate(value)]
            return [item for item in items if item is not NO_VALUE]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            (key, argument), = value.items()
            function = self._functions().get(key)
            if function is not None:
                return function(argument, f"{where}.{key}")
        resolved = {key: self.resolve(item, f"{where}.{key}") for key, item in value.items()}
        return {key: item for key, item in resolved.items() if item is not NO_VALUE}

    def _functions(self) -> dict[str, Callable[[Any, str], Any]]:
        return {
            "Ref": self._ref,
            "Fn::GetAtt": self._get_att,
            "Fn::Sub": self._sub,
            "Fn::Join": self._join,
            "Fn::If": self._if,
            "Fn::Select": self._select,
            "Fn::Split": self._split,
            "Fn::FindInMap": self._find_in_map,
            "Fn::Base64": lambda arg, where: base64.b64encode(
                str(self.resolve(arg, where)).encode()).decode(),
            "Fn::GetAZs": lambda arg, where: self.availability_zones(
                self.resolve(arg, where) or self.parameters["AWS::Region"]),
            "Fn::ImportValue": self._unsupported,
            "Fn::Transform": self._unsupported,
        }

    def _ref(self, name: Any, where: str) -> Any:
        if name == "AWS::NoValue":
            return NO_VALUE
        if name in self.parameters:
            return self.parameters[name]
        if name in self.ref_of:
            return self.ref_of[name]
        raise TemplateError(f"{where}: Ref to {name!r}, which is neither a parameter nor a created resource")

    def _get_att(self, argument: Any, where: str) -> Any:
        logical_id, attribute = _split_get_att(self.resolve(argument, where))
        if logical_id not in self.attributes_of:
            raise TemplateError(f"{where}: Fn::GetAtt on {logical_id!r}, which is not a created resource")
        attributes = self.attributes_of[logical_id]
        if attribute not in attributes:
            raise TemplateError(f"{where}: {logical_id} has no attribute {attribute!r} "
                                f"(has: {sorted(attributes)})")
        return attributes[attribute]

    def _sub(self, argument: Any, where: str) -> str:
        text, variables = _split_sub(argument)
        values = {name: self.resolve(value, f"{where}.{name}") for name, value in variables.items()}

        def substitute(match: re.Match[str]) -> str:
            name = match.group(1)
            if name.startswith("!"):  # ${!Literal} is written out as ${Literal}
                return "${" + name[1:] + "}"
            if name in values:
                return str(values[name])
            if "." in name:
                return str(self._get_att(name.split(".", 1), where))
            return str(self._ref(name, where))

        return _SUB_VARIABLE.sub(substitute, text)

    def _join(self, argument: Any, where: str) -> str:
        delimiter, items = argument
        items = self.resolve(items, where)
        return str(delimiter).join(str(item) for item in items)

    def _if(self, argument: Any, where: str) -> Any:
        name, when_true, when_false = argument
        if name not in self.conditions:
            raise TemplateError(f"{where}: Fn::If on undeclared condition {name!r}")
        return self.resolve(when_true if self.conditions[name] else when_false, where)

    def _select(self, argument: Any, where: str) -> Any:
        index, items = self.resolve(argument, where)
        items = list(items)
        if not 0 <= int(index) < len(items):
            raise TemplateError(f"{where}: index {index} out of range for {items!r}")
        return items[int(index)]

    def _split(self, argument: Any, where: str) -> list[str]:
        delimiter, text = self.resolve(argument, where)
        return str(text).split(delimiter)

    def _find_in_map(self, argument: Any, where: str) -> Any:
        map_name, top_key, second_key = self.resolve(argument, where)
        try:
            return self.mappings[map_name][top_key][second_key]
        except KeyError as missing:
            raise TemplateError(f"{where}: Mappings has no {map_name}.{top_key}.{second_key}") from missing

    def _unsupported(self, argument: Any, where: str) -> Any:
        raise TemplateError(f"{where}: not supported by the local deploy (a single stack has no "
                            f"imports or macros)")


def _split_get_att(argument: Any) -> tuple[str, str]:
    parts = argument.split(".", 1) if isinstance(argument, str) else list(argument)
    if len(parts) != 2:
        raise TemplateError(f"Fn::GetAtt needs [LogicalId, Attribute], got {argument!r}")
    return parts[0], parts[1]


def _split_sub(argument: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(argument, str):
        return argument, {}
    text, variables = argument
    return text, dict(variables)
