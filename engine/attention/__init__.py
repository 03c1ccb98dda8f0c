"""Attention: the metadata handed to kernels, the kernels, and the selector choosing one.

Imports nothing: `engine.attention.fa_contract` (the FlashAttention varlen contract) loads
with torch and the standard library alone.
"""
