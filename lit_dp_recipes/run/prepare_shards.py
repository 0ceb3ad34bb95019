"""``python -m lit_dp_recipes.run.prepare_shards`` (``recipes/prepare_shards.py`` in a clone): text files -> token shards."""

from lit_dp_recipes.cli import recipe_main

main = recipe_main("lit_dp_recipes.prepare:prepare_from_config", config_name="prepare_shards")

if __name__ == "__main__":
    main()
