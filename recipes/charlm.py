"""Train a small GPT-style byte-level language model on the Python standard library's source.

    python recipes/charlm.py                                   # 2 CPU processes, a few minutes
    python recipes/charlm.py experiment=charlm_tiny            # a few steps
    python recipes/charlm.py trainer=gpu model.n_layer=6 model.n_embd=384 data.block_size=256
    python recipes/charlm.py experiment=charlm_gpt2            # GPT-2 small on the GPUs: bf16, compiled, tokens/s, MFU
"""

import hydra
from omegaconf import DictConfig

from lit_dp_recipes.config import register_configs
from lit_dp_recipes.train import train

register_configs()


@hydra.main(config_path="../conf", config_name="charlm", version_base="1.3")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
