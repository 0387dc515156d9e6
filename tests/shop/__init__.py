"""Tests of `shop`."""
