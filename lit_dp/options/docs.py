"""The options' documentation, generated from their declarations: the front doors' docstrings
and the tables of docs/options.md.

``python -m lit_dp.options`` rewrites the generated part of docs/options.md (everything after
``MARKER``); a test keeps it equal to ``options_markdown()``.
"""

from __future__ import annotations

from pathlib import Path

from lit_dp.options.comm_hooks import named_hooks
from lit_dp.options.core import Declared, _comm_hook_in_ddp, declared_options
from lit_dp.options.declare import FABRIC, MODULE, TRAINER

MARKER = "<!-- Generated from the declarations by lit_dp.options.docs: edit those, then run python -m lit_dp.options -->\n"
_FRONT_DOORS = ((TRAINER, "Trainer"), (FABRIC, "Fabric"), (MODULE, "DataParallel"))


def options_doc(scope: str) -> str:
    """One line per option of ``scope``, for the front doors' docstrings."""
    lines = []
    for declared in declared_options(scope):
        meta = declared.field.metadata
        keyword = f" (``{declared.keyword}=``)" if declared.keyword != declared.path else ""
        alias = f" (Lightning: ``{meta['lightning']}``)" if meta["lightning"] else ""
        applies = f"with comm_hook={declared.hook!r}: " if declared.hook else ""
        lines.append(f"        {declared.path}{keyword} = {declared.field.default!r}: {applies}{meta['help']}{alias}.")
    return "\n".join(lines)


def arguments_doc(declared: list[Declared]) -> str:
    """An ``Args:`` section, one entry per option by its keyword spelling: the constructor's docstring,
    which jsonargparse (LightningCLI's help) and editors read next to the generated signature."""
    lines = ["Every option (docs/options.md) is a keyword argument, validated here once.", "", "Args:"]
    for option in declared:
        meta = option.field.metadata
        path = f"``{option.path}``: " if option.keyword != option.path else ""
        applies = f"with comm_hook={option.hook!r}: " if option.hook else ""
        alias = f" (Lightning: ``{meta['lightning']}``)" if meta["lightning"] else ""
        lines.append(f"    {option.keyword}: {path}{applies}{meta['help']}{alias}.")
    return "\n".join(lines)


def options_markdown() -> str:
    """The generated part of docs/options.md: every option, then the named hooks."""
    lines = [
        "| option | keyword | default | where | Hydra | Lightning's name | torch DDP | meaning |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(declared) for declared in declared_options()]
    lines += [
        "",
        "## Refused at a front door, and what does the same there",
        "",
        "| options | front door | instead |",
        "|---|---|---|",
    ]
    refused: dict[tuple[str, str], list[str]] = {}  # (door, what to do there) -> the options it refuses
    for declared in declared_options():
        for scope, name in _FRONT_DOORS:
            if (instead := declared.field.metadata["instead"].get(scope)) is not None:
                refused.setdefault((name, instead), []).append(f"`{declared.path}`")
    lines += [f"| {', '.join(paths)} | {door} | {instead} |" for (door, instead), paths in refused.items()]
    lines += [
        "",
        "## Named communication hooks",
        "",
        "| `comm_hook=` | its options | `comm_dtype=` | meaning |",
        "|---|---|---|---|",
    ]
    for hook in named_hooks():
        options = ", ".join(f"`{d.path}`" for d in declared_options() if d.hook == hook.name)
        dtype = "yes" if hook.compress_wrapper is not None else ""
        lines.append(f"| `{hook.name}` | {options} | {dtype} | {hook.help} |")
    return "\n".join(lines) + "\n"


def _row(declared: Declared) -> str:
    meta = declared.field.metadata
    if declared.hook is not None:
        where = f"with `comm_hook={declared.hook}`"
    else:
        where = ", ".join(name for scope, name in _FRONT_DOORS if scope in meta["scope"])
    keyword = f"`{declared.keyword}`" if declared.keyword != declared.path else ""
    hydra = "yes" if meta["config"] is not None else "no"
    lightning = f"`{meta['lightning']}`" if meta["lightning"] else ""
    default = f"`{declared.field.default!r}`"
    return f"| `{declared.path}` | {keyword} | {default} | {where} | {hydra} | {lightning} | {_in_ddp(declared)} | {meta['help']} |"


def _in_ddp(declared: Declared) -> str:
    """What torch DDP has for the option (``lit_dp.ddp_arguments.ddp_strategy_arguments``): its argument, or refused."""
    to_ddp = declared.field.metadata["ddp"]
    if declared.hook is not None or to_ddp == "comm_hook" or to_ddp is _comm_hook_in_ddp:
        return "the hook, registered"
    if isinstance(to_ddp, str):
        return f"with `{to_ddp}`"
    return f"`{to_ddp.keyword}`" if to_ddp is not None else "refused"


def rewrite(page: Path) -> None:
    """Replace the generated part of ``page`` (after ``MARKER``) with ``options_markdown()``."""
    text = page.read_text()
    if MARKER not in text:
        raise ValueError(f"{page} has no line {MARKER.strip()!r} to generate after.")
    page.write_text(text.split(MARKER)[0] + MARKER + options_markdown())
