"""Developer tools of the repository, run from its root (``python -m tools.<name>``); not part of the
installed package."""
