"""The named hooks ``fp16`` and ``bf16``: torch's half-precision compress hooks, and Paddle's ``comm_dtype``.

``comm_hook="fp16"`` registers torch's ``fp16_compress_hook``; ``comm_dtype="fp16"`` does the
same without a hook, or puts ``fp16_compress_wrapper`` around the hook that is set.
"""

from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lit_dp.options.comm_hooks import NamedHook, register_named_hook


def _half_precision(name: str, precision: str) -> NamedHook:
    hook = getattr(default_hooks, f"{name}_compress_hook")
    return NamedHook(
        name=name,
        help=f"torch's {hook.__name__}: each bucket all-reduced in {precision}",
        build=lambda options: (None, hook),
        describe=lambda options: hook.__name__,
        conflicts={"comm_dtype": "both compress to half precision; set one of them"},
        compress_wrapper=getattr(default_hooks, f"{name}_compress_wrapper"),
        stateless=True,  # their state is the process group (None: the default one)
    )


FP16 = register_named_hook(_half_precision("fp16", "float16"))
BF16 = register_named_hook(_half_precision("bf16", "bfloat16"))
