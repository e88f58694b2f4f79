"""Strata engine host."""
