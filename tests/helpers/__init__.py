"""Helpers shared by the tests (not tests themselves): real multi-process runs, small models,
gradient-equivalence training, recipe and benchmark runs."""
