"""Train an MLP on scikit-learn's handwritten digits with lit_dp: the main job.

    python recipes/digits.py                                   # 2 CPU processes, paddle_dp
    python recipes/digits.py strategy.comm_buffer_size=5       # 5 MB buckets
    python recipes/digits.py strategy=ddp                      # torch DDP, for comparison
    python recipes/digits.py trainer=gpu                       # every local GPU, NCCL
    python recipes/digits.py ckpt_path=outputs/digits/<run>/checkpoints/last.ckpt   # resume
"""

from lit_dp_recipes.run.digits import main

if __name__ == "__main__":
    main()
