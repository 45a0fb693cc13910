"""dsakv: an ownership-aware KV-cache system for DeepSeek Sparse Attention models."""

__version__ = "0.1.0"
