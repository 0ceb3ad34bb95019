"""``python -m lit_dp_recipes.run.digits`` (``recipes/digits.py`` in a clone): ``train`` over the packaged ``digits.yaml``."""

from lit_dp_recipes.cli import recipe_main

main = recipe_main("lit_dp_recipes.train:train", config_name="digits")

if __name__ == "__main__":
    main()
