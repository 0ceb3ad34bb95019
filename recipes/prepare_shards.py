"""Turn a folder of your text files into token shards that recipes/gpt.py trains on.

    python recipes/prepare_shards.py input_dir=my_texts output_dir=data/my_texts               # bytes
    python recipes/prepare_shards.py input_dir=my_texts output_dir=data/my_texts tokenizer=gpt2  # needs tiktoken
    python recipes/gpt.py data.train_shards='data/my_texts/*_train_*.bin' data.val_shards='data/my_texts/*_val_*.bin'

It prints the training command for what it wrote (docs/gpt.md).
"""

from lit_dp_recipes.run.prepare_shards import main

if __name__ == "__main__":
    main()
