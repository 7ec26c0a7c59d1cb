"""The Lightning layer: the module, data, metrics, guards, callbacks, the one launcher, and what every job
shares below the command: its errors, checks and option parsing."""
