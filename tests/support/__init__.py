"""Helpers shared by the test tiers (and the benchmarks): the live-server launcher, SDK and image builders."""
