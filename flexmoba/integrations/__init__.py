"""Adapters that run flexmoba's MoBA inside other libraries' models.

- :mod:`flexmoba.integrations.transformers`: a Hugging Face ``attn_implementation``.
"""

__all__ = []
