"""torch DDP's constructor arguments, checked as DDP checks them, for ``lit_dp.DataParallel``.

``DistributedDataParallel(...)`` -> ``lit_dp.DataParallel(...)`` is a rename in a script written
for DDP: these functions take DDP's arguments with DDP's meaning, raise DDP's errors (its words
where a script or a test may match them), and refuse what lit_dp cannot do with a message that
says what to use instead. The migration table is in docs/reducer.md.

The other way round, ``ddp_strategy_arguments`` gives Lightning ``DDPStrategy``'s arguments for
lit_dp's options, for a run side by side with DDP (the recipes' ``strategy=ddp``).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch._utils import _get_device_index

from lit_dp.gradients.broadcast import trainable_parameters
from lit_dp.job.launcher import detect_launch
from lit_dp.options import MODULE, TRAINER, Options, declared_options
from lit_dp.options.spelling import Spellings


def options_from(given: Options | None, values: dict[str, Any], **ddp: Any) -> Options:
    """The options in effect: ``given`` (a front door validated them), or the keyword options and
    DDP's arguments that are options (``bucket_cap_mb`` is ``comm_buffer_size``), validated here."""
    bucket_cap_mb = ddp.pop("bucket_cap_mb")
    defaults = {"find_unused_parameters": False, "gradient_as_bucket_view": False, "broadcast_buffers": None}
    changed = {name: value for name, value in ddp.items() if value != defaults[name]}
    if bucket_cap_mb is not None:
        changed["bucket_cap_mb"] = bucket_cap_mb
    if given is not None:
        if values or changed:
            raise TypeError(
                f"DataParallel: pass options= or keyword options, not both (got {sorted({**values, **changed})})."
            )
        return given
    values = {**values, **changed}
    if bucket_cap_mb is not None and "last_comm_buffer_size" not in values:
        values["last_comm_buffer_size"] = bucket_cap_mb  # DDP's bucket_cap_mb bounds the last bucket too
    return Options.build(values, MODULE)


def ddp_strategy_arguments(given: Mapping[str, Any], prefix: str = "", *, nested: bool = False) -> dict[str, Any]:
    """Lightning ``DDPStrategy``'s keyword arguments for the lit_dp options ``given``, spelt as for
    ``lit_dp.PaddleDPStrategy`` (``nested``: as a config spells them), for a run side by side with DDP.

    Each option maps to DDP's own, as its declaration says (``ddp=``: ``comm_buffer_size`` is
    ``bucket_cap_mb``; a named ``comm_hook`` is the torch hook it names, with its options), or is
    refused: DDP would run without it, and a comparison would differ silently. The values are
    checked as ``Options.build`` checks them; errors name each option as given (``prefix`` first).

    Raises:
        ValueError: naming every option given that DDP has no counterpart for, or a value DDP
            cannot take (``comm_buffer_size="auto"``).
    """
    spellings = Spellings(declared_options(TRAINER), TRAINER, nested)
    # A named hook's options go with comm_hook, as everywhere else.
    in_ddp = [path for path, d in spellings.declared.items() if d.field.metadata["ddp"] is not None or d.hook is not None]
    written: dict[str, str] = {}
    refused: dict[str, str] = {}  # path -> name=value as given
    for key, value in given.items():
        try:
            resolved = list(spellings.resolve(key, value, prefix))
        except ValueError:
            if key in spellings.groups:
                raise  # a misspelt member of a group: Spellings names the group's options
            close = difflib.get_close_matches(key, in_ddp, n=1)
            hint = f" Did you mean {prefix + close[0]!r}?" if close else ""
            raise ValueError(
                f"{prefix}{key}={value!r} is not an option under torch DDP.{hint} Expected one of: {', '.join(in_ddp)}."
            ) from None
        for path, name, item in resolved:
            written[path] = name
            if path not in in_ddp:
                refused[path] = f"{name}={item!r}"
    if refused:
        one = len(refused) == 1
        what = "; ".join(f"{path}: {spellings.declared[path].field.metadata['help']}" for path in refused)
        raise ValueError(
            f"{' and '.join(refused.values())} {'has' if one else 'have'} no counterpart in torch DDP (Lightning's "
            f"DDPStrategy), which would run without {'it' if one else 'them'} ({what}). Expected "
            f"{'it' if one else 'them'} left out for DDP, or lit_dp's strategy (paddle_dp). DDP has counterparts for: "
            f"{', '.join(in_ddp)}."
        )
    options = Options.build(given, TRAINER, prefix, nested=nested)
    arguments: dict[str, Any] = {}
    for path in in_ddp:
        to_ddp = spellings.declared[path].field.metadata["ddp"]
        if callable(to_ddp):  # else the option whose arguments carry this one (comm_hook)
            arguments.update(to_ddp(path, options, lambda p: written.get(p, prefix + spellings.spell(p))))
    return arguments


def refuse_a_launched_job_without_a_group() -> None:
    """No process group, yet a launcher describes several ranks: each would train its own model
    (torch DDP raises here too). One process, with or without a launcher, runs the module unchanged."""
    remedy = (
        "Call lit_dp.init_parallel_env() (or torch.distributed.init_process_group()) before wrapping the model, "
        "or pass group=."
    )
    try:
        launch = detect_launch()
    except ValueError as error:
        raise ValueError(
            "lit_dp.DataParallel: no process group exists, and the launcher's variables, read to tell whether this "
            f"process is one of several, are invalid: {error} {remedy}"
        ) from error
    world_size = launch.parallel_env.world_size
    if world_size > 1:
        described = ", ".join(source for source in (launch.rank_source, launch.world_size_source) if source)
        raise ValueError(
            f"lit_dp.DataParallel: the environment describes world size {world_size} ({launch.who}: {described}), "
            f"but no process group exists, so each rank would train its own model. {remedy}"
        )


