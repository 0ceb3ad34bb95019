"""``python -m lit_dp_recipes.run.gpt`` (``recipes/gpt.py`` in a clone): ``train`` over the packaged ``gpt.yaml``."""

from lit_dp_recipes.cli import recipe_main
from lit_dp_recipes.train import train

main = recipe_main(train, config_name="gpt")

if __name__ == "__main__":
    main()
