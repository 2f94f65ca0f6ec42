"""The ``octavo`` command line."""
