"""What every stage shares: the executor, manifests, atomic files, model loading."""
