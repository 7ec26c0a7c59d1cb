"""The ``sdpa`` backend: its registry entry (:mod:`.backend`) and its decode (:mod:`.decode`)."""

__all__: list[str] = []
