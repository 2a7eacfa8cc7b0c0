"""Models shared by every strategy."""

from models.mnist import MODELS, build_model

__all__ = ["MODELS", "build_model"]
