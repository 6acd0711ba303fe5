"""Helpers the tests share (importable as ``harness`` from the tests folder, like ``models``)."""
