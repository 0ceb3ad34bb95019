"""Turn a folder of your text files into token shards that recipes/gpt.py trains on.

    python recipes/prepare_shards.py input_dir=my_texts output_dir=data/my_texts               # bytes
    python recipes/prepare_shards.py input_dir=my_texts output_dir=data/my_texts tokenizer=gpt2  # needs tiktoken
    python recipes/gpt.py data.train_shards='data/my_texts/*_train_*.bin' data.val_shards='data/my_texts/*_val_*.bin'

It prints the training command for what it wrote (docs/gpt.md).
"""

import hydra
from omegaconf import DictConfig

from lit_dp_recipes.prepare import prepare_shards, summary


@hydra.main(config_path="../conf", config_name="prepare_shards", version_base="1.3")
def main(cfg: DictConfig) -> None:
    prepared = prepare_shards(
        cfg.input_dir, cfg.output_dir, cfg.pattern, cfg.tokenizer, cfg.val_fraction, cfg.shard_tokens, cfg.name
    )
    print(summary(prepared, cfg.output_dir), flush=True)


if __name__ == "__main__":
    main()