def refuse_what_cannot_work(
    mixed_precision: Any, bucket_cap_mb_list: Any, delayed: Any, param_to_hook_all_reduce: Any
) -> None:
    if mixed_precision is not None:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is not supported by lit_dp.DataParallel (torch DDP's experimental "
            "native mixed precision); expected None: run the forward under torch.autocast (Lightning: "
            "precision='bf16-mixed' or '16-mixed') and all-reduce in half precision with comm_dtype='bf16' or 'fp16'."
        )
    if bucket_cap_mb_list is not None:
        raise ValueError(
            f"bucket_cap_mb_list={list(bucket_cap_mb_list)!r} is not supported by lit_dp.DataParallel; expected None: "
            "set comm_buffer_size (every bucket) and last_comm_buffer_size (the last one reduced), or "
            "comm_buffer_size='auto'."
        )
    if (delayed is None) != (param_to_hook_all_reduce is None):
        raise ValueError(
            "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time "
            f"(torch DDP's rule); got delay_all_reduce_named_params={'set' if delayed is not None else None}, "
            f"param_to_hook_all_reduce={'set' if param_to_hook_all_reduce is not None else None}."
        )


def chosen_group(
    process_group: dist.ProcessGroup | None, group: dist.ProcessGroup | None, device_mesh: Any
) -> dist.ProcessGroup | None:
    """``process_group`` (DDP's name), ``group`` (lit_dp's) or a one-dimensional ``device_mesh``'s group."""
    if process_group is not None and group is not None and process_group is not group:
        raise ValueError(
            "DataParallel(process_group=..., group=...) with two different groups is invalid: they are the same "
            "argument (torch DDP's name and lit_dp's); pass one of them."
        )
    chosen = process_group if process_group is not None else group
    if device_mesh is None:
        return chosen
    if chosen is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments (torch DDP's rule).")
    if device_mesh.ndim != 1:
        raise RuntimeError(
            f"Only 1D device mesh is supported, but got {device_mesh} (torch DDP's rule); expected the data-parallel "
            "dimension, e.g. mesh['dp']."
        )
    return device_mesh.get_group(mesh_dim=0)


def checked_devices(
    module: nn.Module, device_ids: Any, output_device: Any, delayed: list[nn.Parameter], ignore: set[str]
) -> tuple[list[int] | None, int | None]:
    """DDP's checks of the module and its devices; ``(device_ids, output_device)`` as DDP keeps them."""
    if isinstance(device_ids, dist.ProcessGroup):
        raise ValueError(
            f"DataParallel(module, {type(device_ids).__name__}): the second positional argument is torch DDP's "
            "device_ids, no longer lit_dp's group; pass the group by name: DataParallel(module, process_group=g) "
            "(or group=g)."
        )
    named = list(module.named_parameters())
    uninitialized = [name for name, p in named if isinstance(p, nn.parameter.UninitializedParameter)]
    if uninitialized:
        raise RuntimeError(
            f"Modules with uninitialized parameters can't be used with lit_dp.DataParallel ({uninitialized[:5]}); "
            "run a dummy forward pass first to initialize them (torch DDP's rule)."
        )
    trainable = [name for name, _ in trainable_parameters(module, ignore)]
    if not trainable and not delayed:
        names = [name for name, _ in named]
        has = (
            f"its parameters {_some(names)} are frozen, marked no_sync or in _ddp_params_and_buffers_to_ignore"
            if names
            else "it has no parameters"
        )
        raise RuntimeError(
            f"lit_dp.DataParallel: nothing to train in {type(module).__name__}: {has}. As torch DDP says, "
            "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a gradient; "
            "wrap the module you train, or run this one unwrapped."
        )
    by_type: dict[str, list[str]] = {}
    for name, param in named:
        by_type.setdefault(param.device.type, []).append(name)
    if len(by_type) > 1:
        where = "; ".join(f"on {kind}: {_some(names)}" for kind, names in by_type.items())
        raise ValueError(
            "lit_dp.DataParallel's module must be on one type of device, as DistributedDataParallel's: its "
            f"parameters are {where}. Move the module with module.to(device) first."
        )
    if device_ids is not None:
        try:
            device_ids = list(device_ids)
        except TypeError:
            raise ValueError(f"device_ids={device_ids!r} is invalid: expected None or a list of one device.") from None
        if len(device_ids) > 1:
            raise ValueError(
                f"device_ids={device_ids!r} is invalid: device_ids can only be None or contain a single element "
                "(torch DDP's rule: one process per device)."
            )
    devices = {param.device for _, param in named}
    device = next(iter(devices))
    if not device_ids or device.type == "cpu" or len(devices) > 1:
        if device_ids or output_device is not None:
            raise ValueError(
                "DataParallel device_ids and output_device arguments only work with single-device GPU modules "
                f"(torch DDP's rule), but got device_ids {device_ids}, output_device {output_device}, and module "
                f"parameters {sorted(map(str, devices))}; expected device_ids=None for a CPU or multi-device module."
            )
        return None, None
    ids = [_get_device_index(d, True) for d in device_ids]
    if ids[0] != device.index:
        raise ValueError(
            f"device_ids={device_ids!r} is invalid for a module on {device}: inputs would be moved to another device "
            f"than the parameters'; expected device_ids=[{device.index}] (or move the module first)."
        )
    return ids, _get_device_index(output_device if output_device is not None else device_ids[0], True)


def _some(names: list[str], shown: int = 3) -> str:
    """``a, b, c (and 2 more)``: parameter names for a message."""
    more = f" (and {len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
