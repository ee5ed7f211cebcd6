"""Engines: what actually produces completions. One interface, several back ends."""
