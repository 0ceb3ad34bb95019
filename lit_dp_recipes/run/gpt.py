"""``python -m lit_dp_recipes.run.gpt`` (``recipes/gpt.py`` in a clone): ``train`` over the packaged ``gpt.yaml``."""

from lit_dp_recipes.cli import recipe_main

main = recipe_main("lit_dp_recipes.train:train", config_name="gpt")

if __name__ == "__main__":
    main()
