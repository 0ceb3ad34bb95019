"""``python -m lit_dp_recipes.run.charlm`` (``recipes/charlm.py`` in a clone): ``train`` over the packaged ``charlm.yaml``."""

from lit_dp_recipes.cli import recipe_main
from lit_dp_recipes.train import train

main = recipe_main(train, config_name="charlm")

if __name__ == "__main__":
    main()
