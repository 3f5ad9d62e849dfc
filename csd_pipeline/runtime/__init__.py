"""What every stage shares: the executor (stages declare, it runs), run records and manifests,
atomic files and hashes, config options, model loading."""
