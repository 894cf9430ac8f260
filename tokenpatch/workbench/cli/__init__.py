"""The command line: ``main`` (the parser and the patch commands) and one module per command group."""
