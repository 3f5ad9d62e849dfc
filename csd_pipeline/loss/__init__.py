"""The losses (torch): CSD, the baselines, the chunked student log-probs, and the loss a run builds once (`training.py`)."""
