"""Input pipeline, training step and one runner per strategy."""
