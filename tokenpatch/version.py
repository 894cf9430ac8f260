"""The version of tokenpatch, readable without importing torch (the command line's ``--version``,
``setup.cfg``); ``tokenpatch.__version__`` is the same string."""

__version__ = "0.2.0"
