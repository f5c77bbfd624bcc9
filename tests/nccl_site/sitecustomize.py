"""NCCL's rules of progress in every process of a test session that imports torch (tests/nccl_rules.py).

tests/conftest.py puts this folder on the PYTHONPATH of the session, so Python imports this
module at the start of each process it starts: pytest's workers, the fork servers of
`spawn_ranks`, the local cloud's instances and warm images, their node agents, torchrun and its
ranks. With ENABLE_VARIABLE set it wraps c10d's point-to-point ops as the module
torch.distributed.distributed_c10d is executed, before torch.distributed re-exports them and
before anything imports names from it; a process that never imports torch never loads torch
or the rules.
"""

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

ENABLE_VARIABLE = "TRAINFLEET_TEST_NCCL_RULES"
"""nccl_rules.ENABLE_VARIABLE (importing that module here would cost every process its imports)."""
RULES = Path(__file__).resolve().parent.parent / "nccl_rules.py"


def rules():
    """tests/nccl_rules.py, loaded once as the module `nccl_rules` (what the tests import)."""
    module = sys.modules.get("nccl_rules")
    if module is None:
        spec = importlib.util.spec_from_file_location("nccl_rules", RULES)
        module = importlib.util.module_from_spec(spec)
        sys.modules["nccl_rules"] = module
        spec.loader.exec_module(module)
    return module


class NcclRulesFinder(importlib.abc.MetaPathFinder):
    """Installs the rules into torch.distributed.distributed_c10d once it has executed."""

    TARGET = "torch.distributed.distributed_c10d"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            rules().install(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(ENABLE_VARIABLE) == "1":
    sys.meta_path.insert(0, NcclRulesFinder())
