"""``python -m lit_dp_recipes.run.sample ckpt_path=... [key=value ...]``: text from a GPT recipe's checkpoint.

The keys are ``lit_dp_recipes.sample.SampleConfig``'s (``prompt``, ``num_samples``, ``max_new_tokens``,
``temperature``, ``top_k``, ``seed``, ``device``, ``tokenizer``), typed and checked as OmegaConf
merges them onto it; no run folder is made.
"""

from __future__ import annotations

import dataclasses
import sys

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lit_dp_recipes.sample import SampleConfig, sample
from lit_dp_recipes.spelling import did_you_mean


def main(arguments: list[str] | None = None) -> None:
    arguments = sys.argv[1:] if arguments is None else arguments
    keys = [field.name for field in dataclasses.fields(SampleConfig)]
    for argument in arguments:
        key = argument.partition("=")[0]
        if key in keys and "=" not in argument:
            sys.exit(f"error: {argument} has no value: expected {key}=... (docs/gpt.md, 'Sampling').")
        if key not in keys:
            hint = did_you_mean(key, keys, most=2)
            sys.exit(f"error: {argument} is not a key=value of the sampler: {hint + ' ' if hint else ''}expected one of {', '.join(keys)} "
                     "(docs/gpt.md, 'Sampling').")
    try:
        config = OmegaConf.merge(OmegaConf.structured(SampleConfig), OmegaConf.from_dotlist(arguments))
    except OmegaConfBaseException as error:  # a value of the wrong type: OmegaConf names the key
        typed = next((a for a in arguments if a.partition("=")[0] == getattr(error, "full_key", None)), None)
        why = str(getattr(error, "msg", error)).splitlines()[0].rstrip(".")
        sys.exit(f"error: {typed} is invalid: {why}." if typed else f"error: {why}.")
    try:
        sample(SampleConfig(**OmegaConf.to_container(config)))
    except ValueError as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
