"""The gradient path: buckets, dense and sparse reduction, the reducer, the parameter broadcast, hooks."""
