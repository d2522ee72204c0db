"""Lever: flash-resident speculative decoding."""
