"""Training and rollout engines behind two narrow interfaces (see `base`)."""
