"""The Lightning layer: the module, data, metrics, guards, callbacks and the one launcher."""
