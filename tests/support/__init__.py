"""Helpers shared by the test suite: a broker subprocess and an independent wire codec."""
