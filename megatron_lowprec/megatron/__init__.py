"""Thin adapters between megatron_lowprec and megatron-core; the only package that imports megatron."""
