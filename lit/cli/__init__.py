"""The ``flexmoba`` command: one dispatch table, one subcommand per job, one error format."""
