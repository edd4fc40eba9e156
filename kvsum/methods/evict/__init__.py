"""Eviction: score every prompt entry, keep the best ones per head under the byte budget, drop the rest."""
