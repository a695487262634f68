"""Fiddle configs: models, meshes, experiments."""
