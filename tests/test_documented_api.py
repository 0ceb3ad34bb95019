"""Every name the README and docs/ present as lit_dp's API exists in the code.

A name is a dotted chain the docs write, in prose, inline code or a code block, that starts at
``lit_dp.``, ``PaddleDPStrategy.``, ``DataParallel.``, ``fabric.strategy.`` (Fabric's
``lit_dp.fabric.PaddleDPStrategy``) or ``trainer.strategy.`` (the Trainer's), and each name a
code block imports ``from lit_dp...``. Each link of a chain must resolve: a module's attribute
or submodule; a class's attribute, method or property; a dataclass field; an attribute the
class sets in ``__init__`` (read from an instance built without any process group where that
is possible, with a one-rank group for ``DataParallel``). Past a property or a field the chain
goes on in its declared type, so ``strategy.options.sharding.stage`` is checked link by link
even where the value is None until ``setup``. Nothing found in the docs is skipped: a name that
is not Python's (a Hydra resolver) is checked as what it is, in ``NOT_PYTHON``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
from torch import nn

import lit_dp
from tests.helpers.documented import DOCUMENTS, ROOT
from tests.helpers.groups import one_rank_group

# Where a chain starts: the object it starts at (resolved when the test runs), and the links
# the prefix itself stands for (``strategy.options`` is the Trainer strategy's ``options``).
ROOTS = {
    "lit_dp": (lambda: lit_dp, []),
    "PaddleDPStrategy": (lambda: lit_dp.PaddleDPStrategy, []),
    "DataParallel": (lambda: lit_dp.DataParallel, []),
    "fabric.strategy": (lambda: lit_dp.fabric.PaddleDPStrategy, []),
    "trainer.strategy": (lambda: lit_dp.PaddleDPStrategy, []),
    "strategy.options": (lambda: lit_dp.PaddleDPStrategy, ["options"]),
}
IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
# Not preceded by a name or a dot: ``DistributedDataParallel.x`` is torch's, and the
# ``fabric.PaddleDPStrategy`` inside ``lit_dp.fabric.PaddleDPStrategy`` is one chain from ``lit_dp``;
# nor by a dash: ``--trainer.strategy.comm_buffer_size`` is a LightningCLI flag (docs/strategy.md).
CHAIN = re.compile(rf"(?<![\w.-])(?:{'|'.join(re.escape(root) for root in ROOTS)})(?:\.{IDENTIFIER})+")
IMPORT = re.compile(rf"^\s*from\s+(lit_dp(?:\.{IDENTIFIER})*)\s+import\s+\(?([^)#\n]+)", re.MULTILINE)

# Names the docs present that are not Python attributes, with how the test checks each instead.
NOT_PYTHON = {
    "lit_dp.job_folder": "an OmegaConf resolver of the recipes (conf/hydra/default.yaml names run folders with it): "
    "checked registered by lit_dp_recipes.config.register_configs",
}


@dataclass(frozen=True)
class DocumentedName:
    chain: str
    source: str  # document:line

    @property
    def root(self) -> str:
        return max((root for root in ROOTS if self.chain.startswith(root + ".") or self.chain == root), key=len)

    @property
    def links(self) -> list[str]:
        own = self.chain[len(self.root) + 1 :].split(".") if self.chain != self.root else []
        return ROOTS[self.root][1] + own


def names_in(text: str, document: str) -> list[DocumentedName]:
    """The names ``text`` presents as lit_dp's, each with its line."""
    names = []
    for number, line in enumerate(text.splitlines(), start=1):
        source = f"{document}:{number}"
        names += [DocumentedName(match.group(0), source) for match in CHAIN.finditer(line)]
        for match in IMPORT.finditer(line):
            imported = [name.split(" as ")[0].strip() for name in match.group(2).split(",")]
            names += [DocumentedName(f"{match.group(1)}.{name}", source) for name in imported if name]
    return names


NAMES = [name for document in DOCUMENTS for name in names_in(document.read_text(), str(document.relative_to(ROOT)))]
UNIQUE = sorted({name.chain: name for name in reversed(NAMES)}.values(), key=lambda name: name.chain)


@cache
def instance_of(cls: type) -> Any:
    """An instance of ``cls`` built as cheaply as it can be: its attributes set in ``__init__``."""
    if issubclass(cls, lit_dp.DataParallel):
        one_rank_group()  # the autouse fixture destroys it after the test
        return cls(nn.Linear(2, 2))
    return cls()


