"""flexmoba's Lightning package.

``training``: the Lightning layer; ``cli``: the ``flexmoba`` command; ``experiments``: the lab's studies.
"""
