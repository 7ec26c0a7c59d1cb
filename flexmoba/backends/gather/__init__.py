"""The ``gather`` backend: its plan and kernel (:mod:`.kernel`), its decode (:mod:`.decode`) and its
registry entry (:mod:`.backend`)."""

__all__: list[str] = []
