"""``python -m lit_dp_recipes.run.sample ckpt_path=... [key=value ...]``: text from a GPT recipe's checkpoint.

The keys are ``lit_dp_recipes.sample.SampleConfig``'s (``prompt``, ``num_samples``, ``max_new_tokens``,
``temperature``, ``top_k``, ``seed``, ``device``, ``tokenizer``), typed and checked as OmegaConf
merges them onto it; no run folder is made.
"""

from __future__ import annotations

import sys

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lit_dp_recipes.sample import SampleConfig, sample


def main(arguments: list[str] | None = None) -> None:
    arguments = sys.argv[1:] if arguments is None else arguments
    try:
        config = OmegaConf.merge(OmegaConf.structured(SampleConfig), OmegaConf.from_dotlist(arguments))
    except OmegaConfBaseException as error:
        sys.exit(f"{error}\nexpected key=value with the keys of lit_dp_recipes.sample.SampleConfig (docs/gpt.md, 'Sampling').")
    try:
        sample(SampleConfig(**OmegaConf.to_container(config)))
    except ValueError as error:
        sys.exit(f"ValueError: {error}")


if __name__ == "__main__":
    main()
