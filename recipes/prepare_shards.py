"""Turn a folder of your text files into token shards that recipes/gpt.py trains on.

    python recipes/prepare_shards.py input_dir=my_texts output_dir=data/my_texts               # bytes
    python recipes/prepare_shards.py input_dir=my_texts output_dir=data/my_texts tokenizer=gpt2  # needs tiktoken
    python recipes/gpt.py data.train_shards='data/my_texts/*_train_*.bin' data.val_shards='data/my_texts/*_val_*.bin'

It prints the training command for what it wrote (docs/gpt.md).
"""

from lit_dp_recipes.cli import recipe_main
from lit_dp_recipes.prepare import prepare_from_config

main = recipe_main(prepare_from_config, config_name="prepare_shards")

if __name__ == "__main__":
    main()
