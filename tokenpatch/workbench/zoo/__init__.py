"""Real pretrained language models from the package registry (``pretrained``), converted once into a cache (``cache``)."""
