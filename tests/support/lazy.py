"""`lazy_module(name)`: the module `name`, loaded on its first attribute access instead of at
import. A test module that needs a heavy library only in its tests (openenv-core and verifiers
pull gradio, anthropic, ...: seconds of every pytest worker's collection) names it this way, so
collecting the suite, which every worker of every run does, does not import it."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy_module(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"no module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module
