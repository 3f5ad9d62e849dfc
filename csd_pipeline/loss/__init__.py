"""The losses (torch): CSD, the baselines, KD, the chunked student log-probs, and the loss a run builds once (`training.py`)."""
