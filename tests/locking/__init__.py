"""Tests of `locking`."""
