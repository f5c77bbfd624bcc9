"""Each execution environment's own modules, for functions whose handlers run in this process.

On AWS every execution environment of a function is a sandbox of its own: its package
(/var/task) and its layers (/opt/python) come first on its own sys.path, and its modules and
their state are its own, used by one invocation at a time. The common SAM layout relies on it: a
folder per function, each with an `app.py` and the handler `app.lambda_handler`; so does
module-level state such as a Powertools BatchProcessor. Here all functions share one
interpreter, so each environment gets a package of its own that the import system resolves its
function's names into:

- `FunctionModules` is that package: a synthetic top-level package (`_lambda_3_my_function`)
  whose __path__ is the function's package folder and its layers' Python folders, and the
  top-level names found there (`app`, `utils`, `functions`, ...);
- an import made by the function's code of one of those names loads the function's own copy
  (`import app` gives `_lambda_3_my_function.app`); relative imports follow from that;
- every other import (the standard library, boto3, the installed packages that stand in for
  what `sam build` would bundle, a mapped public layer) is the process's one copy.

Who imports is told by the importing module's name; where no module is known (a call of
importlib.import_module) by the function whose handler the thread is running. The copies'
module names carry the package's prefix: `__name__` in a function's module reads
`_lambda_3_my_function.app`, not `app`.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.machinery
import itertools
import re
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["FunctionModules", "new_modules", "install"]

_MODULE_SUFFIXES = tuple(importlib.machinery.all_suffixes())


@dataclass(frozen=True)
class FunctionModules:
    """One function's own modules: a package of this process that holds them."""

    package: str
    """The synthetic top-level package the function's modules live under."""
    search_path: tuple[Path, ...]
    """Where its modules are found: its package folder first, then its layers'."""
    own_names: frozenset[str]
    """Top-level module names found there; imports of these resolve into `package`."""

    def import_module(self, name: str) -> ModuleType:
        """Module `name` ("app", "functions.validate") as the function imports it: its own copy
        where the name is found in its folders, the process's otherwise."""
        if name.partition(".")[0] in self.own_names:
            return _import_module(f"{self.package}.{name}")
        return _import_module(name)


def top_level_names(folders: Iterable[Path]) -> frozenset[str]:
    """Names importable from these folders: modules (source or compiled) and packages (a folder
    with or without __init__.py, as Python 3 imports both)."""
    names = (_module_name(entry) for folder in folders if folder.is_dir() for entry in folder.iterdir())
    return frozenset(name for name in names if name and name.isidentifier() and name != "__pycache__")


def _module_name(entry: Path) -> str | None:
    if entry.is_dir():
        return entry.name
    if entry.name.endswith(_MODULE_SUFFIXES):
        return entry.name.split(".", 1)[0]
    return None


_registry_lock = threading.Lock()
_by_package: dict[str, FunctionModules] = {}
_numbers = itertools.count(1)


def new_modules(function_name: str, search_path: tuple[Path, ...]) -> FunctionModules:
    """A new, empty set of modules for one execution environment of the function: its modules
    are imported afresh into it (a cold start), and their state is that environment's alone."""
    with _registry_lock:
        package = f"_lambda_{next(_numbers)}_{re.sub(r'[^0-9A-Za-z_]', '_', function_name)}"
        modules = FunctionModules(package, search_path, top_level_names(search_path))
        holder = ModuleType(package, f"the modules of an environment of Lambda function {function_name}")
        holder.__path__ = [str(folder) for folder in search_path]
        holder.__spec__ = importlib.machinery.ModuleSpec(package, None, is_package=True)
        holder.__spec__.submodule_search_locations = holder.__path__
        sys.modules[package] = holder
        _by_package[package] = modules
        return modules


# --- the import hook ---------------------------------------------------------------------

_builtin_import = builtins.__import__
_import_module = importlib.import_module
_current: Callable[[], FunctionModules | None] = lambda: None


def _owner(importer_name: str | None) -> FunctionModules | None:
    """The function whose module is importing; with no importing module known, the function
    the running thread serves."""
    if importer_name is None:
        return _current()
    return _by_package.get(importer_name.partition(".")[0])


def _import(name: str, globals: dict[str, Any] | None = None, locals: Any = None,
            fromlist: Any = (), level: int = 0) -> ModuleType:
    if level == 0:
        modules = _owner(globals.get("__name__") if globals else None)
        top = name.partition(".")[0]
        if modules is not None and top in modules.own_names:
            module = _builtin_import(f"{modules.package}.{name}", globals, locals, fromlist, 0)
            return module if fromlist else sys.modules[f"{modules.package}.{top}"]
    return _builtin_import(name, globals, locals, fromlist, level)


def _import_module_of_owner(name: str, package: str | None = None) -> ModuleType:
    modules = None if name.startswith(".") else _current()
    return _import_module(name, package) if modules is None else modules.import_module(name)


def install(current: Callable[[], FunctionModules | None]) -> None:
    """Resolve imports into the importing function's modules from now on, once per process;
    `current` tells which function the running thread serves."""
    global _current
    _current = current
    builtins.__import__ = _import
    importlib.import_module = _import_module_of_owner
