"""The front doors' signatures, generated from the option declarations (lit_dp.options.signature):
what ``inspect.signature``, ``help()``, editors and jsonargparse read."""

from __future__ import annotations

import inspect
import re
import typing
from pathlib import Path

import docstring_parser
import pytest
from jsonargparse import ArgumentParser

from lit_dp import DataParallel, PaddleDPStrategy, fabric
from lit_dp.options import FABRIC, MODULE, TRAINER, declared_options
from lit_dp.options.core import Options
from lit_dp.options.signature import option_types, takes_options

DOCS = Path(__file__).resolve().parents[2] / "docs" / "options.md"
FRONT_DOORS = {TRAINER: PaddleDPStrategy, FABRIC: fabric.PaddleDPStrategy, MODULE: DataParallel}
NAMES_IN_DOCS = {TRAINER: "Trainer", FABRIC: "Fabric", MODULE: "DataParallel"}


def documented() -> list[tuple[str, str, str, str]]:
    """``(path, keyword, where, help)`` of each row of docs/options.md's table of options."""
    rows, columns = [], None
    for line in DOCS.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[:2] == ["option", "keyword"]:
            columns = {name: index for index, name in enumerate(cells)}
        elif columns and len(cells) == len(columns) and re.fullmatch(r"`[\w.]+`", cells[0]):
            path = cells[0].strip("`")
            rows.append((path, cells[columns["keyword"]].strip("`") or path, cells[columns["where"]], cells[columns["meaning"]]))
    assert len(rows) >= 30, "docs/options.md's table was not read"
    return rows


@pytest.mark.parametrize("scope", FRONT_DOORS)
def test_the_signature_lists_every_documented_option_of_its_front_door(scope):
    parameters = inspect.signature(FRONT_DOORS[scope]).parameters
    for path, keyword, where, _ in documented():
        if NAMES_IN_DOCS[scope] in where or where.startswith("with `comm_hook="):
            assert keyword in parameters, f"{path} ({keyword}) is missing from {FRONT_DOORS[scope].__qualname__}'s signature"


@pytest.mark.parametrize("scope", FRONT_DOORS)
def test_each_option_is_typed_with_its_declared_type_and_default(scope):
    init = FRONT_DOORS[scope].__init__
    parameters = inspect.signature(init).parameters
    hints = typing.get_type_hints(init)
    types = option_types()
    for declared in declared_options(scope):
        parameter = parameters[declared.keyword]
        if scope == MODULE and parameter.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue  # torch DDP's own argument with DDP's default (find_unused_parameters, broadcast_buffers, ...)
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, declared.path
        assert parameter.default == declared.field.default, declared.path
        assert parameter.annotation == types[declared.path] == hints[declared.keyword], declared.path
    assert list(parameters)[-1] in ("values", "option_values"), "Lightning's names and groups as a whole still go through"


@pytest.mark.parametrize("scope", FRONT_DOORS)
def test_the_constructors_docstring_gives_each_options_help(scope):
    parsed = docstring_parser.parse(FRONT_DOORS[scope].__init__.__doc__, style=docstring_parser.Style.GOOGLE)
    helps = {param.arg_name: param.description for param in parsed.params}
    parameters = inspect.signature(FRONT_DOORS[scope]).parameters
    for declared in declared_options(scope):
        if parameters[declared.keyword].kind is inspect.Parameter.KEYWORD_ONLY:
            assert declared.field.metadata["help"] in helps[declared.keyword], declared.path


def test_help_shows_the_options_with_their_types_and_defaults():
    shown = inspect.getdoc(PaddleDPStrategy.__init__) + str(inspect.signature(PaddleDPStrategy))
    assert "sharding_stage: Optional[int] = None" in shown and "comm_buffer_size: float | str = 25.0" in shown
    assert "sharding_stage: ``sharding.stage``: 1: each rank keeps the optimizer state" in shown


def test_calls_are_unchanged_only_the_options_given_are_built():
    # Lightning's names, a group whole and keyword spellings, as before the signature was generated.
    strategy = PaddleDPStrategy(bucket_cap_mb=5, sharding={"stage": 1}, straggler_every_n_steps=5)
    assert (strategy.options.comm_buffer_size, strategy.options.sharding.stage, strategy.options.straggler.every_n_steps) == (5.0, 1, 5)
    with pytest.raises(ValueError, match=re.escape("comm_buffer_size=4 and bucket_cap_mb=5 are the same option")):
        PaddleDPStrategy(comm_buffer_size=4, bucket_cap_mb=5)
    with pytest.raises(TypeError, match="pass options= or keyword options, not both"):
        fabric.PaddleDPStrategy(options=Options.build({}, FABRIC), sharding_stage=1)


def test_an_init_without_room_for_the_options_is_refused():
    with pytest.raises(TypeError, match=r"must end with \*\*values"):
        takes_options(TRAINER)(lambda self, options=None: None)


@pytest.mark.parametrize("strategy", [PaddleDPStrategy, fabric.PaddleDPStrategy], ids=[TRAINER, FABRIC])
def test_jsonargparse_reads_every_option_types_them_and_builds_the_strategy(strategy):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(strategy, "strategy")
    keywords = [declared.keyword for declared in declared_options(strategy._options_scope)]
    assert {f"strategy.{keyword}" for keyword in keywords} <= set(parser.get_defaults().keys())
    config = parser.parse_args(["--strategy.comm_buffer_size=5", "--strategy.sharding_stage=1", "--strategy.straggler_every_n_steps=5"])
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # the name before 4.49
    built = instantiate(config).strategy
    assert (built.options.comm_buffer_size, built.options.sharding.stage, built.options.straggler.every_n_steps) == (5.0, 1, 5)
    with pytest.raises(Exception, match="find_unused_parameters"):
        parser.parse_args(["--strategy.find_unused_parameters=maybe"])