def declared_type(owner: Any, annotation: Any) -> Any:
    """The class an annotation names, without ``None`` (a value unset until ``setup``)."""
    if isinstance(annotation, str):
        module = inspect.getmodule(owner)
        try:
            annotation = eval(annotation, vars(module) if module is not None else {})  # noqa: S307 (our own source)
        except NameError:
            return annotation  # a name imported for type checkers only: the chain's end, as a union's
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(options) == 1:
            return options[0]
    return annotation  # a union of several is the chain's end: a link after it fails, naming it


def resolve_link(current: Any, link: str, chain: str) -> Any:
    """What ``current.link`` is, as far as the docs' next link needs: a module, a class or a value."""
    if isinstance(current, types.ModuleType):
        if hasattr(current, link):
            return getattr(current, link)
        try:
            return importlib.import_module(f"{current.__name__}.{link}")
        except ModuleNotFoundError as error:
            raise AssertionError(f"{chain}: module {current.__name__} has no attribute or submodule {link!r}") from error
    cls = current if isinstance(current, type) else type(current)
    try:
        found = inspect.getattr_static(cls, link)
    except AttributeError:
        found = None
    else:
        if isinstance(found, property):
            return declared_type(found.fget, found.fget.__annotations__.get("return") if found.fget else None)
        if isinstance(found, (types.FunctionType, classmethod, staticmethod)):
            return found
        if not isinstance(current, type) or inspect.isclass(found) or isinstance(found, types.ModuleType):
            return found
    fields = {field.name: field.type for field in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    if link in fields:
        return declared_type(cls, fields[link])
    if found is not None:
        return found  # a plain class attribute
    declared = {name: hint for klass in reversed(cls.__mro__) for name, hint in vars(klass).get("__annotations__", {}).items()}
    if link in declared:  # an instance attribute the class declares
        return declared_type(cls, declared[link])
    if isinstance(current, type):
        try:
            current = instance_of(cls)
        except Exception as error:
            raise AssertionError(
                f"{chain}: {link!r} is no attribute of the class {cls.__qualname__}, and no instance could be built "
                f"to look for it ({error!r}): declare it on the class (a property, or an annotation)"
            ) from error
    if not hasattr(current, link):  # hasattr, not vars: a Module's submodules and parameters are found by __getattr__
        raise AssertionError(f"{chain}: {cls.__module__}.{cls.__qualname__} has no attribute {link!r}")
    return getattr(current, link)


def resolve(name: DocumentedName) -> Any:
    current = ROOTS[name.root][0]()
    for link in name.links:
        current = resolve_link(current, link, name.chain)
    return current


def test_names_are_read_as_a_reader_reads_them():
    text = (
        "Call `lit_dp.DataParallel.no_sync()`. See DistributedDataParallel._set_static_graph and lit_dp.fabric.\n"
        "    from lit_dp.options import (Options, option as declare)  # comment\n"
        "read `strategy.options.sharding.stage`, `fabric.strategy.join(model)`; python recipes/x.py strategy.trace.dir=t"
    )
    found = [(name.chain, name.source, name.root, name.links) for name in names_in(text, "doc.md")]
    assert found == [
        ("lit_dp.DataParallel.no_sync", "doc.md:1", "lit_dp", ["DataParallel", "no_sync"]),
        ("lit_dp.fabric", "doc.md:1", "lit_dp", ["fabric"]),
        ("lit_dp.options", "doc.md:2", "lit_dp", ["options"]),
        ("lit_dp.options.Options", "doc.md:2", "lit_dp", ["options", "Options"]),
        ("lit_dp.options.option", "doc.md:2", "lit_dp", ["options", "option"]),
        ("strategy.options.sharding.stage", "doc.md:3", "strategy.options", ["options", "sharding", "stage"]),
        ("fabric.strategy.join", "doc.md:3", "fabric.strategy", ["join"]),
    ]


def test_the_docs_present_names_of_every_kind():
    """Each kind of chain is found in the docs (a pattern broken by an edit would pass everything)."""
    roots = {name.root for name in NAMES}
    assert roots == set(ROOTS), f"no documented name starts at {sorted(set(ROOTS) - roots)}"


@pytest.mark.parametrize("name", [n for n in UNIQUE if n.chain not in NOT_PYTHON], ids=lambda n: n.chain)
def test_each_documented_name_resolves(name):
    resolve(name)


def test_names_that_are_not_python_attributes_are_what_the_docs_say():
    from omegaconf import OmegaConf

    from lit_dp_recipes.config import register_configs

    documented = {name.chain for name in NAMES}
    stale = sorted(set(NOT_PYTHON) - documented)
    assert not stale, f"NOT_PYTHON entries the docs no longer name: {stale}"
    register_configs()
    assert OmegaConf.has_resolver("lit_dp.job_folder")
