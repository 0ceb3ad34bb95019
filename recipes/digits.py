"""Train an MLP on scikit-learn's handwritten digits with lit_dp: the main job.

    python recipes/digits.py                                   # 2 CPU processes, paddle_dp
    python recipes/digits.py strategy.comm_buffer_size=5       # 5 MB buckets
    python recipes/digits.py strategy=ddp                      # torch DDP, for comparison
    python recipes/digits.py trainer=gpu                       # every local GPU, NCCL
    python recipes/digits.py ckpt_path=outputs/digits/<run>/checkpoints/last.ckpt   # resume
"""

import hydra
from omegaconf import DictConfig

from lit_dp_recipes.config import register_configs
from lit_dp_recipes.train import train

register_configs()


@hydra.main(config_path="../conf", config_name="digits", version_base="1.3")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
