"""Which Python runs a Lambda function here, and what its public layers stand for.

A function runs on the Python its `Runtime` names, as on AWS:

- the local cloud's own Python (`HOST_RUNTIME`): in this process, its modules its own
  (`localcloud.lambda_isolation`);
- another `python3.X`: in processes of a python3.X interpreter found on PATH, one process per
  execution environment (`localcloud.lambda_bootstrap`). A pyenv shim runs the version it is
  told with PYENV_VERSION, so the probe sets it to 3.X; the real executable it reports is used;
- anything else (another language, a container image, no interpreter installed): refused when
  the function is created, naming it and why, never at its first invocation.

What a function on another interpreter can import is what it could on AWS, and no more: its
runtime's standard library; boto3 and what boto3 needs (every Python runtime includes the AWS
SDK), taken from this environment, where it is pure Python and so loads in any Python 3; its
package and its layers; and what that interpreter has installed itself, which stands in for
what `sam build` bundles into a package (as this environment does for the local cloud's own
Python). The host's other packages are never on its path: compiled ones, built for this Python
(pydantic-core, ...), would not load there, and AWS would not have them either.

Public layers: AWS Lambda Powertools for Python, by the ARNs it publishes, stands for the
installed aws-lambda-powertools with the extras installed beside it (its layer bundles its
extras). Its major version must be the installed one's, and a v3 layer built for another
Python than the function's is refused, as its compiled parts would not load. Any other layer
ARN must be a layer version of the local cloud (a deploy publishes a stack's own layers).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HOST_RUNTIME", "PublicLayer", "public_layer", "interpreter_for", "installed_for", "function_problems",
           "public_layer_problems", "foreign_distributions", "import_path"]

HOST_RUNTIME = f"python{sys.version_info.major}.{sys.version_info.minor}"
"""The runtime whose functions run in this process."""

SDK_DISTRIBUTION = "boto3"
"""What every Python runtime of Lambda includes: the AWS SDK for Python, with its dependencies."""

POWERTOOLS_DISTRIBUTION = "aws-lambda-powertools"

_POWERTOOLS_LAYER = re.compile(
    r"arn:aws(?:-cn)?:lambda:[a-z0-9-]+:(?:017000801446|498634801083):layer:"
    r"AWSLambdaPowertoolsPython(?:V(?P<major>\d+))?(?:-(?P<python>python3\d+))?(?:-(?:x86_64|arm64|Arm64))?"
    r":(?P<version>\d+)")
"""Powertools for AWS Lambda (Python)'s public layers, in the accounts its documentation names
(017000801446; 498634801083 in the China regions): AWSLambdaPowertoolsPython:N (v1),
AWSLambdaPowertoolsPythonV2[-Arm64]:N, AWSLambdaPowertoolsPythonV3-python3XX-{x86_64,arm64}:N."""


@dataclass(frozen=True)
class PublicLayer:
    """A public layer the local cloud maps to an installed distribution."""

    arn: str
    distribution: str
    """The installed distribution it stands for."""
    major: int
    """The distribution's major version the layer carries."""
    runtime: str | None
    """The Python the layer was built for, where its name says (python3.12)."""


def public_layer(arn: str) -> PublicLayer | None:
    """The installed distribution a public layer ARN stands for; None if it is not one known."""
    match = _POWERTOOLS_LAYER.fullmatch(arn)
    if match is None:
        return None
    python = match["python"]
    return PublicLayer(arn, POWERTOOLS_DISTRIBUTION, int(match["major"] or 1),
                       f"python{python[6]}.{python[7:]}" if python else None)


# --- interpreters ------------------------------------------------------------------------

@functools.cache
def interpreter_for(runtime: str) -> str | None:
    """The executable of an installed interpreter for `runtime` ("python3.12"), checked by asking
    it its version; None when there is none."""
    command = shutil.which(runtime)
    if command is None:
        return None
    version = runtime.removeprefix("python")
    try:
        probe = subprocess.run(
            [command, "-I", "-c", "import sys; print('%d.%d' % sys.version_info[:2]); print(sys.executable)"],
            capture_output=True, text=True, timeout=60, env=os.environ | {"PYENV_VERSION": version})
    except (OSError, subprocess.SubprocessError):
        return None
    lines = probe.stdout.split()
    return lines[1] if probe.returncode == 0 and len(lines) == 2 and lines[0] == version else None


@functools.cache
def installed_for(executable: str) -> frozenset[str]:
    """The distributions an interpreter has installed itself (normalised names)."""
    listing = subprocess.run(
        [executable, "-I", "-c",
         "import importlib.metadata as m, json; print(json.dumps([d.metadata['Name'] for d in m.distributions()]))"],
        capture_output=True, text=True, timeout=60, check=True).stdout
    return frozenset(_normalised(name) for name in json.loads(listing) if name)


# --- the distributions installed here ----------------------------------------------------

def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


_REQUIREMENT_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _requirements(distribution: importlib.metadata.Distribution) -> tuple[set[str], set[str]]:
    """(required, optional) distribution names of an installed distribution's Requires-Dist."""
    required, optional = set(), set()
    for requirement in distribution.requires or []:
        name = _normalised(_REQUIREMENT_NAME.match(requirement).group(1))
        (optional if re.search(r"\bextra\s*==", requirement) else required).add(name)
    return required, optional


