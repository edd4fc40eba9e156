"""Reconstruction methods: calibrated per model, they store part of the cache and rebuild the rest."""
