"""Tests of `inventory`."""
