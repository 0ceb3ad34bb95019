"""``python -m lit_dp_recipes.run.charlm`` (``recipes/charlm.py`` in a clone): ``train`` over the packaged ``charlm.yaml``."""

from lit_dp_recipes.cli import recipe_main

main = recipe_main("lit_dp_recipes.train:train", config_name="charlm")

if __name__ == "__main__":
    main()
