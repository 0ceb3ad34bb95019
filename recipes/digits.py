"""Train an MLP on scikit-learn's handwritten digits with lit_dp: the main job.

    python recipes/digits.py                                   # 2 CPU processes, paddle_dp
    python recipes/digits.py strategy.comm_buffer_size=5       # 5 MB buckets
    python recipes/digits.py strategy=ddp                      # torch DDP, for comparison
    python recipes/digits.py trainer=gpu                       # every local GPU, NCCL
    python recipes/digits.py ckpt_path=outputs/digits/<run>/checkpoints/last.ckpt   # resume
"""

from lit_dp_recipes.cli import recipe_main
from lit_dp_recipes.train import train

main = recipe_main(train, config_name="digits")

if __name__ == "__main__":
    main()
