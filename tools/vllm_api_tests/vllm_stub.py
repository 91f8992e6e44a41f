"""A stand-in for the `vllm` package in the copied tests: `vllm.tokenizers.get_tokenizer` gives the
embedded model's tokenizer (the one the server serves under every name), `current_platform`
answers False to every question; anything else imports, and raises NeedsVllm when used, so
a test that exercises vLLM's own internals fails as "needs vLLM" (not applicable), not as a
wrong answer from Octavo."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class NeedsVllm(Exception):
    pass


class _Thing:
    """What any name from vLLM's internals is here: usable as a type, unusable as a value."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NeedsVllm(self._name)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Thing(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (NeedsVllmBase,)

    def __or__(self, other):
        return object

    __ror__ = __or__

    def __getitem__(self, item):
        return self


class NeedsVllmBase:
    def __init__(self, *args, **kwargs):
        raise NeedsVllm(type(self).__name__)


class _Platform:
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *a, **k: False


def get_tokenizer(*args, **kwargs):
    from octavo.models.loader import resolve_model
    from octavo.tokenizer import hf_tokenizer, load_tokenizer

    return hf_tokenizer(load_tokenizer(resolve_model(None)))


class _Module(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr == "get_tokenizer":
            return get_tokenizer
        if attr == "current_platform":
            return _Platform()
        return _Thing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    sys.meta_path.insert(0, _Finder())
