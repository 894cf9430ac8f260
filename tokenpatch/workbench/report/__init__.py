"""The main job, ``tokenpatch reproduce``: ``reproduce`` runs the sections, one module each; ``plots`` draws."""
