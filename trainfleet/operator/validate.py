"""`trainfleet validate`: the independent judges of what users deploy.

    sam validate --lint    template.yaml, by aws-sam-cli with cfn-lint
    statelint              each state machine's ASL, with its DefinitionSubstitutions filled in

Both tools live in their own virtualenv (`make sam-tools` creates .venv-sam): aws-sam-cli pins
its own boto3, which must not leak into the project's environment.

statelint runs with ReaderConfig's InputType added as the Step Functions guide documents it
(statemachine/statelint_documented.py says why); every other check is its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ValidationSetup", "load_template", "statelint_command", "substituted_definitions", "validate"]

REPO_ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDER = re.compile(r"\$\{([A-Za-z0-9_]+)\}")
# Stand-ins for what CloudFormation fills in at deploy time; statelint checks their shape only.
EXAMPLE_REGION = "us-east-1"
EXAMPLE_ACCOUNT = "123456789012"
TOOL_TIMEOUT_S = 300
STATELINT_DOCUMENTED = REPO_ROOT / "statemachine" / "statelint_documented.py"


@dataclass(frozen=True)
class ValidationSetup:
    """Where the template and the judging tools are."""

    template: Path = REPO_ROOT / "template.yaml"
    """The SAM template; state machine DefinitionUris are relative to its folder."""
    tools_venv: Path = REPO_ROOT / ".venv-sam"
    """The virtualenv holding aws-sam-cli, cfn-lint and statelint (`make sam-tools`)."""


def load_template(text: str) -> dict[str, Any]:
    """Parse a CloudFormation/SAM template, turning short-form tags (!Ref, !GetAtt, !Sub...)
    into their long form ({"Ref": ...}, {"Fn::GetAtt": [...]}, ...)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def long_form(loader: yaml.SafeLoader, tag_suffix: str, node: yaml.Node) -> dict[str, Any]:
        name = "Ref" if tag_suffix == "Ref" else f"Fn::{tag_suffix}"
        if isinstance(node, yaml.ScalarNode):
            value: Any = loader.construct_scalar(node)
            if tag_suffix == "GetAtt":
                value = value.split(".", 1)
        elif isinstance(node, yaml.SequenceNode):
            value = loader.construct_sequence(node, deep=True)
        else:
            value = loader.construct_mapping(node, deep=True)
        return {name: value}

    Loader.add_multi_constructor("!", long_form)
    return yaml.load(text, Loader=Loader)


def _example_value(name: str, value: Any, resources: dict[str, Any]) -> str:
    """A deploy-time-like value for one DefinitionSubstitutions entry."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "Fn::GetAtt" in value:
        logical_id, attribute = value["Fn::GetAtt"]
        resource_type = resources.get(logical_id, {}).get("Type")
        if resource_type == "AWS::Serverless::Function" and attribute == "Arn":
            return f"arn:aws:lambda:{EXAMPLE_REGION}:{EXAMPLE_ACCOUNT}:function:{logical_id}"
        raise ValueError(f"DefinitionSubstitutions.{name}: no example value for "
                         f"{resource_type or 'unknown resource'} {logical_id}.{attribute}")
    raise ValueError(f"DefinitionSubstitutions.{name}: unsupported value {value!r}")


def substituted_definitions(template: Path) -> dict[str, str]:
    """Each state machine's ASL text with its substitutions filled in, keyed by logical id.

    A placeholder in the ASL without a substitution, or a substitution the ASL never uses,
    is an error: both mean the template and the definition have drifted apart.
    """
    resources = load_template(template.read_text())["Resources"]
    definitions = {}
    for logical_id, resource in resources.items():
        if resource.get("Type") != "AWS::Serverless::StateMachine":
            continue
        properties = resource["Properties"]
        asl_text = (template.parent / properties["DefinitionUri"]).read_text()
        substitutions = {name: _example_value(name, value, resources)
                         for name, value in properties.get("DefinitionSubstitutions", {}).items()}
        used = set(PLACEHOLDER.findall(asl_text))
        if missing := sorted(used - substitutions.keys()):
            raise ValueError(f"{logical_id}: placeholders without a substitution: {missing}")
        if unused := sorted(substitutions.keys() - used):
            raise ValueError(f"{logical_id}: substitutions the definition never uses: {unused}")
        definitions[logical_id] = PLACEHOLDER.sub(lambda m: substitutions[m.group(1)], asl_text)
    return definitions


def statelint_command(setup: ValidationSetup, asl_file: Path) -> list[str]:
    """statelint on `asl_file`, knowing what the Step Functions guide documents and it lacks."""
    return [str(setup.tools_venv / "bin" / "python"), str(STATELINT_DOCUMENTED), str(asl_file)]


def _run(command: list[str], label: str) -> subprocess.CompletedProcess[str]:
    print(f"--- {label}: {' '.join(command)}", flush=True)
    environment = {**os.environ, "SAM_CLI_TELEMETRY": "0"}
    completed = subprocess.run(command, cwd=REPO_ROOT, env=environment, timeout=TOOL_TIMEOUT_S,
                               capture_output=True, text=True)
    print((completed.stdout + completed.stderr).strip() or "(no output)", flush=True)
    return completed


def validate(setup: ValidationSetup = ValidationSetup()) -> int:
    """Run every judge; 0 when all pass, 1 otherwise (each one's output is printed)."""
    tools = setup.tools_venv / "bin"
    missing = [tool for tool in ("sam", "statelint") if not (tools / tool).exists()]
    if missing:
        print(f"validate: {', '.join(missing)} not found in {setup.tools_venv}; "
              "run `make sam-tools` to create it", file=sys.stderr)
        return 1
    passed = _run([str(tools / "sam"), "validate", "--lint", "--template", str(setup.template),
                   "--region", EXAMPLE_REGION], "sam validate --lint").returncode == 0
    with tempfile.TemporaryDirectory(prefix="trainfleet-asl-") as folder:
        for logical_id, asl_text in substituted_definitions(setup.template).items():
            asl_file = Path(folder) / f"{logical_id}.asl.json"
            asl_file.write_text(json.dumps(json.loads(asl_text), indent=2))
            passed &= _run(statelint_command(setup, asl_file), f"statelint {logical_id}").returncode == 0
    print("validate: all checks passed" if passed else "validate: FAILED", flush=True)
    return 0 if passed else 1
