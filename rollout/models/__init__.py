"""Model implementations (plain composition of ``rollout.layers``) and the architecture registry."""

from rollout.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from rollout.models.registry import build_model

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES", "build_model"]
