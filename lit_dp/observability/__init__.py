"""What the reducer's events show: communication statistics, traces, and bucket-size autotuning."""
