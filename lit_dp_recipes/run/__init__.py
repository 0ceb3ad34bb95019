"""The recipes' commands, one module each, runnable from any folder once lit_dp is installed:

    python -m lit_dp_recipes.run.digits                  # = lit-dp-digits = python recipes/digits.py in a clone
    python -m lit_dp_recipes.run.gpt experiment=gpt_tiny # = lit-dp-gpt
    python -m lit_dp_recipes.run.sample ckpt_path=outputs/gpt/<run>/checkpoints/last.ckpt   # = lit-dp-sample

Their configs ship in the package (``lit_dp_recipes/conf``, docs/configs.md); ``recipes/*.py`` in a
clone run the same ``main``.
"""
