"""Train a GPT (nanoGPT's model and recipe) on your token shards, or offline on the stdlib bytes.

    python recipes/gpt.py                                      # stdlib bytes, 2 CPU processes, a few minutes
    python recipes/gpt.py experiment=gpt_tiny                  # a few steps
    python recipes/prepare_shards.py input_dir=my_texts output_dir=data/my_texts     # your text -> shards
    python recipes/gpt.py data.train_shards='data/my_texts/*_train_*.bin' data.val_shards='data/my_texts/*_val_*.bin'
    python recipes/gpt.py experiment=gpt2_small data.train_shards='fineweb10B/*train*.bin' \\
        data.val_shards='fineweb10B/*val*.bin'                 # GPT-2 small on the GPUs: bf16, compiled, MFU
    python recipes/gpt.py trainer.accumulate_grad_batches=4 trainer.gradient_clip_val=1.0 model.lr=1e-3

Shards: nanoGPT's flat uint16 .bin or llm.c's headed shards (docs/gpt.md).
"""

from lit_dp_recipes.run.gpt import main

if __name__ == "__main__":
    main()
