"""recipes/gpt.py's offline default under its earlier name: a small GPT on the stdlib's source, as bytes.

    python recipes/charlm.py                                   # 2 CPU processes, a few minutes
    python recipes/charlm.py experiment=charlm_tiny            # a few steps
    python recipes/charlm.py experiment=charlm_gpt2            # GPT-2 small's shape on the GPUs, bytes

Every key of recipes/gpt.py applies (conf/charlm.yaml extends conf/gpt.yaml); see docs/gpt.md.
"""

from lit_dp_recipes.run.charlm import main

if __name__ == "__main__":
    main()
