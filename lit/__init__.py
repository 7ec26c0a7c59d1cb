"""flexmoba's Lightning package.

``training``: the Lightning layer; ``experiments``: the lab's studies; ``cli``: the ``flexmoba`` command.
Imports point one way, each package to its own floor or below: ``flexmoba`` <- ``lit.training`` <-
``lit.experiments`` <- ``lit.cli`` (tests/test_import_floors.py).
"""