def host_distributions(root: str, with_extras: bool = False) -> dict[str, importlib.metadata.Distribution]:
    """`root` and what it requires, transitively, as installed here, by normalised name; with
    `with_extras`, also its extras' distributions that are installed. A required distribution
    that is not installed is left out (the import that needs it fails as it would anywhere)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = [_normalised(root)]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        try:
            found[name] = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        required, optional = _requirements(found[name])
        pending += required
        if with_extras and name == _normalised(root):
            pending += optional
    return found


def _compiled(distribution: importlib.metadata.Distribution) -> bool:
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES) + (".so", ".pyd")
    return any(str(path).endswith(suffixes) for path in distribution.files or ())


# --- what a function may be -------------------------------------------------------------

def function_problems(runtime: str | None, package_type: str | None, layers: Iterable[str],
                      is_local_layer: Callable[[str], bool]) -> list[str]:
    """Why a function with this runtime and these layers cannot run here (empty when it can).
    `is_local_layer` tells whether an ARN is a layer version of the local cloud."""
    if package_type == "Image":
        return ["a container image function needs Docker, which the local cloud does not use"]
    if not runtime:
        return ["a .zip function needs a Runtime"]
    if runtime != HOST_RUNTIME:
        if not re.fullmatch(r"python3\.\d+", runtime):
            return [f"runtime {runtime} is not Python: the local cloud runs Python functions only"]
        if interpreter_for(runtime) is None:
            return [f"runtime {runtime}: no {runtime} interpreter is installed here (looked for `{runtime}` "
                    f"on PATH); install one, or use {HOST_RUNTIME}"]
    problems = []
    for arn in layers:
        layer = public_layer(arn)
        if layer is not None:
            problems += public_layer_problems(layer, runtime)
        elif not is_local_layer(arn):
            problems.append(f"layer {arn} is unknown here: not a layer version of the local cloud, nor a "
                            f"public layer it maps (AWS Lambda Powertools for Python)")
    return problems


def public_layer_problems(layer: PublicLayer, runtime: str) -> list[str]:
    """Why the installed distribution cannot stand for `layer` in a function on `runtime`."""
    try:
        installed = importlib.metadata.version(layer.distribution)
    except importlib.metadata.PackageNotFoundError:
        return [f"layer {layer.arn} stands for {layer.distribution}, which is not installed here"]
    if int(installed.split(".")[0]) != layer.major:
        return [f"layer {layer.arn} carries {layer.distribution} {layer.major}.x; {installed} is installed here"]
    if layer.runtime is not None and layer.runtime != runtime:
        return [f"layer {layer.arn} is built for {layer.runtime}, the function runs {runtime}: "
                f"its compiled parts would not load"]
    if runtime == HOST_RUNTIME:
        return []
    return [f"layer {layer.arn} needs {name} {distribution.version}, built for {HOST_RUNTIME} here; "
            f"install it for {runtime} ({runtime} -m pip install '{name}=={distribution.version}')"
            for name, distribution in sorted(foreign_distributions(layer, runtime).items())]


def foreign_distributions(layer: PublicLayer, runtime: str) -> dict[str, importlib.metadata.Distribution]:
    """The distributions of `layer` that a `runtime` interpreter cannot take from here: compiled
    for this Python, and not installed for its own."""
    own = installed_for(interpreter_for(runtime))
    return {name: distribution
            for name, distribution in host_distributions(layer.distribution, with_extras=True).items()
            if _compiled(distribution) and name not in own}


def import_path(runtime: str, layers: Iterable[PublicLayer], cache: Path) -> Path:
    """A folder holding the host's copies of boto3 (and what it needs) and of what the public
    `layers` stand for, for a function on `runtime`: links to the installed top-level modules,
    all pure Python (function_problems refused the rest), leaving out what the interpreter has
    installed itself, so that its own copy is the one imported."""
    own = installed_for(interpreter_for(runtime))
    distributions = host_distributions(SDK_DISTRIBUTION)
    for layer in layers:
        distributions |= host_distributions(layer.distribution, with_extras=True)
    offered = sorted(name for name, distribution in distributions.items()
                     if name not in own and not _compiled(distribution))
    folder = cache / f"{runtime}-{hashlib.sha256(' '.join(offered).encode()).hexdigest()[:16]}"
    with _import_path_lock:
        if not folder.exists():
            folder.mkdir(parents=True)
            for name in offered:
                for module, location in _top_level_modules(distributions[name]).items():
                    (folder / module).symlink_to(location)
    return folder


_import_path_lock = threading.Lock()


def _top_level_modules(distribution: importlib.metadata.Distribution) -> dict[str, Path]:
    """The top-level modules and packages a distribution installed, and where."""
    modules = {}
    for path in distribution.files or ():
        top = path.parts[0]
        if top.endswith((".dist-info", ".egg-info", ".pth")) or top in ("..", "__pycache__") or top.startswith("."):
            continue
        if len(path.parts) > 1 or top.endswith(".py"):
            modules[top] = Path(distribution.locate_file(top))
    return modules
